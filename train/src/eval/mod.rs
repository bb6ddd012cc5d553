//! Drafter evaluation (`dflash-train eval`): is this drafter better than that one, measured
//! exactly and apples-to-apples (same prompts, same target continuations, same block size)?
//!
//! - **Offline** (default): the target's greedy continuation of each prompt and its tapped
//!   features are computed once and cached on disk ([`cache`]); each drafter is then replayed
//!   round by round exactly as greedy decoding would run it ([`replay`], DDTREE.md §7.2), giving
//!   per-round accepted drafts for vanilla DFlash (`chain`) and DDTree at every budget, which
//!   [`summary`] turns into tau, histograms and per-depth acceptance. [`offline_eval`] is the
//!   library entry point, also for periodic evaluation inside training.
//! - **Live** (`--live`): real speculative decoding through the engine, timed against plain
//!   decoding in the same run ([`live`]).
//!
//! Results go to stdout as markdown, to `--out-dir` as `eval.json` and PNG plots ([`report`],
//! [`plot`]). Errors are [`EvalError`]; anyhow appears only in [`run`].

pub mod cache;
pub mod drafters;
pub mod error;
pub mod identity;
pub mod live;
pub mod offline;
pub mod plot;
pub mod prompts;
pub mod replay;
pub mod report;
pub mod summary;

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::Instant;

use crate::tap_compat::last_layer_tap_warning;
use anyhow::Context;
use candle_core::{DType, Device};
use dflash_common::Qwen3Config;
use dflash_models::{OpsMode, Qwen3Model};
use serde_json::{Map, Value};

pub use cache::{CacheStatus, EvalCache};
pub use drafters::{Drafter, DrafterArg};
pub use error::{CacheError, EvalError};
pub use identity::{CacheRequest, CacheSpec, PromptSetIdentity, TargetIdentity};
pub use offline::{offline_eval, replay_cache};
pub use prompts::{PromptSet, TokenizedPrompt};
pub use replay::{replay_batch, replay_prompt, ReplayInput, ReplayRound, Verify};
pub use summary::{EvalSummary, ModeSummary};

/// Which measurements to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    /// Round replay on cached target continuations (exact, no target forward per round).
    Offline,
    /// Real speculative decoding, timed against plain decoding.
    Live,
    /// Both, so live tau can be checked against offline tau.
    Both,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum DTypeArg {
    /// bf16 on CUDA, f32 on the CPU.
    Auto,
    F32,
    Bf16,
    F16,
}

/// Flags of `dflash-train eval`.
#[derive(Debug, clap::Args)]
pub struct EvalArgs {
    /// Target model: a local directory, a Hugging Face repo id, or `demo`
    /// (serve/assets/tiny-coder-demo).
    #[arg(long, required_unless_present = "replot")]
    pub target: Option<String>,
    /// A drafter to compare (repeat the flag): `[NAME=]SPEC`, SPEC being a checkpoint directory,
    /// a z-lab repo id, `demo` (serve/assets/tiny-coder-demo-dflash) or
    /// `random[:seed=S,layers=N,block_size=B,mask_token_id=M,target_layer_ids=A+B]`, or
    /// `oracle[:noise=P,seed=S]` (the target's own continuation: a harness check).
    #[arg(long = "drafter", required_unless_present = "replot", value_parser = DrafterArg::parse)]
    pub drafters: Vec<DrafterArg>,
    /// Prompt set: JSONL chat records `{"id": ..., "messages": [...]}`, e.g.
    /// shared/fixtures/corpus/prompts-coding.jsonl.
    #[arg(long, required_unless_present = "replot")]
    pub prompts: Option<PathBuf>,
    /// Use only the first N prompts.
    #[arg(long)]
    pub limit: Option<usize>,
    /// Tokens generated per prompt (the target's greedy continuation).
    #[arg(long, default_value_t = 256)]
    pub max_new_tokens: usize,
    /// DDTree budgets (draft nodes per round, root excluded), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "4,8,16,32,64,128")]
    pub budgets: Vec<usize>,
    /// offline (default), live, or both.
    #[arg(long, value_enum, default_value_t = Mode::Offline)]
    pub mode: Mode,
    /// Shorthand for `--mode live`.
    #[arg(long, conflicts_with = "mode")]
    pub live: bool,
    /// Folder of the offline cache (continuations + target features); reused when it matches.
    #[arg(long, default_value = "dflash-eval-cache")]
    pub cache_dir: PathBuf,
    /// Rebuild the offline cache even when the one in --cache-dir matches this run.
    #[arg(long)]
    pub rebuild_cache: bool,
    /// Folder for eval.json and the PNG plots.
    #[arg(long, default_value = "dflash-eval-out")]
    pub out_dir: PathBuf,
    /// `cpu`, `cuda` or `cuda:N`.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    #[arg(long, value_enum, default_value_t = DTypeArg::Auto)]
    pub dtype: DTypeArg,
    /// Longest prompt + generated tokens (default: the target's max_position_embeddings).
    #[arg(long)]
    pub context_length: Option<usize>,
    /// Chat-template variables as a JSON object.
    #[arg(long, default_value = r#"{"enable_thinking": false}"#)]
    pub chat_template_kwargs: String,
    /// Live mode: tokens of the untimed warm-up generation before each configuration.
    #[arg(long, default_value_t = 16)]
    pub warmup_tokens: usize,
    /// DDTree budget shown next to the chain in the histogram plot (default: the largest).
    #[arg(long)]
    pub histogram_budget: Option<usize>,
    /// TrueType font for plot text (default: a DejaVu/Liberation/Noto font found on the machine).
    #[arg(long)]
    pub font: Option<PathBuf>,
    /// Re-draw the tables and plots of an earlier run's eval.json into --out-dir and stop
    /// (e.g. on a machine with fonts, for a run made on one without).
    #[arg(long, conflicts_with_all = ["target", "drafters", "prompts"])]
    pub replot: Option<PathBuf>,
}

fn parse_device(spec: &str) -> anyhow::Result<Device> {
    let index = match spec {
        "cpu" => return Ok(Device::Cpu),
        "cuda" => 0,
        s => s
            .strip_prefix("cuda:")
            .and_then(|i| i.parse().ok())
            .with_context(|| format!("--device {spec}: expected cpu, cuda or cuda:N"))?,
    };
    Device::new_cuda(index).with_context(|| {
        format!("--device {spec}: build with `--features cuda` on a machine with a GPU, or use --device cpu")
    })
}

fn validate(args: &EvalArgs) -> anyhow::Result<Map<String, Value>> {
    if let Some(&b) = args.budgets.iter().find(|&&b| b == 0) {
        anyhow::bail!("--budgets: {b} is not a budget; each must be at least 1 draft node");
    }
    if args.max_new_tokens == 0 {
        anyhow::bail!("--max-new-tokens must be at least 1");
    }
    let mut names = BTreeSet::new();
    for d in &args.drafters {
        if !names.insert(d.name.as_str()) {
            anyhow::bail!(
                "--drafter: two drafters are named `{}`; name them with NAME=SPEC",
                d.name
            );
        }
    }
    match serde_json::from_str(&args.chat_template_kwargs) {
        Ok(Value::Object(m)) => Ok(m),
        _ => anyhow::bail!(
            "--chat-template-kwargs {}: expected a JSON object, e.g. '{{\"enable_thinking\": false}}'",
            args.chat_template_kwargs
        ),
    }
}

/// The oracle replayed one prompt and one verification at a time with a fresh proposer per
/// verification, so its seeded noise follows the same call sequence as in the engine.
fn oracle_eval(
    target: &Qwen3Model,
    oracle: &Drafter,
    cache: &EvalCache,
    verifies: &[Verify],
) -> Result<EvalSummary, EvalError> {
    let mut modes = Vec::with_capacity(verifies.len());
    let mut max_depth = 0;
    for v in verifies {
        let mut proposer = oracle.proposer(target);
        let mut s = replay_cache(proposer.as_mut(), cache, &[*v], 1, |_| Ok(None))?;
        max_depth = s.max_depth;
        modes.append(&mut s.modes);
    }
    Ok(EvalSummary { max_depth, modes })
}

pub fn run(args: EvalArgs) -> anyhow::Result<()> {
    if let Some(json) = &args.replot {
        let report = report::EvalReport::read_json(json)?;
        let offline = report.drafters.iter().any(|d| d.offline.is_some());
        return write_outputs(&report, &args, offline, false);
    }
    let (Some(target_spec), Some(prompts)) = (args.target.clone(), args.prompts.clone()) else {
        anyhow::bail!("--target, --prompts and --drafter are required (unless --replot)");
    };
    let kwargs = validate(&args)?;
    let mode = if args.live { Mode::Live } else { args.mode };
    let (offline, live) = (mode != Mode::Live, mode != Mode::Offline);
    let mut budgets = args.budgets.clone();
    budgets.sort_unstable();
    budgets.dedup();
    let device = parse_device(&args.device)?;
    let dtype = match args.dtype {
        DTypeArg::Auto if device.is_cuda() => DType::BF16,
        DTypeArg::Auto | DTypeArg::F32 => DType::F32,
        DTypeArg::Bf16 => DType::BF16,
        DTypeArg::F16 => DType::F16,
    };
    // A bad prompt file fails before the (possibly long) target load.
    PromptSet::load(&prompts, args.limit)?;
    let target_dir = if target_spec == "demo" {
        drafters::demo_target_dir()
    } else {
        dflash_common::resolve_model(&target_spec)
            .with_context(|| format!("--target {target_spec}"))?
            .dir
    };
    let target_cfg = Qwen3Config::from_file(target_dir.join("config.json"))?;
    let context = args
        .context_length
        .unwrap_or(target_cfg.max_position_embeddings);
    tracing::info!(
        "loading target {} ({dtype:?} on {})",
        target_dir.display(),
        args.device
    );
    let target = Qwen3Model::load(&target_dir, dtype, &device, context, OpsMode::Fused)
        .with_context(|| format!("--target {target_spec}"))?;
    let drafters: Vec<(DrafterArg, Drafter)> = args
        .drafters
        .iter()
        .map(|d| d.load(&target).map(|m| (d.clone(), m)))
        .collect::<Result<_, _>>()?;
    for (a, d) in &drafters {
        let layers = target.config().num_hidden_layers;
        if let Some(w) = last_layer_tap_warning(&d.target_layer_ids(), layers) {
            tracing::warn!("drafter `{}`: {w}", a.name);
        }
    }
    let spec = CacheSpec::prepare(CacheRequest {
        target_dir: &target_dir,
        target_source: &target_spec,
        dtype,
        prompts: &prompts,
        limit: args.limit,
        template_kwargs: kwargs,
        max_new_tokens: args.max_new_tokens,
        tap_layer_ids: drafters
            .iter()
            .flat_map(|(_, d)| d.target_layer_ids())
            .collect(),
    })?;
    let longest = cache::check_lengths(&spec.tokenized, args.max_new_tokens, context)?;
    let verifies = Verify::chain_and_budgets(&budgets);

    let mut report = report::EvalReport {
        target: spec.target.clone(),
        device: args.device.clone(),
        prompts: report::PromptSetInfo {
            path: prompts.display().to_string(),
            sha256: spec.prompts.sha256.clone(),
            count: spec.tokenized.len(),
        },
        max_new_tokens: args.max_new_tokens,
        budgets: budgets.clone(),
        cache: None,
        plain: None,
        drafters: drafters
            .iter()
            .map(|(a, d)| report::DrafterReport {
                name: a.name.clone(),
                spec: a.spec.clone(),
                block_size: d.block_size(),
                target_layer_ids: d.target_layer_ids(),
                offline: None,
                live: Vec::new(),
            })
            .collect(),
    };

    if offline {
        let t0 = Instant::now();
        let (cache, status) =
            EvalCache::open_or_build(&args.cache_dir, &target, &spec, context, args.rebuild_cache)?;
        tracing::info!(
            "offline cache {} at {} ({:.1}s)",
            if status == CacheStatus::Built {
                "built"
            } else {
                "reused"
            },
            args.cache_dir.display(),
            t0.elapsed().as_secs_f64()
        );
        for (a, d) in &drafters {
            cache.check_drafter(&a.name, &d.target_layer_ids())?;
        }
        for ((a, d), r) in drafters.iter().zip(&mut report.drafters) {
            let t0 = Instant::now();
            let summary = match d {
                Drafter::DFlash(d) => offline_eval(&target, d, &cache, &verifies)?,
                Drafter::Oracle { .. } => oracle_eval(&target, d, &cache, &verifies)?,
            };
            tracing::info!(
                "drafter {}: offline replay in {:.1}s",
                a.name,
                t0.elapsed().as_secs_f64()
            );
            r.offline = Some(summary);
        }
        report.cache = Some(report::CacheInfo {
            dir: args.cache_dir.display().to_string(),
            status,
            tap_layer_ids: cache.manifest.tap_layer_ids.clone(),
            entries: cache.manifest.entries.clone(),
        });
    }

    if live {
        let opts = live::LiveOptions {
            max_new_tokens: args.max_new_tokens,
            warmup_tokens: args.warmup_tokens,
            eos_token_ids: spec.eos_token_ids.clone(),
            max_context: longest,
        };
        let plain = live::run_plain(&target, &spec.tokenized, &opts)?;
        tracing::info!("plain decoding: {:.1} tokens/s", plain.tokens_per_second);
        let algorithms: Vec<_> = verifies.iter().map(Verify::algorithm).collect();
        for ((a, d), r) in drafters.iter().zip(&mut report.drafters) {
            r.live = live::run_speculative(
                &target,
                d.proposer(&target),
                &algorithms,
                &spec.tokenized,
                &opts,
                &plain,
            )?;
            tracing::info!("drafter {}: live decoding done", a.name);
        }
        report.plain = Some(plain);
    }

    write_outputs(&report, &args, offline, true)
}

/// Markdown to stdout, then (when `json`) eval.json and the PNG plots into --out-dir.
fn write_outputs(
    report: &report::EvalReport,
    args: &EvalArgs,
    offline: bool,
    json: bool,
) -> anyhow::Result<()> {
    println!("{}", report.markdown());
    std::fs::create_dir_all(&args.out_dir)
        .with_context(|| format!("--out-dir {}", args.out_dir.display()))?;
    let mut written = Vec::new();
    if json {
        let path = args.out_dir.join("eval.json");
        report.write_json(&path)?;
        written.push(path);
    }
    let tau_png = args.out_dir.join("tau_vs_budget.png");
    plot::tau_vs_budget(report, &tau_png, args.font.as_deref())?;
    written.push(tau_png);
    if offline {
        let hist_png = args.out_dir.join("acceptance_histogram.png");
        plot::acceptance_histogram(
            report,
            &hist_png,
            args.font.as_deref(),
            args.histogram_budget,
        )?;
        written.push(hist_png);
    }
    for p in written {
        println!("wrote {}", p.display());
    }
    Ok(())
}
