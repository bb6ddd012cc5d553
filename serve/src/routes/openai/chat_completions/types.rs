//! `/v1/chat/completions` wire types (OpenAI `ChatCompletionRequest` plus SGLang's extras).
//! `messages` and `tools` stay JSON: the chat template reads whatever fields they carry.

use serde::Deserialize;
use serde_json::{Map, Value};

use super::super::CommonFields;

#[derive(Debug, Clone, Default, Deserialize)]
pub struct ChatRequest {
    #[serde(default)]
    pub messages: Vec<Value>,
    pub max_tokens: Option<i64>,
    pub max_completion_tokens: Option<i64>,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    pub chat_template_kwargs: Option<Map<String, Value>>,
    pub reasoning_effort: Option<Value>,
    pub separate_reasoning: Option<bool>,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<i64>,
    pub response_format: Option<Value>,
    pub continue_final_message: Option<bool>,
    pub return_meta_info: Option<bool>,
    pub return_spec_tokens_details: Option<bool>,
    #[serde(flatten)]
    pub common: CommonFields,
}

impl ChatRequest {
    /// `max_completion_tokens or max_tokens`, under the name the client used.
    pub fn max(&self) -> (Option<i64>, &'static str) {
        match (self.max_completion_tokens, self.max_tokens) {
            (Some(m), _) => (Some(m), "max_completion_tokens"),
            (None, Some(m)) => (Some(m), "max_tokens"),
            (None, None) => (None, "max_completion_tokens"),
        }
    }
}
