//! `/generate` wire types (SGLang's `GenerateReqInput` and `SamplingParams`). Every top-level
//! field may be a scalar (one request) or a list (a batch). Unknown top-level fields are
//! accepted and ignored; unknown `sampling_params` keys are refused as SGLang 0.5.23 refuses
//! them; fields we know but cannot honour are refused in `validate.rs`.

use serde::Deserialize;
use serde_json::Value;

/// A scalar or a list of them.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum OneOrMany<T> {
    One(T),
    Many(Vec<T>),
}

impl<T: Clone> OneOrMany<T> {
    pub fn to_vec(&self) -> Vec<T> {
        match self {
            OneOrMany::One(x) => vec![x.clone()],
            OneOrMany::Many(v) => v.clone(),
        }
    }
}

/// `input_ids`: one prompt or a batch.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum InputIds {
    One(Vec<i64>),
    Batch(Vec<Vec<i64>>),
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct GenerateRequest {
    #[serde(default)]
    pub text: Option<OneOrMany<String>>,
    #[serde(default)]
    pub input_ids: Option<InputIds>,
    #[serde(default)]
    pub input_embeds: Option<Value>,
    #[serde(default)]
    pub sampling_params: Option<OneOrMany<SamplingParams>>,
    #[serde(default)]
    pub rid: Option<OneOrMany<String>>,
    #[serde(default)]
    pub stream: bool,
    #[serde(default)]
    pub return_logprob: Option<OneOrMany<bool>>,
    #[serde(default)]
    pub top_logprobs_num: Option<OneOrMany<i64>>,
    #[serde(default)]
    pub logprob_start_len: Option<OneOrMany<i64>>,
    #[serde(default)]
    pub return_text_in_logprobs: bool,
    #[serde(default)]
    pub token_ids_logprob: Option<Value>,
    #[serde(default)]
    pub return_hidden_states: Option<OneOrMany<bool>>,
    #[serde(default)]
    pub lora_path: Option<Value>,
    #[serde(default)]
    pub image_data: Option<Value>,
}

/// SGLang 0.5.23's `SamplingParams` keys; any other key is a 400 naming it (SGLang's contract
/// check, serde's `unknown field` text).
pub const SAMPLING_PARAMS_FIELDS: &[&str] = &[
    "max_new_tokens",
    "stop",
    "stop_token_ids",
    "stop_regex",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "min_new_tokens",
    "n",
    "json_schema",
    "regex",
    "ebnf",
    "structural_tag",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "stream_interval",
    "logit_bias",
    "sampling_seed",
    "custom_params",
    "beam_width",
    "watermark",
    "choice",
];

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
pub struct SamplingParams {
    pub max_new_tokens: Option<i64>,
    pub min_new_tokens: Option<i64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub presence_penalty: Option<f64>,
    pub repetition_penalty: Option<f64>,
    pub stop: Option<OneOrMany<String>>,
    pub stop_token_ids: Option<Vec<i64>>,
    pub stop_regex: Option<Value>,
    pub ignore_eos: Option<bool>,
    pub skip_special_tokens: Option<bool>,
    pub spaces_between_special_tokens: Option<bool>,
    pub no_stop_trim: Option<bool>,
    pub n: Option<i64>,
    pub json_schema: Option<Value>,
    pub regex: Option<Value>,
    pub ebnf: Option<Value>,
    pub structural_tag: Option<Value>,
    pub logit_bias: Option<Value>,
    pub sampling_seed: Option<i64>,
    pub stream_interval: Option<i64>,
    pub custom_params: Option<Value>,
    pub beam_width: Option<Value>,
    pub watermark: Option<Value>,
    pub choice: Option<Value>,
    /// Keys SGLang does not know (refused in `validate.rs`); collected rather than refused by
    /// serde because a refusal inside the scalar-or-list enum would lose the key's name.
    #[serde(flatten)]
    pub unknown: std::collections::BTreeMap<String, Value>,
}
