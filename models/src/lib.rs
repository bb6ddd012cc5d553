//! Model math, once: the Qwen3 dense target, the Qwen3.5 / Qwen3.6 / Qwen3-Next hybrid
//! targets, the DFlash drafter, their caches, their CUDA path, and the speculative decoding
//! engine built on them. Inference and the trainer's differentiable forward share these
//! layers; [`OpsMode`] picks fused kernels or differentiable compositions once per model.
//! HTTP, scheduling and data pipelines live in `dflash-serve` and `dflash-train`.
//!
//! The house, bottom to top (a file imports only from its own floor or below; no file imports
//! another that imports it back, which `tools/import_cycles.py` checks):
//! - [`error`], [`random`], [`probe`]: errors, seeded weights, device probes;
//! - [`layers`]: ops, RoPE, attention patterns, the decoder layer;
//! - [`cache`]: per-sequence K/V and recurrent caches; [`batch`]: the batched-forward types;
//!   [`taps`]: what a tap on a target layer is (HF `hidden_states[i + 1]`);
//! - [`cuda`]: the fused kernels, the fused decoder-layer stack, CUDA-graph capture/replay;
//! - a folder per model: [`qwen3`], [`qwen3_5`] (hybrids, dense and MoE, with the MTP head),
//!   [`dflash`] (inference, CUDA block, training forward); [`target`]: the verifier enum;
//! - [`tp`]: tensor-parallel shards of the Qwen3 dense target (rank-local pieces, the
//!   collectives as in-process reductions, a sequential driver the tests hold to the unsplit model);
//! - [`speculative`]: draft trees, the acceptance walk, sampling, proposers, the engine;
//! - [`training`]: the training engine's pieces (fused linear + cross-entropy over the frozen
//!   head, multi-tensor AdamW on flat buffers), CPU references beside their kernels.

pub mod batch;
pub mod cache;
pub mod cuda;
pub mod dflash;
pub mod error;
pub mod layers;
pub mod probe;
pub mod qwen3;
pub mod qwen3_5;
pub mod random;
pub mod speculative;
pub mod taps;
pub mod target;
pub mod tp;
pub mod training;

pub use batch::{ForwardOutput, SeqForward};
pub use cache::{SequenceCache, PAGE_SIZE};
#[cfg(feature = "cuda")]
pub use dflash::DraftGraph;
pub use dflash::{
    DFlashDrafter, DraftInput, TargetEmbeddingsAndHead, TrainAttention, TrainSequence,
};
pub use error::{ModelError, ModelResult};
pub use layers::attention::AttnPattern;
pub use layers::ops::OpsMode;
#[cfg(feature = "cuda")]
pub use qwen3::StepGraph;
pub use qwen3::{Qwen3Model, TapsOutput};
#[cfg(feature = "cuda")]
pub use qwen3_5::HybridDecodeGraph;
pub use qwen3_5::Qwen35Model;
pub use taps::tap_is_final_normed;
pub use target::{DraftTarget, Target};
