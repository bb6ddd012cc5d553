//! Tool calls parsed out of a chat answer (`--tool-call-parser`), in the formats Qwen models are
//! trained to write, under SGLang's parser names.
//!
//! Both formats wrap each call in `<tool_call>` ... `</tool_call>`; only the body differs
//! (`qwen25.rs`: a JSON object; `qwen3_coder.rs`: `<function=...>` with `<parameter=...>`
//! elements). One streaming parser ([`ToolCallStream`]) serves streamed and whole answers alike,
//! so both see the same calls: text before the first call is content, each complete call
//! becomes a [`ToolCall`] (calls to tools the request did not declare are dropped, as SGLang
//! drops them), text between and after calls is dropped (SGLang keeps only the text before the
//! first call), and a call still open when the answer ends is given back as content.

mod qwen25;
mod qwen3_coder;

use serde_json::Value;

const CALL_START: &str = "<tool_call>";
const CALL_END: &str = "</tool_call>";

/// The parsers `--tool-call-parser` accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolParserKind {
    /// Qwen2.5 / Qwen3 (SGLang `qwen25`; `hermes` is the same format):
    /// `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`.
    Qwen25,
    /// Qwen3-Coder (SGLang `qwen3_coder`): `<tool_call>\n<function=NAME>\n<parameter=KEY>\nVALUE\n
    /// </parameter>\n</function>\n</tool_call>`.
    Qwen3Coder,
}

impl ToolParserKind {
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "qwen25" | "qwen" | "hermes" => Some(Self::Qwen25),
            "qwen3_coder" => Some(Self::Qwen3Coder),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Qwen25 => "qwen25",
            Self::Qwen3Coder => "qwen3_coder",
        }
    }
}

/// One parsed call: the function's name and its arguments as a JSON object's text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCall {
    pub name: String,
    pub arguments: String,
}

/// What one piece of streamed answer text turned into.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolEvent {
    Content(String),
    /// Call number `index` (0-based, in answer order) is complete.
    Call {
        index: usize,
        call: ToolCall,
    },
}

/// The request's declared tools: names and their parameter schemas.
#[derive(Debug, Clone, Default)]
pub struct DeclaredTools {
    tools: Vec<(String, Value)>,
}

impl DeclaredTools {
    /// From OpenAI's `tools`: `[{"type": "function", "function": {"name", "parameters"}}]`.
    pub fn from_request(tools: &[Value]) -> Self {
        let tools = tools
            .iter()
            .filter_map(|t| {
                let f = t.get("function")?;
                let name = f.get("name")?.as_str()?.to_string();
                let params = f.get("parameters").cloned().unwrap_or(Value::Null);
                Some((name, params))
            })
            .collect();
        Self { tools }
    }

    /// The declared tool's position in the request's `tools`.
    pub fn index_of(&self, name: &str) -> Option<usize> {
        self.tools.iter().position(|(n, _)| n == name)
    }

    fn schema(&self, name: &str) -> Option<&Value> {
        self.tools.iter().find(|(n, _)| n == name).map(|(_, s)| s)
    }
}

/// The streaming parser of one chat choice.
#[derive(Debug)]
pub struct ToolCallStream {
    kind: ToolParserKind,
    tools: DeclaredTools,
    /// Text not yet decided (a possible start tag, or an open call's body).
    pending: String,
    in_call: bool,
    /// A call has started: later text outside calls is dropped.
    seen_call: bool,
    calls: usize,
}

impl ToolCallStream {
    pub fn new(kind: ToolParserKind, tools: DeclaredTools) -> Self {
        Self {
            kind,
            tools,
            pending: String::new(),
            in_call: false,
            seen_call: false,
            calls: 0,
        }
    }

    /// Calls completed so far.
    pub fn calls(&self) -> usize {
        self.calls
    }

    pub fn push(&mut self, text: &str) -> Vec<ToolEvent> {
        self.pending.push_str(text);
        let mut out = Vec::new();
        loop {
            if self.in_call {
                let Some(end) = self.pending.find(CALL_END) else {
                    break;
                };
                let body: String = self.pending[..end].to_string();
                self.pending.drain(..end + CALL_END.len());
                self.in_call = false;
                if let Some(call) = self.parse_body(&body) {
                    out.push(ToolEvent::Call {
                        index: self.calls,
                        call,
                    });
                    self.calls += 1;
                }
                continue;
            }
            match self.pending.find(CALL_START) {
                Some(start) => {
                    let before: String = self.pending[..start].to_string();
                    self.pending.drain(..start + CALL_START.len());
                    self.emit_outside(before, &mut out);
                    self.in_call = true;
                    self.seen_call = true;
                }
                None => {
                    // Hold back only a suffix that could still grow into the start tag.
                    let keep = partial_suffix(&self.pending, CALL_START);
                    let cut = self.pending.len() - keep;
                    let text: String = self.pending.drain(..cut).collect();
                    self.emit_outside(text, &mut out);
                    break;
                }
            }
        }
        out
    }

    /// The answer ended: held-back text, and a call left open, come back as content.
    pub fn finish(&mut self) -> Vec<ToolEvent> {
        let mut out = Vec::new();
        let rest = std::mem::take(&mut self.pending);
        if self.in_call {
            self.in_call = false;
            out.push(ToolEvent::Content(format!("{CALL_START}{rest}")));
        } else {
            self.emit_outside(rest, &mut out);
        }
        out
    }

    fn emit_outside(&self, text: String, out: &mut Vec<ToolEvent>) {
        if !text.is_empty() && !self.seen_call {
            out.push(ToolEvent::Content(text));
        }
    }

    fn parse_body(&self, body: &str) -> Option<ToolCall> {
        let call = match self.kind {
            ToolParserKind::Qwen25 => qwen25::parse(body),
            ToolParserKind::Qwen3Coder => qwen3_coder::parse(body, |name| self.tools.schema(name)),
        };
        let call = match call {
            Some(c) => c,
            None => {
                tracing::warn!("could not parse a {} tool call: {body:?}", self.kind.name());
                return None;
            }
        };
        if self.tools.schema(&call.name).is_none() {
            tracing::warn!(
                "the model called `{}`, which the request did not declare; dropped",
                call.name
            );
            return None;
        }
        Some(call)
    }
}

/// A whole answer: its content (the text before the first call, trimmed when there are calls,
/// as SGLang trims it) and its calls.
pub fn parse_whole(
    kind: ToolParserKind,
    tools: DeclaredTools,
    text: &str,
) -> (String, Vec<ToolCall>) {
    let mut stream = ToolCallStream::new(kind, tools);
    let mut content = String::new();
    let mut calls = Vec::new();
    let events = stream.push(text).into_iter().chain(stream.finish());
    for e in events {
        match e {
            ToolEvent::Content(t) => content.push_str(&t),
            ToolEvent::Call { call, .. } => calls.push(call),
        }
    }
    if !calls.is_empty() {
        content = content.trim().to_string();
    }
    (content, calls)
}

/// The length of the longest proper prefix of `tag` that `text` ends with.
fn partial_suffix(text: &str, tag: &str) -> usize {
    (1..tag.len())
        .rev()
        .find(|&n| text.ends_with(&tag[..n]))
        .unwrap_or(0)
}

#[cfg(test)]
mod tests;
