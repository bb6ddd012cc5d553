//! Speculative decoding: tree construction, the acceptance walk and sampling (pure functions),
//! the proposers, and the decoding engine built on them.

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
