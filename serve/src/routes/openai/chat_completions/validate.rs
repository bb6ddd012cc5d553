//! `/v1/chat/completions` rules: messages are objects with a string `role` and text content
//! (a string, null, or a list of `{"type":"text"}` parts, flattened as SGLang does for
//! string-content templates).

use serde_json::{Map, Value};

use super::types::ChatRequest;
use crate::validation::{self as v, ValidationError};

pub struct ValidChat {
    /// Messages with text-part lists flattened into strings.
    pub messages: Vec<Value>,
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

/// `auto` and `none` are served; `required` and a named function need the answer constrained
/// to a call, which needs grammar-constrained generation (not built yet): a 400 that says so.
fn check_tool_choice(choice: Option<&Value>) -> Result<(), ValidationError> {
    match choice {
        None | Some(Value::Null) => Ok(()),
        Some(Value::String(s)) if s == "auto" || s == "none" => Ok(()),
        Some(Value::String(s)) if s == "required" => Err(ValidationError::ToolChoiceNeedsGrammar {
            given: "\"required\"".into(),
        }),
        Some(Value::Object(o)) if o.get("type").and_then(Value::as_str) == Some("function") => {
            Err(ValidationError::ToolChoiceNeedsGrammar {
                given: Value::Object(o.clone()).to_string(),
            })
        }
        Some(other) => Err(ValidationError::BadToolChoice {
            given: other.to_string(),
        }),
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
    check_tool_choice(req.tool_choice.as_ref())?;
    let format_type = req
        .response_format
        .as_ref()
        .and_then(|f| f.get("type"))
        .and_then(Value::as_str);
    v::check_unsupported(
        "response_format",
        !matches!(format_type, None | Some("text")),
    )?;
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
    Ok(ValidChat { messages })
}
