//! Assembling and running the server: metrics, the engine thread, the router, and graceful
//! shutdown (on SIGTERM or Ctrl-C new requests get 503 while running ones finish).

use std::future::Future;
use std::sync::Arc;

use tokio::net::TcpListener;

use crate::config::ServeConfig;
use crate::engine::thread::SchedulerLimits;
use crate::engine::{spawn_engine_thread, StepEngine};
use crate::metrics::ServerMetrics;
use crate::routes;
use crate::state::{AppState, ModelAssets};

/// Starts the engine thread for `engine` and builds the handlers' state.
pub fn build_state<E: StepEngine>(
    mut config: ServeConfig,
    model: ModelAssets,
    engine: E,
) -> std::io::Result<AppState> {
    let metrics = Arc::new(ServerMetrics::new(&config.served_model_name));
    let info = engine.info();
    let max_total_tokens = engine
        .kv_pool_tokens()
        .unwrap_or_else(|| config.total_tokens(model.lower.context_length));
    // What every reader (/server_info, admission) sees from here on is the effective pool.
    config.max_total_tokens = Some(max_total_tokens);
    metrics.set_static(
        model.lower.context_length,
        max_total_tokens,
        info.drafts_per_round,
        config.speculative.as_ref().map_or(0, |s| s.num_steps),
    );
    let limits = SchedulerLimits {
        max_running_requests: config.max_running_requests,
        max_total_tokens,
        max_queued_requests: config.max_queued_requests,
        request_timeout: config.request_timeout,
        decode_log_interval: config.decode_log_interval,
    };
    let handle = spawn_engine_thread(engine, limits, metrics.clone())?;
    Ok(AppState::new(config, model, handle, metrics))
}

/// SGLang's warm-up: one short greedy generation through the whole engine path before the
/// server announces readiness, so the first client does not pay for lazy initialisation.
pub async fn warm_up(state: &AppState) -> Result<std::time::Duration, String> {
    let started = std::time::Instant::now();
    let prompt = state
        .model
        .tokenizer
        .encode("The capital city of France is", false)
        .map_err(|e| e.to_string())?;
    let req = crate::engine::EngineRequest {
        prompt,
        max_new_tokens: 8,
        sampling: crate::engine::EngineSampling::greedy(),
        stop_token_ids: Vec::new(),
        ignore_eos: true,
    };
    let mut rx = state.engine.submit("WARMUP", req);
    while let Some(update) = rx.recv().await {
        match update {
            crate::engine::SeqUpdate::Step {
                finished: Some(_), ..
            } => return Ok(started.elapsed()),
            crate::engine::SeqUpdate::Failed(f) => return Err(f.to_string()),
            _ => {}
        }
    }
    Err("the engine stopped during warm-up".into())
}

/// Serves until `shutdown` resolves, then refuses new requests and drains running ones.
pub async fn serve(
    listener: TcpListener,
    state: AppState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = routes::router(state.clone());
    let draining = state.clone();
    axum::serve(listener, app)
        .with_graceful_shutdown(async move {
            shutdown.await;
            tracing::info!("shutting down: refusing new requests, finishing running ones");
            draining.engine.begin_shutdown();
            // Keep serving (503 for new requests, health included) until the running and
            // waiting requests are done; only then stop accepting connections.
            draining.engine.idle().await;
            tracing::info!("all requests finished; exiting");
        })
        .await
}

/// Resolves on SIGTERM or Ctrl-C.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        if tokio::signal::ctrl_c().await.is_err() {
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}
