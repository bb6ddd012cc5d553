//! Where a model lives: a local directory, or a Hugging Face repo id resolved through hf-hub's
//! standard cache (`HF_HOME`, `HF_HUB_CACHE`; `HF_HUB_OFFLINE=1` forbids the network).
//!
//! Every environment variable the project honours for models is read here, in one place.

use std::path::{Path, PathBuf};

use hf_hub::{api::sync::ApiBuilder, Cache, Repo};

use crate::error::HubError;

/// Files fetched next to the weights when present; only `config.json` is mandatory.
const OPTIONAL_FILES: &[&str] = &[
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
];

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelLocation {
    /// Directory holding config.json and the weights.
    pub dir: PathBuf,
    /// The repo id when the model came from the hub.
    pub repo: Option<String>,
}

fn hub_cache() -> Cache {
    match std::env::var("HF_HUB_CACHE") {
        Ok(p) if !p.is_empty() => Cache::new(PathBuf::from(p)),
        _ => Cache::from_env(),
    }
}

fn offline() -> bool {
    matches!(
        std::env::var("HF_HUB_OFFLINE")
            .ok()
            .as_deref()
            .map(str::to_ascii_lowercase)
            .as_deref(),
        Some("1" | "true" | "yes" | "on")
    )
}

fn looks_like_repo_id(spec: &str) -> bool {
    let parts: Vec<&str> = spec.split('/').collect();
    parts.len() == 2 && parts.iter().all(|p| !p.is_empty() && !p.starts_with('.'))
}

/// Weight files named by a directory's index, or the single-file default.
fn weight_files_in(dir: &Path) -> Vec<String> {
    let index = dir.join("model.safetensors.index.json");
    let Ok(text) = std::fs::read_to_string(index) else {
        return vec!["model.safetensors".into()];
    };
    let mut files: Vec<String> = serde_json::from_str::<serde_json::Value>(&text)
        .ok()
        .and_then(|v| {
            v.get("weight_map").and_then(|m| m.as_object()).map(|m| {
                m.values()
                    .filter_map(|f| f.as_str().map(str::to_string))
                    .collect()
            })
        })
        .unwrap_or_default();
    files.sort();
    files.dedup();
    files
}

/// Resolves `spec` (a directory or an `owner/name` repo id) to a directory with the checkpoint.
pub fn resolve_model(spec: &str) -> Result<ModelLocation, HubError> {
    let path = Path::new(spec);
    if path.is_dir() {
        return Ok(ModelLocation {
            dir: path.to_path_buf(),
            repo: None,
        });
    }
    if !looks_like_repo_id(spec) {
        return Err(HubError::BadSpec { spec: spec.into() });
    }
    let cache = hub_cache();
    if let Some(dir) = cached_snapshot(&cache, spec) {
        return Ok(ModelLocation {
            dir,
            repo: Some(spec.into()),
        });
    }
    if offline() {
        return Err(HubError::NotCachedOffline {
            repo: spec.into(),
            cache: cache.path().clone(),
        });
    }
    download(&cache, spec)
}

/// The snapshot directory when config.json and every weight file are already cached.
fn cached_snapshot(cache: &Cache, repo: &str) -> Option<PathBuf> {
    let cached = cache.repo(Repo::model(repo.to_string()));
    let config = cached.get("config.json")?;
    let dir = config.parent()?.to_path_buf();
    if cached.get("model.safetensors.index.json").is_none()
        && cached.get("model.safetensors").is_none()
    {
        return None;
    }
    weight_files_in(&dir)
        .iter()
        .all(|f| cached.get(f).is_some())
        .then_some(dir)
}

fn download(cache: &Cache, repo: &str) -> Result<ModelLocation, HubError> {
    let err = |file: &str, message: String| HubError::Download {
        repo: repo.into(),
        file: file.into(),
        message,
        cache: cache.path().clone(),
    };
    let api = ApiBuilder::from_cache(cache.clone())
        .with_progress(true)
        .build()
        .map_err(|e| err("(client)", e.to_string()))?;
    let r = api.model(repo.to_string());
    let config = r
        .get("config.json")
        .map_err(|e| err("config.json", e.to_string()))?;
    let dir = config
        .parent()
        .map(Path::to_path_buf)
        .ok_or_else(|| err("config.json", "cache path has no parent".into()))?;
    let weights = match r.get("model.safetensors.index.json") {
        Ok(_) => weight_files_in(&dir),
        Err(_) => vec!["model.safetensors".to_string()],
    };
    for f in &weights {
        r.get(f).map_err(|e| err(f, e.to_string()))?;
    }
    for f in OPTIONAL_FILES {
        // Drafter repos ship no tokenizer; a missing optional file is not an error.
        let _ = r.get(f);
    }
    Ok(ModelLocation {
        dir,
        repo: Some(repo.into()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repo_ids_are_owner_slash_name() {
        assert!(looks_like_repo_id("Qwen/Qwen3-8B"));
        assert!(!looks_like_repo_id("Qwen3-8B"));
        assert!(!looks_like_repo_id("a/b/c"));
        assert!(!looks_like_repo_id("./x"));
    }
}
