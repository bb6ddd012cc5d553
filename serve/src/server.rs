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
    config: ServeConfig,
    model: ModelAssets,
    engine: E,
) -> std::io::Result<AppState> {
    let metrics = Arc::new(ServerMetrics::new(&config.served_model_name));
    let info = engine.info();
    metrics.set_static(
        model.lower.context_length,
        model.lower.context_length * config.max_running_requests,
        info.drafts_per_round,
    );
    let limits = SchedulerLimits {
        max_running_requests: config.max_running_requests,
        max_queued_requests: config.max_queued_requests,
        decode_log_interval: config.decode_log_interval,
    };
    let handle = spawn_engine_thread(engine, limits, metrics.clone())?;
    Ok(AppState::new(config, model, handle, metrics))
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
