//! Server-sent events as SGLang writes them: each event is exactly `data: <json>\n\n`, and a
//! stream ends with `data: [DONE]\n\n`.
//!
//! A stream is a bounded channel drained by the response body. When the client disconnects the
//! body (and so the receiver) is dropped, the producing task's next send fails, it returns, and
//! dropping its generations cancels them in the engine.

use std::convert::Infallible;

use axum::body::{Body, Bytes};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::Value;
use tokio::sync::mpsc;

use crate::error::{ApiError, ErrorShape};

/// Events buffered between the producer and a slow client.
const STREAM_BUFFER: usize = 64;

pub const DONE: &[u8] = b"data: [DONE]\n\n";

pub fn event(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

pub fn error_event(e: &ApiError, shape: ErrorShape) -> Bytes {
    event(&e.sse_payload(shape))
}

/// A sender for the producer and the `200 text/event-stream` response reading from it.
pub fn channel() -> (mpsc::Sender<Bytes>, Response) {
    let (tx, rx) = mpsc::channel::<Bytes>(STREAM_BUFFER);
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|b| (Ok::<_, Infallible>(b), rx))
    });
    let response = (
        StatusCode::OK,
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        Body::from_stream(stream),
    )
        .into_response();
    (tx, response)
}
