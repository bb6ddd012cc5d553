//! `ApiError`: every way a request can fail, mapped once to an HTTP status and to the body shape
//! SGLang uses on that route: the flat OpenAI-style `{"object":"error",...}` on `/v1/*`, and
//! `{"error": {"message": ...}}` on the native routes. The same mapping produces the SSE error
//! event for failures after a stream has started.

use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use dflash_common::chat::TemplateError;
use dflash_common::tokenizer::TokenizerError;
use serde_json::{json, Value};

use crate::engine::EngineFailure;
use crate::validation::ValidationError;

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error(transparent)]
    Validation(#[from] ValidationError),
    /// The body is not JSON, or a field has the wrong type; the message is serde's, with the path.
    #[error("{0}")]
    BadJson(String),
    #[error("Unsupported Media Type: Only 'application/json' is allowed")]
    MediaType,
    #[error(transparent)]
    Template(#[from] TemplateError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error(transparent)]
    Engine(#[from] EngineFailure),
    #[error("Unauthorized")]
    Unauthorized,
    #[error("The request body is larger than the limit of {limit} bytes (--max-request-body-bytes); send a smaller request or raise the limit")]
    PayloadTooLarge { limit: usize },
    #[error("The request body did not arrive within {secs} s (--body-read-timeout); send it promptly or raise the limit")]
    BodyTimeout { secs: f64 },
    /// Broken HTTP framing (a malformed chunk size, a body cut short).
    #[error("{0}")]
    BadFraming(String),
    #[error("{0}")]
    Internal(String),
}

/// Which body shape a route answers with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorShape {
    /// `/v1/*`: `{"object":"error","message","type","param","code"}`.
    OpenAi,
    /// `/generate` and the other native routes: `{"error": {"message": ...}}`.
    Native,
}

impl ApiError {
    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::Validation(_)
            | ApiError::BadJson(_)
            | ApiError::MediaType
            | ApiError::BadFraming(_)
            | ApiError::Template(_) => StatusCode::BAD_REQUEST,
            ApiError::BodyTimeout { .. } => StatusCode::REQUEST_TIMEOUT,
            ApiError::Tokenizer(TokenizerError::Encode { .. }) => StatusCode::BAD_REQUEST,
            ApiError::Tokenizer(_) | ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
            ApiError::Engine(
                EngineFailure::Rejected(_) | EngineFailure::TooLargeForCache { .. },
            ) => StatusCode::BAD_REQUEST,
            // SGLang answers a request ended by /abort_request with its partial output; the
            // status only shows in `finish_reason.status_code`.
            ApiError::Engine(
                EngineFailure::Aborted
                | EngineFailure::TimedOut { .. }
                | EngineFailure::QueueTimedOut { .. },
            ) => StatusCode::OK,
            ApiError::Engine(EngineFailure::Overloaded { .. } | EngineFailure::ShuttingDown) => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            ApiError::Engine(EngineFailure::Internal(_)) => StatusCode::INTERNAL_SERVER_ERROR,
            ApiError::Unauthorized => StatusCode::UNAUTHORIZED,
            ApiError::PayloadTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
        }
    }

    /// SGLang's `type` for the flat error body.
    fn openai_type(&self) -> String {
        let status = self.status();
        match status {
            StatusCode::BAD_REQUEST => "BadRequestError".into(),
            StatusCode::INTERNAL_SERVER_ERROR => "InternalServerError".into(),
            _ => status.canonical_reason().unwrap_or("Error").into(),
        }
    }

    pub fn body(&self, shape: ErrorShape) -> Value {
        if let ApiError::Unauthorized = self {
            return json!({"error": "Unauthorized"});
        }
        // SGLang's contract check answers `/generate` with the bare text.
        if let (ApiError::Validation(ValidationError::UnknownField { .. }), ErrorShape::Native) =
            (self, shape)
        {
            return json!({"error": self.to_string()});
        }
        match shape {
            ErrorShape::OpenAi => self.openai_body(),
            ErrorShape::Native => json!({"error": {"message": self.to_string()}}),
        }
    }

    fn openai_body(&self) -> Value {
        json!({
            "object": "error",
            "message": self.to_string(),
            "type": self.openai_type(),
            "param": null,
            "code": self.status().as_u16(),
        })
    }

    /// The `data:` payload for an error after the stream started (then `data: [DONE]`).
    pub fn sse_payload(&self, shape: ErrorShape) -> Value {
        match shape {
            ErrorShape::OpenAi => json!({"error": self.openai_body()}),
            ErrorShape::Native => json!({"error": {
                "message": self.to_string(),
                "type": "invalid_request_error",
                "code": self.status().as_u16(),
                "retryable": self.status() == StatusCode::SERVICE_UNAVAILABLE,
            }}),
        }
    }

    pub fn into_response_as(self, shape: ErrorShape) -> Response {
        let status = self.status();
        if status.is_server_error() {
            tracing::error!(status = status.as_u16(), "{self}");
        } else {
            tracing::info!(status = status.as_u16(), "rejected: {self}");
        }
        let body = self.body(shape).to_string();
        (status, [(header::CONTENT_TYPE, "application/json")], body).into_response()
    }
}

/// An error answered in the OpenAI flat shape.
#[derive(Debug)]
pub struct OpenAiError(pub ApiError);

/// An error answered in SGLang's native shape.
#[derive(Debug)]
pub struct NativeError(pub ApiError);

impl<E: Into<ApiError>> From<E> for OpenAiError {
    fn from(e: E) -> Self {
        OpenAiError(e.into())
    }
}

impl<E: Into<ApiError>> From<E> for NativeError {
    fn from(e: E) -> Self {
        NativeError(e.into())
    }
}

impl IntoResponse for OpenAiError {
    fn into_response(self) -> Response {
        self.0.into_response_as(ErrorShape::OpenAi)
    }
}

impl IntoResponse for NativeError {
    fn into_response(self) -> Response {
        self.0.into_response_as(ErrorShape::Native)
    }
}
