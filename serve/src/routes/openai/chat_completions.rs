//! `POST /v1/chat/completions`. Streams follow SGLang's chunk order: a role chunk, content
//! deltas (`reasoning_content: null` always present), a separate finish chunk with
//! `matched_stop`, the usage chunk when asked, then `[DONE]`. With `--reasoning-parser`, the
//! `<think>` part arrives as `reasoning_content` deltas and `message.reasoning_content`.

pub mod convert;
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
        if req.common.stream {
            let render = Render {
                id: rid.clone(),
                model: model.clone(),
                created,
                continuous_usage: req.common.continuous_usage(),
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
            .map(|(i, g)| choice(i, g, with_meta))
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

fn choice(index: usize, g: &Generation, with_meta: bool) -> Value {
    let (reasoning, content) = match g.reasoning_kind() {
        Some(kind) => split_whole(kind, g.text()),
        None => (None, g.text().to_string()),
    };
    let mut c = json!({
        "index": index,
        "message": {"role": "assistant", "content": content, "reasoning_content": reasoning},
        "logprobs": null,
        "finish_reason": g.finish().map(|f| f.openai_reason()),
        "matched_stop": g.finish().map(|f| f.matched_stop()).unwrap_or(Value::Null),
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
}

impl Render {
    fn chunk(
        &self,
        index: usize,
        delta: Value,
        finish: Option<&crate::generation::Finish>,
    ) -> Value {
        json!({
            "id": self.id,
            "object": CHUNK_OBJECT,
            "created": self.created,
            "model": self.model,
            "choices": [{
                "index": index,
                "delta": delta,
                "logprobs": null,
                "finish_reason": finish.map(|f| f.openai_reason()),
                "matched_stop": finish.map(|f| f.matched_stop()).unwrap_or(Value::Null),
            }],
        })
    }
}

impl RenderChunk for Render {
    fn render(&self, index: usize, g: &Generation, chunk: &Chunk, first: bool) -> Vec<Value> {
        let mut out = self.render_deltas(index, chunk, first);
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
        if !chunk.delta.is_empty() {
            out.push(self.chunk(
                index,
                json!({"reasoning_content": null, "content": chunk.delta}),
                None,
            ));
        }
        if let Some(finish) = &chunk.finish {
            out.push(self.chunk(index, json!({"reasoning_content": null}), Some(finish)));
        }
        out
    }
}
