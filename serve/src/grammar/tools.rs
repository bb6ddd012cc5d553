//! The grammar `tool_choice` `required` or a named function constrains a chat answer to, in
//! the format the Qwen2.5 / Qwen3 tool-call parser reads (`--tool-call-parser qwen25`):
//! `<tool_call>\n{"name": NAME, "arguments": ARGS}\n</tool_call>`, ARGS following the tool's
//! `parameters` schema, up to three calls for `required` (each of any declared tool) and one
//! call of that tool for a named choice. The answer is then parsed into `tool_calls` as an
//! `auto` answer is.

use serde_json::{json, Value};

use super::spec::GrammarSpec;

/// Most calls one `required` answer may make (more would be cut by `max_tokens` first).
const MAX_CALLS: usize = 3;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ToolGrammarError {
    #[error("`tool_choice` names function {name:?}, which is not among the request's `tools`")]
    UnknownTool { name: String },
    #[error("`tool_choice` {given} needs `tools` with at least one function")]
    NoTools { given: String },
}

/// A declared function: its name and its `parameters` schema (any object when absent).
fn functions(tools: &[Value]) -> Vec<(String, Value)> {
    tools
        .iter()
        .filter_map(|t| {
            let f = t.get("function")?;
            let name = f.get("name")?.as_str()?.to_string();
            let params = f
                .get("parameters")
                .filter(|p| p.is_object())
                .cloned()
                .unwrap_or_else(|| json!({"type": "object"}));
            Some((name, params))
        })
        .collect()
}

/// The grammar for `tool_choice` `required` (`named` None) or a named function.
pub fn tool_call_grammar(
    tools: &[Value],
    named: Option<&str>,
) -> Result<GrammarSpec, ToolGrammarError> {
    let mut funcs = functions(tools);
    if let Some(name) = named {
        funcs.retain(|(n, _)| n == name);
        if funcs.is_empty() {
            return Err(ToolGrammarError::UnknownTool {
                name: name.to_string(),
            });
        }
    }
    if funcs.is_empty() {
        return Err(ToolGrammarError::NoTools {
            given: "\"required\"".into(),
        });
    }
    let mut lark = String::new();
    let calls = if named.is_some() { 1 } else { MAX_CALLS };
    lark.push_str("start: block");
    for _ in 1..calls {
        lark.push_str(" (\"\\n\" block)?");
    }
    lark.push('\n');
    lark.push_str("block: \"<tool_call>\\n\" call \"\\n</tool_call>\"\n");
    let alternatives: Vec<String> = (0..funcs.len()).map(|i| format!("call_{i}")).collect();
    lark.push_str(&format!("call: {}\n", alternatives.join(" | ")));
    for (i, (name, params)) in funcs.iter().enumerate() {
        let schema = json!({
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": params},
            "required": ["name", "arguments"],
            "additionalProperties": false,
            "x-guidance": {"whitespace_flexible": false, "key_separator": ": ", "item_separator": ", "},
        });
        lark.push_str(&format!("call_{i}: %json {schema}\n"));
    }
    Ok(GrammarSpec::Lark {
        field: "tool_choice",
        grammar: lark,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn named_choice_keeps_one_tool_and_unknown_names_are_refused() {
        let tools = vec![
            json!({"type": "function", "function": {"name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}),
            json!({"type": "function", "function": {"name": "add"}}),
        ];
        let GrammarSpec::Lark { grammar, .. } = tool_call_grammar(&tools, Some("add")).unwrap()
        else {
            panic!("a Lark grammar");
        };
        assert!(grammar.contains("\"const\":\"add\"") && !grammar.contains("get_weather"));
        assert!(grammar.starts_with("start: block\n"), "{grammar}");
        let GrammarSpec::Lark { grammar, .. } = tool_call_grammar(&tools, None).unwrap() else {
            panic!("a Lark grammar");
        };
        assert!(grammar.contains("call: call_0 | call_1"), "{grammar}");
        assert_eq!(
            tool_call_grammar(&tools, Some("nope")),
            Err(ToolGrammarError::UnknownTool {
                name: "nope".into()
            })
        );
        assert!(tool_call_grammar(&[], None).is_err());
    }
}
