//! `POST /v1/chat/completions`. Streams follow SGLang's chunk order: a role chunk, content
//! deltas (`reasoning_content: null` always present), a separate finish chunk with
//! `matched_stop`, the usage chunk when asked, then `[DONE]`. With `--reasoning-parser`, the
//! `<think>` part arrives as `reasoning_content` deltas and `message.reasoning_content`. With
//! `--tool-call-parser` and `tools`, tool calls come back parsed (`tools.rs`).

pub mod convert;
pub mod tools;
pub mod types;
pub mod validate;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};
use tracing::Instrument;

use super::{counts_of, spec_tokens_details, usage, usage_chunk};
use crate::error::{ErrorShape, OpenAiError};
use crate::generation::reasoning::split_whole;
use crate::generation::{new_rid, Chunk, Generation};
use crate::routes::stream::{self, RenderChunk};
use crate::state::{unix_now, AppState};

const OBJECT: &str = "chat.completion";
const CHUNK_OBJECT: &str = "chat.completion.chunk";

pub async fn handle(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, OpenAiError> {
    let req: types::ChatRequest = crate::routes::parse_json(
        &headers,
        body,
        state.limits.body_bytes,
        crate::routes::BodyKind::OpenAi,
    )?;
    let valid = validate::validate(&req)?;
    validate::check_limits(&req, &valid, &state.limits)?;
    let rid = req.common.rid.clone().unwrap_or_else(new_rid);
    let span = tracing::info_span!("chat_completions", request_id = %rid, model = %state.config.served_model_name);
    async move {
        let (worker, req2, rid2) = (state.clone(), req.clone(), rid.clone());
        let prepared = state
            .tokenizer_pool
            .run(move || convert::lower_chat(&worker, &req2, valid, &rid2))
            .await?;
        let mut gens = stream::start_all(&state, prepared, req.common.stream).await?;
        let reasoning = state.config.reasoning_parser.filter(|kind| {
            kind.applies(
                req.separate_reasoning,
                &convert::template_kwargs(&state, &req),
            )
        });
        if let Some(kind) = reasoning {
            gens.iter_mut().for_each(|g| g.separate_reasoning(kind));
        }
        let (model, created, n) = (
            state.config.served_model_name.clone(),
            unix_now(),
            req.common.n(),
        );
        let tool_parsing = tools::tool_parsing(&state, &req);
        if req.common.stream {
            let render = Render {
                id: rid.clone(),
                model: model.clone(),
                created,
                continuous_usage: req.common.continuous_usage(),
                tool_parsing: tool_parsing.clone(),
                logprobs: Default::default(),
                tool_streams: std::sync::Mutex::new(std::collections::HashMap::new()),
            };
            let include_usage = req.common.include_usage();
            let spec_details = req.return_spec_tokens_details == Some(true);
            let tail = move |counts: &[stream::Counts]| {
                let mut out = Vec::new();
                if spec_details {
                    out.push(
                        json!({"id": rid, "object": CHUNK_OBJECT, "created": created,
                        "model": model, "choices": [],
                        "sglext": {"spec_tokens_details": spec_tokens_details(counts)}}),
                    );
                }
                if include_usage {
                    out.push(usage_chunk(&rid, CHUNK_OBJECT, created, &model, counts, n));
                }
                out
            };
            return Ok(stream::respond(gens, render, ErrorShape::OpenAi, tail));
        }
        stream::run_all(&mut gens).await?;
        let with_meta = req.return_meta_info == Some(true);
        let choices: Vec<Value> = gens
            .iter()
            .enumerate()
            .map(|(i, g)| choice(i, g, with_meta, tool_parsing.as_ref()))
            .collect();
        let counts = counts_of(&gens);
        let mut body = json!({
            "id": rid,
            "object": OBJECT,
            "created": created,
            "model": model,
            "choices": choices,
            "usage": usage(&counts, n, false),
            "metadata": {"weight_version": "default"},
        });
        if let (true, Some(obj)) = (
            req.return_spec_tokens_details == Some(true),
            body.as_object_mut(),
        ) {
            obj.insert(
                "sglext".into(),
                json!({"spec_tokens_details": spec_tokens_details(&counts)}),
            );
        }
        Ok(Json(body).into_response())
    }
    .instrument(span)
    .await
    .map_err(OpenAiError)
}

fn choice(
    index: usize,
    g: &Generation,
    with_meta: bool,
    tool_parsing: Option<&tools::ToolParsing>,
) -> Value {
    let (reasoning, mut content) = match g.reasoning_kind() {
        Some(kind) => split_whole(kind, g.text()),
        None => (None, g.text().to_string()),
    };
    let mut message =
        json!({"role": "assistant", "content": content, "reasoning_content": reasoning});
    let mut calls = 0;
    if let Some(p) = tool_parsing {
        let (text, parsed) =
            crate::generation::tool_calls::parse_whole(p.kind, p.tools.clone(), &content);
        content = text;
        calls = parsed.len();
        if let Some(m) = message.as_object_mut() {
            m.insert("content".into(), json!(content));
            if calls > 0 {
                let list: Vec<Value> = parsed
                    .iter()
                    .enumerate()
                    .map(|(k, c)| tools::message_call(k, c))
                    .collect();
                m.insert("tool_calls".into(), Value::Array(list));
            }
        }
    }
    let (reason, matched) = match g.finish() {
        Some(f) => {
            let (r, m) = tools::finish_fields(f.openai_reason(), f.matched_stop(), calls);
            (Some(r), m)
        }
        None => (None, Value::Null),
    };
    let logprobs = match g.logprobs_requested() {
        Some(_) => crate::routes::logprobs::openai_chat(g.logprobs(), g.tokenizer()),
        None => Value::Null,
    };
    let mut c = json!({
        "index": index,
        "message": message,
        "logprobs": logprobs,
        "finish_reason": reason,
        "matched_stop": matched,
    });
    if let (true, Some(obj)) = (with_meta, c.as_object_mut()) {
        obj.insert("meta_info".into(), g.meta_info());
    }
    c
}

struct Render {
    id: String,
    model: String,
    created: u64,
    continuous_usage: bool,
    tool_parsing: Option<tools::ToolParsing>,
    /// Each choice's tool-call parser (streams are rendered from one task, so the lock is
    /// never contended).
    logprobs: crate::routes::logprobs::StreamedLogprobs,
    tool_streams: std::sync::Mutex<
        std::collections::HashMap<usize, crate::generation::tool_calls::ToolCallStream>,
    >,
}

impl Render {
    /// One chunk; `finish` is the choice's `(finish_reason, matched_stop)`.
    fn chunk(&self, index: usize, delta: Value, finish: Option<(&'static str, Value)>) -> Value {
        let (reason, matched) = match finish {
            Some((r, m)) => (Some(r), m),
            None => (None, Value::Null),
        };
        json!({
            "id": self.id,
            "object": CHUNK_OBJECT,
            "created": self.created,
            "model": self.model,
            "choices": [{
                "index": index,
                "delta": delta,
                "logprobs": null,
                "finish_reason": reason,
                "matched_stop": matched,
            }],
        })
    }
}

impl RenderChunk for Render {
    fn render(&self, index: usize, g: &Generation, chunk: &Chunk, first: bool) -> Vec<Value> {
        let mut out = self.render_deltas(index, chunk, first);
        // This step's tokens' logprobs ride on its last chunk.
        if g.logprobs_requested().is_some() {
            let new = self.logprobs.take(index, g.logprobs());
            let last = out.last_mut().and_then(|c| c["choices"][0].as_object_mut());
            if let (false, Some(choice)) = (new.is_empty(), last) {
                choice.insert(
                    "logprobs".into(),
                    crate::routes::logprobs::openai_chat(new, g.tokenizer()),
                );
            }
        }
        if self.continuous_usage {
            let usage = super::running_usage(g);
            for c in out.iter_mut().filter_map(Value::as_object_mut) {
                c.insert("usage".into(), usage.clone());
            }
        }
        out
    }
}

impl Render {
    fn render_deltas(&self, index: usize, chunk: &Chunk, first: bool) -> Vec<Value> {
        let mut out = Vec::new();
        if first {
            out.push(self.chunk(
                index,
                json!({"reasoning_content": null, "role": "assistant", "content": ""}),
                None,
            ));
        }
        if !chunk.reasoning_delta.is_empty() {
            out.push(self.chunk(
                index,
                json!({"reasoning_content": chunk.reasoning_delta}),
                None,
            ));
        }
        let mut calls = 0;
        match &self.tool_parsing {
            None => {
                if !chunk.delta.is_empty() {
                    out.push(self.chunk(
                        index,
                        json!({"reasoning_content": null, "content": chunk.delta}),
                        None,
                    ));
                }
            }
            Some(parsing) => {
                let mut streams = self
                    .tool_streams
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                let parser = streams.entry(index).or_insert_with(|| parsing.stream());
                let mut events = parser.push(&chunk.delta);
                if chunk.finish.is_some() {
                    events.extend(parser.finish());
                }
                calls = parser.calls();
                for delta in events.into_iter().flat_map(tools::deltas) {
                    out.push(self.chunk(index, delta, None));
                }
            }
        }
        if let Some(finish) = &chunk.finish {
            let fields = tools::finish_fields(finish.openai_reason(), finish.matched_stop(), calls);
            out.push(self.chunk(index, json!({"reasoning_content": null}), Some(fields)));
        }
        out
    }
}
