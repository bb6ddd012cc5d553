//! Driving several generations (a batch, or `n` samples) into one SSE stream: each generation's
//! chunks are rendered by the endpoint, interleaved as they arrive, and followed by the
//! endpoint's tail (usage chunk) and `data: [DONE]`.

use std::pin::Pin;

use axum::response::Response;
use futures_util::stream::{self, BoxStream, StreamExt};
use serde_json::Value;

use super::sse;
use crate::error::{ApiError, ErrorShape};
use crate::generation::{Chunk, Generation};

/// Token counts of one generation, for the usage chunk.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Counts {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub reasoning_tokens: usize,
    /// `Generation::reported_cached_tokens`.
    pub cached_tokens: Option<usize>,
    /// `Generation::spec_tokens_details`, for `sglext` chunks.
    pub spec_details: Value,
}

/// Renders one chunk of generation `index` into zero or more SSE payloads; `first` is true for
/// the first chunk of that generation.
pub trait RenderChunk: Send + Sync + 'static {
    fn render(&self, index: usize, g: &Generation, chunk: &Chunk, first: bool) -> Vec<Value>;
}

struct Item {
    index: usize,
    result: Result<(Vec<Value>, Counts), ApiError>,
}

fn one<R: RenderChunk>(
    index: usize,
    g: Generation,
    render: std::sync::Arc<R>,
) -> BoxStream<'static, Item> {
    stream::unfold(Some((g, true)), move |state| {
        let render = render.clone();
        async move {
            let (mut g, first) = state?;
            match g.next_chunk().await {
                None => None,
                Some(Ok(chunk)) => {
                    let events = render.render(index, &g, &chunk, first);
                    let counts = Counts {
                        prompt_tokens: g.prompt_tokens(),
                        completion_tokens: g.completion_tokens(),
                        reasoning_tokens: g.reasoning_tokens(),
                        cached_tokens: g.reported_cached_tokens(),
                        spec_details: g.spec_tokens_details(),
                    };
                    Some((
                        Item {
                            index,
                            result: Ok((events, counts)),
                        },
                        Some((g, false)),
                    ))
                }
                Some(Err(e)) => Some((
                    Item {
                        index,
                        result: Err(e),
                    },
                    None,
                )),
            }
        }
    })
    .boxed()
}

/// Starts the producing task and returns the streaming response. `tail` turns the final counts
/// into payloads sent just before `[DONE]` (the usage chunk).
pub fn respond<R, T>(gens: Vec<Generation>, render: R, shape: ErrorShape, tail: T) -> Response
where
    R: RenderChunk,
    T: FnOnce(&[Counts]) -> Vec<Value> + Send + 'static,
{
    let (tx, response) = sse::channel();
    let render = std::sync::Arc::new(render);
    let mut counts = vec![Counts::default(); gens.len()];
    let streams: Vec<_> = gens
        .into_iter()
        .enumerate()
        .map(|(i, g)| one(i, g, render.clone()))
        .collect();
    let mut merged: Pin<Box<_>> = Box::pin(stream::select_all(streams));
    tokio::spawn(async move {
        while let Some(item) = merged.next().await {
            match item.result {
                Ok((events, c)) => {
                    if let Some(slot) = counts.get_mut(item.index) {
                        *slot = c;
                    }
                    for e in events {
                        if tx.send(sse::event(&e)).await.is_err() {
                            return;
                        }
                    }
                }
                Err(e) => {
                    let _ = tx.send(sse::error_event(&e, shape)).await;
                    let _ = tx.send(sse::DONE.into()).await;
                    return;
                }
            }
        }
        for e in tail(&counts) {
            if tx.send(sse::event(&e)).await.is_err() {
                return;
            }
        }
        let _ = tx.send(sse::DONE.into()).await;
    });
    response
}

/// Starts every prepared request and waits until the engine admitted all of them, so admission
/// errors are answered as normal 4xx/5xx before any stream begins.
pub async fn start_all(
    state: &crate::state::AppState,
    mut prepared: Vec<crate::generation::PreparedRequest>,
    streaming: bool,
) -> Result<Vec<Generation>, ApiError> {
    prepared.iter_mut().for_each(|p| p.stream = streaming);
    let mut gens = Generation::start_all(state, prepared);
    for g in gens.iter_mut() {
        g.admitted().await?;
    }
    Ok(gens)
}

/// Runs every generation to its end (non-streaming requests).
pub async fn run_all(gens: &mut [Generation]) -> Result<(), ApiError> {
    let results = futures_util::future::join_all(gens.iter_mut().map(|g| g.run_to_end())).await;
    results.into_iter().collect()
}
