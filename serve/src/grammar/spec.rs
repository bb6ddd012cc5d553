//! What a request constrains its output to, from the fields SGLang and OpenAI use: OpenAI's
//! `response_format` (`json_object`, `json_schema`), SGLang's `json_schema`, `regex` and `ebnf`
//! (on `/generate`'s `sampling_params` and the OpenAI routes), and the tool-call grammars
//! `tool_choice` `required` / named build (a Lark grammar). At most one per request, as SGLang
//! requires.

use llguidance::api::TopLevelGrammar;
use serde_json::Value;

#[derive(Debug, Clone, PartialEq)]
pub enum GrammarSpec {
    /// A JSON schema; `field` is where the request gave it.
    JsonSchema {
        field: &'static str,
        schema: Value,
    },
    Regex(String),
    /// SGLang's EBNF (GBNF: `root ::= ...`), rewritten to llguidance's Lark syntax.
    Ebnf(String),
    /// A Lark grammar built here (tool calls).
    Lark {
        field: &'static str,
        grammar: String,
    },
}

impl GrammarSpec {
    /// The request field it came from, for error messages.
    pub fn field(&self) -> &'static str {
        match self {
            GrammarSpec::JsonSchema { field, .. } | GrammarSpec::Lark { field, .. } => field,
            GrammarSpec::Regex(_) => "regex",
            GrammarSpec::Ebnf(_) => "ebnf",
        }
    }

    pub fn to_llguidance(&self) -> Result<TopLevelGrammar, String> {
        Ok(match self {
            GrammarSpec::JsonSchema { schema, .. } => {
                TopLevelGrammar::from_json_schema(with_layout(schema))
            }
            GrammarSpec::Regex(rx) => TopLevelGrammar::from_regex(rx),
            GrammarSpec::Ebnf(g) => TopLevelGrammar::from_lark(gbnf_to_lark(g)),
            GrammarSpec::Lark { grammar, .. } => TopLevelGrammar::from_lark(grammar.clone()),
        })
    }
}

/// JSON laid out as Python's `json.dumps` writes it (`", "` and `": "`, no other whitespace)
/// unless the schema sets llguidance's own `x-guidance` options: free whitespace lets a model
/// spend its whole budget on blank lines before the object closes.
fn with_layout(schema: &Value) -> Value {
    let mut schema = schema.clone();
    if let Some(obj) = schema.as_object_mut() {
        obj.entry("x-guidance").or_insert_with(|| {
            serde_json::json!({"whitespace_flexible": false, "key_separator": ": ", "item_separator": ", "})
        });
    }
    schema
}

/// Why a request's structured-output fields were refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SpecError {
    #[error("Only one of json_schema, regex, ebnf, or structural_tag can be set; got {given}.")]
    Several { given: String },
    #[error("`{field}` must be {expected}")]
    Shape {
        field: &'static str,
        expected: &'static str,
    },
    #[error("`{field}` is not valid JSON: {message}")]
    NotJson {
        field: &'static str,
        message: String,
    },
    #[error("`response_format` type {given:?} is not supported; use \"text\", \"json_object\" or \"json_schema\"")]
    FormatType { given: String },
}

/// The structured-output fields of one request, as sent.
#[derive(Debug, Clone, Default)]
pub struct GrammarFields<'a> {
    pub response_format: Option<&'a Value>,
    pub json_schema: Option<&'a Value>,
    pub regex: Option<&'a Value>,
    pub ebnf: Option<&'a Value>,
}

fn present(v: Option<&Value>) -> Option<&Value> {
    v.filter(|v| !v.is_null())
}

/// The request's grammar, if any (at most one of its fields may set one).
pub fn from_fields(f: &GrammarFields<'_>) -> Result<Option<GrammarSpec>, SpecError> {
    let mut specs = Vec::new();
    if let Some(rf) = present(f.response_format) {
        if let Some(spec) = response_format(rf)? {
            specs.push(spec);
        }
    }
    if let Some(v) = present(f.json_schema) {
        specs.push(GrammarSpec::JsonSchema {
            field: "json_schema",
            schema: schema_value("json_schema", v)?,
        });
    }
    if let Some(v) = present(f.regex) {
        specs.push(GrammarSpec::Regex(string("regex", v)?));
    }
    if let Some(v) = present(f.ebnf) {
        specs.push(GrammarSpec::Ebnf(string("ebnf", v)?));
    }
    if specs.len() > 1 {
        let given: Vec<&str> = specs.iter().map(GrammarSpec::field).collect();
        return Err(SpecError::Several {
            given: given.join(", "),
        });
    }
    Ok(specs.pop())
}

fn string(field: &'static str, v: &Value) -> Result<String, SpecError> {
    v.as_str().map(str::to_string).ok_or(SpecError::Shape {
        field,
        expected: "a string",
    })
}

/// A schema given as a JSON string (SGLang's `json_schema`) or as an object.
fn schema_value(field: &'static str, v: &Value) -> Result<Value, SpecError> {
    match v {
        Value::String(s) => serde_json::from_str(s).map_err(|e| SpecError::NotJson {
            field,
            message: e.to_string(),
        }),
        Value::Object(_) | Value::Bool(_) => Ok(v.clone()),
        _ => Err(SpecError::Shape {
            field,
            expected: "a JSON schema (an object, or a string holding one)",
        }),
    }
}

/// OpenAI's `response_format`: `text` (none), `json_object` (any JSON object, as SGLang
/// constrains it) or `json_schema` (`json_schema.schema`).
fn response_format(rf: &Value) -> Result<Option<GrammarSpec>, SpecError> {
    let field = "response_format";
    let kind = rf
        .get("type")
        .and_then(Value::as_str)
        .ok_or(SpecError::Shape {
            field,
            expected: "an object with a `type`",
        })?;
    match kind {
        "text" => Ok(None),
        "json_object" => Ok(Some(GrammarSpec::JsonSchema {
            field,
            schema: serde_json::json!({"type": "object"}),
        })),
        "json_schema" => {
            let schema = rf
                .get("json_schema")
                .and_then(|j| j.get("schema").or_else(|| j.get("schema_")))
                .ok_or(SpecError::Shape {
                    field: "response_format.json_schema.schema",
                    expected: "a JSON schema",
                })?;
            Ok(Some(GrammarSpec::JsonSchema {
                field,
                schema: schema_value("response_format.json_schema.schema", schema)?,
            }))
        }
        other => Err(SpecError::FormatType {
            given: other.to_string(),
        }),
    }
}

/// GBNF (`root ::= "a" [0-9]+ rule-name`) as llguidance's Lark: `::=` becomes `:`, `root`
/// becomes `start`, `-` in rule names `_`, character classes `/[...]/` regexes, `#` comments
/// are dropped, and a line that continues the previous rule is joined to it.
pub fn gbnf_to_lark(src: &str) -> String {
    let mut rules: Vec<String> = Vec::new();
    for line in src.lines() {
        let converted = convert_line(line);
        let trimmed = converted.trim();
        if trimmed.is_empty() {
            continue;
        }
        match rules.last_mut() {
            Some(last) if !line.contains("::=") => {
                last.push(' ');
                last.push_str(trimmed);
            }
            _ => rules.push(trimmed.to_string()),
        }
    }
    rules.join("\n")
}

fn convert_line(line: &str) -> String {
    let chars: Vec<char> = line.chars().collect();
    let mut out = String::with_capacity(line.len() + 8);
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        match c {
            '"' => {
                // A string literal, escapes kept.
                let start = i;
                i += 1;
                while i < chars.len() && chars[i] != '"' {
                    i += if chars[i] == '\\' { 2 } else { 1 };
                }
                let end = (i + 1).min(chars.len());
                out.extend(&chars[start..end]);
                i = end;
            }
            '[' => {
                let start = i;
                i += 1;
                while i < chars.len() && chars[i] != ']' {
                    i += if chars[i] == '\\' { 2 } else { 1 };
                }
                let end = (i + 1).min(chars.len());
                out.push('/');
                for &ch in &chars[start..end] {
                    if ch == '/' {
                        out.push('\\');
                    }
                    out.push(ch);
                }
                out.push('/');
                i = end;
            }
            '#' => break,
            ':' if chars[i..].starts_with(&[':', ':', '=']) => {
                while out.ends_with(' ') {
                    out.pop();
                }
                out.push(':');
                i += 3;
            }
            c if c.is_ascii_alphabetic() || c == '_' => {
                let start = i;
                while i < chars.len()
                    && (chars[i].is_ascii_alphanumeric() || chars[i] == '_' || chars[i] == '-')
                {
                    i += 1;
                }
                let name: String = chars[start..i]
                    .iter()
                    .map(|&ch| {
                        if ch == '-' {
                            '_'
                        } else {
                            ch.to_ascii_lowercase()
                        }
                    })
                    .collect();
                out.push_str(if name == "root" { "start" } else { &name });
            }
            _ => {
                out.push(c);
                i += 1;
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn gbnf_rules_become_lark_rules() {
        let g = "root ::= \"{\" ws pair-list \"}\" # an object\n\
                 pair-list ::= [a-z]+ (\",\" [a-z/]+)*\n   | \"x\"\n\
                 ws ::= [ \\t]*";
        assert_eq!(
            gbnf_to_lark(g),
            "start: \"{\" ws pair_list \"}\"\n\
             pair_list: /[a-z]/+ (\",\" /[a-z\\/]/+)* | \"x\"\n\
             ws: /[ \\t]/*"
        );
    }

    #[test]
    fn one_grammar_per_request_and_response_format_shapes() {
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let rf = json!({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}});
        let spec = from_fields(&GrammarFields {
            response_format: Some(&rf),
            ..Default::default()
        });
        assert_eq!(
            spec,
            Ok(Some(GrammarSpec::JsonSchema {
                field: "response_format",
                schema: schema.clone()
            }))
        );
        let text = json!({"type": "text"});
        let none = from_fields(&GrammarFields {
            response_format: Some(&text),
            ..Default::default()
        });
        assert_eq!(none, Ok(None));
        let as_string = json!(schema.to_string());
        let rx = json!("[0-9]+");
        let both = from_fields(&GrammarFields {
            json_schema: Some(&as_string),
            regex: Some(&rx),
            ..Default::default()
        });
        assert!(matches!(both, Err(SpecError::Several { .. })), "{both:?}");
        let bad = json!({"type": "structural_tag"});
        let refused = from_fields(&GrammarFields {
            response_format: Some(&bad),
            ..Default::default()
        });
        assert!(matches!(refused, Err(SpecError::FormatType { .. })));
    }
}
