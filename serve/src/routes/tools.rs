//! SGLang's utility routes: `/tokenize` and `/detokenize` (also under `/v1/`), `/abort_request`,
//! `/separate_reasoning`, and the profiler switches that `bench_serving --profile` calls.

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use super::generate::types::OneOrMany;
use crate::error::{ApiError, NativeError, OpenAiError};
use crate::generation::reasoning::split_whole;
use crate::generation::tool_calls::{parse_whole, DeclaredTools};
use crate::generation::{ReasoningParserKind, ToolParserKind};
use crate::routes::openai::chat_completions::types::ChatRequest;
use crate::state::AppState;
use crate::validation::ValidationError;

/// SGLang's `TokenizeRequest`: exactly one of `prompt` (text, or a list) or `messages` (a chat,
/// rendered by the chat template as a chat completion renders it, with its `tools` and
/// `chat_template_kwargs`).
#[derive(Debug, Deserialize)]
pub struct TokenizeRequest {
    #[serde(default)]
    pub prompt: Option<OneOrMany<String>>,
    #[serde(default)]
    pub messages: Option<Vec<Value>>,
    #[serde(default = "yes")]
    pub add_special_tokens: bool,
    /// With `messages`: passed to the template [default: true, as for a chat completion].
    #[serde(default)]
    pub add_generation_prompt: Option<bool>,
    #[serde(flatten)]
    pub chat: ChatRequest,
}

fn yes() -> bool {
    true
}

/// `POST /tokenize`: `{"tokens", "count", "max_model_len"}`, lists for a list of prompts.
pub async fn tokenize(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, OpenAiError> {
    let req: TokenizeRequest = super::parse_json(
        &headers,
        body,
        state.limits.body_bytes,
        super::BodyKind::Native,
    )?;
    let max_model_len = state.model.lower.context_length;
    let prompt = match (req.prompt, req.messages) {
        (Some(p), None) => p,
        (None, Some(messages)) => {
            let mut chat = req.chat;
            chat.messages = messages;
            let valid = crate::routes::openai::chat_completions::validate::validate(&chat)?;
            crate::routes::openai::chat_completions::validate::check_limits(
                &chat,
                &valid,
                &state.limits,
            )?;
            let add_generation_prompt = req.add_generation_prompt.unwrap_or(true);
            let worker = state.clone();
            let one = state
                .tokenizer_pool
                .run(move || {
                    crate::routes::openai::chat_completions::convert::prompt_ids(
                        &worker,
                        &chat,
                        &valid,
                        add_generation_prompt,
                    )
                })
                .await?;
            return Ok(Json(
                json!({"count": one.len(), "tokens": one, "max_model_len": max_model_len}),
            ));
        }
        _ => {
            return Err(ApiError::BadJson(
                "Exactly one of 'prompt' or 'messages' must be provided.".into(),
            )
            .into())
        }
    };
    let tokenizer = state.model.tokenizer.clone();
    let batch = matches!(prompt, OneOrMany::Many(_));
    let prompts = prompt.to_vec();
    let add = req.add_special_tokens;
    // Tokenizing costs many times the text's size in memory; a text that cannot fit the
    // context is refused from its length instead.
    for p in &prompts {
        state.limits.prompt.check_bytes(p.len())?;
    }
    let ids = state
        .tokenizer_pool
        .run(move || {
            prompts
                .iter()
                .map(|p| tokenizer.encode(p, add).map_err(ApiError::from))
                .collect::<Result<Vec<_>, _>>()
        })
        .await?;
    Ok(Json(if batch {
        let counts: Vec<usize> = ids.iter().map(Vec::len).collect();
        json!({"tokens": ids, "count": counts, "max_model_len": max_model_len})
    } else {
        let one = ids.into_iter().next().unwrap_or_default();
        json!({"count": one.len(), "tokens": one, "max_model_len": max_model_len})
    }))
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum TokenLists {
    One(Vec<i64>),
    Many(Vec<Vec<i64>>),
}

#[derive(Debug, Deserialize)]
pub struct DetokenizeRequest {
    #[serde(default)]
    pub model: Option<String>,
    pub tokens: TokenLists,
}

/// `POST /detokenize`: `{"text"}` (a list for a list of token lists). Ids outside the vocabulary
/// are a 400 naming the first one.
pub async fn detokenize(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, OpenAiError> {
    let req: DetokenizeRequest = super::parse_json(
        &headers,
        body,
        state.limits.body_bytes,
        super::BodyKind::Native,
    )?;
    let vocab = state.model.lower.vocab_size;
    let (lists, batch) = match req.tokens {
        TokenLists::One(t) => (vec![t], false),
        TokenLists::Many(t) => (t, true),
    };
    let lists = lists
        .iter()
        .map(|l| crate::validation::check_token_ids("tokens", l, vocab))
        .collect::<Result<Vec<_>, ValidationError>>()?;
    let tokenizer = state.model.tokenizer.clone();
    let texts = state
        .tokenizer_pool
        .run(move || {
            lists
                .iter()
                .map(|ids| tokenizer.decode(ids, true).map_err(ApiError::from))
                .collect::<Result<Vec<_>, _>>()
        })
        .await?;
    Ok(Json(if batch {
        json!({"text": texts})
    } else {
        json!({"text": texts.into_iter().next().unwrap_or_default()})
    }))
}

#[derive(Debug, Default, Deserialize)]
pub struct AbortRequest {
    #[serde(default)]
    pub rid: String,
    #[serde(default)]
    pub abort_all: bool,
}

/// `POST /abort_request`: ends the named request (or all) with finish reason `abort`; clients
/// get what was generated so far. Unknown ids are ignored; the answer is always 200.
pub async fn abort_request(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<StatusCode, NativeError> {
    let req: AbortRequest = super::parse_json(
        &headers,
        body,
        state.limits.body_bytes,
        super::BodyKind::Native,
    )?;
    if req.abort_all {
        state.engine.abort(None);
    } else if !req.rid.is_empty() {
        state.engine.abort(Some(req.rid));
    }
    Ok(StatusCode::OK)
}

#[derive(Debug, Deserialize)]
pub struct SeparateReasoningRequest {
    pub text: String,
    #[serde(default)]
    pub reasoning_parser: Option<String>,
}

/// `POST /separate_reasoning`: `{"text", "reasoning_text"}` for a finished answer.
pub async fn separate_reasoning(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, NativeError> {
    let req: SeparateReasoningRequest = super::parse_json(
        &headers,
        body,
        state.limits.body_bytes,
        super::BodyKind::Native,
    )?;
    let kind = match req.reasoning_parser.as_deref() {
        Some(name) => ReasoningParserKind::parse(name).ok_or_else(|| {
            ApiError::BadJson(format!(
                "unknown reasoning_parser `{name}`; use qwen3 or qwen3-thinking"
            ))
        })?,
        None => state.config.reasoning_parser.ok_or_else(|| {
            ApiError::BadJson(
                "no reasoning_parser given and the server has none (--reasoning-parser)".into(),
            )
        })?,
    };
    let (reasoning, text) = split_whole(kind, &req.text);
    Ok(Json(
        json!({"text": text, "reasoning_text": reasoning.unwrap_or_default()}),
    ))
}

#[derive(Debug, Deserialize)]
pub struct ParseFunctionCallRequest {
    pub text: String,
    #[serde(default)]
    pub tools: Vec<Value>,
    #[serde(default)]
    pub tool_call_parser: Option<String>,
}

/// `POST /parse_function_call`: SGLang's offline tool-call parsing of a finished answer,
/// `{"normal_text", "calls": [{"tool_index", "name", "parameters"}]}` (the same parser chat
/// completions use; the request's parser, else `--tool-call-parser`).
pub async fn parse_function_call(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<Value>, NativeError> {
    let req: ParseFunctionCallRequest = super::parse_json(
        &headers,
        body,
        state.limits.body_bytes,
        super::BodyKind::Native,
    )?;
    let kind = match req.tool_call_parser.as_deref() {
        Some(name) => ToolParserKind::parse(name).ok_or_else(|| {
            ApiError::BadJson(format!(
                "unknown tool_call_parser `{name}`; use qwen25 (alias hermes) or qwen3_coder"
            ))
        })?,
        None => state.config.tool_call_parser.ok_or_else(|| {
            ApiError::BadJson(
                "no tool_call_parser given and the server has none (--tool-call-parser)".into(),
            )
        })?,
    };
    let tools = DeclaredTools::from_request(&req.tools);
    let (normal_text, calls) = parse_whole(kind, tools.clone(), &req.text);
    let calls: Vec<Value> = calls
        .iter()
        .map(|c| json!({"tool_index": tools.index_of(&c.name), "name": c.name, "parameters": c.arguments}))
        .collect();
    Ok(Json(json!({"normal_text": normal_text, "calls": calls})))
}

/// `/start_profile` and `/stop_profile`: there is no torch profiler to drive; answer 200 so
/// `bench_serving --profile` runs, and say so in the log.
pub async fn profile_unavailable() -> Response {
    tracing::warn!(
        "profiling requested, but dflash-serve has no profiler; use nsys on the process"
    );
    (
        StatusCode::OK,
        "Profiling is not available in dflash-serve; the request was ignored.\n",
    )
        .into_response()
}
