//! The model's tokenizer as Hugging Face ships it: `tokenizer.json` (the `tokenizers` pipeline),
//! `tokenizer_config.json` (special tokens, chat template) and, when present,
//! `generation_config.json` (the extra EOS ids generation must stop on).
//!
//! Prompts rendered from a chat template already carry their special tokens, so [`Tokenizer::encode`]
//! takes `add_special_tokens` explicitly instead of guessing: `transformers`' `apply_chat_template`
//! tokenizes with `add_special_tokens=False`, and that is what reproduces its ids.

use std::path::{Path, PathBuf};

use serde::Deserialize;

/// Tokenizer-side failures. Each names the file it came from, because they are read by people
/// starting a server against a model folder.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("cannot read {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path} is not a valid tokenizer.json: {message}")]
    Load { path: PathBuf, message: String },
    #[error("{path}: {message}")]
    Config { path: PathBuf, message: String },
    #[error("tokenization failed: {message}")]
    Encode { message: String },
    #[error("detokenization failed: {message}")]
    Decode { message: String },
}

/// A special token in `tokenizer_config.json`: either a plain string or an `AddedToken` object.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
enum TokenSpelling {
    Plain(String),
    Added { content: String },
}

impl TokenSpelling {
    fn into_content(self) -> String {
        match self {
            TokenSpelling::Plain(s) | TokenSpelling::Added { content: s } => s,
        }
    }
}

/// One entry of a list-valued `chat_template` (`[{"name": "default", "template": "..."}]`).
#[derive(Debug, Clone, Deserialize)]
pub struct NamedTemplate {
    pub name: String,
    pub template: String,
}

/// `chat_template` in `tokenizer_config.json`: one template, or several named ones.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum ChatTemplateField {
    Single(String),
    Named(Vec<NamedTemplate>),
}

/// The fields of `tokenizer_config.json` that serving needs; HF names kept.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct TokenizerConfig {
    #[serde(default)]
    bos_token: Option<TokenSpelling>,
    #[serde(default)]
    eos_token: Option<TokenSpelling>,
    #[serde(default)]
    pub chat_template: Option<ChatTemplateField>,
    #[serde(default)]
    pub model_max_length: Option<f64>,
}

impl TokenizerConfig {
    pub fn bos_token(&self) -> Option<String> {
        self.bos_token.clone().map(TokenSpelling::into_content)
    }

    pub fn eos_token(&self) -> Option<String> {
        self.eos_token.clone().map(TokenSpelling::into_content)
    }
}

/// `eos_token_id` in `generation_config.json` / `config.json`: one id or a list.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
enum IdOrIds {
    One(u32),
    Many(Vec<u32>),
}

#[derive(Debug, Default, Deserialize)]
struct GenerationConfigEos {
    #[serde(default)]
    eos_token_id: Option<IdOrIds>,
}

/// Text <-> token ids for one model folder.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    config: TokenizerConfig,
    eos_token_ids: Vec<u32>,
    dir: PathBuf,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("dir", &self.dir)
            .field("vocab_size", &self.vocab_size())
            .field("eos_token_ids", &self.eos_token_ids)
            .finish()
    }
}

fn read_json<T: for<'de> Deserialize<'de> + Default>(path: &Path) -> Result<T, TokenizerError> {
    if !path.exists() {
        return Ok(T::default());
    }
    let text = std::fs::read_to_string(path).map_err(|source| TokenizerError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    serde_json::from_str(&text).map_err(|e| TokenizerError::Config {
        path: path.to_path_buf(),
        message: e.to_string(),
    })
}

impl Tokenizer {
    /// Loads `tokenizer.json` (required), `tokenizer_config.json` and `generation_config.json`
    /// (both optional) from `dir`.
    pub fn from_dir(dir: &Path) -> Result<Self, TokenizerError> {
        let path = dir.join("tokenizer.json");
        if !path.exists() {
            return Err(TokenizerError::Read {
                path,
                source: std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    "no tokenizer.json in the model folder; pass a folder that has one",
                ),
            });
        }
        let inner = tokenizers::Tokenizer::from_file(&path).map_err(|e| TokenizerError::Load {
            path: path.clone(),
            message: e.to_string(),
        })?;
        let config: TokenizerConfig = read_json(&dir.join("tokenizer_config.json"))?;
        let generation: GenerationConfigEos = read_json(&dir.join("generation_config.json"))?;

        let mut eos_token_ids = Vec::new();
        if let Some(id) = config.eos_token().and_then(|t| inner.token_to_id(&t)) {
            eos_token_ids.push(id);
        }
        match generation.eos_token_id {
            Some(IdOrIds::One(id)) => eos_token_ids.push(id),
            Some(IdOrIds::Many(ids)) => eos_token_ids.extend(ids),
            None => {}
        }
        let mut seen = std::collections::HashSet::new();
        eos_token_ids.retain(|id| seen.insert(*id));

        Ok(Self {
            inner,
            config,
            eos_token_ids,
            dir: dir.to_path_buf(),
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn config(&self) -> &TokenizerConfig {
        &self.config
    }

    /// Ids that end generation unless a request sets `ignore_eos`: the tokenizer's `eos_token`
    /// followed by `generation_config.json`'s `eos_token_id` (deduplicated, in that order).
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_token_ids
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizerError> {
        let encoding =
            self.inner
                .encode(text, add_special_tokens)
                .map_err(|e| TokenizerError::Encode {
                    message: e.to_string(),
                })?;
        Ok(encoding.get_ids().to_vec())
    }

    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, TokenizerError> {
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| TokenizerError::Decode {
                message: e.to_string(),
            })
    }
}

/// What the incremental detokenizer needs: decoding a slice of ids. Implemented by [`Tokenizer`];
/// tests implement it with byte-exact toy vocabularies.
pub trait Decode {
    fn decode_ids(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, TokenizerError>;
}

impl Decode for Tokenizer {
    fn decode_ids(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, TokenizerError> {
        self.decode(ids, skip_special_tokens)
    }
}
