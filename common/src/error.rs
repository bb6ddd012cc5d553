//! One error enum per domain. Every variant names the file (and, where there is one, the field or
//! tensor) and says what to change, because these errors are read by people starting a server.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: field `{field}`: {message}")]
    Field {
        path: PathBuf,
        field: String,
        message: String,
    },
    #[error("{path}: {message}")]
    Invalid { path: PathBuf, message: String },
}

/// A [`ConfigError::Field`] for `field` of the file at `path`.
pub(crate) fn field_err(
    path: &std::path::Path,
    field: &str,
    message: impl Into<String>,
) -> ConfigError {
    ConfigError::Field {
        path: path.to_path_buf(),
        field: field.into(),
        message: message.into(),
    }
}

#[derive(Debug, thiserror::Error)]
pub enum WeightError {
    #[error("no safetensors weights in {dir}: expected model.safetensors or model.safetensors.index.json")]
    NoWeights { dir: PathBuf },
    #[error("cannot read {path}: {message}")]
    Read { path: PathBuf, message: String },
    #[error("tensor `{name}` is missing from the checkpoint in {dir} (looked in: {files})")]
    MissingTensor {
        dir: PathBuf,
        name: String,
        files: String,
    },
    #[error("{file}: tensor `{name}` has shape {found:?}, but the config implies {expected:?}; check that config.json matches the weights")]
    ShapeMismatch {
        file: PathBuf,
        name: String,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error("{file}: tensor `{name}` has dtype {dtype:?}; supported are BF16, F16 and F32")]
    UnsupportedDtype {
        file: PathBuf,
        name: String,
        dtype: String,
    },
    #[error("{file}: cannot load tensor `{name}`: {message}")]
    Load {
        file: PathBuf,
        name: String,
        message: String,
    },
}

#[derive(Debug, thiserror::Error)]
pub enum HubError {
    #[error("model `{repo}` is not a local directory and is not in the Hugging Face cache ({cache}); HF_HUB_OFFLINE is set, so it was not downloaded. Run `huggingface-cli download {repo}` on a machine with network access (or unset HF_HUB_OFFLINE), or pass a local directory")]
    NotCachedOffline { repo: String, cache: PathBuf },
    #[error("model `{repo}`: downloading `{file}` failed: {message}. Check the repo id and network access, or pass a local directory (set HF_HUB_OFFLINE=1 to use only the cache at {cache})")]
    Download {
        repo: String,
        file: String,
        message: String,
        cache: PathBuf,
    },
    #[error("`{spec}` is neither an existing directory nor a Hugging Face repo id of the form owner/name")]
    BadSpec { spec: String },
}
