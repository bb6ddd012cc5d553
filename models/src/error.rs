//! Errors of model loading and of the forward-pass contract.

use dflash_common::{ConfigError, WeightError};

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Weights(#[from] WeightError),
    #[error("cache full: {len} rows live, {requested} more requested, capacity {capacity}")]
    CacheFull {
        len: usize,
        requested: usize,
        capacity: usize,
    },
    #[error("the K/V pool has {free} free pages of {total}, {pages} needed")]
    PoolExhausted {
        pages: usize,
        free: usize,
        total: usize,
    },
    #[error("position {position} is beyond the rotary table ({max} positions); raise the context length")]
    PositionOutOfRange { position: usize, max: usize },
    #[error("bad cache operation: {0}")]
    BadCacheOp(String),
    #[error("bad forward input: {0}")]
    BadInput(String),
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// config.json and the weights disagree (layer kinds, projection layouts).
    #[error("inconsistent checkpoint: {0}")]
    Inconsistent(String),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

pub type ModelResult<T> = Result<T, ModelError>;
