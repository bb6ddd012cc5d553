//! `/generate` wire types (SGLang's `GenerateReqInput` and `SamplingParams`). Every top-level
//! field may be a scalar (one request) or a list (a batch). Unknown fields are accepted and
//! ignored, as SGLang's older dataclass parsing did; fields we know but cannot honour are
//! refused in `validate.rs`.

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
    pub return_hidden_states: Option<OneOrMany<bool>>,
    #[serde(default)]
    pub lora_path: Option<Value>,
    #[serde(default)]
    pub image_data: Option<Value>,
}

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
}
