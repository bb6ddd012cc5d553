//! OpenAI-compatible routes as SGLang implements them: ids are bare 32-hex rids, any `model`
//! string is accepted (SGLang serves its one model whatever the name) and answers name the
//! served model, errors use the flat `{"object":"error",...}` body, and the SGLang extras
//! (`top_k`, `min_p`, `ignore_eos`, `stop_token_ids`, `chat_template_kwargs`, ...) are honoured.

pub mod chat_completions;
pub mod completions;
pub mod models;
pub mod responses;

use serde::Deserialize;
use serde_json::{json, Value};

use super::generate::types::OneOrMany;
use super::stream::Counts;
use crate::generation::{check_sampling, SamplingInput};
use crate::grammar::{spec, CompiledGrammar, GrammarFields, GrammarSpec};
use crate::validation::{self as v, ValidationError};

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
    #[serde(default)]
    pub continuous_usage_stats: bool,
}

/// Fields chat and completions share (flattened into both request types).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct CommonFields {
    pub model: Option<String>,
    pub n: Option<i64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub presence_penalty: Option<f64>,
    pub repetition_penalty: Option<f64>,
    pub seed: Option<i64>,
    pub stop: Option<OneOrMany<String>>,
    pub stop_token_ids: Option<Vec<i64>>,
    pub ignore_eos: Option<bool>,
    pub no_stop_trim: Option<bool>,
    pub skip_special_tokens: Option<bool>,
    pub min_tokens: Option<i64>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    pub logit_bias: Option<Value>,
    pub json_schema: Option<Value>,
    pub regex: Option<Value>,
    pub ebnf: Option<Value>,
    pub stop_regex: Option<Value>,
    pub lora_path: Option<Value>,
    pub rid: Option<String>,
}

fn present(v: &Option<Value>) -> bool {
    !matches!(v, None | Some(Value::Null))
}

impl CommonFields {
    pub fn n(&self) -> usize {
        self.n.unwrap_or(1).max(1) as usize
    }

    /// `stream_options.continuous_usage_stats`: every chunk carries its choice's usage so far.
    pub fn continuous_usage(&self) -> bool {
        self.stream_options
            .as_ref()
            .is_some_and(|o| o.continuous_usage_stats)
    }

    pub fn include_usage(&self) -> bool {
        self.stream_options
            .as_ref()
            .is_some_and(|o| o.include_usage)
    }

    /// The shared sampling input; `max` is the explicit budget under the client's field name.
    pub fn sampling(&self, max: Option<i64>, max_field: &'static str) -> SamplingInput {
        SamplingInput {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            min_p: self.min_p,
            frequency_penalty: self.frequency_penalty,
            presence_penalty: self.presence_penalty,
            repetition_penalty: self.repetition_penalty,
            seed: self.seed,
            max_new_tokens: max,
            max_field,
            min_new_tokens: self.min_tokens,
            stop: self.stop.as_ref().map(|s| s.to_vec()).unwrap_or_default(),
            stop_token_ids: self.stop_token_ids.clone().unwrap_or_default(),
            ignore_eos: self.ignore_eos.unwrap_or(false),
            no_stop_trim: self.no_stop_trim.unwrap_or(false),
            skip_special_tokens: self.skip_special_tokens.unwrap_or(true),
            logit_bias: self.logit_bias.clone(),
        }
    }

    /// Rules both OpenAI routes apply.
    pub fn check(&self, max: Option<i64>, max_field: &'static str) -> Result<(), ValidationError> {
        v::check_unsupported("stop_regex", present(&self.stop_regex))?;
        v::check_unsupported("lora_path", present(&self.lora_path))?;
        v::check_n("n", self.n)?;
        check_sampling(&self.sampling(max, max_field))
    }

    /// The request's grammar: OpenAI's `response_format` or SGLang's `json_schema`, `regex`,
    /// `ebnf` (at most one).
    pub fn grammar(
        &self,
        response_format: Option<&Value>,
    ) -> Result<Option<GrammarSpec>, ValidationError> {
        Ok(spec::from_fields(&GrammarFields {
            response_format,
            json_schema: self.json_schema.as_ref(),
            regex: self.regex.as_ref(),
            ebnf: self.ebnf.as_ref(),
        })?)
    }
}

/// Compiles a request's grammar against the served vocabulary (400 when llguidance refuses
/// it or structured output is off).
pub fn compile_grammar(
    state: &crate::state::AppState,
    spec: Option<GrammarSpec>,
) -> Result<Option<CompiledGrammar>, ValidationError> {
    Ok(spec.map(|s| state.model.grammar.compile(&s)).transpose()?)
}

/// SGLang's usage object. `n > 1` counts each prompt's tokens once and sums completions.
pub fn usage(counts: &[Counts], n: usize, drop_nulls: bool) -> Value {
    let n = n.max(1);
    let prompt: usize = counts.iter().step_by(n).map(|c| c.prompt_tokens).sum();
    let completion: usize = counts.iter().map(|c| c.completion_tokens).sum();
    let reasoning: usize = counts.iter().map(|c| c.reasoning_tokens).sum();
    // `completion_tokens_details` only when there was reasoning (SGLANG_API.md 2.7).
    let details = if reasoning > 0 {
        json!({"reasoning_tokens": reasoning})
    } else {
        Value::Null
    };
    // `prompt_tokens_details` only with --enable-cache-report (SGLang's rule).
    let cached: Option<usize> = counts
        .iter()
        .step_by(n)
        .map(|c| c.cached_tokens)
        .sum::<Option<usize>>();
    let prompt_details = match cached {
        Some(c) if !counts.is_empty() => json!({ "cached_tokens": c }),
        _ => Value::Null,
    };
    let mut u = json!({"prompt_tokens": prompt, "total_tokens": prompt + completion,
           "completion_tokens": completion, "prompt_tokens_details": prompt_details,
           "reasoning_tokens": reasoning, "completion_tokens_details": details});
    if let (true, Some(obj)) = (drop_nulls, u.as_object_mut()) {
        obj.retain(|_, v| !v.is_null());
    }
    u
}

/// `sglext.spec_tokens_details`: one object, or a list when `n > 1` (SGLANG_API.md 2.10).
pub fn spec_tokens_details(counts: &[Counts]) -> Value {
    match counts {
        [one] => one.spec_details.clone(),
        many => Value::Array(many.iter().map(|c| c.spec_details.clone()).collect()),
    }
}

/// The final `choices: []` chunk with usage (when `stream_options.include_usage`).
pub fn usage_chunk(
    id: &str,
    object: &str,
    created: u64,
    model: &str,
    counts: &[Counts],
    n: usize,
) -> Value {
    json!({"id": id, "object": object, "created": created, "model": model,
           "choices": [], "usage": usage(counts, n, true)})
}

/// One generation's usage so far (`continuous_usage_stats` chunks).
pub fn running_usage(g: &crate::generation::Generation) -> Value {
    usage(&counts_of(std::slice::from_ref(g)), 1, false)
}

pub fn counts_of(gens: &[crate::generation::Generation]) -> Vec<Counts> {
    gens.iter()
        .map(|g| Counts {
            prompt_tokens: g.prompt_tokens(),
            completion_tokens: g.completion_tokens(),
            reasoning_tokens: g.reasoning_tokens(),
            cached_tokens: g.reported_cached_tokens(),
            spec_details: g.spec_tokens_details(),
        })
        .collect()
}
