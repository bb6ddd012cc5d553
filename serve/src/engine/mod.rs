//! The boundary between HTTP and the model: one engine thread owns the model and steps every
//! active sequence; handlers talk to it only through channels, with token ids in and out.
//!
//! [`StepEngine`] is the small surface the thread needs. The real implementation wraps
//! `dflash_models::speculative::engine::Engine` (see [`real`]); tests drive the same thread and HTTP
//! layer with a deterministic scripted engine. No tensor crosses this boundary, and no JSON.

pub mod admission;
pub mod handle;
pub mod memory;
pub mod real;
pub mod steplog;
pub mod thread;
pub mod warmup;

use crate::grammar::CompiledGrammar;

pub use handle::{EngineFailure, EngineHandle, EngineStats, SeqUpdate};
pub use thread::spawn_engine_thread;

/// Identifies one sequence inside an engine.
pub type SeqId = u64;

/// Sampling as the engine sees it, after defaults and validation (see `generation::lower`).
#[derive(Debug, Clone, PartialEq)]
pub struct EngineSampling {
    /// 0 means greedy.
    pub temperature: f32,
    pub top_p: f32,
    /// `None` means the whole vocabulary.
    pub top_k: Option<usize>,
    pub min_p: f32,
    pub repetition_penalty: f32,
    pub frequency_penalty: f32,
    pub presence_penalty: f32,
    /// Stop tokens are masked until this many tokens are generated.
    pub min_new_tokens: usize,
    /// (token, bias) added to the target's logits, token ids ascending.
    pub logit_bias: Vec<(u32, f32)>,
    pub seed: Option<u64>,
}

impl EngineSampling {
    pub fn greedy() -> Self {
        Self {
            temperature: 0.0,
            top_p: 1.0,
            top_k: None,
            min_p: 0.0,
            repetition_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
            min_new_tokens: 0,
            logit_bias: Vec::new(),
            seed: None,
        }
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0 || self.top_k == Some(1)
    }
}

/// One generation as the engine receives it.
#[derive(Debug, Clone, PartialEq)]
pub struct EngineRequest {
    pub prompt: Vec<u32>,
    pub max_new_tokens: usize,
    pub sampling: EngineSampling,
    /// Ids that end the sequence: the request's `stop_token_ids` plus the model's EOS ids unless
    /// `ignore_eos` (the server folds them in so the engine needs no tokenizer).
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    /// `Some(top_n)`: report each committed token's logprob under the target, with the `top_n`
    /// most likely tokens of its position.
    pub logprobs: Option<usize>,
    /// The grammar the output must follow (structured output), compiled by the route.
    pub grammar: Option<CompiledGrammar>,
    /// `Some((start, top_n))`: report the logprobs of the prompt's tokens from position
    /// `start` on (the first prompt token has none), with the first token's step.
    pub prompt_logprobs: Option<(usize, usize)>,
}

/// A committed token's log-probability under the target (log-softmax of the logits row that
/// predicted it) and its position's `top` most likely tokens, most likely first.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// Why the engine ended a sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineFinish {
    /// `max_new_tokens` reached.
    Length,
    /// A stop token was committed (it is the last of the event's tokens).
    Stop(u32),
}

/// Tokens one step committed for one sequence, with its speculative statistics for that step.
#[derive(Debug, Clone, PartialEq)]
pub struct StepEvent {
    pub id: SeqId,
    pub tokens: Vec<u32>,
    pub finished: Option<EngineFinish>,
    /// Draft tokens accepted in this step (bonus token excluded).
    pub accepted_drafts: usize,
    /// Target verify forwards this sequence took part in during this step (0 without drafting).
    pub verify_rounds: usize,
    /// One per token when the request asked for logprobs, else empty.
    pub logprobs: Vec<TokenLogprob>,
    /// Prompt tokens the sequence found in the prefix cache at admission (not prefilled).
    pub cached_tokens: usize,
    /// Times the sequence was retracted for lack of K/V pages so far.
    pub retractions: usize,
    /// The sequence failed (a device or model error in its forward) and the engine dropped
    /// it: its request ends with a 500 carrying this message; the others go on.
    pub error: Option<String>,
    /// With the first token, when the request asked: the prompt tokens' logprobs.
    pub prompt_logprobs: Vec<TokenLogprob>,
}

/// The engine could not admit a request: the request's fault (HTTP 400, the message says what
/// to change) or the server's (HTTP 500: a device or model error such as a CUDA out-of-memory
/// while allocating the sequence's cache, which is never a bad request).
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
#[error("{message}")]
pub struct AdmitError {
    pub message: String,
    pub server_fault: bool,
}

impl AdmitError {
    /// The request is at fault.
    pub fn client(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            server_fault: false,
        }
    }

    /// The server is at fault.
    pub fn server(message: impl Into<String>) -> Self {
        Self {
            message: message.into(),
            server_fault: true,
        }
    }
}

/// A step failed; every active sequence is aborted with this message (HTTP 500).
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
#[error("engine step failed: {message}")]
pub struct StepError {
    pub message: String,
}

/// What the engine was built with, for `/server_info` and the acceptance statistics.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineInfo {
    /// Draft tokens proposed per verify round (block size - 1 for a chain); 0 without drafting.
    pub drafts_per_round: usize,
}

/// What the engine thread needs from a decoding engine.
pub trait StepEngine: Send + 'static {
    fn add(&mut self, req: EngineRequest) -> Result<SeqId, AdmitError>;
    /// One round for every active sequence. Finished sequences are dropped by the engine.
    fn step(&mut self) -> Result<Vec<StepEvent>, StepError>;
    /// Drops a sequence that has not finished (client gone, stop string matched).
    fn remove(&mut self, id: SeqId);
    fn num_active(&self) -> usize;
    fn info(&self) -> EngineInfo;
    /// K/V-cache tokens a request holds while it runs (what admission reserves): by default
    /// its prompt plus `max_new_tokens`; an engine that allocates more says so.
    fn reservation(&self, prompt_len: usize, max_new_tokens: usize) -> usize {
        prompt_len.saturating_add(max_new_tokens)
    }
    /// The K/V-cache tokens device memory holds for all running requests together, when the
    /// engine sized that from the device (`--mem-fraction-static` on CUDA); `None` otherwise.
    fn kv_pool_tokens(&self) -> Option<usize> {
        None
    }
    /// Empties the prefix cache (only called with nothing running or waiting).
    fn flush_cache(&mut self) {}
    /// Whether the engine retracts running sequences when their K/V pages run short (and
    /// resumes them later): then admission reserves an estimate of the tokens a request will
    /// generate ([`admission::NewTokenRatio`]), not its whole `max_new_tokens`.
    fn retracts(&self) -> bool {
        false
    }
    /// Target forwards replayed from a CUDA graph so far (the decode log's `cuda graph:`).
    fn graph_replays(&self) -> u64 {
        0
    }
    /// What the last step held and was estimated to take, for the step log (`steplog.rs`).
    fn last_step(&self) -> Option<String> {
        None
    }
}

impl StepEngine for Box<dyn StepEngine> {
    fn add(&mut self, req: EngineRequest) -> Result<SeqId, AdmitError> {
        (**self).add(req)
    }
    fn step(&mut self) -> Result<Vec<StepEvent>, StepError> {
        (**self).step()
    }
    fn remove(&mut self, id: SeqId) {
        (**self).remove(id)
    }
    fn num_active(&self) -> usize {
        (**self).num_active()
    }
    fn info(&self) -> EngineInfo {
        (**self).info()
    }
    fn reservation(&self, prompt_len: usize, max_new_tokens: usize) -> usize {
        (**self).reservation(prompt_len, max_new_tokens)
    }
    fn kv_pool_tokens(&self) -> Option<usize> {
        (**self).kv_pool_tokens()
    }
    fn graph_replays(&self) -> u64 {
        (**self).graph_replays()
    }
    fn last_step(&self) -> Option<String> {
        (**self).last_step()
    }
    fn flush_cache(&mut self) {
        (**self).flush_cache()
    }
    fn retracts(&self) -> bool {
        (**self).retracts()
    }
}
