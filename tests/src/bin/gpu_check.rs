//! GPU check (not a CI test: CI has no GPU). On the chosen device it
//! 1. re-runs the parity fixtures in f32 and bf16 and reports the max errors;
//! 2. decodes tiny-coder-demo greedily (plain and DDTree with the oracle) in both dtypes and
//!    counts prompts that reproduce transformers' fp32 tokens;
//! The Qwen3-8B-shaped speed figures that used to live here moved to `dflash-serve bench`
//! (serve/src/bench/, deploy/bench/README.md), which also checks the fused CUDA kernels.
//!
//! Usage: gpu-check [cuda|cpu] [out.json] [--hybrid | --pooled | --train | --scale | --moe |
//! --trainer-optimizer | --train-explicit | --data-parallel | --gdn-chunk]
//!
//! With `--data-parallel` (CUDA builds) it checks NCCL (`nccl` builds) and the trainer's
//! data-parallel replicas on the visible GPUs (`gpu_check/data_parallel.rs`).
//!
//! With `--scale` (CUDA builds) it runs only the checks and timings of steps at scale
//! (`gpu_check/scale.rs`): prefill pieces over long contexts, the 17..64-row skinny GEMMs
//! against cuBLAS, batched decode and mixed steps of a random Qwen3-8B.
//!
//! With `--pooled` it runs only the paged-pool checks (`gpu_check/pooled.rs`).
//!
//! With `--moe` (CUDA builds) it runs only the sparse-MoE checks and the
//! Qwen3-Coder-30B-A3B-shaped benchmark (`gpu_check/moe.rs`, `gpu_check/moe_forward.rs`;
//! `--moe-layers=N` benches N layers instead of 48).
//!
//! With `--train` it runs only the training engine's checks (`gpu_check/train.rs`): fused
//! linear + cross-entropy and the flat AdamW against the trainer's candle path
//! (`gpu_check/train.rs`), the DFlash attention forward (`gpu_check/train_attn.rs`) and its
//! backward: a gradient check and a trainer step, fused vs composed
//! (`gpu_check/train_attn_bwd.rs`); the fused RMSNorm, q/k-norm + RoPE and SiLU-gate ops and
//! their gradients against the compositions (`gpu_check/train_ops.rs`); and the trainer's
//! packed target forward against the full forward (`gpu_check/train_taps.rs`); last, the
//! trainer with the fused AdamW: resume exactness, a NaN-gradient skip and the optimizer step
//! against the reference (`gpu_check/train_optim.rs`; alone, on any device, with
//! `--trainer-optimizer`).
//!
//! With `--hybrid` it runs only the hybrid-target checks and the Qwen3.6-27B-shaped benchmark
//! (see `gpu_check/hybrid.rs`).

#[cfg(feature = "cuda")]
#[path = "gpu_check/data_parallel.rs"]
mod data_parallel;
#[path = "gpu_check/hybrid.rs"]
mod hybrid;
#[path = "gpu_check/hybrid_attn.rs"]
mod hybrid_attn;
#[path = "gpu_check/hybrid_fused.rs"]
mod hybrid_fused;
#[cfg(feature = "cuda")]
#[path = "gpu_check/hybrid_gdn.rs"]
mod hybrid_gdn;
#[cfg(feature = "cuda")]
#[path = "gpu_check/hybrid_graph.rs"]
mod hybrid_graph;
#[cfg(feature = "cuda")]
#[path = "gpu_check/hybrid_lt.rs"]
mod hybrid_lt;
#[path = "gpu_check/hybrid_noise.rs"]
mod hybrid_noise;
#[cfg(feature = "cuda")]
#[path = "gpu_check/hybrid_paths.rs"]
mod hybrid_paths;
#[cfg(feature = "cuda")]
#[path = "gpu_check/moe.rs"]
mod moe;
#[cfg(feature = "cuda")]
#[path = "gpu_check/moe_forward.rs"]
mod moe_forward;
#[path = "gpu_check/pooled.rs"]
mod pooled;
#[path = "gpu_check/pooled_draft.rs"]
mod pooled_draft;
#[cfg(feature = "cuda")]
#[path = "gpu_check/scale.rs"]
mod scale;
#[cfg(feature = "cuda")]
#[path = "gpu_check/scale_attn.rs"]
mod scale_attn;
#[path = "gpu_check/train.rs"]
mod train;
#[path = "gpu_check/train_attn.rs"]
mod train_attn;
#[path = "gpu_check/train_attn_bwd.rs"]
mod train_attn_bwd;
#[path = "gpu_check/train_explicit.rs"]
mod train_explicit;
#[path = "gpu_check/train_ops.rs"]
mod train_ops;
#[path = "gpu_check/train_optim.rs"]
mod train_optim;
#[path = "gpu_check/train_taps.rs"]
mod train_taps;

use anyhow::{Context, Result};

use candle_core::{DType, Device};
use dflash_models::speculative::{
    Algorithm, Engine, EngineConfig, GenerationRequest, OracleProposer, SamplingParams,
};
use dflash_models::{AttnPattern, DFlashDrafter, DraftInput, OpsMode, Qwen3Model, SeqForward};
use dflash_tests::{demo_model, fixture, greedy_cases, ids, load_expected, max_abs_diff};
use serde_json::{json, Value};

fn parity(dev: &Device, dtype: DType) -> Result<Value> {
    let target = Qwen3Model::load(
        &fixture("qwen3-tiny-random"),
        dtype,
        dev,
        64,
        OpsMode::Fused,
    )?;
    let exp = load_expected("qwen3-tiny-random");
    let tokens = ids(&exp["input_ids"]);
    let pos: Vec<u32> = (0..12).collect();
    let rows: Vec<usize> = (0..12).collect();
    let mut cache = target.new_cache(64)?;
    let out = target.forward(
        &mut [SeqForward {
            cache: &mut cache,
            tokens: &tokens,
            positions: &pos,
            pattern: &AttnPattern::Causal,
            logit_rows: &rows,
        }],
        &[0, 1],
    )?;
    let logits_err = max_abs_diff(&out.logits.context("logits")?, &exp["logits"].squeeze(0)?);
    let taps = out.taps.context("taps")?;
    let lo = &exp["layer_outputs"];
    let taps_err = max_abs_diff(&taps.narrow(1, 0, 64)?, &lo.get(0)?.squeeze(0)?).max(
        max_abs_diff(&taps.narrow(1, 64, 64)?, &lo.get(1)?.squeeze(0)?),
    );
    let drafter = DFlashDrafter::load(&fixture("dflash-tiny-random"), &target, OpsMode::Fused)?;
    let dexp = load_expected("dflash-tiny-random");
    let mut dcache = drafter.new_cache(64)?;
    let th = dexp["target_hidden"].squeeze(0)?.to_device(dev)?;
    let block = ids(&dexp["block_input_ids"]);
    let hidden = drafter.forward(&mut [DraftInput {
        cache: &mut dcache,
        context: Some(&th),
        block: &block,
    }])?;
    let draft_err = max_abs_diff(&drafter.lm_head(&hidden)?, &dexp["logits"].squeeze(0)?);
    Ok(
        json!({"dtype": format!("{dtype:?}"), "target_logits_max_abs_err": logits_err, "target_taps_max_abs_err": taps_err, "drafter_logits_max_abs_err": draft_err}),
    )
}

fn greedy(dev: &Device, dtype: DType) -> Result<Value> {
    let target = Qwen3Model::load(&demo_model(), dtype, dev, 1024, OpsMode::Fused)?;
    let cfg = EngineConfig {
        max_context: 512,
        max_ddtree_budget: 256,
        eos_token_ids: vec![8188, 8186],
        seed: 0,
    };
    let mut plain = Engine::new(target.clone(), None, cfg.clone());
    let mut tree = Engine::new(
        target.clone(),
        Some(Box::new(OracleProposer::new(
            target.clone(),
            15,
            Some(dflash_models::speculative::Noise {
                corrupt_prob: 0.3,
                seed: 3,
            }),
        ))),
        cfg,
    );
    let (mut exact, mut spec_same, mut first_div) = (0, 0, Vec::new());
    for c in greedy_cases("tiny-coder-demo") {
        let req = |algorithm| GenerationRequest {
            prompt: c.input_ids.clone(),
            max_new_tokens: 48,
            sampling: SamplingParams::greedy(),
            stop_token_ids: vec![],
            ignore_eos: false,
            algorithm,
        };
        let (p, _) = plain.generate(req(Algorithm::Plain))?;
        let (t, _) = tree.generate(req(Algorithm::DDTree { budget: 64 }))?;
        if p == c.output_ids {
            exact += 1;
        }
        if t == p {
            spec_same += 1;
        }
        first_div.push(
            p.iter()
                .zip(&c.output_ids)
                .position(|(a, b)| a != b)
                .unwrap_or(48),
        );
    }
    Ok(
        json!({"dtype": format!("{dtype:?}"), "prompts": 10, "plain_equal_to_transformers_fp32": exact, "ddtree64_equal_to_plain": spec_same, "first_divergence_from_fp32": first_div}),
    )
}

/// Median wall time of `reps` runs of `f` (the probe `dflash-serve bench` uses too).
pub(crate) fn time_ms(dev: &Device, reps: usize, f: impl FnMut() -> Result<()>) -> Result<f64> {
    dflash_models::probe::time_ms(dev, reps, f)
}

/// Copy bandwidth, read + write bytes per second, of a 4 GiB device-to-device copy: the driver
/// memcpy probe `dflash-serve bench` reports (candle's `slice_set` undercounts it about 4x).
fn copy_bandwidth(dev: &Device) -> Result<f64> {
    Ok(dflash_models::probe::copy_bandwidth(dev, 4 << 30)?)
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let dev = match args.get(1).map(String::as_str) {
        Some("cpu") => Device::Cpu,
        _ => Device::new_cuda(0)?,
    };
    let mut report = serde_json::Map::new();
    if args.iter().any(|a| a == "--trainer-optimizer") {
        let out = json!({ "trainer_optimizer": train_optim::run(&dev)? }).to_string();
        println!("{out}");
        return Ok(());
    }
    // --train-explicit: the explicit training engine against autograd, and both engines' time
    // at the tiny and 8B recipes' drafter shapes (gpu_check/train_explicit.rs).
    if args.iter().any(|a| a == "--train-explicit") {
        let out = json!({ "train_explicit": train_explicit::run(&dev)? }).to_string();
        if let Some(path) = args.get(2).filter(|a| !a.starts_with("--")) {
            std::fs::write(path, &out)?;
        }
        println!("{out}");
        return Ok(());
    }
    if args.iter().any(|a| a == "--train") {
        let t = train::run(&dev)?;
        // The target part runs the trainer's batch shape: GPU sized (the CPU test is
        // tests/tests/taps_forward.rs).
        let (ops, a, g, taps) = if dev.is_cuda() {
            (
                train_ops::run(&dev)?,
                train_attn::run(&dev)?,
                train_attn_bwd::run(&dev)?,
                train_taps::run(&dev)?,
            )
        } else {
            let cuda_only = json!("the fused training kernels are CUDA only");
            (
                cuda_only.clone(),
                cuda_only.clone(),
                cuda_only.clone(),
                cuda_only,
            )
        };
        // Last: the trainer opens its own device, whose pool keeps what it frees.
        let optim = train_optim::run(&dev)?;
        let out = json!({ "train": t, "fused_ops": ops, "attention": a,
                          "attention_backward": g, "target_taps": taps,
                          "trainer_optimizer": optim })
        .to_string();
        if let Some(path) = args.get(2).filter(|a| !a.starts_with("--")) {
            std::fs::write(path, &out)?;
        }
        println!("{out}");
        return Ok(());
    }
    // --data-parallel: NCCL and the trainer's data-parallel replicas on the visible GPUs
    // (gpu_check/data_parallel.rs).
    #[cfg(feature = "cuda")]
    if args.iter().any(|a| a == "--data-parallel") {
        let p = data_parallel::run()?;
        if let Some(path) = args.get(2).filter(|a| !a.starts_with("--")) {
            std::fs::write(path, p.to_string())?;
        }
        let failed: Vec<&String> = p
            .as_object()
            .into_iter()
            .flatten()
            .filter(|(_, v)| v["pass"] == json!(false))
            .map(|(k, _)| k)
            .collect();
        anyhow::ensure!(failed.is_empty(), "data-parallel checks failed: {failed:?}");
        return Ok(());
    }
    #[cfg(feature = "cuda")]
    if args.iter().any(|a| a == "--scale") {
        let bw = copy_bandwidth(&dev)?;
        println!("scale copy bandwidth {:.1} GB/s", bw / 1e9);
        // --attn-only: the batched decode attention's checks and timings and the batched
        // decode steps with each of its variants.
        if args.iter().any(|a| a == "--attn-only") {
            let mut p = scale_attn::run(&dev, bw)?;
            if let Value::Object(m) = &mut p {
                m.insert("copy_bandwidth_GBps".into(), json!(bw / 1e9));
            }
            let out = json!({ "scale": p }).to_string();
            if let Some(path) = args.get(2).filter(|a| !a.starts_with("--")) {
                std::fs::write(path, &out)?;
            }
            return scale_attn::verdict(&p);
        }
        // --gemm-only: the GEMM checks and timings and the batched decode steps, without the
        // prefill-piece attention and the mixed steps.
        let mut p = scale::run(&dev, args.iter().any(|a| a == "--gemm-only"))?;
        if let Value::Object(m) = &mut p {
            m.insert("copy_bandwidth_GBps".into(), json!(bw / 1e9));
        }
        let out = json!({ "scale": p }).to_string();
        if let Some(path) = args.get(2).filter(|a| !a.starts_with("--")) {
            std::fs::write(path, &out)?;
        }
        return Ok(());
    }
    // --moe: the device sparse-MoE block and a qwen3_moe target's fused path against the
    // plain ones, then the Qwen3-Coder-30B-A3B-shaped benchmark (gpu_check/moe*.rs). Each
    // part records its error instead of ending the run.
    #[cfg(feature = "cuda")]
    if args.iter().any(|a| a == "--moe") {
        let out_path = args.get(2).filter(|a| !a.starts_with("--")).cloned();
        let save = |report: &serde_json::Map<String, Value>| -> Result<()> {
            if let Some(path) = &out_path {
                std::fs::write(path, Value::Object(report.clone()).to_string())?;
            }
            Ok(())
        };
        let or_err = |r: Result<Value>| r.unwrap_or_else(|e| json!({"error": format!("{e:#}")}));
        let b = or_err(moe::router_route_check(&dev));
        println!("moe router_route {b}");
        report.insert("moe_router_route".into(), b);
        save(&report)?;
        let b = or_err(moe::block_check(&dev));
        println!("moe block {b}");
        report.insert("moe_block".into(), b);
        save(&report)?;
        let b = or_err(moe::hybrid_block_check(&dev));
        println!("moe hybrid block {b}");
        report.insert("moe_hybrid_block".into(), b);
        save(&report)?;
        let f = or_err(moe_forward::forward_check(&dev));
        println!("moe forward {f}");
        report.insert("moe_target_fused_vs_plain_4_layers".into(), f);
        save(&report)?;
        let bw = copy_bandwidth(&dev)?;
        let layers = args
            .iter()
            .find_map(|a| a.strip_prefix("--moe-layers="))
            .map_or(Ok(48), str::parse)?;
        let b = or_err(moe_forward::bench(&dev, bw, layers));
        println!("moe bench {b}");
        report.insert("qwen3_coder_30b_a3b_shape_bench".into(), b);
        save(&report)?;
        return Ok(());
    }
    // --gdn-chunk: only the chunked delta rule against the scan (errors and ms per case), the
    // quick run to profile the two kernels with ncu.
    #[cfg(feature = "cuda")]
    if args.iter().any(|a| a == "--gdn-chunk") {
        let cases = dflash_models::cuda::check::gdn_chunked_report(&dev)?;
        let out = json!({ "gdn_chunked": cases }).to_string();
        if let Some(path) = args.get(2).filter(|a| !a.starts_with("--")) {
            std::fs::write(path, &out)?;
        }
        println!("{out}");
        return Ok(());
    }
    if args.iter().any(|a| a == "--pooled") {
        let p = pooled::run(&dev)?;
        let out = json!({ "pooled": p }).to_string();
        if let Some(path) = args.get(2).filter(|a| !a.starts_with("--")) {
            std::fs::write(path, &out)?;
        }
        println!("{out}");
        return Ok(());
    }
    if args.iter().any(|a| a == "--hybrid") {
        for dtype in [DType::F32, DType::BF16] {
            let p = hybrid::parity(&dev, dtype)?;
            println!("hybrid parity {p}");
            report.insert(format!("hybrid_parity_{dtype:?}"), p);
        }
        // On the CPU a scaled-down shape only checks that the benchmark runs.
        let (cfg, key) = if dev.is_cpu() {
            (hybrid::small_for_cpu()?, "hybrid_small_shape_bf16_cpu")
        } else {
            (hybrid::qwen36_27b()?, "qwen3_6_27b_shape_bf16")
        };
        // (No 8 GiB copy probe on the CPU: its roofline figures are meaningless there anyway.)
        let bw = if dev.is_cpu() {
            f64::NAN
        } else {
            copy_bandwidth(&dev)?
        };
        let b = hybrid::bench(&dev, bw, cfg)?;
        println!("hybrid bench {b}");
        report.insert(key.into(), b);
        let out = Value::Object(report).to_string();
        if let Some(path) = args.get(2).filter(|a| !a.starts_with("--")) {
            std::fs::write(path, &out)?;
        }
        println!("{out}");
        return Ok(());
    }
    for dtype in [DType::F32, DType::BF16] {
        let p = parity(&dev, dtype)?;
        println!("parity {p}");
        report.insert(format!("parity_{dtype:?}"), p);
        let g = greedy(&dev, dtype)?;
        println!("greedy {g}");
        report.insert(format!("greedy_{dtype:?}"), g);
    }
    let out = Value::Object(report).to_string();
    if let Some(path) = args.get(2) {
        std::fs::write(path, &out)?;
    }
    println!("{out}");
    Ok(())
}
