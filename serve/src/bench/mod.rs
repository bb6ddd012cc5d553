//! `dflash-serve bench`: speed of a model of any published shape with random weights, in the
//! spirit of `sglang.bench_one_batch`, as JSON. See deploy/bench/README.md for the figures, how
//! they relate to the rooflines, and the HF transformers baseline script run beside it.

#[cfg(feature = "cuda")]
mod batched;
mod e2e;
mod e2e_batched;
mod family;
mod family_shapes;
mod kernel_checks;
mod measure;
mod shapes;

use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device};
use clap::Parser;
use dflash_common::DFlashConfig;
use dflash_models::random::WeightRng;
use dflash_models::{DFlashDrafter, OpsMode, Qwen3Model, Target};
use serde_json::{json, Map, Value};

use measure::{decode_ms, drafter_block_ms, fill_context, forward_n, time_ms};

#[derive(Debug, Parser)]
#[command(
    name = "dflash-serve bench",
    about = "Benchmark a Qwen3-shaped model with random weights (no download) and print JSON.",
    long_about = "Benchmark a Qwen3-shaped model with random weights (no download) and print JSON:\n\
batch-1 decode at each --contexts, forward latency of --sizes new tokens over a 1K cache with chain\n\
and tree masks, DFlash drafter block latency, prefill throughput, and end-to-end speculative\n\
decoding with a simulated acceptance length against plain decoding. Every figure comes with its\n\
ratio to the memory or compute roofline measured in the same run (copy bandwidth into a\n\
preallocated buffer, bf16 matmul rate) and to the plain decode step. On CUDA both the plain candle\n\
path and the fused-kernel path are measured, and the fused kernels are checked against the plain\n\
path. deploy/bench/hf_baseline.py measures the same figures with HF transformers; see\n\
deploy/bench/README.md."
)]
pub struct BenchArgs {
    /// Published shape (dense: qwen3-0.6b, qwen3-1.7b, qwen3-4b, qwen3-8b, qwen3-14b,
    /// qwen3-32b; hybrid: qwen3.6-27b, qwen3.6-35b-a3b; MoE: qwen3-coder-30b-a3b,
    /// qwen3-30b-a3b) or a config.json path / model directory of any of these families
    #[arg(long, default_value = "qwen3-8b")]
    model: String,
    /// cpu, cuda or cuda:N
    #[arg(long, default_value = "cuda")]
    device: String,
    /// bfloat16, float16 or float32
    #[arg(long, default_value = "bfloat16")]
    dtype: String,
    /// Write the JSON here as well as to stdout
    #[arg(long)]
    out: Option<std::path::PathBuf>,
    /// Context lengths for batch-1 decode
    #[arg(long, value_delimiter = ',', default_value = "1024,8192")]
    contexts: Vec<usize>,
    /// Sequences per batched step (pooled K/V, 1K context each; the flag with no value: none)
    #[arg(long, value_delimiter = ',', num_args = 0.., default_value = "8,32,64")]
    batch_sizes: Vec<usize>,
    /// New-token counts for the forward-latency sweep (over a 1024-token cache)
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "1,2,4,8,16,32,64,128,256"
    )]
    sizes: Vec<usize>,
    /// Repetitions per timing (the median is reported)
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// Decode steps timed per context
    #[arg(long, default_value_t = 32)]
    decode_steps: usize,
    /// Drafter layers (default: the published drafter's, 5 for the dense and 27B shapes
    /// (z-lab Qwen3-8B-DFlash-b16), 8 for the A3B MoE shapes)
    #[arg(long)]
    drafter_layers: Option<usize>,
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// Prefill length
    #[arg(long, default_value_t = 4096)]
    prefill: usize,
    /// Simulated acceptance length (tokens per round, bonus included) for the end-to-end run
    #[arg(long, default_value_t = 6.5)]
    tau: f64,
    /// DDTree budgets for the end-to-end run
    #[arg(long, value_delimiter = ',', default_value = "16,64,256")]
    budgets: Vec<usize>,
    #[arg(long, default_value_t = 1024)]
    e2e_prompt: usize,
    #[arg(long, default_value_t = 192)]
    e2e_tokens: usize,
    /// Which paths to measure: plain (candle ops), fast (fused CUDA kernels), fast_cublas (fused
    /// kernels with every GEMM on cuBLAS), fast_skinny (fused kernels with forwards of up to 64
    /// rows on the skinny tensor-core GEMMs)
    #[arg(long, value_delimiter = ',', default_value = "plain,fast")]
    variants: Vec<String>,
    /// Skip the end-to-end speculative runs
    #[arg(long)]
    no_e2e: bool,
    /// Only the end-to-end runs (no per-forward figures, no kernel checks)
    #[arg(long, conflicts_with = "no_e2e")]
    e2e_only: bool,
    /// Run each end-to-end request a second time with the device waited for between the
    /// round's phases and report that run's per-phase times (`phases`)
    #[arg(long)]
    e2e_profile: bool,
    /// Also run this many requests at once in one engine on a paged pool (plain and chain,
    /// `e2e_batched`; 0: not)
    #[arg(long, default_value_t = 0)]
    e2e_batch: usize,
    /// Skip the end-to-end check that graphs on and off decode the same tokens
    #[arg(long)]
    no_e2e_check: bool,
}

fn parse_device(s: &str) -> Result<Device> {
    let d = match s {
        "cpu" => Device::Cpu,
        "cuda" => Device::new_cuda(0)?,
        other => match other.strip_prefix("cuda:").map(str::parse::<usize>) {
            Some(Ok(i)) => Device::new_cuda(i)?,
            _ => bail!("--device {other}: use cpu, cuda or cuda:N"),
        },
    };
    // As the server opens its device (serve/src/engine/real.rs), so the figures are its.
    #[cfg(feature = "cuda")]
    dflash_models::cuda::keep_freed_memory(&d).map_err(anyhow::Error::msg)?;
    Ok(d)
}

fn parse_dtype(s: &str) -> Result<DType> {
    Ok(match s {
        "bfloat16" | "bf16" => DType::BF16,
        "float16" | "f16" | "half" => DType::F16,
        "float32" | "f32" | "float" => DType::F32,
        other => bail!("--dtype {other}: use bfloat16, float16 or float32"),
    })
}

/// Entry point: `argv` starts with the word `bench`.
pub fn main(argv: Vec<String>) -> Result<()> {
    let args = BenchArgs::parse_from(argv);
    let dev = parse_device(&args.device)?;
    let dtype = parse_dtype(&args.dtype)?;
    let family = family_shapes::resolve(&args.model)?;
    let cfg = match &family {
        Some(_) => None,
        None => Some(shapes::resolve(&args.model)?),
    };
    let bpe = dtype.size_in_bytes() as f64;

    let bw = measure::copy_bandwidth(&dev, if dev.is_cpu() { 1 << 26 } else { 4 << 30 })?;
    let mm = measure::matmul_rate(&dev, if dev.is_cpu() { 512 } else { 8192 }, dtype)?;
    let probes = json!({"copy_bandwidth_GBps": bw / 1e9, "matmul_TFLOPs": mm / 1e12,
        "note": "copy: read+write bytes of a copy into a preallocated buffer (4 GiB on CUDA); matmul: n^3 in the model dtype (n = 8192 on CUDA)"});
    eprintln!("probes {probes}");
    let Some(cfg) = cfg else {
        let family = family.context("a family shape")?;
        let mut report = Map::new();
        report.insert(
            "command".into(),
            json!(std::env::args().collect::<Vec<_>>().join(" ")),
        );
        report.insert("probes".into(), probes);
        report.extend(family::run(&args, &family, &dev, dtype, (bw, mm))?);
        return emit(&args, report);
    };

    let max_ctx = args
        .contexts
        .iter()
        .copied()
        .max()
        .unwrap_or(1024)
        .max(1024)
        // The prefill figure needs rotary positions for its whole prompt.
        .max(args.prefill);
    let t0 = Instant::now();
    let rng = &mut if dev.is_cpu() {
        WeightRng::new(0)
    } else {
        WeightRng::on_device()
    };
    let base = Qwen3Model::random_with(
        cfg.clone(),
        rng,
        dtype,
        &dev,
        max_ctx + 1024,
        OpsMode::Fused,
    )?;
    let mask_id = 151669.min(cfg.vocab_size as u32 - 1);
    let dcfg = DFlashConfig::for_target(
        &cfg,
        args.drafter_layers.unwrap_or(5),
        args.block_size,
        mask_id,
        None,
    );
    let drafter = DFlashDrafter::random_with(dcfg, &base, rng, OpsMode::Fused)?;
    dev.synchronize()?;
    let init_s = t0.elapsed().as_secs_f64();

    let mut report = Map::new();
    report.insert(
        "command".into(),
        json!(std::env::args().collect::<Vec<_>>().join(" ")),
    );
    report.insert(
        "model".into(),
        json!({"shape": args.model, "dtype": format!("{dtype:?}"), "device": args.device,
               "params_per_step": shapes::step_params(&cfg), "init_s": init_s}),
    );
    report.insert("probes".into(), probes);

    let mut plain_decode_1k = None;
    let mut variants = Map::new();
    for v in &args.variants {
        let (fast, gemv_rows) = match v.as_str() {
            "plain" => (false, 0),
            "fast" => (true, dflash_models::cuda::GEMV_DEFAULT_ROWS),
            "fast_cublas" => (true, 0),
            "fast_skinny" => (true, dflash_models::cuda::GEMV_MAX_ROWS),
            other => bail!("--variants {other}: use plain, fast, fast_cublas and/or fast_skinny"),
        };
        if fast && !base.fast_kernels_available() {
            variants.insert(v.clone(), json!({"skipped": "fused kernels need a CUDA device and bf16 (build with --features cuda)"}));
            continue;
        }
        // Step graphs off for the per-forward figures ("plain launches"; the graph figures
        // capture their own), on for the end-to-end runs, as the engine and server use them.
        let m = base
            .clone()
            .with_fast_kernels(fast)
            .with_gemv_rows(gemv_rows)
            .with_step_graphs(false);
        let d = drafter
            .clone()
            .with_fast_kernels(fast)
            .with_gemv_rows(gemv_rows);
        let mut fig = if args.e2e_only {
            Value::Object(Map::new())
        } else {
            figures(&args, &m, &d, bw, mm, bpe)?
        };
        if !args.no_e2e {
            if let Value::Object(f) = &mut fig {
                e2e_figures(&args, &m, &d, f)?;
            }
        }
        if !fast && !args.e2e_only {
            plain_decode_1k = fig["decode"]["ctx_1024"]["ms"].as_f64();
        }
        eprintln!("{v} {fig}");
        variants.insert(v.clone(), fig);
    }
    if let (Some(p), Some(Value::Object(f))) = (plain_decode_1k, variants.get_mut("fast")) {
        if let Some(ms) = f["decode"]["ctx_1024"]["ms"].as_f64() {
            f.insert("decode_speedup_vs_plain_variant".into(), json!(p / ms));
        }
    }
    report.insert("variants".into(), Value::Object(variants));
    if base.fast_kernels_available() && args.variants.iter().any(|v| v == "fast") && !args.e2e_only
    {
        let checks = kernel_checks::kernel_checks(&base, &drafter)?;
        eprintln!("kernel_checks {checks}");
        report.insert("kernel_checks".into(), checks);
    }
    emit(&args, report)
}

/// Prints the report as JSON, and writes it to `--out` when given.
fn emit(args: &BenchArgs, report: Map<String, Value>) -> Result<()> {
    let out = serde_json::to_string_pretty(&Value::Object(report))?;
    if let Some(p) = &args.out {
        std::fs::write(p, &out).with_context(|| format!("--out {}", p.display()))?;
    }
    println!("{out}");
    Ok(())
}

/// Every figure of one variant, with its roofline ratios.
fn figures(
    args: &BenchArgs,
    m: &Qwen3Model,
    drafter: &DFlashDrafter,
    bw: f64,
    mm: f64,
    bpe: f64,
) -> Result<Value> {
    let cfg = m.config().clone();
    let dev = m.device().clone();
    let weights = shapes::step_params(&cfg) * bpe;
    let kv_pos = shapes::kv_bytes_per_position(&cfg, bpe);
    let attn_flops = |n: f64, l: f64| {
        4.0 * (cfg.num_attention_heads * cfg.head_dim * cfg.num_hidden_layers) as f64 * n * l
    };
    let mut out = Map::new();

    // Decode at each context.
    let mut decode = Map::new();
    let mut cache = m.new_cache(
        args.contexts
            .iter()
            .copied()
            .max()
            .unwrap_or(1024)
            .max(1024)
            + 512,
    )?;
    let mut ctxs = args.contexts.clone();
    ctxs.sort_unstable();
    for &c in &ctxs {
        fill_context(m, &mut cache, c)?;
        let ms = decode_ms(m, &mut cache, args.decode_steps)?;
        let roof = (weights + kv_pos * c as f64) / bw * 1e3;
        decode.insert(
            format!("ctx_{c}"),
            json!({"ms": ms, "tok_per_s": 1e3 / ms, "roofline_ms": roof, "fraction_of_roofline": roof / ms}),
        );
        #[cfg(feature = "cuda")]
        if m.fast_kernels() {
            let entry = match measure::decode_graph_ms(m, &mut cache, args.decode_steps) {
                Ok(g) => {
                    json!({"ms": g, "tok_per_s": 1e3 / g, "roofline_ms": roof, "fraction_of_roofline": roof / g, "speedup_vs_no_graph": ms / g})
                }
                Err(e) => json!({"error": format!("{e:#}")}),
            };
            decode.insert(format!("ctx_{c}_cuda_graph"), entry);
        }
    }
    cache.truncate(1024.min(cache.len()))?;
    fill_context(m, &mut cache, 1024)?;
    let decode_1k = match decode.get("ctx_1024").and_then(|d| d["ms"].as_f64()) {
        Some(ms) => ms,
        None => decode_ms(m, &mut cache, args.decode_steps)?,
    };
    let graph_1k = decode
        .get("ctx_1024_cuda_graph")
        .and_then(|d| d["ms"].as_f64());
    // The best plain step this path has: the ratios of drafting and e2e refer to it.
    let best_decode_1k = graph_1k.unwrap_or(decode_1k);
    out.insert("decode".into(), Value::Object(decode));
    #[cfg(feature = "cuda")]
    if m.fast_kernels() && !args.batch_sizes.is_empty() {
        let fig = batched::run(
            m,
            &args.batch_sizes,
            1024,
            args.decode_steps,
            (weights, kv_pos, bw),
        )
        .unwrap_or_else(|e| json!({"error": format!("{e:#}")}));
        out.insert("batched".into(), fig);
    }

    // Forward of n new tokens over the 1K cache, chain and tree.
    for (name, tree) in [("forward_chain", false), ("forward_tree", true)] {
        let mut f = Map::new();
        #[allow(unused_mut)]
        let mut graphs = Map::new();
        for &n in &args.sizes {
            let ms = time_ms(&dev, args.reps, || {
                forward_n(m, &mut cache, n, tree)?;
                Ok(())
            })?;
            let l = 1024.0 + n as f64;
            let mem = (weights + kv_pos * l) / bw * 1e3;
            let comp =
                (2.0 * shapes::step_params(&cfg) * n as f64 + attn_flops(n as f64, l)) / mm * 1e3;
            let roof = mem.max(comp);
            f.insert(
                n.to_string(),
                json!({"ms": ms, "ratio_to_decode_step": ms / decode_1k, "roofline_ms": roof,
                       "bound": if mem >= comp { "memory" } else { "compute" }, "fraction_of_roofline": roof / ms}),
            );
            #[cfg(feature = "cuda")]
            if let Some(g1) = graph_1k {
                let entry = match measure::forward_graph_ms(m, &mut cache, n, tree, args.reps) {
                    Ok((g, _)) => {
                        json!({"ms": g, "ratio_to_decode_step": g / g1, "roofline_ms": roof, "fraction_of_roofline": roof / g})
                    }
                    Err(e) => json!({"error": format!("{e:#}")}),
                };
                graphs.insert(n.to_string(), entry);
            }
        }
        out.insert(name.into(), Value::Object(f));
        if !graphs.is_empty() {
            out.insert(format!("{name}_cuda_graph"), Value::Object(graphs));
        }
    }

    // Drafter block over 1K and 8K of context.
    let dc = drafter.config();
    let dl = dc.layers.num_hidden_layers as f64;
    let dweights = (shapes::layer_params(&dc.layers) * dl
        + (dc.target_layer_ids.len() * dc.layers.hidden_size * dc.layers.hidden_size) as f64)
        * bpe;
    let head = (cfg.vocab_size * cfg.hidden_size) as f64 * bpe;
    let mut dr = Map::new();
    for c in [1024usize, 8192]
        .into_iter()
        .filter(|&c| c <= ctxs.last().copied().unwrap_or(1024))
    {
        let (hid, logits) = drafter_block_ms(drafter, c, args.reps)?;
        #[allow(unused_mut)]
        let mut graph = Value::Null;
        #[cfg(feature = "cuda")]
        if drafter.fast_kernels() {
            graph = match measure::drafter_graph_ms(drafter, c, args.reps) {
                Ok(g) => json!({"hidden_ms": g, "hidden_ratio_to_decode_step": g / best_decode_1k}),
                Err(e) => json!({"error": format!("{e:#}")}),
            };
        }
        let kv = 2.0
            * dl
            * (dc.layers.num_key_value_heads * dc.layers.head_dim) as f64
            * bpe
            * (c + args.block_size) as f64;
        let roof_h = (dweights + kv) / bw * 1e3;
        let roof_l = roof_h + head / bw * 1e3;
        dr.insert(
            format!("ctx_{c}"),
            json!({"block": args.block_size, "hidden_ms": hid, "with_logits_ms": logits,
                   "hidden_ratio_to_decode_step": hid / best_decode_1k, "with_logits_ratio_to_decode_step": logits / best_decode_1k,
                   "hidden_roofline_ms": roof_h, "with_logits_roofline_ms": roof_l,
                   "hidden_fraction_of_roofline": roof_h / hid, "with_logits_fraction_of_roofline": roof_l / logits,
                   "cuda_graph": graph}),
        );
    }
    out.insert("drafter".into(), Value::Object(dr));
    drop(cache);

    // Prefill.
    let n = args.prefill;
    let s = measure::prefill_s(m, n, args.reps.min(3))?;
    let flops =
        2.0 * (shapes::step_params(&cfg) - (cfg.vocab_size * cfg.hidden_size) as f64) * n as f64
            + attn_flops(n as f64, n as f64) / 2.0;
    out.insert(
        format!("prefill_{n}"),
        json!({"s": s, "tok_per_s": n as f64 / s, "TFLOPs": flops / s / 1e12,
               "fraction_of_matmul_rate": flops / s / mm, "note": "FLOPs: 2*params*tokens (LM head on the last row only) + causal attention"}),
    );

    // The same prefill in pieces of each length (the fused path's default is
    // cuda::PREFILL_CHUNK).
    #[cfg(feature = "cuda")]
    if m.fast_kernels() {
        let mut by_chunk = Map::new();
        for chunk in [512usize, 1024, 2048, 4096] {
            let mc = m.clone().with_prefill_chunk(chunk);
            let s = measure::prefill_s(&mc, n, args.reps.min(3))?;
            by_chunk.insert(
                chunk.to_string(),
                json!({"s": s, "tok_per_s": n as f64 / s, "fraction_of_matmul_rate": flops / s / mm}),
            );
        }
        out.insert(format!("prefill_{n}_by_chunk"), Value::Object(by_chunk));
    }
    Ok(Value::Object(out))
}

/// The end-to-end runs of one variant (`m` with step graphs off; the runs turn them on, as
/// the engine and server use them) into `out`.
fn e2e_figures(
    args: &BenchArgs,
    m: &Qwen3Model,
    drafter: &DFlashDrafter,
    out: &mut Map<String, Value>,
) -> Result<()> {
    let target = Target::from(m.clone().with_step_graphs(true));
    let setup = e2e::E2eSetup {
        target: &target,
        drafter,
        prompt_len: args.e2e_prompt,
        new_tokens: args.e2e_tokens,
        tau: args.tau,
        profile: args.e2e_profile,
    };
    out.insert("e2e".into(), e2e::run(&setup, &args.budgets)?);
    if args.e2e_batch > 0 {
        out.insert(
            "e2e_batched".into(),
            e2e_batched::run(&setup, args.e2e_batch)?,
        );
    }
    if m.device().is_cuda() {
        let vocab = m.config().vocab_size;
        out.insert(
            "greedy_select".into(),
            e2e::greedy_select(m.device(), vocab)?,
        );
    }
    if m.fast_kernels() && !args.no_e2e_check {
        let uncaptured = Target::from(m.clone());
        out.insert(
            "e2e_step_graph_check".into(),
            e2e::graph_check(&setup, &uncaptured)?,
        );
    }
    Ok(())
}
