//! Structured output with llguidance (`--grammar-backend llguidance`, the default): a request's
//! JSON schema, regex or EBNF grammar is compiled once per request against the tokenizer's
//! vocabulary and travels to the engine as a [`CompiledGrammar`], which masks the target's row
//! at every tree node from the committed tokens plus that node's path (llguidance's parser
//! consumes the path and rolls it back), so drafts outside the grammar are simply rejected and
//! speculation chooses the tokens plain decoding would.

pub mod spec;
pub mod tools;

use std::path::Path;
use std::sync::Arc;

use dflash_models::speculative::constraint::{mask_row, Constraint};
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};

pub use spec::{GrammarFields, GrammarSpec, SpecError};

/// SGLang's `--grammar-backend` values: the one dflash-serve ships, and `none`.
pub const BACKENDS: &[&str] = &["llguidance", "none"];

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum GrammarError {
    #[error("cannot read {path} for the grammar backend: {message}")]
    Vocabulary { path: String, message: String },
    #[error("starting llguidance: {0}")]
    Backend(String),
    #[error("structured output is off (--grammar-backend none); `{field}` needs it: start the server with --grammar-backend llguidance")]
    Disabled { field: &'static str },
    #[error("structured output is unavailable for this model: {reason}; `{field}` needs it")]
    Unavailable { field: &'static str, reason: String },
    #[error("`{field}` is not a grammar llguidance accepts: {message}")]
    Invalid {
        field: &'static str,
        message: String,
    },
}

/// The vocabulary as llguidance sees it and the parser factory built on it, shared by every
/// request.
pub struct GrammarBackend {
    factory: Option<ParserFactory>,
    eos: u32,
    /// Why there is no factory although the backend was asked for (the tokenizer's vocabulary
    /// could not be read for llguidance); None: `--grammar-backend none`.
    unavailable: Option<String>,
}

impl std::fmt::Debug for GrammarBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarBackend")
            .field("enabled", &self.factory.is_some())
            .finish()
    }
}

impl GrammarBackend {
    /// Structured output refused (`--grammar-backend none`).
    pub fn disabled() -> Self {
        Self {
            factory: None,
            eos: 0,
            unavailable: None,
        }
    }

    /// Structured output unavailable because loading failed with `reason`: the server still
    /// serves everything else, and grammar requests get a 400 saying why.
    pub fn unavailable(reason: String) -> Self {
        Self {
            factory: None,
            eos: 0,
            unavailable: Some(reason),
        }
    }

    /// llguidance over `tokenizer.json` in `tokenizer_dir`: every token's bytes (byte-level
    /// BPE or byte-fallback pieces; special tokens marked special, so grammars never emit
    /// them as text), `vocab_size` rows (the model's, which may exceed the tokenizer's), `eos`
    /// the token that ends a finished grammar.
    pub fn load(tokenizer_dir: &Path, vocab_size: usize, eos: u32) -> Result<Self, GrammarError> {
        let path = tokenizer_dir.join("tokenizer.json");
        let err = |message: String| GrammarError::Vocabulary {
            path: path.display().to_string(),
            message,
        };
        let text = std::fs::read_to_string(&path).map_err(|e| err(e.to_string()))?;
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| err(e.to_string()))?;
        let mut words =
            llguidance::token_bytes_from_tokenizer_json(&json).map_err(|e| err(e.to_string()))?;
        let vocab = vocab_size.max(words.len());
        words.resize(vocab, Vec::new());
        let info = TokRxInfo::new(vocab as u32, eos);
        let trie = TokTrie::from(&info, &words);
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory =
            ParserFactory::new_simple(&env).map_err(|e| GrammarError::Backend(e.to_string()))?;
        factory.quiet();
        Ok(Self {
            factory: Some(factory),
            eos,
            unavailable: None,
        })
    }

    pub fn is_enabled(&self) -> bool {
        self.factory.is_some()
    }

    /// Compiles `spec` for one request (400 on a grammar llguidance refuses).
    pub fn compile(&self, spec: &GrammarSpec) -> Result<CompiledGrammar, GrammarError> {
        let factory = self
            .factory
            .as_ref()
            .ok_or_else(|| match &self.unavailable {
                Some(reason) => GrammarError::Unavailable {
                    field: spec.field(),
                    reason: reason.clone(),
                },
                None => GrammarError::Disabled {
                    field: spec.field(),
                },
            })?;
        let invalid = |message: String| GrammarError::Invalid {
            field: spec.field(),
            message,
        };
        let grammar: TopLevelGrammar = spec.to_llguidance().map_err(invalid)?;
        let parser = factory
            .create_parser(grammar)
            .map_err(|e| invalid(e.to_string()))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(invalid(e));
        }
        Ok(CompiledGrammar {
            matcher,
            spec: Arc::new(spec.clone()),
            eos: self.eos,
        })
    }
}

/// One request's grammar state. Cloned for each of its parallel samples (`n`); equal when
/// compiled from the same spec.
#[derive(Clone)]
pub struct CompiledGrammar {
    matcher: Matcher,
    spec: Arc<GrammarSpec>,
    eos: u32,
}

impl std::fmt::Debug for CompiledGrammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompiledGrammar")
            .field("spec", &self.spec)
            .finish()
    }
}

impl PartialEq for CompiledGrammar {
    fn eq(&self, other: &Self) -> bool {
        self.spec == other.spec
    }
}

impl CompiledGrammar {
    /// Whether the tokens so far complete the grammar (it would allow EOS now).
    pub fn is_accepting(&mut self) -> bool {
        self.matcher.is_accepting().unwrap_or(false)
    }
}

impl Constraint for CompiledGrammar {
    fn mask(&mut self, path: &[u32], row: &mut [f32]) {
        let consumed = match self.matcher.try_consume_tokens(path) {
            Ok(n) => n,
            Err(_) => return self.end_only(row),
        };
        if consumed == path.len() {
            match self.matcher.compute_mask_or_eos() {
                Ok(mask) => mask_row(row, |t| mask.is_allowed(t)),
                Err(_) => return self.end_only(row),
            }
        }
        // A path that left the grammar is never reached by the walk: its row stays as it is.
        if self.matcher.rollback(consumed).is_err() {
            self.end_only(row);
        }
    }

    fn commit(&mut self, tokens: &[u32]) {
        // A token the mask allowed always consumes; after EOS the sequence has ended.
        let _ = self.matcher.try_consume_tokens(tokens);
    }
}

impl CompiledGrammar {
    /// A matcher that failed internally ends the answer: only EOS stays allowed.
    fn end_only(&self, row: &mut [f32]) {
        mask_row(row, |t| t == self.eos);
    }
}

#[cfg(test)]
mod tests;
