//! `/v1/chat/completions` rules: messages are objects with a string `role` and text content
//! (a string, null, or a list of `{"type":"text"}` parts, flattened as SGLang does for
//! string-content templates).

use serde_json::{Map, Value};

use super::types::ChatRequest;
use crate::validation::{self as v, ValidationError};

pub struct ValidChat {
    /// Messages with text-part lists flattened into strings.
    pub messages: Vec<Value>,
    /// `response_format` / `json_schema` / `regex` / `ebnf`.
    pub grammar: Option<crate::grammar::GrammarSpec>,
    pub tool_choice: ToolChoice,
}

fn flatten_content(index: usize, content: &Value) -> Result<Value, ValidationError> {
    let bad = |problem: String| ValidationError::BadMessage { index, problem };
    match content {
        Value::Null | Value::String(_) => Ok(content.clone()),
        Value::Array(parts) => {
            let mut text = String::new();
            for part in parts {
                match (
                    part.get("type").and_then(Value::as_str),
                    part.get("text").and_then(Value::as_str),
                ) {
                    (Some("text"), Some(t)) => text.push_str(t),
                    (kind, _) => {
                        return Err(bad(format!(
                            "content part of type `{}` is not supported; send text only",
                            kind.unwrap_or("?")
                        )))
                    }
                }
            }
            Ok(Value::String(text))
        }
        other => Err(bad(format!(
            "`content` must be a string, null or a list of text parts, not {other}"
        ))),
    }
}

/// Limits checked before the template is rendered: `n` against
/// `--max-sequences-per-request`, and the messages' text bytes (summed) against what the
/// context holds, so an 8 MiB message is refused without rendering or tokenizing it.
pub fn check_limits(
    req: &ChatRequest,
    valid: &ValidChat,
    limits: &crate::state::RequestLimits,
) -> Result<(), ValidationError> {
    v::check_sequences(req.common.n(), limits.max_sequences)?;
    let bytes: usize = valid
        .messages
        .iter()
        .filter_map(|m| m.get("content").and_then(Value::as_str))
        .map(str::len)
        .sum();
    limits.prompt.check_bytes(bytes)
}

/// What `tool_choice` asks: `auto` and `none` leave the answer free; `required` and a named
/// function constrain it to a call with the grammar backend (`convert.rs`).
#[derive(Debug, Clone, PartialEq)]
pub enum ToolChoice {
    Free,
    Required,
    Named(String),
}

fn check_tool_choice(choice: Option<&Value>) -> Result<ToolChoice, ValidationError> {
    let bad = |v: &Value| ValidationError::BadToolChoice {
        given: v.to_string(),
    };
    match choice {
        None | Some(Value::Null) => Ok(ToolChoice::Free),
        Some(Value::String(s)) if s == "auto" || s == "none" => Ok(ToolChoice::Free),
        Some(Value::String(s)) if s == "required" => Ok(ToolChoice::Required),
        Some(v @ Value::Object(o)) if o.get("type").and_then(Value::as_str) == Some("function") => {
            let name = o
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .ok_or_else(|| bad(v))?;
            Ok(ToolChoice::Named(name.to_string()))
        }
        Some(other) => Err(bad(other)),
    }
}

pub fn validate(req: &ChatRequest) -> Result<ValidChat, ValidationError> {
    if req.messages.is_empty() {
        return Err(ValidationError::EmptyMessages);
    }
    v::check_at_least("top_logprobs", 0, req.top_logprobs)?;
    v::check_unsupported(
        "continue_final_message",
        req.continue_final_message == Some(true),
    )?;
    let tool_choice = check_tool_choice(req.tool_choice.as_ref())?;
    let grammar = req.common.grammar(req.response_format.as_ref())?;
    let (max, field) = req.max();
    v::check_at_least(field, 1, max)?;
    req.common.check(max, field)?;
    let mut messages = Vec::with_capacity(req.messages.len());
    for (index, m) in req.messages.iter().enumerate() {
        let Some(obj) = m.as_object() else {
            return Err(ValidationError::BadMessage {
                index,
                problem: "must be an object with `role` and `content`".into(),
            });
        };
        if !obj.get("role").is_some_and(Value::is_string) {
            return Err(ValidationError::BadMessage {
                index,
                problem: "`role` must be a string such as \"user\"".into(),
            });
        }
        let mut out: Map<String, Value> = obj.clone();
        if let Some(c) = obj.get("content") {
            out.insert("content".into(), flatten_content(index, c)?);
        }
        messages.push(Value::Object(out));
    }
    Ok(ValidChat {
        messages,
        grammar,
        tool_choice,
    })
}
