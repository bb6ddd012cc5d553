//! Everything a handler can reach: the parsed config, the tokenizer and chat template, the engine
//! handle and the metrics. Built once at startup; cloning is one `Arc`.

use std::ops::Deref;
use std::path::Path;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use dflash_common::chat::{ChatTemplate, TemplateError};
use dflash_common::tokenizer::{Tokenizer, TokenizerError};
use serde::Deserialize;

use crate::config::ServeConfig;
use crate::engine::EngineHandle;
use crate::generation::{LowerContext, SamplingDefaults};
use crate::grammar::{GrammarBackend, GrammarError};
use crate::metrics::ServerMetrics;

/// What the HTTP layer knows about the model: text side only.
#[derive(Debug)]
pub struct ModelAssets {
    pub tokenizer: Arc<Tokenizer>,
    /// `Err` keeps the reason so chat requests can say why there is no template.
    pub template: Result<Arc<ChatTemplate>, Arc<TemplateError>>,
    pub lower: LowerContext,
    pub model_type: String,
    pub architectures: Vec<String>,
    /// The most text bytes one token can stand for (the longest decoded vocabulary entry), so
    /// that a text's byte length bounds its token count from below before tokenizing it.
    pub max_token_bytes: usize,
    /// Structured output (`--grammar-backend`).
    pub grammar: Arc<GrammarBackend>,
}

#[derive(Debug, thiserror::Error)]
pub enum AssetError {
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error(transparent)]
    Template(#[from] TemplateError),
    #[error("cannot read {path}: {message}")]
    ModelConfig { path: String, message: String },
    #[error(transparent)]
    Grammar(#[from] GrammarError),
}

#[derive(Debug, Default, Deserialize)]
struct ModelConfigHead {
    #[serde(default)]
    model_type: String,
    #[serde(default)]
    architectures: Vec<String>,
    #[serde(default)]
    max_position_embeddings: Option<usize>,
    #[serde(default)]
    vocab_size: Option<usize>,
    /// Qwen3.5 / Qwen3.6 checkpoints (multimodal layout) keep the text model's settings here.
    #[serde(default)]
    text_config: Option<TextConfigHead>,
}

#[derive(Debug, Default, Deserialize)]
struct TextConfigHead {
    #[serde(default)]
    max_position_embeddings: Option<usize>,
    #[serde(default)]
    vocab_size: Option<usize>,
}

impl ModelAssets {
    /// Loads the tokenizer (from `tokenizer_dir`), the chat template (`--chat-template` file, or
    /// the tokenizer's) and the few `config.json` / `generation_config.json` fields serving uses.
    pub fn load(
        config: &ServeConfig,
        model_dir: &Path,
        tokenizer_dir: &Path,
    ) -> Result<Self, AssetError> {
        let tokenizer = Tokenizer::from_dir(tokenizer_dir)?;
        let template = match &config.chat_template {
            Some(path) => Ok(Arc::new(ChatTemplate::from_file(path, tokenizer.config())?)),
            None => match ChatTemplate::from_model(
                tokenizer_dir,
                tokenizer.config(),
                config.hf_chat_template_name.as_deref(),
            ) {
                Ok(t) => Ok(Arc::new(t)),
                Err(TemplateError::Missing) => Err(Arc::new(TemplateError::Missing)),
                Err(e) => return Err(e.into()),
            },
        };
        let head: ModelConfigHead = read_json(&model_dir.join("config.json"))?;
        let defaults: SamplingDefaults = read_json(&model_dir.join("generation_config.json"))?;
        let text = head.text_config.unwrap_or_default();
        let context_length = config
            .context_length
            .or(head.max_position_embeddings)
            .or(text.max_position_embeddings)
            .unwrap_or(4096);
        // The grammar masks whole logits rows: the model's vocabulary, often padded past the
        // tokenizer's.
        let model_vocab = head
            .vocab_size
            .or(text.vocab_size)
            .unwrap_or(0)
            .max(tokenizer.vocab_size());
        let grammar = match (config.grammar, tokenizer.eos_token_ids().first()) {
            (true, Some(&eos)) => match GrammarBackend::load(tokenizer_dir, model_vocab, eos) {
                Ok(g) => g,
                // Structured output is one feature; the server serves everything else.
                Err(e) => {
                    tracing::warn!("structured output is off: {e}");
                    GrammarBackend::unavailable(e.to_string())
                }
            },
            _ => GrammarBackend::disabled(),
        };
        let lower = LowerContext {
            context_length,
            vocab_size: tokenizer.vocab_size(),
            eos_token_ids: tokenizer.eos_token_ids().to_vec(),
            defaults,
        };
        let max_token_bytes = (0..tokenizer.vocab_size() as u32)
            .filter_map(|id| tokenizer.decode(&[id], false).ok())
            .map(|t| t.len())
            .max()
            .unwrap_or(1)
            .max(1);
        Ok(Self {
            max_token_bytes,
            grammar: Arc::new(grammar),
            tokenizer: Arc::new(tokenizer),
            template,
            lower,
            model_type: head.model_type,
            architectures: head.architectures,
        })
    }
}

fn read_json<T: for<'de> Deserialize<'de> + Default>(path: &Path) -> Result<T, AssetError> {
    if !path.exists() {
        return Ok(T::default());
    }
    let err = |message: String| AssetError::ModelConfig {
        path: path.display().to_string(),
        message,
    };
    let text = std::fs::read_to_string(path).map_err(|e| err(e.to_string()))?;
    serde_json::from_str(&text).map_err(|e| err(e.to_string()))
}

/// Size limits applied before any work is done on a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestLimits {
    /// Largest request body (`--max-request-body-bytes`, or sized from the context).
    pub body_bytes: usize,
    pub prompt: crate::generation::limits::PromptLimits,
    /// Most sequences (prompts x n) per request (`--max-sequences-per-request`).
    pub max_sequences: usize,
}

/// The smallest default body limit: room for chat requests with many short messages.
const MIN_DEFAULT_BODY_BYTES: usize = 1 << 20;

impl RequestLimits {
    pub fn new(config: &ServeConfig, model: &ModelAssets) -> Self {
        let prompt = crate::generation::limits::PromptLimits::new(
            model.lower.context_length,
            model.max_token_bytes,
        );
        // Twice the longest possible prompt leaves room for JSON escaping and the other fields.
        let derived = prompt
            .max_text_bytes
            .saturating_mul(2)
            .max(MIN_DEFAULT_BODY_BYTES);
        Self {
            body_bytes: config.max_request_body_bytes.unwrap_or(derived),
            prompt,
            max_sequences: config.max_sequences_per_request,
        }
    }
}

#[derive(Debug)]
pub struct AppInner {
    pub config: ServeConfig,
    pub limits: RequestLimits,
    pub tokenizer_pool: crate::generation::limits::TokenizerPool,
    pub model: ModelAssets,
    pub engine: EngineHandle,
    pub metrics: Arc<ServerMetrics>,
    pub started: Instant,
    pub started_unix: u64,
}

#[derive(Debug, Clone)]
pub struct AppState(Arc<AppInner>);

impl AppState {
    pub fn new(
        config: ServeConfig,
        model: ModelAssets,
        engine: EngineHandle,
        metrics: Arc<ServerMetrics>,
    ) -> Self {
        Self(Arc::new(AppInner {
            limits: RequestLimits::new(&config, &model),
            tokenizer_pool: crate::generation::limits::TokenizerPool::new(),
            config,
            model,
            engine,
            metrics,
            started: Instant::now(),
            started_unix: unix_now(),
        }))
    }
}

impl Deref for AppState {
    type Target = AppInner;
    fn deref(&self) -> &AppInner {
        &self.0
    }
}

pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}
