//! The parsers on answers as Qwen models write them (the shapes of Qwen's function-calling
//! guide and Qwen3-Coder's chat template), whole and cut into every possible pair of pieces.

use serde_json::{json, Value};

use super::*;

/// Qwen2.5 / Qwen3: two parallel calls after a sentence (Qwen's guide's temperature example).
const QWEN25_TWO_CALLS: &str = "I'll look both up.\n\n<tool_call>\n{\"name\": \"get_current_temperature\", \"arguments\": {\"location\": \"San Francisco, CA, USA\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_temperature_date\", \"arguments\": {\"location\": \"San Francisco, CA, USA\", \"date\": \"2024-10-01\"}}\n</tool_call>";

/// Qwen3-Coder: one call with a string, an integer and an array parameter.
const CODER_CALL: &str = "<tool_call>\n<function=search_files>\n<parameter=pattern>\nfn main\n</parameter>\n<parameter=max_results>\n20\n</parameter>\n<parameter=paths>\n[\"src\", \"tests\"]\n</parameter>\n</function>\n</tool_call>";

fn tools() -> DeclaredTools {
    DeclaredTools::from_request(&[
        json!({"type": "function", "function": {"name": "get_current_temperature",
            "parameters": {"type": "object", "properties": {"location": {"type": "string"}}}}}),
        json!({"type": "function", "function": {"name": "get_temperature_date",
            "parameters": {"type": "object", "properties": {"location": {"type": "string"}, "date": {"type": "string"}}}}}),
        json!({"type": "function", "function": {"name": "search_files",
            "parameters": {"type": "object", "properties": {
                "pattern": {"type": "string"}, "max_results": {"type": "integer"},
                "paths": {"type": "array", "items": {"type": "string"}}}}}}),
    ])
}

fn args(call: &ToolCall) -> Value {
    serde_json::from_str(&call.arguments).expect("arguments are JSON")
}

/// Streams `text` in two pieces cut at every char boundary and collects content and calls.
fn stream_every_cut(kind: ToolParserKind, text: &str) -> Vec<(String, Vec<ToolCall>)> {
    (0..=text.len())
        .filter(|&i| text.is_char_boundary(i))
        .map(|i| {
            let mut s = ToolCallStream::new(kind, tools());
            let mut content = String::new();
            let mut calls = Vec::new();
            let events: Vec<ToolEvent> = s
                .push(&text[..i])
                .into_iter()
                .chain(s.push(&text[i..]))
                .chain(s.finish())
                .collect();
            for e in events {
                match e {
                    ToolEvent::Content(t) => content.push_str(&t),
                    ToolEvent::Call { index, call } => {
                        assert_eq!(index, calls.len(), "calls are numbered in order");
                        calls.push(call)
                    }
                }
            }
            (content, calls)
        })
        .collect()
}

#[test]
fn qwen25_parses_parallel_calls_and_keeps_the_text_before_them() {
    let (content, calls) = parse_whole(ToolParserKind::Qwen25, tools(), QWEN25_TWO_CALLS);
    assert_eq!(content, "I'll look both up.");
    assert_eq!(calls.len(), 2);
    assert_eq!(calls[0].name, "get_current_temperature");
    assert_eq!(
        args(&calls[0]),
        json!({"location": "San Francisco, CA, USA"})
    );
    assert_eq!(calls[1].name, "get_temperature_date");
    assert_eq!(
        args(&calls[1]),
        json!({"location": "San Francisco, CA, USA", "date": "2024-10-01"})
    );
}

#[test]
fn streaming_in_any_two_pieces_gives_the_whole_answers_calls() {
    for (kind, text) in [
        (ToolParserKind::Qwen25, QWEN25_TWO_CALLS),
        (ToolParserKind::Qwen3Coder, CODER_CALL),
    ] {
        let (_, whole) = parse_whole(kind, tools(), text);
        assert!(!whole.is_empty());
        for (content, calls) in stream_every_cut(kind, text) {
            assert_eq!(calls, whole, "{kind:?}");
            assert!(!content.contains("<tool"), "{content:?}");
        }
    }
}

#[test]
fn qwen3_coder_converts_values_by_the_tools_schema() {
    let (content, calls) = parse_whole(ToolParserKind::Qwen3Coder, tools(), CODER_CALL);
    assert_eq!(content, "");
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0].name, "search_files");
    assert_eq!(
        args(&calls[0]),
        json!({"pattern": "fn main", "max_results": 20, "paths": ["src", "tests"]})
    );
}

#[test]
fn text_without_calls_is_all_content_even_when_it_mentions_a_tag_prefix() {
    let text = "Use `a < b` and <tool_ca";
    let (content, calls) = parse_whole(ToolParserKind::Qwen25, tools(), text);
    assert_eq!((content.as_str(), calls.len()), (text, 0));
}

#[test]
fn an_unfinished_call_comes_back_as_content_and_undeclared_tools_are_dropped() {
    let cut = "Sure.\n<tool_call>\n{\"name\": \"get_current_temperature\", \"argu";
    let (content, calls) = parse_whole(ToolParserKind::Qwen25, tools(), cut);
    assert!(calls.is_empty());
    assert_eq!(content, cut);
    let undeclared = "<tool_call>\n{\"name\": \"rm_rf\", \"arguments\": {}}\n</tool_call>";
    let (_, calls) = parse_whole(ToolParserKind::Qwen25, tools(), undeclared);
    assert!(calls.is_empty());
    let malformed =
        "<tool_call>\n{\"name\": \"get_current_temperature\", \"arguments\": {\n</tool_call>";
    let (_, calls) = parse_whole(ToolParserKind::Qwen25, tools(), malformed);
    assert!(calls.is_empty());
}

#[test]
fn qwen25_accepts_parameters_and_string_encoded_arguments() {
    let text = "<tool_call>\n{\"name\": \"get_current_temperature\", \"parameters\": \"{\\\"location\\\": \\\"Oslo\\\"}\"}\n</tool_call>";
    let (_, calls) = parse_whole(ToolParserKind::Qwen25, tools(), text);
    assert_eq!(args(&calls[0]), json!({"location": "Oslo"}));
}
