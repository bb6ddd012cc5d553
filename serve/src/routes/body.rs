//! Request bodies are read here, once, before any handler runs: a `Content-Length` over the
//! limit is a 413 before a byte of the body is read, a body still arriving after
//! `--body-read-timeout` is a 408, a chunked body that grows past the limit is a 413, and broken
//! framing (a malformed chunk size) is a 400. The connection is closed after each of these
//! (hyper cannot reuse a connection whose body was not read to its end). Handlers then get the
//! buffered bytes.

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap};
use axum::middleware::Next;
use axum::response::Response;
use http_body_util::BodyExt;

use crate::error::{ApiError, ErrorShape};
use crate::state::AppState;

/// Bodies above this size ask the engine thread to return freed memory once they are dropped.
const TRIM_AFTER_BYTES: usize = 1 << 20;

fn shape_of(path: &str) -> ErrorShape {
    if path.starts_with("/v1/") {
        ErrorShape::OpenAi
    } else {
        ErrorShape::Native
    }
}

fn declared_length(headers: &HeaderMap) -> Option<u64> {
    headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse().ok())
}

/// Reads the whole body, refusing it once it passes `limit` bytes.
async fn read_body(mut body: Body, limit: usize, hint: usize) -> Result<Vec<u8>, ApiError> {
    let mut buf = Vec::with_capacity(hint.min(limit));
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| {
            ApiError::BadFraming(format!(
                "The request body could not be read ({e}); send a well-formed HTTP/1.1 body"
            ))
        })?;
        if let Ok(data) = frame.into_data() {
            if buf.len() + data.len() > limit {
                return Err(ApiError::PayloadTooLarge { limit });
            }
            buf.extend_from_slice(&data);
        }
    }
    Ok(buf)
}

/// The body was not read to its end, so the connection cannot carry another request.
fn closing(mut response: Response) -> Response {
    response.headers_mut().insert(
        header::CONNECTION,
        axum::http::HeaderValue::from_static("close"),
    );
    response
}

pub async fn guard(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let shape = shape_of(req.uri().path());
    let limit = state.limits.body_bytes;
    let declared = declared_length(req.headers());
    if declared.is_some_and(|n| n > limit as u64) {
        return closing(ApiError::PayloadTooLarge { limit }.into_response_as(shape));
    }
    let (parts, body) = req.into_parts();
    let hint = declared.unwrap_or(0) as usize;
    let read = read_body(body, limit, hint);
    let bytes = match state.config.http.body_read {
        Some(t) => match tokio::time::timeout(t, read).await {
            Ok(r) => r,
            Err(_) => Err(ApiError::BodyTimeout {
                secs: t.as_secs_f64(),
            }),
        },
        None => read.await,
    };
    let bytes = match bytes {
        Ok(b) => b,
        Err(e) => return closing(e.into_response_as(shape)),
    };
    let large = bytes.len() > TRIM_AFTER_BYTES;
    let response = next
        .run(Request::from_parts(parts, Body::from(Bytes::from(bytes))))
        .await;
    if large {
        state.engine.request_trim();
    }
    response
}
