//! Assembling and running the server: metrics, the engine thread, the router, the accept loop
//! (`connection` drives each connection with its timeouts), and graceful shutdown (on SIGTERM
//! or Ctrl-C new requests get 503 while running ones finish).

mod connection;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::config::ServeConfig;
use crate::engine::handle::SchedulerLimits;
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
        config
            .spec_num_draft_tokens(info.drafts_per_round)
            .unwrap_or(0),
        config.speculative.as_ref().map_or(0, |s| s.num_steps),
    );
    let limits = SchedulerLimits {
        max_running_requests: config.max_running_requests,
        max_total_tokens,
        max_queued_sequences: config.max_queued_requests,
        request_timeout: config.request_timeout,
        queue_timeout: config.queue_timeout,
        decode_log_interval: config.decode_log_interval,
        schedule_conservativeness: config.schedule_conservativeness,
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
        logprobs: None,
        grammar: None,
        prompt_logprobs: None,
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

/// Serves until `shutdown` resolves, then refuses new requests (503, health included) and
/// drains running ones; once the engine is idle, open connections are told to close, and any
/// still open after `--shutdown-grace-period` (a half-sent request, a client not reading its
/// response) are dropped so the process can exit.
pub async fn serve(
    listener: TcpListener,
    state: AppState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = routes::router(state.clone());
    let timeouts = state.config.http.clone();
    let (close_tx, close_rx) = watch::channel(false);
    let mut connections = JoinSet::new();
    let drained = {
        let state = state.clone();
        async move {
            shutdown.await;
            tracing::info!("shutting down: refusing new requests, finishing running ones");
            state.engine.begin_shutdown();
            state.engine.idle().await;
        }
    };
    tokio::pin!(drained);
    loop {
        tokio::select! {
            () = &mut drained => break,
            accepted = listener.accept() => match accepted {
                Ok((tcp, _)) => {
                    let _ = tcp.set_nodelay(true);
                    connections.spawn(connection::serve_connection(
                        tcp,
                        app.clone(),
                        timeouts.clone(),
                        close_rx.clone(),
                    ));
                }
                Err(e) => {
                    // Out of file descriptors and the like: wait instead of spinning.
                    tracing::warn!("accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
    drop(listener);
    let _ = close_tx.send(true);
    let grace = tokio::time::sleep(timeouts.shutdown_grace);
    tokio::pin!(grace);
    loop {
        tokio::select! {
            () = &mut grace => {
                if !connections.is_empty() {
                    tracing::info!(
                        "closing {} connections still open after the {:?} grace period",
                        connections.len(),
                        timeouts.shutdown_grace
                    );
                }
                connections.shutdown().await;
                break;
            }
            next = connections.join_next() => if next.is_none() { break },
        }
    }
    tracing::info!("all requests finished; exiting");
    Ok(())
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
