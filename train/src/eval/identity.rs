//! What a cache is built from: the target checkpoint (config hash, content fingerprints of the
//! weight files, dtype), the prompt set (file hash, template kwargs, rendered tokens) and the
//! run's settings, gathered in a [`CacheSpec`]. Compared field by field when a cache is reused,
//! so a refusal can say what changed.

use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use candle_core::DType;
use dflash_common::chat::ChatTemplate;
use dflash_common::tokenizer::Tokenizer;
use dflash_common::Qwen3Config;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

use super::error::EvalError;
use super::prompts::{sha256_hex, PromptSet, TokenizedPrompt};

/// What a run needs from a cache: built by [`CacheSpec::prepare`] (the CLI, a trainer) or by
/// hand (tests).
#[derive(Debug, Clone)]
pub struct CacheSpec {
    pub target: TargetIdentity,
    pub prompts: PromptSetIdentity,
    pub tokenized: Vec<TokenizedPrompt>,
    pub max_new_tokens: usize,
    pub tap_layer_ids: Vec<usize>,
    pub eos_token_ids: Vec<u32>,
}

/// The inputs of [`CacheSpec::prepare`].
#[derive(Debug, Clone)]
pub struct CacheRequest<'a> {
    /// The target checkpoint folder (tokenizer and chat template are read from it too).
    pub target_dir: &'a Path,
    /// How the user named the target (kept in the manifest, not compared).
    pub target_source: &'a str,
    /// The dtype the target runs in: features depend on it.
    pub dtype: DType,
    /// JSONL chat records.
    pub prompts: &'a Path,
    /// Keep only the first N prompts.
    pub limit: Option<usize>,
    /// Chat-template variables, e.g. `{"enable_thinking": false}`.
    pub template_kwargs: Map<String, Value>,
    pub max_new_tokens: usize,
    /// Target layers whose features to cache: every drafter's `target_layer_ids`.
    pub tap_layer_ids: Vec<usize>,
}

impl CacheSpec {
    /// Reads and renders the prompt set with the target's tokenizer and chat template,
    /// fingerprints the target and takes its end-of-sequence ids (the tokenizer's, else
    /// config.json's), as the engine would stop on them.
    pub fn prepare(req: CacheRequest<'_>) -> Result<Self, EvalError> {
        let err = |message: String| EvalError::Target {
            spec: req.target_source.to_string(),
            message,
        };
        let tokenizer = Tokenizer::from_dir(req.target_dir).map_err(|e| err(e.to_string()))?;
        let template = ChatTemplate::from_model(req.target_dir, tokenizer.config(), None)
            .map_err(|e| err(e.to_string()))?;
        let set = PromptSet::load(req.prompts, req.limit)?;
        let tokenized = set.tokenize(&tokenizer, &template, &req.template_kwargs)?;
        let mut eos_token_ids = tokenizer.eos_token_ids().to_vec();
        if eos_token_ids.is_empty() {
            let config = Qwen3Config::from_file(req.target_dir.join("config.json"))
                .map_err(|e| err(e.to_string()))?;
            eos_token_ids = config.eos_token_ids;
        }
        let mut tap_layer_ids = req.tap_layer_ids;
        tap_layer_ids.sort_unstable();
        tap_layer_ids.dedup();
        Ok(Self {
            target: TargetIdentity::of_dir(req.target_dir, req.target_source, req.dtype)?,
            prompts: PromptSetIdentity {
                name: set.name(),
                sha256: set.sha256.clone(),
                count: tokenized.len(),
                template_kwargs: req.template_kwargs,
            },
            tokenized,
            max_new_tokens: req.max_new_tokens,
            tap_layer_ids,
            eos_token_ids,
        })
    }
}

/// Weight files are fingerprinted by this many evenly spaced 64 KiB samples (first and last
/// included): content-based, so a copied checkpoint still matches, yet cheap for 16 GB.
const FINGERPRINT_SAMPLES: u64 = 16;
const FINGERPRINT_CHUNK: u64 = 64 * 1024;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WeightFingerprint {
    pub file: String,
    pub size: u64,
    pub sampled_sha256: String,
}

/// What identifies the target features were computed with.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TargetIdentity {
    /// As given on the command line; informational, not compared.
    pub source: String,
    pub config_sha256: String,
    pub weights: Vec<WeightFingerprint>,
    pub dtype: String,
}

impl TargetIdentity {
    /// Fingerprints the checkpoint folder `dir` (config.json and every `*.safetensors`).
    pub fn of_dir(dir: &Path, source: &str, dtype: DType) -> Result<Self, EvalError> {
        let err = |path: &Path, e: std::io::Error| EvalError::Target {
            spec: source.to_string(),
            message: format!("cannot read {}: {e}", path.display()),
        };
        let config = dir.join("config.json");
        let config_bytes = std::fs::read(&config).map_err(|e| err(&config, e))?;
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|e| err(dir, e))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect();
        files.sort();
        let weights = files
            .iter()
            .map(|p| fingerprint(p).map_err(|e| err(p, e)))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            source: source.to_string(),
            config_sha256: sha256_hex(&config_bytes),
            weights,
            dtype: format!("{dtype:?}").to_lowercase(),
        })
    }
}

fn fingerprint(path: &Path) -> std::io::Result<WeightFingerprint> {
    let mut f = std::fs::File::open(path)?;
    let size = f.metadata()?.len();
    let mut hasher = Sha256::new();
    hasher.update(size.to_le_bytes());
    let mut buf = vec![0u8; FINGERPRINT_CHUNK as usize];
    let last = size.saturating_sub(FINGERPRINT_CHUNK);
    for i in 0..FINGERPRINT_SAMPLES {
        let at = last * i / (FINGERPRINT_SAMPLES - 1);
        f.seek(SeekFrom::Start(at))?;
        let n = f.read(&mut buf)?;
        hasher.update(&buf[..n]);
    }
    Ok(WeightFingerprint {
        file: path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
        size,
        sampled_sha256: hasher
            .finalize()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect(),
    })
}

/// What identifies the prompts: the file and how it was rendered.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PromptSetIdentity {
    pub name: String,
    pub sha256: String,
    pub count: usize,
    pub template_kwargs: Map<String, Value>,
}

pub(crate) fn short(hash: &str) -> &str {
    &hash[..hash.len().min(12)]
}

pub(crate) fn weights_change(was: &[WeightFingerprint], now: &[WeightFingerprint]) -> String {
    let names = |w: &[WeightFingerprint]| w.iter().map(|f| f.file.clone()).collect::<Vec<_>>();
    if names(was) != names(now) {
        return format!("weight files were {:?}, now {:?}", names(was), names(now));
    }
    let changed: Vec<String> = was
        .iter()
        .zip(now)
        .filter(|(a, b)| a != b)
        .map(|(a, b)| {
            format!(
                "{} (size {} -> {}, sampled sha256 {} -> {})",
                a.file,
                a.size,
                b.size,
                short(&a.sampled_sha256),
                short(&b.sampled_sha256)
            )
        })
        .collect();
    format!("weights changed: {}", changed.join(", "))
}
