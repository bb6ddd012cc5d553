//! Tool calling on `/v1/chat/completions` (`--tool-call-parser`): when the request declares
//! `tools` and `tool_choice` is `auto` (or absent), the answer's tool calls are parsed out of
//! its content into OpenAI's `tool_calls` (whole answers) or `delta.tool_calls` chunks
//! (streams: per call, one chunk with its `id`, `type` and `function.name`, then one with its
//! `function.arguments`), and a `stop` finish becomes `tool_calls`, as SGLang answers.
//! `tool_choice: "none"` leaves the tools out of the prompt and parses nothing.

use serde_json::{json, Value};

use super::types::ChatRequest;
use crate::generation::tool_calls::{DeclaredTools, ToolCall, ToolCallStream, ToolEvent};
use crate::generation::{new_rid, ToolParserKind};
use crate::state::AppState;

/// How a request's answer is parsed for tool calls.
#[derive(Debug, Clone)]
pub struct ToolParsing {
    pub kind: ToolParserKind,
    pub tools: DeclaredTools,
}

impl ToolParsing {
    pub fn stream(&self) -> ToolCallStream {
        ToolCallStream::new(self.kind, self.tools.clone())
    }
}

fn tool_choice_none(req: &ChatRequest) -> bool {
    matches!(&req.tool_choice, Some(Value::String(s)) if s == "none")
}

/// The tools the chat template renders: none with `tool_choice: "none"`.
pub fn template_tools(req: &ChatRequest) -> Option<&[Value]> {
    if tool_choice_none(req) {
        return None;
    }
    req.tools.as_deref().filter(|t| !t.is_empty())
}

/// Parsing is on with a parser configured, tools declared and `tool_choice` not `none`.
pub fn tool_parsing(state: &AppState, req: &ChatRequest) -> Option<ToolParsing> {
    let kind = state.config.tool_call_parser?;
    let tools = template_tools(req)?;
    Some(ToolParsing {
        kind,
        tools: DeclaredTools::from_request(tools),
    })
}

/// SGLang's call id: `call_` and 24 hex digits.
fn call_id() -> String {
    format!("call_{}", &new_rid()[..24])
}

/// One entry of `message.tool_calls`.
pub fn message_call(index: usize, call: &ToolCall) -> Value {
    json!({"id": call_id(), "index": index, "type": "function",
           "function": {"name": call.name, "arguments": call.arguments}})
}

/// The `delta`s one parser event becomes, in OpenAI's chunk order.
pub fn deltas(event: ToolEvent) -> Vec<Value> {
    match event {
        ToolEvent::Content(text) => vec![json!({"reasoning_content": null, "content": text})],
        ToolEvent::Call { index, call } => vec![
            json!({"tool_calls": [{"index": index, "id": call_id(), "type": "function",
                   "function": {"name": call.name, "arguments": ""}}]}),
            json!({"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]}),
        ],
    }
}

/// `finish_reason` and `matched_stop` once tool calls were made: a natural stop is `tool_calls`
/// (with no matched stop), anything else (`length`, `abort`) stays.
pub fn finish_fields(reason: &'static str, matched: Value, calls: usize) -> (&'static str, Value) {
    if calls > 0 && reason == "stop" {
        ("tool_calls", Value::Null)
    } else {
        (reason, matched)
    }
}
