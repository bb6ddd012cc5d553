//! Errors of a training run. Each names the file, flag or checkpoint to fix.

use std::path::PathBuf;

use dflash_common::chat::TemplateError;
use dflash_common::tokenizer::TokenizerError;
use dflash_common::{ConfigError, WeightError};
use dflash_models::ModelError;

use super::manifest::IntegrityError;

#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error("invalid {flag}: {message}")]
    Flag { flag: &'static str, message: String },
    #[error("cannot read dataset {path}: {message}")]
    DatasetRead { path: PathBuf, message: String },
    #[error("{path}:{line}: {count} unreadable lines so far, more than --max-bad-lines {limit}; the last one: {message}")]
    TooManyBadLines {
        path: PathBuf,
        line: usize,
        count: usize,
        limit: usize,
        message: String,
    },
    #[error("no usable training sequence in {paths}: {detail}")]
    NoSupervisedTokens { paths: String, detail: String },
    #[error("the drafter does not fit the target: {0}")]
    DrafterMismatch(String),
    #[error("output directory {path} is not writable: {message}")]
    OutputDir { path: PathBuf, message: String },
    #[error("checkpoint {path}: {message}")]
    Checkpoint { path: PathBuf, message: String },
    #[error("checkpoint {dir} failed verification: {problem}; {fix}")]
    UnverifiedCheckpoint {
        dir: PathBuf,
        problem: IntegrityError,
        fix: String,
    },
    #[error("stopping: {count} steps in a row had a non-finite loss or gradient (last at step {step}, {total} skipped in all; limit --max-nonfinite-steps {limit}); the last good (verified) checkpoint is {last_good}")]
    NonFinite {
        count: usize,
        step: usize,
        total: usize,
        limit: usize,
        last_good: String,
    },
    #[error("data-parallel training: {0}")]
    DataParallel(String),
    #[error("target worker on {device}: {message}")]
    Worker { device: String, message: String },
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Weights(#[from] WeightError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error(transparent)]
    Template(#[from] TemplateError),
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

pub type TrainResult<T> = Result<T, TrainError>;
