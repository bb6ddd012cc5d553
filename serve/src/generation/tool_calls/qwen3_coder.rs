//! The Qwen3-Coder call body: `<function=NAME>` then `<parameter=KEY>VALUE</parameter>`
//! elements, then `</function>`. Values are text; each is converted by the type its tool's JSON
//! schema gives the parameter (integer, number, boolean, object/array as JSON, `null`), and
//! stays a string when the schema says string, names no type or the text does not convert
//! (SGLang's rule).

use serde_json::{Map, Value};

use super::ToolCall;

const FUNCTION: &str = "<function=";
const FUNCTION_END: &str = "</function>";
const PARAMETER: &str = "<parameter=";
const PARAMETER_END: &str = "</parameter>";

/// `schema_of(name)` is the declared tool's `parameters` schema.
pub fn parse<'a>(body: &str, schema_of: impl Fn(&str) -> Option<&'a Value>) -> Option<ToolCall> {
    let start = body.find(FUNCTION)? + FUNCTION.len();
    let rest = &body[start..];
    let name_end = rest.find('>')?;
    let name = rest[..name_end].trim().to_string();
    let mut params = &rest[name_end + 1..];
    if let Some(end) = params.find(FUNCTION_END) {
        params = &params[..end];
    }
    let properties = schema_of(&name)
        .and_then(|s| s.get("properties"))
        .and_then(Value::as_object);
    let mut arguments = Map::new();
    let mut cursor = params;
    while let Some(p) = cursor.find(PARAMETER) {
        let after = &cursor[p + PARAMETER.len()..];
        let Some(key_end) = after.find('>') else {
            break;
        };
        let key = after[..key_end].trim().to_string();
        let value_and_rest = &after[key_end + 1..];
        // A value runs to its end tag, or (unclosed) to the next parameter.
        let (value, next) = match value_and_rest.find(PARAMETER_END) {
            Some(e) => (
                &value_and_rest[..e],
                &value_and_rest[e + PARAMETER_END.len()..],
            ),
            None => match value_and_rest.find(PARAMETER) {
                Some(e) => (&value_and_rest[..e], &value_and_rest[e..]),
                None => (value_and_rest, ""),
            },
        };
        let value = value.strip_prefix('\n').unwrap_or(value);
        let value = value.strip_suffix('\n').unwrap_or(value);
        let schema_type = properties
            .and_then(|p| p.get(&key))
            .and_then(|s| s.get("type"))
            .and_then(Value::as_str);
        arguments.insert(key, convert(value, schema_type));
        cursor = next;
    }
    Some(ToolCall {
        name,
        arguments: Value::Object(arguments).to_string(),
    })
}

fn convert(text: &str, schema_type: Option<&str>) -> Value {
    if text.eq_ignore_ascii_case("null") {
        return Value::Null;
    }
    let string = || Value::String(text.to_string());
    let t = schema_type.map(str::to_ascii_lowercase);
    match t.as_deref() {
        None | Some("string" | "str" | "text" | "enum") => string(),
        Some(t) if t.starts_with("int") => text
            .trim()
            .parse::<i64>()
            .map(Value::from)
            .unwrap_or_else(|_| string()),
        Some(t) if t.starts_with("num") || t.starts_with("float") => {
            let trimmed = text.trim();
            let integral = !trimmed.contains('.') && !trimmed.to_ascii_lowercase().contains('e');
            match (integral, trimmed.parse::<i64>(), trimmed.parse::<f64>()) {
                (true, Ok(i), _) => Value::from(i),
                (_, _, Ok(f)) => serde_json::Number::from_f64(f)
                    .map(Value::Number)
                    .unwrap_or_else(string),
                _ => string(),
            }
        }
        Some("boolean" | "bool") => Value::Bool(text.trim().eq_ignore_ascii_case("true")),
        Some(_) => serde_json::from_str(text).unwrap_or_else(|_| string()),
    }
}
