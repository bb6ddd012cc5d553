//! The Qwen2.5 / Qwen3 (and Hermes) call body: one JSON object, `{"name": ..., "arguments":
//! {...}}` (`parameters` is accepted for `arguments`, as SGLang accepts it).

use serde_json::Value;

use super::ToolCall;

pub fn parse(body: &str) -> Option<ToolCall> {
    let v: Value = serde_json::from_str(body.trim()).ok()?;
    let name = v.get("name")?.as_str()?.to_string();
    let arguments = match v.get("arguments").or_else(|| v.get("parameters")) {
        None | Some(Value::Null) => "{}".to_string(),
        // Some models write the arguments as a JSON string already.
        Some(Value::String(s)) if serde_json::from_str::<Value>(s).is_ok() => s.clone(),
        Some(other) => other.to_string(),
    };
    Some(ToolCall { name, arguments })
}
