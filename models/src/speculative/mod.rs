//! Speculative decoding, the top floor of the crate: draft trees (chain and DDTree) and the
//! acceptance walk (`tree.rs`), sampling and greedy argmax (`sampling.rs`, `greedy.rs`),
//! penalties and grammars on every node's row (`penalties.rs`, `constraint.rs`), the
//! proposers (`proposer.rs`: DFlash; `mtp.rs`: a hybrid's MTP head; `oracle.rs`,
//! `simulate.rs`: test and benchmark proposers), spare caches (`spare.rs`), per-round
//! statistics and profiling (`stats.rs`, `profile.rs`), and the decoding engine that drives a
//! target and a proposer over many sequences (`engine.rs`, `request.rs`).

pub mod constraint;
pub mod engine;
pub mod greedy;
pub mod logprobs;
pub mod mtp;
pub mod oracle;
pub mod penalties;
pub mod profile;
pub mod proposer;
pub mod request;
pub mod sampling;
pub mod simulate;
pub mod spare;
pub mod stats;
pub mod tree;

/// A tiny random Qwen3 target (2 layers, hidden 32, vocab 64) for the engine's unit tests.
#[cfg(test)]
pub(crate) fn tiny_test_target(max_positions: usize, seed: u64) -> crate::Qwen3Model {
    use dflash_common::{LayerType, Qwen3Config, RopeScaling};
    let cfg = Qwen3Config {
        vocab_size: 64,
        hidden_size: 32,
        intermediate_size: 64,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 8,
        rms_norm_eps: 1e-6,
        rope_theta: 10000.0,
        rope_scaling: RopeScaling::Default,
        max_position_embeddings: max_positions,
        tie_word_embeddings: true,
        eos_token_ids: vec![],
        bos_token_id: None,
        layer_types: vec![LayerType::FullAttention; 2],
        sliding_window: None,
        moe: None,
    };
    let cpu = candle_core::Device::Cpu;
    crate::Qwen3Model::random(
        cfg,
        seed,
        candle_core::DType::F32,
        &cpu,
        max_positions,
        crate::OpsMode::Fused,
    )
    .expect("random tiny target")
}

pub use constraint::Constraint;
pub use engine::piece::StepReport;
pub use engine::{
    Algorithm, Engine, EngineConfig, EngineError, FinishReason, GenerationRequest, SeqEvent,
    DEFAULT_MIXED_STEP_BUDGET,
};
pub use mtp::MtpProposer;
pub use oracle::{Noise, OracleProposer};
pub use penalties::{Penalties, PenaltyError};
pub use proposer::{DFlashProposer, ProposeItem, Proposer, SeqId};
pub use sampling::{argmax, Sampler, SamplingError, SamplingParams};
pub use simulate::{PeakedProposer, SimulatedAcceptance};
pub use stats::{RoundStats, SeqStats};
pub use tree::{
    build_ddtree, chain_tree, topk_from_logprobs, topk_logprobs, walk, DraftTree, TopK, TreeError,
};
