//! Errors of `dflash-train eval`. Each variant names the input at fault and says what to change,
//! because they are read by a person deciding which drafter to deploy.

use std::path::PathBuf;

use dflash_models::speculative::EngineError;
use dflash_models::ModelError;

#[derive(Debug, thiserror::Error)]
pub enum EvalError {
    #[error("prompt set {path}: {message}")]
    Prompts { path: PathBuf, message: String },
    #[error("prompt set {path} line {line}: {message}")]
    PromptLine {
        path: PathBuf,
        line: usize,
        message: String,
    },
    #[error("prompt `{id}`: {message}")]
    Render { id: String, message: String },
    #[error("prompt `{id}` has {prompt} tokens; with --max-new-tokens {max_new_tokens} it needs {needed} positions, but the context length is {context}; shorten the prompt, lower --max-new-tokens or raise --context-length")]
    PromptTooLong {
        id: String,
        prompt: usize,
        max_new_tokens: usize,
        needed: usize,
        context: usize,
    },
    #[error("replaying prompt `{id}`: {message}")]
    Replay { id: String, message: String },
    #[error("drafter `{spec}`: {message}")]
    Drafter { spec: String, message: String },
    #[error("target `{spec}`: {message}")]
    Target { spec: String, message: String },
    #[error(transparent)]
    Cache(#[from] CacheError),
    #[error("cannot write {path}: {message}")]
    Output { path: PathBuf, message: String },
    #[error("cannot read the report {path}: {message}")]
    Report { path: PathBuf, message: String },
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error(transparent)]
    Model(#[from] ModelError),
}

impl From<candle_core::Error> for EvalError {
    fn from(e: candle_core::Error) -> Self {
        EvalError::Model(ModelError::Candle(e))
    }
}

/// Why an on-disk evaluation cache cannot be used for this run.
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    #[error(
        "cannot read the evaluation cache at {path}: {message}; delete it or pass --rebuild-cache"
    )]
    Read { path: PathBuf, message: String },
    #[error("cannot write the evaluation cache at {path}: {message}")]
    Write { path: PathBuf, message: String },
    #[error("the evaluation cache at {dir} was built for a different {what}: {detail}. Rebuild it with --rebuild-cache (or point --cache-dir at another folder)")]
    Mismatch {
        dir: PathBuf,
        what: &'static str,
        detail: String,
    },
    #[error("the evaluation cache holds target layers {cached:?} but drafter `{drafter}` needs layers {missing:?}; rebuild it with --rebuild-cache, listing every drafter to compare in the same run")]
    MissingTaps {
        drafter: String,
        cached: Vec<usize>,
        missing: Vec<usize>,
    },
    #[error("the evaluation cache at {dir} was built with --max-new-tokens {cached}, fewer than the {requested} asked for; rebuild it with --rebuild-cache or lower --max-new-tokens")]
    TooShort {
        dir: PathBuf,
        cached: usize,
        requested: usize,
    },
}
