//! Model math, once: the Qwen3 target and the DFlash drafter on candle, their caches, and the
//! attention patterns speculative decoding needs (causal, tree, full block, sliding window).
//!
//! Inference and the trainer's differentiable forward share these layers; [`ops::OpsMode`]
//! picks fused kernels or differentiable compositions once per model. HTTP, scheduling and
//! data pipelines live in `dflash-serve` and `dflash-train`.

pub mod attention;
pub mod dflash;
#[cfg(feature = "cuda")]
mod dflash_fast;
pub mod dflash_train;
pub mod error;
pub mod fast;
#[cfg(feature = "cuda")]
mod fast_decoder;
pub mod kv_cache;
pub mod layer;
pub mod ops;
pub mod probe;
pub mod qwen3;
pub mod qwen3_5;
#[cfg(feature = "cuda")]
mod qwen3_fast;
pub mod random;
pub mod rope;
pub mod spec;
pub mod step_graphs;
pub mod target;

pub use attention::AttnPattern;
pub use dflash::{DFlashDrafter, DraftInput, TargetEmbeddingsAndHead};
#[cfg(feature = "cuda")]
pub use dflash_fast::DraftGraph;
pub use dflash_train::TrainSequence;
pub use error::{ModelError, ModelResult};
pub use kv_cache::SequenceCache;
pub use ops::OpsMode;
pub use qwen3::{ForwardOutput, Qwen3Model, SeqForward};
pub use qwen3_5::Qwen35Model;
#[cfg(feature = "cuda")]
pub use qwen3_fast::StepGraph;
pub use target::{DraftTarget, Target};
