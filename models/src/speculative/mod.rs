//! Speculative decoding, the top floor of the crate: draft trees (chain and DDTree) and the
//! acceptance walk (`tree.rs`), sampling and greedy argmax (`sampling.rs`, `greedy.rs`), the
//! proposers (`proposer.rs`: DFlash; `mtp.rs`: a hybrid's MTP head; `oracle.rs`, `simulate.rs`:
//! test and benchmark proposers), spare caches (`spare.rs`), per-round statistics and
//! profiling (`stats.rs`, `profile.rs`), and the decoding engine that drives a target and a
//! proposer over many sequences (`engine.rs`, `request.rs`).

pub mod engine;
pub mod greedy;
pub mod mtp;
pub mod oracle;
pub mod profile;
pub mod proposer;
pub mod request;
pub mod sampling;
pub mod simulate;
pub mod spare;
pub mod stats;
pub mod tree;

pub use engine::{
    Algorithm, Engine, EngineConfig, EngineError, FinishReason, GenerationRequest, SeqEvent,
};
pub use mtp::MtpProposer;
pub use oracle::{Noise, OracleProposer};
pub use proposer::{DFlashProposer, ProposeItem, Proposer, SeqId};
pub use sampling::{argmax, Sampler, SamplingError, SamplingParams};
pub use simulate::{PeakedProposer, SimulatedAcceptance};
pub use stats::{RoundStats, SeqStats};
pub use tree::{
    build_ddtree, chain_tree, topk_from_logprobs, topk_logprobs, walk, DraftTree, TopK, TreeError,
};
