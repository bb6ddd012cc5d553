//! `POST /generate`: SGLang's native route. Text or token ids in, `{text, output_ids,
//! meta_info}` out (a list for batches and `n > 1`); streams carry the cumulative text and ids
//! in every chunk, as SGLang does by default.

pub mod convert;
pub mod types;
pub mod validate;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use tracing::Instrument;

use super::stream::{self, RenderChunk};
use crate::error::{ErrorShape, NativeError};
use crate::generation::{Chunk, Generation};
use crate::state::AppState;

pub async fn handle(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, NativeError> {
    let req: types::GenerateRequest = super::parse_json(
        &headers,
        body,
        state.limits.body_bytes,
        super::BodyKind::Native,
    )?;
    let valid = validate::validate(&req, state.model.lower.vocab_size)?;
    validate::check_limits(&valid, &state.limits)?;
    let (batch, streaming, with_text) = (valid.batch, valid.stream, valid.text_in_logprobs);
    let span = tracing::info_span!(
        "generate",
        request_id = tracing::field::Empty,
        stream = streaming
    );
    async move {
        let worker = state.clone();
        let prepared = state
            .tokenizer_pool
            .run(move || convert::lower_generate(&worker, valid))
            .await?;
        if let Some(first) = prepared.first() {
            tracing::Span::current().record("request_id", first.rid.as_str());
        }
        let mut gens = stream::start_all(&state, prepared, streaming).await?;
        if streaming {
            return Ok(stream::respond(
                gens,
                Cumulative { batch, with_text },
                ErrorShape::Native,
                |_| Vec::new(),
            ));
        }
        stream::run_all(&mut gens).await?;
        let items: Vec<Value> = gens.iter().map(|g| item(g, None, with_text)).collect();
        let body = if batch {
            Value::Array(items)
        } else {
            items.into_iter().next().unwrap_or(Value::Null)
        };
        Ok((
            StatusCode::OK,
            [(header::CONTENT_TYPE, "application/json")],
            body.to_string(),
        )
            .into_response())
    }
    .instrument(span)
    .await
    .map_err(NativeError)
}

fn item(g: &Generation, index: Option<usize>, with_text: bool) -> Value {
    let mut meta = g.meta_info();
    if let (Some(top), Some(m)) = (g.logprobs_requested(), meta.as_object_mut()) {
        super::logprobs::sglang_meta(m, g.logprobs(), top, g.tokenizer(), with_text);
        if let Some(start) = g.prompt_logprob_start() {
            super::logprobs::sglang_input(m, g, start, top, with_text);
        }
    }
    let mut v = json!({
        "text": g.text(),
        "output_ids": g.output_ids(),
        "meta_info": meta,
    });
    if let (Some(i), Some(obj)) = (index, v.as_object_mut()) {
        obj.insert("index".into(), json!(i));
    }
    v
}

/// Every chunk repeats the whole text and ids so far (`bench_serving` sets
/// `generated_text = data["text"]`); batch chunks carry their `index`.
struct Cumulative {
    batch: bool,
    with_text: bool,
}

impl RenderChunk for Cumulative {
    fn render(&self, index: usize, g: &Generation, chunk: &Chunk, _first: bool) -> Vec<Value> {
        if chunk.new_ids.is_empty() && chunk.finish.is_none() {
            return Vec::new();
        }
        vec![item(g, self.batch.then_some(index), self.with_text)]
    }
}
