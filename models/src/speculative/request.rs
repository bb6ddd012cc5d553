//! What the decoding engine takes and gives: the algorithm and request of a sequence, the
//! engine's limits, its errors and the events a step produces.

use crate::error::ModelError;
use crate::speculative::penalties::PenaltyError;
use crate::speculative::proposer::SeqId;
use crate::speculative::sampling::{SamplingError, SamplingParams};
use crate::speculative::stats::{RoundStats, SeqStats};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Algorithm {
    /// One target token per forward: the baseline.
    Plain,
    /// DFlash chain: verify `[bonus, d1 .. d(B-1)]` causally, keep the longest matching prefix.
    Chain,
    /// DFlash + DDTree: best-first tree of `budget` nodes (root excluded), one tree forward.
    DDTree { budget: usize },
}

#[derive(Debug, Clone)]
pub struct GenerationRequest {
    pub prompt: Vec<u32>,
    pub max_new_tokens: usize,
    pub sampling: SamplingParams,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    pub algorithm: Algorithm,
}

#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Prompt plus generated tokens per sequence (SGLang's --context-length).
    pub max_context: usize,
    /// Largest DDTree budget a request may ask for (it sizes the verify width).
    pub max_ddtree_budget: usize,
    /// End-of-sequence ids (generation_config's list), honoured unless `ignore_eos`.
    pub eos_token_ids: Vec<u32>,
    /// Seed for requests that bring none (each sequence derives its own stream from it).
    pub seed: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("the prompt has {prompt} tokens but the context length is {max_context}")]
    PromptTooLong { prompt: usize, max_context: usize },
    #[error("prompt ({prompt} tokens) + max_new_tokens ({max_new_tokens}) exceeds the context length {max_context}; lower max_new_tokens")]
    ContextExceeded {
        prompt: usize,
        max_new_tokens: usize,
        max_context: usize,
    },
    #[error("max_new_tokens must be at least 1")]
    ZeroMaxNewTokens,
    #[error("token id {token} is outside the vocabulary ({vocab})")]
    TokenOutOfVocab { token: u32, vocab: usize },
    #[error(transparent)]
    Sampling(#[from] SamplingError),
    #[error("ddtree budget {budget} is outside 1..={max}")]
    BadBudget { budget: usize, max: usize },
    #[error("speculative algorithm {0:?} needs a drafter, but none is loaded")]
    NoProposer(Algorithm),
    #[error("no sequence with id {0}")]
    UnknownSequence(SeqId),
    #[error(transparent)]
    Penalty(#[from] PenaltyError),
    #[error("penalties and constraints of sequence {0} are set before it generates")]
    AlreadyGenerating(SeqId),
    #[error(transparent)]
    Model(#[from] ModelError),
}

impl EngineError {
    /// Whether the request itself is at fault (a server answers 4xx and the client changes the
    /// request), as opposed to the model or the device (a 5xx: the same request may succeed
    /// later, e.g. after a CUDA out-of-memory while allocating its cache).
    pub fn is_client_error(&self) -> bool {
        match self {
            EngineError::EmptyPrompt
            | EngineError::PromptTooLong { .. }
            | EngineError::ContextExceeded { .. }
            | EngineError::ZeroMaxNewTokens
            | EngineError::TokenOutOfVocab { .. }
            | EngineError::Sampling(_)
            | EngineError::BadBudget { .. }
            | EngineError::NoProposer(_)
            | EngineError::Penalty(_) => true,
            EngineError::UnknownSequence(_)
            | EngineError::AlreadyGenerating(_)
            | EngineError::Model(_) => false,
        }
    }
}

impl From<candle_core::Error> for EngineError {
    fn from(e: candle_core::Error) -> Self {
        EngineError::Model(ModelError::Candle(e))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    Length,
    /// Stopped by this token (EOS or a stop_token_id); it is the last token emitted.
    Stop(u32),
}

/// What one step produced for one sequence.
#[derive(Debug, Clone)]
pub struct SeqEvent {
    pub id: SeqId,
    pub tokens: Vec<u32>,
    pub finished: Option<FinishReason>,
    /// Set for verify rounds (not for the prefill token).
    pub round: Option<RoundStats>,
    /// Totals so far, for meta_info and metrics.
    pub stats: SeqStats,
    /// One per token of `tokens` when the sequence asked ([`crate::speculative::Engine::set_logprobs`]),
    /// else empty.
    pub logprobs: Vec<crate::speculative::logprobs::TokenLogprob>,
    /// The sequence failed (a device or model error in its forward) and left the engine;
    /// `tokens` is empty and `finished` None.
    pub error: Option<String>,
    /// With the first token, when asked ([`crate::speculative::Engine::set_prompt_logprobs`]):
    /// the logprobs of the prompt's tokens from the asked start on (token `p` from the row at
    /// `p - 1`; the first prompt token has none), else empty.
    pub prompt_logprobs: Vec<crate::speculative::logprobs::TokenLogprob>,
}
