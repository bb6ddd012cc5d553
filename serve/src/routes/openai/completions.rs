//! `POST /v1/completions`.

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

use super::{counts_of, usage, usage_chunk};
use crate::engine::TokenLogprob;
use crate::error::{ErrorShape, OpenAiError};
use crate::generation::{new_rid, Chunk, Generation};
use crate::routes::stream::{self, RenderChunk};
use crate::state::{unix_now, AppState};

const OBJECT: &str = "text_completion";

pub async fn handle(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, OpenAiError> {
    let req: types::CompletionRequest = crate::routes::parse_json(
        &headers,
        body,
        state.limits.body_bytes,
        crate::routes::BodyKind::OpenAi,
    )?;
    let prompts = validate::validate(&req, state.model.lower.vocab_size)?;
    validate::check_limits(&prompts, req.common.n(), &state.limits)?;
    let rid = req.common.rid.clone().unwrap_or_else(new_rid);
    let span = tracing::info_span!("completions", request_id = %rid, model = %state.config.served_model_name);
    async move {
        let (worker, req2, rid2) = (state.clone(), req.clone(), rid.clone());
        let prepared = state
            .tokenizer_pool
            .run(move || convert::lower_completion(&worker, &req2, prompts, &rid2))
            .await?;
        let mut gens = stream::start_all(&state, prepared, req.common.stream).await?;
        let echo = req.echo == Some(true);
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
                logprobs: Default::default(),
                echo,
            };
            let include_usage = req.common.include_usage();
            let tail = move |counts: &[stream::Counts]| {
                if include_usage {
                    vec![usage_chunk(&rid, OBJECT, created, &model, counts, n)]
                } else {
                    Vec::new()
                }
            };
            return Ok(stream::respond(gens, render, ErrorShape::OpenAi, tail));
        }
        stream::run_all(&mut gens).await?;
        let choices: Vec<Value> = gens
            .iter()
            .enumerate()
            .map(|(i, g)| {
                if echo {
                    let prompt = echoed_prompt(g);
                    let lps = crate::routes::logprobs::openai_completions_echo(g, g.logprobs(), 0);
                    with_logprobs(choice(i, g, &format!("{prompt}{}", g.text()), None), g, lps)
                } else {
                    choice(i, g, g.text(), Some((g.logprobs(), 0)))
                }
            })
            .collect();
        Ok(Json(json!({
            "id": rid,
            "object": OBJECT,
            "created": created,
            "model": model,
            "choices": choices,
            "usage": usage(&counts_of(&gens), n, false),
            "metadata": {"weight_version": "default"},
        }))
        .into_response())
    }
    .instrument(span)
    .await
    .map_err(OpenAiError)
}

/// `logprobs`: the tokens' logprobs when asked (`offset`: the text before them).
fn choice(
    index: usize,
    g: &Generation,
    text: &str,
    logprobs: Option<(&[TokenLogprob], usize)>,
) -> Value {
    let logprobs = match (g.logprobs_requested(), logprobs) {
        (Some(_), Some((lps, offset))) => {
            crate::routes::logprobs::openai_completions(lps, g.tokenizer(), offset)
        }
        _ => Value::Null,
    };
    json!({
        "index": index,
        "text": text,
        "logprobs": logprobs,
        "finish_reason": g.finish().map(|f| f.openai_reason()),
        "matched_stop": g.finish().map(|f| f.matched_stop()).unwrap_or(Value::Null),
    })
}

/// `echo`: the prompt as text (its ids decoded, special tokens kept).
fn echoed_prompt(g: &Generation) -> String {
    g.tokenizer()
        .decode(g.prompt_ids(), false)
        .unwrap_or_default()
}

/// The choice with its `logprobs` replaced (when the request asked for them).
fn with_logprobs(mut choice: Value, g: &Generation, lps: Value) -> Value {
    if let (Some(_), Some(obj)) = (g.logprobs_requested(), choice.as_object_mut()) {
        obj.insert("logprobs".into(), lps);
    }
    choice
}

/// Text deltas; `finish_reason` rides on the last text chunk (no separate finish chunk).
/// With `echo` the first chunk starts with the prompt (and its logprobs).
struct Render {
    id: String,
    model: String,
    created: u64,
    continuous_usage: bool,
    logprobs: crate::routes::logprobs::StreamedLogprobs,
    echo: bool,
}

impl RenderChunk for Render {
    fn render(&self, index: usize, g: &Generation, chunk: &Chunk, first: bool) -> Vec<Value> {
        let echo_now = self.echo && first;
        if chunk.delta.is_empty() && chunk.finish.is_none() && !echo_now {
            return Vec::new();
        }
        let new = self.logprobs.take(index, g.logprobs());
        let before = g.text().len().saturating_sub(chunk.delta.len());
        let choice = if echo_now {
            let prompt = echoed_prompt(g);
            let lps = crate::routes::logprobs::openai_completions_echo(g, new, 0);
            with_logprobs(
                choice(index, g, &format!("{prompt}{}", chunk.delta), None),
                g,
                lps,
            )
        } else {
            let prompt_len = if self.echo { echoed_prompt(g).len() } else { 0 };
            choice(index, g, &chunk.delta, Some((new, prompt_len + before)))
        };
        vec![json!({
            "id": self.id,
            "object": OBJECT,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": if self.continuous_usage { super::running_usage(g) } else { Value::Null },
        })]
    }
}
