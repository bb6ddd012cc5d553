//! `/v1/completions` wire types (OpenAI `CompletionRequest` plus SGLang's extras).

use serde::Deserialize;
use serde_json::Value;

use super::super::CommonFields;

/// `prompt`: a string, strings, token ids, or lists of token ids.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum PromptField {
    Text(String),
    Texts(Vec<String>),
    Ids(Vec<i64>),
    IdsBatch(Vec<Vec<i64>>),
}

#[derive(Debug, Clone, Default, Deserialize)]
pub struct CompletionRequest {
    pub prompt: Option<PromptField>,
    pub max_tokens: Option<i64>,
    pub echo: Option<bool>,
    pub logprobs: Option<Value>,
    pub best_of: Option<i64>,
    pub suffix: Option<String>,
    pub response_format: Option<Value>,
    #[serde(flatten)]
    pub common: CommonFields,
}
