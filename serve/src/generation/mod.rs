//! What every endpoint lowers into, and what drives one generation to the client.
//!
//! Endpoint `convert.rs` files build a [`SamplingInput`] from their wire fields (already checked
//! by their `validate.rs`) and call [`lower`], which applies defaults in one place — request
//! value, then the model's `generation_config.json`, then SGLang's constants — and checks the
//! lengths against the context. The result, [`PreparedRequest`], is the only thing the engine
//! boundary accepts.

pub mod finish;
pub mod limits;
pub mod reasoning;
pub mod run;
pub mod tool_calls;

pub use finish::Finish;
pub use reasoning::ReasoningParserKind;
pub use run::{Chunk, Generation};
pub use tool_calls::ToolParserKind;

use serde::Deserialize;

use crate::engine::{EngineRequest, EngineSampling};
use crate::grammar::CompiledGrammar;
use crate::validation::{self as v, ValidationError};

/// Below this temperature sampling is greedy (SGLang rewrites it to `top_k = 1`).
const GREEDY_TEMPERATURE: f64 = 1e-6;

/// Sampling values as the client sent them, after the endpoint mapped its field names.
#[derive(Debug, Clone, Default)]
pub struct SamplingInput {
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub presence_penalty: Option<f64>,
    pub repetition_penalty: Option<f64>,
    pub seed: Option<i64>,
    /// The explicit completion budget, under the name the client used (`max_tokens`, ...).
    pub max_new_tokens: Option<i64>,
    pub max_field: &'static str,
    pub min_new_tokens: Option<i64>,
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<i64>,
    pub ignore_eos: bool,
    pub no_stop_trim: bool,
    pub skip_special_tokens: bool,
    /// `{"token id": bias}` as sent (checked against the vocabulary by [`lower`]).
    pub logit_bias: Option<serde_json::Value>,
}

/// The rules every endpoint applies to its sampling values.
pub fn check_sampling(s: &SamplingInput) -> Result<(), ValidationError> {
    for (field, value) in [
        ("temperature", s.temperature),
        ("top_p", s.top_p),
        ("min_p", s.min_p),
        ("frequency_penalty", s.frequency_penalty),
        ("presence_penalty", s.presence_penalty),
        ("repetition_penalty", s.repetition_penalty),
    ] {
        v::check_f32(field, value)?;
    }
    v::check_temperature("temperature", s.temperature)?;
    v::check_top_p("top_p", s.top_p)?;
    v::check_top_k("top_k", s.top_k)?;
    v::check_min_p("min_p", s.min_p)?;
    v::check_penalty("frequency_penalty", s.frequency_penalty)?;
    v::check_penalty("presence_penalty", s.presence_penalty)?;
    v::check_repetition_penalty("repetition_penalty", s.repetition_penalty)?;
    v::check_at_least(s.max_field, 0, s.max_new_tokens)?;
    v::check_at_least("min_new_tokens", 0, s.min_new_tokens)?;
    v::check_stop_count("stop", &s.stop)?;
    if let (Some(min), Some(max)) = (s.min_new_tokens, s.max_new_tokens) {
        if min > max {
            return Err(ValidationError::MinAboveMax {
                min_field: "min_new_tokens",
                min,
                max_field: s.max_field,
                max,
            });
        }
    }
    Ok(())
}

/// Sampling defaults from the model's `generation_config.json` (SGLang's `--sampling-defaults
/// model`); keys the file does not set fall back to SGLang's constants.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
pub struct SamplingDefaults {
    #[serde(default)]
    pub temperature: Option<f64>,
    #[serde(default)]
    pub top_p: Option<f64>,
    #[serde(default)]
    pub top_k: Option<i64>,
    #[serde(default)]
    pub min_p: Option<f64>,
    #[serde(default)]
    pub repetition_penalty: Option<f64>,
}

/// Model facts `lower` checks against.
#[derive(Debug, Clone)]
pub struct LowerContext {
    pub context_length: usize,
    pub vocab_size: usize,
    pub eos_token_ids: Vec<u32>,
    pub defaults: SamplingDefaults,
}

/// A request that passed every check; only this reaches the engine.
#[derive(Debug, Clone, PartialEq)]
pub struct PreparedRequest {
    pub rid: String,
    pub prompt_ids: Vec<u32>,
    pub max_new_tokens: usize,
    pub sampling: EngineSampling,
    pub stop_strings: Vec<String>,
    /// The request's own `stop_token_ids` (trimmed from the text like EOS).
    pub stop_token_ids: Vec<u32>,
    /// What the engine stops on: `stop_token_ids` plus EOS unless `ignore_eos`.
    pub engine_stop_ids: Vec<u32>,
    pub ignore_eos: bool,
    pub no_stop_trim: bool,
    pub skip_special_tokens: bool,
    /// Answered as a stream (the `is_streaming` metric label); set by the route.
    pub stream: bool,
    /// `Some(top_n)`: the answer reports each output token's logprob (and `top_n` alternatives);
    /// set by the route.
    pub logprobs: Option<usize>,
    /// The grammar the output must follow; set by the route.
    pub grammar: Option<CompiledGrammar>,
    /// `Some((start, top_n))`: the prompt tokens' logprobs from `start` on; set by the route.
    pub prompt_logprobs: Option<(usize, usize)>,
}

impl PreparedRequest {
    pub fn engine_request(&self) -> EngineRequest {
        EngineRequest {
            prompt: self.prompt_ids.clone(),
            max_new_tokens: self.max_new_tokens,
            sampling: self.sampling.clone(),
            stop_token_ids: self.engine_stop_ids.clone(),
            ignore_eos: self.ignore_eos,
            logprobs: self.logprobs,
            grammar: self.grammar.clone(),
            prompt_logprobs: self.prompt_logprobs,
        }
    }

    /// The same request as sample `index` of `n`: its own id and, when seeded, its own seed, so
    /// parallel samples differ but stay reproducible.
    pub fn sample(&self, index: usize, n: usize) -> Self {
        let mut out = self.clone();
        if n > 1 {
            out.rid = format!("{}-{index}", self.rid);
            out.sampling.seed = self.sampling.seed.map(|s| s.wrapping_add(index as u64));
        }
        out
    }
}

/// How many tokens a request may generate when it does not say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DefaultBudget {
    /// A fixed default, clamped to what the context leaves (`/generate`: 128, completions: 16).
    Fixed(usize),
    /// Up to the context (chat without `max_tokens`).
    RestOfContext,
}

/// Lowers checked wire values into a [`PreparedRequest`].
pub fn lower(
    rid: String,
    prompt_ids: Vec<u32>,
    s: &SamplingInput,
    budget: DefaultBudget,
    ctx: &LowerContext,
) -> Result<PreparedRequest, ValidationError> {
    if prompt_ids.is_empty() {
        return Err(ValidationError::EmptyPrompt);
    }
    let input = prompt_ids.len();
    if input >= ctx.context_length {
        return Err(ValidationError::PromptTooLong {
            input,
            context: ctx.context_length,
        });
    }
    let room = ctx.context_length - input;
    let max_new_tokens = match (s.max_new_tokens, budget) {
        (Some(m), _) => {
            let m = m.max(0) as usize;
            if m > room {
                return Err(ValidationError::TotalTooLong {
                    context: ctx.context_length,
                    total: input + m,
                    input,
                    completion: m,
                });
            }
            m
        }
        (None, DefaultBudget::Fixed(d)) => d.min(room),
        (None, DefaultBudget::RestOfContext) => room,
    };
    let stop_token_ids = v::check_token_ids("stop_token_ids", &s.stop_token_ids, ctx.vocab_size)?;
    let logit_bias = v::check_logit_bias("logit_bias", s.logit_bias.as_ref(), ctx.vocab_size)?;
    let mut engine_stop_ids = stop_token_ids.clone();
    if !s.ignore_eos {
        for id in &ctx.eos_token_ids {
            if !engine_stop_ids.contains(id) {
                engine_stop_ids.push(*id);
            }
        }
    }
    Ok(PreparedRequest {
        rid,
        prompt_ids,
        max_new_tokens,
        sampling: EngineSampling {
            logit_bias,
            ..lower_sampling(s, &ctx.defaults)
        },
        stop_strings: s.stop.clone(),
        stop_token_ids,
        engine_stop_ids,
        ignore_eos: s.ignore_eos,
        no_stop_trim: s.no_stop_trim,
        skip_special_tokens: s.skip_special_tokens,
        stream: false,
        logprobs: None,
        grammar: None,
        prompt_logprobs: None,
    })
}

fn lower_sampling(s: &SamplingInput, d: &SamplingDefaults) -> EngineSampling {
    let temperature = s.temperature.or(d.temperature).unwrap_or(1.0);
    let top_k = s.top_k.or(d.top_k).unwrap_or(-1);
    let greedy = temperature < GREEDY_TEMPERATURE;
    EngineSampling {
        temperature: if greedy { 0.0 } else { temperature as f32 },
        top_p: s.top_p.or(d.top_p).unwrap_or(1.0) as f32,
        top_k: match (greedy, top_k) {
            (true, _) => Some(1),
            (false, k) if k >= 1 => Some(k as usize),
            _ => None,
        },
        min_p: s.min_p.or(d.min_p).unwrap_or(0.0) as f32,
        repetition_penalty: s.repetition_penalty.or(d.repetition_penalty).unwrap_or(1.0) as f32,
        frequency_penalty: s.frequency_penalty.unwrap_or(0.0) as f32,
        presence_penalty: s.presence_penalty.unwrap_or(0.0) as f32,
        min_new_tokens: s.min_new_tokens.unwrap_or(0).max(0) as usize,
        logit_bias: Vec::new(),
        seed: s.seed.map(|x| x as u64),
    }
}

/// A fresh request id: 32 lowercase hex characters, like SGLang's `uuid4().hex`.
pub fn new_rid() -> String {
    let bits: u128 = rand::random();
    format!("{bits:032x}")
}
