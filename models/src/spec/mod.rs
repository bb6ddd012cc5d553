//! Speculative decoding: tree construction, the acceptance walk and sampling (pure functions),
//! and the decoding engine built on them.

pub mod sampling;
pub mod tree;

pub use sampling::{argmax, Sampler, SamplingError, SamplingParams};
pub use tree::{
    build_ddtree, chain_tree, topk_from_logprobs, topk_logprobs, walk, DraftTree, TopK, TreeError,
};
