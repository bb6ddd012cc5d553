//! Operational routes: health (engine progress, as SGLang probes), readiness, model
//! and server info (flattened settings plus a non-empty `internal_states` with
//! `avg_spec_accept_length`, which benchmark tools index without guards), load (what
//! sglang-router polls), cache flush, metrics.

use std::time::Duration;

use axum::extract::{Query, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::config::{DraftSource, VerifyMode};
use crate::engine::handle::StatsSnapshot;
use crate::state::AppState;

/// SGLANG_HEALTH_CHECK_TIMEOUT's default.
const HEALTH_TIMEOUT: Duration = Duration::from_secs(20);
/// Version reported in /server_info: the SGLang API level this server follows.
pub const SGLANG_API_VERSION: &str = "0.5.23";

/// `/health` and `/health_generate` as SGLang defines them: healthy when the scheduler makes
/// progress after the probe arrived. A busy engine proves that with its next completed step; an
/// idle one runs a one-token probe generation ahead of any queue. Either way the probe never
/// waits behind user requests, so a loaded server stays healthy.
pub async fn health(State(state): State<AppState>) -> Response {
    if state.engine.is_shutting_down() {
        return StatusCode::SERVICE_UNAVAILABLE.into_response();
    }
    match tokio::time::timeout(HEALTH_TIMEOUT, state.engine.probe()).await {
        Ok(Ok(())) => StatusCode::OK.into_response(),
        Ok(Err(e)) => {
            tracing::warn!("health check failed: {e}");
            StatusCode::SERVICE_UNAVAILABLE.into_response()
        }
        Err(_) => {
            tracing::warn!(
                "health check failed: no engine step completed within {HEALTH_TIMEOUT:?}"
            );
            StatusCode::SERVICE_UNAVAILABLE.into_response()
        }
    }
}

pub async fn ready(State(state): State<AppState>) -> StatusCode {
    if state.engine.is_shutting_down() {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::OK
    }
}

pub async fn model_info(State(state): State<AppState>) -> Json<Value> {
    let c = &state.config;
    Json(json!({
        "model_path": c.model_path,
        "tokenizer_path": c.tokenizer_path.as_ref().map(|p| p.display().to_string()).unwrap_or_else(|| c.model_path.clone()),
        "is_generation": true,
        "preferred_sampling_params": null,
        "weight_version": "default",
        "has_image_understanding": false,
        "has_audio_understanding": false,
        "model_type": state.model.model_type,
        "architectures": state.model.architectures,
        "served_model_name": c.served_model_name,
        "load_format": "safetensors",
        "reasoning_parser": c.reasoning_parser.map(|k| k.name()),
        "tool_call_parser": c.tool_call_parser.map(|k| k.name()),
        "disaggregation_mode": "null",
        "speculative_algorithm": c.speculative.as_ref().map(|s| s.algorithm.name()),
    }))
}

/// The resolved settings under SGLang's `server_args` names.
fn server_args(state: &AppState) -> serde_json::Map<String, Value> {
    let c = &state.config;
    let spec = c.speculative.as_ref();
    let draft = spec.map(|s| match &s.draft {
        DraftSource::Path(p) => p.clone(),
        DraftSource::ZLab { repo } => repo.clone(),
        // SGLang reports the target itself as NEXTN's draft model.
        DraftSource::TargetMtp => c.model_path.clone(),
    });
    let (verify, budget) = match spec.map(|s| s.verify) {
        Some(VerifyMode::Chain) => (Some("chain"), None),
        Some(VerifyMode::DDTree { budget }) => (Some("ddtree"), Some(budget)),
        None => (None, None),
    };
    let ctx = state.model.lower.context_length;
    // A chain verifies the drafter's depth plus the bonus token (DFLASH: its block size).
    let drafts = state.engine.info().drafts_per_round;
    let v = json!({
        "model_path": c.model_path,
        "tokenizer_path": c.tokenizer_path.as_ref().map(|p| p.display().to_string()).unwrap_or_else(|| c.model_path.clone()),
        "served_model_name": c.served_model_name,
        "host": c.host,
        "port": c.port,
        "dtype": format!("{:?}", c.dtype).to_ascii_lowercase(),
        "device": match c.device { crate::config::DeviceSpec::Cpu => "cpu".to_string(), crate::config::DeviceSpec::Cuda(i) => format!("cuda:{i}") },
        "context_length": ctx,
        "max_running_requests": c.max_running_requests,
        "max_total_tokens": c.max_total_tokens,
        "max_queued_requests": c.max_queued_requests,
        "max_sequences_per_request": c.max_sequences_per_request,
        "max_request_body_bytes": state.limits.body_bytes,
        "tp_size": 1, "dp_size": 1, "pp_size": 1,
        "kv_cache_dtype": "auto",
        "enable_metrics": c.enable_metrics,
        "decode_log_interval": c.decode_log_interval,
        "speculative_algorithm": spec.map(|s| s.algorithm.name()),
        "speculative_draft_model_path": draft,
        "speculative_num_steps": spec.map(|s| s.num_steps),
        "speculative_eagle_topk": spec.map(|s| s.eagle_topk),
        "speculative_num_draft_tokens": c.spec_num_draft_tokens(drafts),
        "speculative_verify": verify,
        "speculative_ddtree_budget": budget,
        "api_key": null,
    });
    let more = json!({
        "page_size": c.page_size,
        "chunked_prefill_size": match c.chunked_prefill_size { Some(None) => json!(-1), Some(Some(n)) => json!(n), None => Value::Null },
        "mem_fraction_static": c.mem_fraction_static,
        "reasoning_parser": c.reasoning_parser.map(|k| k.name()),
        "tool_call_parser": c.tool_call_parser.map(|k| k.name()),
        "grammar_backend": if c.grammar { "llguidance" } else { "none" },
        "chat_template": c.chat_template.as_ref().map(|p| p.display().to_string()),
        "hf_chat_template_name": c.hf_chat_template_name,
        "log_level": c.log_level,
        "skip_server_warmup": !c.warmup,
        "request_timeout": c.request_timeout.map(|d| d.as_secs_f64()),
        "stream_interval": 1,
        "random_seed": null,
        "skip_tokenizer_init": false,
        "is_embedding": false,
        "enable_lora": false,
        "disable_radix_cache": c.disable_radix_cache,
        "enable_mixed_chunk": !c.disable_mixed_chunk,
        "enable_cache_report": c.enable_cache_report,
        "load_format": "safetensors",
        "nnodes": 1, "node_rank": 0, "ep_size": 1,
        "disaggregation_mode": "null",
        "ignored_sglang_flags": c.ignored_sglang_flags,
    });
    match (v, more) {
        (Value::Object(mut m), Value::Object(more)) => {
            m.extend(more);
            m
        }
        _ => serde_json::Map::new(),
    }
}

pub async fn server_info(State(state): State<AppState>) -> Json<Value> {
    let stats = state.engine.stats();
    let ctx = state.model.lower.context_length;
    let mut internal = server_args(&state);
    internal.insert("world_size".into(), json!(1));
    internal.insert(
        "effective_max_running_requests_per_dp".into(),
        json!(state.config.max_running_requests),
    );
    internal.insert(
        "last_gen_throughput".into(),
        json!(stats.last_gen_throughput),
    );
    internal.insert(
        "avg_spec_accept_length".into(),
        json!(stats.avg_spec_accept_length()),
    );
    internal.insert(
        "memory_usage".into(),
        json!({"weight": 0.0, "kvcache": 0.0, "graph": 0.0, "token_capacity": ctx}),
    );
    let mut top = server_args(&state);
    top.insert(
        "launch_command".into(),
        json!(launch_command(&state.config.launch_command)),
    );
    top.insert("status".into(), json!("ready"));
    top.insert(
        "max_total_num_tokens".into(),
        json!(state.config.total_tokens(ctx)),
    );
    top.insert("max_req_input_len".into(), json!(ctx.saturating_sub(1)));
    top.insert("startup_time".into(), json!(state.started_unix));
    top.insert("internal_states".into(), json!([Value::Object(internal)]));
    top.insert("version".into(), json!(SGLANG_API_VERSION));
    top.insert("frontend".into(), json!("rust"));
    top.insert("num_running_reqs".into(), json!(stats.num_running));
    top.insert("num_queue_reqs".into(), json!(stats.num_waiting));
    Json(Value::Object(top))
}

/// `/get_load` as SGLang's: one entry per data-parallel rank (we have one). sglang-router's load
/// monitor sums `num_tokens` over the entries for its power-of-two policy, and its own
/// `/get_loads` reports it per worker. As SGLang's scheduler counts them, `num_reqs` is running
/// plus waiting and `num_tokens` is K/V tokens in use plus the prompts still waiting.
pub async fn load(State(state): State<AppState>) -> Json<Value> {
    Json(load_report(&state.engine.stats()))
}

pub fn load_report(stats: &StatsSnapshot) -> Value {
    json!([{
        "dp_rank": 0,
        "num_reqs": stats.num_running + stats.num_waiting,
        "num_waiting_reqs": stats.num_waiting,
        "num_tokens": stats.reserved_tokens + stats.waiting_tokens,
    }])
}

/// SGLang's `launch_command`: the arguments after the program name, space-joined, with the
/// `--api-key` value redacted (SGLang redacts its secret flags the same way).
fn launch_command(argv: &[String]) -> String {
    let mut out = Vec::with_capacity(argv.len());
    let mut redact_next = false;
    for word in argv.iter().skip(1) {
        if redact_next {
            out.push("<redacted>".to_string());
            redact_next = false;
        } else if word == "--api-key" {
            out.push(word.clone());
            redact_next = true;
        } else if word.starts_with("--api-key=") {
            out.push("--api-key=<redacted>".to_string());
        } else {
            out.push(word.clone());
        }
    }
    out.join(" ")
}

#[derive(Debug, Deserialize)]
pub struct FlushQuery {
    #[serde(default)]
    timeout: Option<f64>,
}

/// Empties the prefix cache when nothing is running or waiting (SGLang's rule), polling until
/// `timeout` seconds; 400 when the server stays busy.
pub async fn flush_cache(State(state): State<AppState>, Query(q): Query<FlushQuery>) -> Response {
    let deadline = tokio::time::Instant::now()
        + Duration::from_secs_f64(
            q.timeout
                .filter(|t| t.is_finite() && *t >= 0.0)
                .unwrap_or(0.0)
                .min(3600.0),
        );
    loop {
        if state.engine.flush_cache().await {
            return (StatusCode::OK, "Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting requests, the operation will not be performed.)\n").into_response();
        }
        if tokio::time::Instant::now() >= deadline {
            return (
                StatusCode::BAD_REQUEST,
                "Cache not flushed: requests are running or waiting. Retry when idle or pass ?timeout=SECONDS.\n",
            )
                .into_response();
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

pub async fn metrics(State(state): State<AppState>) -> Response {
    if !state.config.enable_metrics {
        return (
            StatusCode::NOT_FOUND,
            "metrics are off; start the server with --enable-metrics\n",
        )
            .into_response();
    }
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        state.metrics.render(),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn load_counts_waiting_requests_and_their_prompts() {
        let stats = StatsSnapshot {
            num_running: 3,
            num_waiting: 2,
            reserved_tokens: 1024,
            waiting_tokens: 17,
            ..StatsSnapshot::default()
        };
        assert_eq!(
            load_report(&stats),
            json!([{"dp_rank": 0, "num_reqs": 5, "num_waiting_reqs": 2, "num_tokens": 1041}])
        );
    }
}
