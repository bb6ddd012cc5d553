//! The HTTP surface: one module per endpoint (wire types, validation and lowering in a folder
//! beside it), the router, and API-key auth. Handlers never see a tensor: they lower requests to
//! `PreparedRequest` and talk to the engine thread through `Generation`.

pub mod body;
pub mod generate;
pub mod info;
pub mod logprobs;
pub mod openai;
pub mod sse;
pub mod stream;
pub mod tools;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, HeaderMap, Method};
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::{get, post};
use axum::Router;
use serde::de::DeserializeOwned;
use tower_http::cors::CorsLayer;

use crate::error::{ApiError, ErrorShape};
use crate::state::AppState;

pub fn router(state: AppState) -> Router {
    let limit = state.limits.body_bytes;
    Router::new()
        .route("/generate", post(generate::handle).put(generate::handle))
        .route(
            "/v1/chat/completions",
            post(openai::chat_completions::handle),
        )
        .route("/v1/completions", post(openai::completions::handle))
        .route("/v1/responses", post(openai::responses::handle))
        .route("/v1/models", get(openai::models::list))
        .route("/v1/models/{*model}", get(openai::models::one))
        .route("/health", get(info::health))
        .route("/health_generate", get(info::health))
        .route("/ready", get(info::ready))
        .route("/get_model_info", get(info::model_info))
        .route("/model_info", get(info::model_info))
        .route("/get_server_info", get(info::server_info))
        .route("/server_info", get(info::server_info))
        .route("/get_load", get(info::load))
        .route(
            "/flush_cache",
            get(info::flush_cache).post(info::flush_cache),
        )
        .route("/metrics", get(info::metrics))
        .route("/tokenize", post(tools::tokenize))
        .route("/v1/tokenize", post(tools::tokenize))
        .route("/detokenize", post(tools::detokenize))
        .route("/v1/detokenize", post(tools::detokenize))
        .route("/abort_request", post(tools::abort_request))
        .route("/separate_reasoning", post(tools::separate_reasoning))
        .route("/parse_function_call", post(tools::parse_function_call))
        .route(
            "/start_profile",
            get(tools::profile_unavailable).post(tools::profile_unavailable),
        )
        .route(
            "/stop_profile",
            get(tools::profile_unavailable).post(tools::profile_unavailable),
        )
        .layer(middleware::from_fn_with_state(state.clone(), auth))
        .layer(middleware::from_fn_with_state(state.clone(), body::guard))
        .layer(DefaultBodyLimit::max(limit))
        .layer(CorsLayer::permissive())
        .with_state(state)
}

/// `--api-key`: `Authorization: Bearer KEY` on every route except health, readiness and metrics
/// (and CORS preflights), as SGLang does.
async fn auth(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let Some(key) = state.config.api_key.as_deref() else {
        return next.run(req).await;
    };
    let path = req.uri().path();
    let open = req.method() == Method::OPTIONS
        || path.starts_with("/health")
        || path == "/ready"
        || path == "/metrics";
    if open || bearer_matches(req.headers(), key) {
        return next.run(req).await;
    }
    ApiError::Unauthorized.into_response_as(ErrorShape::OpenAi)
}

fn bearer_matches(headers: &HeaderMap, key: &str) -> bool {
    let Some(value) = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
    else {
        return false;
    };
    let Some((scheme, token)) = value.split_once(' ') else {
        return false;
    };
    scheme.eq_ignore_ascii_case("bearer")
        && constant_time_eq(token.trim().as_bytes(), key.as_bytes())
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Which request content types a JSON route takes. Absent is fine everywhere but the OpenAI
/// routes (SGLang's FastAPI answers those 400); `application/x-www-form-urlencoded` is what
/// `curl -d` sends, so the native routes take it as SGLang's docs' curl lines rely on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyKind {
    /// `/v1/*`: `application/json` (or `application/*+json`) required.
    OpenAi,
    /// `/generate` and the utility routes.
    Native,
}

fn content_type_ok(headers: &HeaderMap, kind: BodyKind) -> bool {
    let Some(value) = headers.get(header::CONTENT_TYPE) else {
        return kind == BodyKind::Native;
    };
    let Ok(value) = value.to_str() else {
        return false;
    };
    let essence = value
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    match essence.split_once('/') {
        Some(("application", "json")) => true,
        Some(("application", sub)) if sub.ends_with("+json") => true,
        Some(("application", "x-www-form-urlencoded")) => kind == BodyKind::Native,
        _ => false,
    }
}

/// Reads a JSON body (already bounded and buffered by `body::guard`): content type, UTF-8, then
/// serde with the path of the offending field in the message; anything after the JSON value
/// but whitespace is refused.
pub fn parse_json<T: DeserializeOwned>(
    headers: &HeaderMap,
    body: Result<Bytes, BytesRejection>,
    limit: usize,
    kind: BodyKind,
) -> Result<T, ApiError> {
    if !content_type_ok(headers, kind) {
        return Err(ApiError::MediaType);
    }
    let body = body.map_err(|e| match e {
        BytesRejection::FailedToBufferBody(_) => ApiError::PayloadTooLarge { limit },
        other => ApiError::BadJson(other.body_text()),
    })?;
    if let Err(e) = std::str::from_utf8(&body) {
        return Err(ApiError::BadJson(format!(
            "The request body is not valid UTF-8 (invalid byte at offset {}); send UTF-8 encoded JSON",
            e.valid_up_to()
        )));
    }
    let mut de = serde_json::Deserializer::from_slice(&body);
    let value = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        let malformed = matches!(
            inner.classify(),
            serde_json::error::Category::Syntax | serde_json::error::Category::Eof
        );
        if malformed {
            ApiError::BadJson(format!(
                "Invalid JSON body (send well-formed JSON): {inner}"
            ))
        } else if path.is_empty() || path == "." {
            ApiError::BadJson(format!("Invalid JSON body: {inner}"))
        } else {
            ApiError::BadJson(format!("Invalid request: `{path}`: {inner}"))
        }
    })?;
    de.end().map_err(|e| {
        ApiError::BadJson(format!(
            "Invalid JSON body (send exactly one JSON value): {e}"
        ))
    })?;
    Ok(value)
}
