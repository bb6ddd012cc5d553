//! `dflash-serve`: parse the command line once, load the tokenizer and model, start the engine
//! thread and serve. anyhow lives only here.

use anyhow::Context;
use dflash_serve::cli::Args;
use dflash_serve::config::ServeConfig;
use dflash_serve::engine::real::RealEngine;
use dflash_serve::engine::StepEngine;
use dflash_serve::server;
use dflash_serve::state::ModelAssets;

mod bench;

/// `RUST_LOG` when set, else `--log-level` in SGLang's names (`warning` is tracing's `warn`; a
/// name tracing does not know would otherwise read as a target and silence everything).
fn init_tracing(level: &str) -> anyhow::Result<()> {
    let directive = dflash_serve::config::log_filter(level)?;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(directive));
    tracing_subscriber::fmt().with_env_filter(filter).init();
    Ok(())
}

/// The decoding engine for `config`: the target (Qwen3 or a Qwen3.5 / Qwen3.6 hybrid), plus the
/// DFlash drafter or the built-in MTP head when speculating.
fn load_engine(
    config: &ServeConfig,
    model_dir: &std::path::Path,
    assets: &ModelAssets,
) -> anyhow::Result<Box<dyn StepEngine>> {
    let engine = RealEngine::load(
        config,
        model_dir,
        assets.lower.context_length,
        assets.lower.eos_token_ids.clone(),
    )?;
    Ok(Box::new(engine))
}

fn main() -> anyhow::Result<()> {
    // `dflash-serve bench ...` is the benchmark (its own flags); everything else is the server.
    let argv: Vec<String> = std::env::args().collect();
    if argv.get(1).map(String::as_str) == Some("bench") {
        // Warnings (a kernel path declined, a fallback taken) belong in a benchmark's log.
        init_tracing("warning")?;
        return bench::main(argv[1..].to_vec());
    }
    let args = Args::parse_sglang();
    init_tracing(&args.log_level)?;
    let config = ServeConfig::from_args(&args)?;
    tracing::info!("server_args={config:?}");
    let location = dflash_common::resolve_model(&config.model_path)
        .with_context(|| format!("--model-path {}", config.model_path))?;
    let tokenizer_dir = config
        .tokenizer_path
        .clone()
        .unwrap_or_else(|| location.dir.clone());
    let assets = ModelAssets::load(&config, &location.dir, &tokenizer_dir)
        .with_context(|| format!("loading the tokenizer from {}", tokenizer_dir.display()))?;
    let engine = load_engine(&config, &location.dir, &assets)?;
    tracing::info!(
        "max_running_requests={}, context_len={}, max_queued_requests={}",
        config.max_running_requests,
        assets.lower.context_length,
        config.max_queued_requests
    );
    let addr = format!("{}:{}", config.host, config.port);
    let state =
        server::build_state(config, assets, engine).context("starting the engine thread")?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(&addr)
            .await
            .with_context(|| format!("binding {addr} (--host/--port)"))?;
        if state.config.warmup {
            let took = server::warm_up(&state)
                .await
                .map_err(|e| anyhow::anyhow!("warm-up generation failed: {e}"))?;
            tracing::info!("warm-up generation done in {:.2} s", took.as_secs_f64());
        }
        tracing::info!("The server is fired up and ready to roll!");
        tracing::info!("serving on http://{addr}");
        server::serve(listener, state, server::shutdown_signal())
            .await
            .context("serving")
    })
}
