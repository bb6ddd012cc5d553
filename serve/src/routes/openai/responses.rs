//! `POST /v1/responses`: OpenAI's Responses API for text answers, lowered onto the chat path
//! (the chat template, sampling, structured output). `input` is a string or a list of
//! messages (`content` a string or `input_text` parts), `instructions` a system message first,
//! `max_output_tokens` the budget and `text.format` the `response_format`. The answer is one
//! `message` output item with one `output_text` part; streams send OpenAI's events in order:
//! `response.created`, `response.in_progress`, `response.output_item.added`,
//! `response.content_part.added`, `response.output_text.delta`..., `response.output_text.done`,
//! `response.content_part.done`, `response.output_item.done`, `response.completed`. Tools,
//! stored responses (`previous_response_id`, `store`) and reasoning items are refused.

use std::sync::atomic::{AtomicU64, Ordering};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Map, Value};
use tracing::Instrument;

use super::chat_completions::{convert, types::ChatRequest, validate};
use crate::error::{ErrorShape, OpenAiError};
use crate::generation::{new_rid, Chunk, Generation};
use crate::routes::stream::{self, RenderChunk};
use crate::state::{unix_now, AppState};
use crate::validation::{self as v, ValidationError};

#[derive(Debug, Clone, Default, Deserialize)]
pub struct ResponsesRequest {
    pub model: Option<String>,
    pub input: Option<Value>,
    pub instructions: Option<String>,
    pub max_output_tokens: Option<i64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    #[serde(default)]
    pub stream: bool,
    pub text: Option<Value>,
    pub tools: Option<Vec<Value>>,
    pub previous_response_id: Option<String>,
    pub reasoning: Option<Value>,
    pub metadata: Option<Value>,
}

/// One `input` message as chat sees it: `input_text` / `output_text` parts flattened.
fn message(index: usize, item: &Value) -> Result<Value, ValidationError> {
    let bad = |problem: &str| ValidationError::BadMessage {
        index,
        problem: problem.to_string(),
    };
    let role = item
        .get("role")
        .and_then(Value::as_str)
        .ok_or_else(|| bad("an input item needs a `role` (only message items are served)"))?;
    let content = match item.get("content") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for p in parts {
                match (
                    p.get("type").and_then(Value::as_str),
                    p.get("text").and_then(Value::as_str),
                ) {
                    (Some("input_text" | "output_text" | "text"), Some(t)) => text.push_str(t),
                    _ => return Err(bad("only `input_text` content parts are supported")),
                }
            }
            text
        }
        _ => {
            return Err(bad(
                "`content` must be a string or a list of `input_text` parts",
            ))
        }
    };
    Ok(json!({"role": role, "content": content}))
}

/// The chat request this Responses request is.
fn to_chat(req: &ResponsesRequest) -> Result<ChatRequest, ValidationError> {
    v::check_unsupported("tools", req.tools.as_ref().is_some_and(|t| !t.is_empty()))?;
    v::check_unsupported("previous_response_id", req.previous_response_id.is_some())?;
    v::check_unsupported(
        "reasoning",
        !matches!(req.reasoning, None | Some(Value::Null)),
    )?;
    let mut messages = Vec::new();
    if let Some(sys) = &req.instructions {
        messages.push(json!({"role": "system", "content": sys}));
    }
    match &req.input {
        Some(Value::String(s)) => messages.push(json!({"role": "user", "content": s})),
        Some(Value::Array(items)) => {
            for (i, item) in items.iter().enumerate() {
                messages.push(message(i, item)?);
            }
        }
        _ => {
            return Err(ValidationError::BadJsonType {
                field: "input",
                expected: "a string or a list of messages",
            })
        }
    }
    let format = req.text.as_ref().and_then(|t| t.get("format")).map(|f| {
        // Responses puts the schema beside `type`; chat nests it under `json_schema`.
        match f.get("type").and_then(Value::as_str) {
            Some("json_schema") => json!({"type": "json_schema", "json_schema": f}),
            _ => f.clone(),
        }
    });
    let mut chat = Map::new();
    chat.insert("messages".into(), Value::Array(messages));
    for (key, value) in [
        ("model", req.model.clone().map(Value::from)),
        (
            "max_completion_tokens",
            req.max_output_tokens.map(Value::from),
        ),
        ("temperature", req.temperature.map(Value::from)),
        ("top_p", req.top_p.map(Value::from)),
        ("response_format", format),
    ] {
        if let Some(value) = value {
            chat.insert(key.into(), value);
        }
    }
    chat.insert("stream".into(), Value::Bool(req.stream));
    serde_json::from_value(Value::Object(chat)).map_err(|_| ValidationError::BadJsonType {
        field: "input",
        expected: "a string or a list of messages",
    })
}

pub async fn handle(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, OpenAiError> {
    let req: ResponsesRequest = crate::routes::parse_json(
        &headers,
        body,
        state.limits.body_bytes,
        crate::routes::BodyKind::OpenAi,
    )?;
    let chat = to_chat(&req).map_err(|e| OpenAiError(e.into()))?;
    let valid = validate::validate(&chat)?;
    validate::check_limits(&chat, &valid, &state.limits)?;
    let rid = new_rid();
    let span = tracing::info_span!("responses", request_id = %rid, model = %state.config.served_model_name);
    async move {
        let (worker, chat2, rid2) = (state.clone(), chat.clone(), rid.clone());
        let prepared = state
            .tokenizer_pool
            .run(move || convert::lower_chat(&worker, &chat2, valid, &rid2))
            .await?;
        let mut gens = stream::start_all(&state, prepared, req.stream).await?;
        let ids = Ids {
            response: format!("resp_{rid}"),
            item: format!("msg_{rid}"),
            model: state.config.served_model_name.clone(),
            created: unix_now(),
            max_output_tokens: req.max_output_tokens,
        };
        if req.stream {
            let render = Render {
                ids,
                seq: AtomicU64::new(0),
            };
            return Ok(stream::respond(gens, render, ErrorShape::OpenAi, |_| {
                Vec::new()
            }));
        }
        stream::run_all(&mut gens).await?;
        let g = gens
            .first()
            .ok_or_else(|| crate::error::ApiError::Internal("no generation".into()))?;
        Ok(Json(ids.response(Some(g))).into_response())
    }
    .instrument(span)
    .await
    .map_err(OpenAiError)
}

struct Ids {
    response: String,
    item: String,
    model: String,
    created: u64,
    max_output_tokens: Option<i64>,
}

impl Ids {
    fn item(&self, text: Option<&str>) -> Value {
        let (status, content) = match text {
            Some(t) => ("completed", json!([output_text(t)])),
            None => ("in_progress", json!([])),
        };
        json!({"type": "message", "id": self.item, "status": status, "role": "assistant",
               "content": content})
    }

    /// The response object: in progress (`g` None), or finished with `g`'s answer.
    fn response(&self, g: Option<&Generation>) -> Value {
        let (status, incomplete, output, usage) = match g {
            None => ("in_progress", Value::Null, json!([]), Value::Null),
            Some(g) => {
                let cut = g.finish().map(|f| f.openai_reason()) == Some("length");
                let (input, output) = (g.prompt_tokens(), g.completion_tokens());
                (
                    if cut { "incomplete" } else { "completed" },
                    if cut {
                        json!({"reason": "max_output_tokens"})
                    } else {
                        Value::Null
                    },
                    json!([self.item(Some(g.text()))]),
                    json!({"input_tokens": input, "input_tokens_details": {"cached_tokens": 0},
                           "output_tokens": output,
                           "output_tokens_details": {"reasoning_tokens": g.reasoning_tokens()},
                           "total_tokens": input + output}),
                )
            }
        };
        json!({"id": self.response, "object": "response", "created_at": self.created,
               "status": status, "error": null, "incomplete_details": incomplete,
               "instructions": null, "max_output_tokens": self.max_output_tokens,
               "model": self.model, "output": output, "parallel_tool_calls": false,
               "previous_response_id": null, "reasoning": null, "store": false,
               "text": {"format": {"type": "text"}}, "tool_choice": "none", "tools": [],
               "truncation": "disabled", "usage": usage, "metadata": {}})
    }
}

fn output_text(text: &str) -> Value {
    json!({"type": "output_text", "text": text, "annotations": []})
}

struct Render {
    ids: Ids,
    seq: AtomicU64,
}

impl Render {
    fn event(&self, kind: &str, mut fields: Value) -> Value {
        if let Some(o) = fields.as_object_mut() {
            o.insert("type".into(), json!(kind));
            o.insert(
                "sequence_number".into(),
                json!(self.seq.fetch_add(1, Ordering::Relaxed)),
            );
        }
        fields
    }

    fn part_fields(&self) -> Value {
        json!({"item_id": self.ids.item, "output_index": 0, "content_index": 0})
    }

    fn with(&self, mut base: Value, key: &str, value: Value) -> Value {
        if let Some(o) = base.as_object_mut() {
            o.insert(key.into(), value);
        }
        base
    }
}

impl RenderChunk for Render {
    fn render(&self, _index: usize, g: &Generation, chunk: &Chunk, first: bool) -> Vec<Value> {
        let mut out = Vec::new();
        if first {
            let ids = &self.ids;
            out.push(self.event("response.created", json!({"response": ids.response(None)})));
            out.push(self.event(
                "response.in_progress",
                json!({"response": ids.response(None)}),
            ));
            out.push(self.event(
                "response.output_item.added",
                json!({"output_index": 0, "item": ids.item(None)}),
            ));
            let part = self.with(self.part_fields(), "part", output_text(""));
            out.push(self.event("response.content_part.added", part));
        }
        if !chunk.delta.is_empty() {
            let delta = self.with(self.part_fields(), "delta", json!(chunk.delta));
            out.push(self.event("response.output_text.delta", delta));
        }
        if chunk.finish.is_some() {
            let text = g.text();
            let done = self.with(self.part_fields(), "text", json!(text));
            out.push(self.event("response.output_text.done", done));
            let part = self.with(self.part_fields(), "part", output_text(text));
            out.push(self.event("response.content_part.done", part));
            out.push(self.event(
                "response.output_item.done",
                json!({"output_index": 0, "item": self.ids.item(Some(text))}),
            ));
            let kind = if g.finish().map(|f| f.openai_reason()) == Some("length") {
                "response.incomplete"
            } else {
                "response.completed"
            };
            out.push(self.event(kind, json!({"response": self.ids.response(Some(g))})));
        }
        out
    }
}
