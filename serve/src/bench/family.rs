//! `dflash-serve bench --model qwen3.6-27b | qwen3.6-35b-a3b | qwen3-coder-30b-a3b |
//! qwen3-30b-a3b` (or a hybrid / MoE `config.json`): the non-dense targets with random weights,
//! through the same engine the server runs. Figures: prefill throughput against the measured
//! matmul rate, decode (plain decoding through the engine, per token) against the memory
//! roofline of the bytes a token reads (the routed experts only, for MoE), end-to-end plain,
//! chain and DDTree with a simulated acceptance length (SGLang's SGLANG_SIMULATE_ACC_LEN), and
//! with `--e2e-batch N` N requests in one engine. The per-forward kernel figures of these
//! targets (verify sizes, trees, recurrent-state memory, fused against plain) are
//! `gpu_check --hybrid` and `gpu_check --moe`.

use std::time::Instant;

use anyhow::{Context, Result};
use candle_core::{DType, Device};
use dflash_common::config::default_target_layer_ids;
use dflash_common::{DFlashConfig, LayerType, Qwen3Config, RopeScaling};
use dflash_models::random::WeightRng;
use dflash_models::{
    AttnPattern, DFlashDrafter, OpsMode, Qwen35Model, Qwen3Model, SeqForward, Target,
};
use serde_json::{json, Map, Value};

use super::e2e;
use super::e2e_batched;
use super::family_shapes::{cache_bytes, params, Family, FamilyTarget};
use super::measure::{time_ms, tokens};
use super::BenchArgs;

/// The drafter config for `family` (its published layer shape, `--drafter-layers` layers if
/// given, the target's vocabulary and taps).
fn drafter_config(args: &BenchArgs, family: &Family, target: &Target) -> DFlashConfig {
    let (h, inter, layers, heads, kv) = family.drafter;
    let layers = args.drafter_layers.unwrap_or(layers);
    let vocab = dflash_models::DraftTarget::vocab_size(target);
    let target_layers = dflash_models::DraftTarget::num_layers(target);
    DFlashConfig {
        layers: Qwen3Config {
            vocab_size: vocab,
            hidden_size: h,
            intermediate_size: inter,
            num_hidden_layers: layers,
            num_attention_heads: heads,
            num_key_value_heads: kv,
            head_dim: 128,
            rms_norm_eps: 1e-6,
            rope_theta: 1e7,
            rope_scaling: RopeScaling::Default,
            max_position_embeddings: 262144,
            tie_word_embeddings: false,
            eos_token_ids: Vec::new(),
            bos_token_id: None,
            layer_types: vec![LayerType::FullAttention; layers],
            sliding_window: None,
            moe: None,
        },
        block_size: args.block_size,
        mask_token_id: (vocab - 1) as u32,
        target_layer_ids: default_target_layer_ids(target_layers, layers),
    }
}

/// The whole report of a family target (the probes measured by the caller).
pub fn run(
    args: &BenchArgs,
    family: &Family,
    dev: &Device,
    dtype: DType,
    (bw, mm): (f64, f64),
) -> Result<Map<String, Value>> {
    let max_positions = args
        .prefill
        .max(args.e2e_prompt + args.e2e_tokens)
        .max(1024)
        + 1024;
    let rng = &mut if dev.is_cpu() {
        WeightRng::new(0)
    } else {
        WeightRng::on_device()
    };
    let t0 = Instant::now();
    let target: Target = match &family.target {
        FamilyTarget::Hybrid(c) => {
            Qwen35Model::random(c.clone(), rng, dtype, dev, max_positions, OpsMode::Fused)?.into()
        }
        FamilyTarget::Moe(c) => {
            Qwen3Model::random_with(c.clone(), rng, dtype, dev, max_positions, OpsMode::Fused)?
                .into()
        }
    };
    let drafter = DFlashDrafter::random_with(
        drafter_config(args, family, &target),
        &target,
        rng,
        OpsMode::Fused,
    )?;
    dev.synchronize()?;
    let init_s = t0.elapsed().as_secs_f64();
    let elem = dtype.size_in_bytes() as f64;
    let (total, active) = params(&family.target);
    let (kv_per_pos, state) = cache_bytes(&family.target, elem);
    let mut out = Map::new();
    let (family_name, moe) = match &family.target {
        FamilyTarget::Hybrid(c) => ("hybrid (Gated DeltaNet + gated attention)", c.moe.is_some()),
        FamilyTarget::Moe(_) => ("qwen3_moe", true),
    };
    out.insert(
        "model".into(),
        json!({"shape": args.model, "family": family_name, "moe": moe,
               "dtype": format!("{dtype:?}"), "device": args.device,
               "params_B": total / 1e9, "active_params_per_token_B": active / 1e9,
               "drafter": {"layers": drafter.config().layers.num_hidden_layers,
                           "hidden": family.drafter.0, "taps": drafter.config().target_layer_ids},
               "init_s": init_s}),
    );

    let n = args.prefill;
    let prefill_s = prefill_seconds(&target, n, args.reps.min(3))?;
    // 2 FLOPs per active weight per token, plus the causal attention of the full layers.
    let full_layers = match &family.target {
        FamilyTarget::Hybrid(c) => (c.num_hidden_layers - c.num_linear_layers()) as f64,
        FamilyTarget::Moe(c) => c.num_hidden_layers as f64,
    };
    let q_width = match &family.target {
        FamilyTarget::Hybrid(c) => (c.num_attention_heads * c.head_dim) as f64,
        FamilyTarget::Moe(c) => (c.num_attention_heads * c.head_dim) as f64,
    };
    let flops = 2.0 * active * n as f64 + 2.0 * full_layers * q_width * (n as f64).powi(2);
    out.insert(
        format!("prefill_{n}"),
        json!({"seconds": prefill_s, "tok_per_s": n as f64 / prefill_s,
               "TFLOPs": flops / prefill_s / 1e12, "fraction_of_matmul_rate": flops / prefill_s / mm}),
    );
    #[cfg(feature = "cuda")]
    if dev.is_cuda() {
        // Where the prefill's time goes: one more prefill with the plain forward's phases
        // marked on the GPU timeline (`cuda::phases`), summed per phase over the layers.
        let started = Instant::now();
        dflash_models::cuda::phases::start();
        let run = prefill_once(&target, n);
        let spans = dflash_models::cuda::phases::finish();
        let seconds = started.elapsed().as_secs_f64();
        let (_, spans) = (run?, spans?);
        let mut phases = Map::new();
        for (label, ms, count) in spans {
            phases.insert(label.into(), json!({"ms": ms, "count": count}));
        }
        out.insert(
            format!("prefill_{n}_phases"),
            json!({"seconds": seconds, "phases": phases,
                   "note": "one more prefill with CUDA events at each phase of the plain forward (the hybrids' marks in models/src/qwen3_5, the dense-attention MoE family's in models/src/cuda/decoder_stack.rs and moe_grouped.rs): ms from each mark to the next, summed over layers"}),
        );
    }

    let target_g = target.clone();
    let setup = e2e::E2eSetup {
        target: &target_g,
        drafter: &drafter,
        prompt_len: args.e2e_prompt,
        new_tokens: args.e2e_tokens,
        tau: args.tau,
        profile: args.e2e_profile,
    };
    let e2e_fig = e2e::run(&setup, &args.budgets)?;
    // Plain decoding through the engine: its warm per-token time against the bytes a token
    // reads (weights of the routed experts only, the K/V at the mean context, the recurrent
    // state read and written).
    let ctx = args.e2e_prompt as f64 + args.e2e_tokens as f64 / 2.0;
    let bytes = active * elem + kv_per_pos * ctx + 2.0 * state;
    let roof = bytes / bw * 1e3;
    if let Some(tps) = e2e_fig["plain"]["warm_tok_per_s"].as_f64() {
        let ms = 1e3 / tps;
        out.insert(
            "decode_through_engine".into(),
            json!({"ms_per_token": ms, "roofline_ms": roof, "fraction_of_roofline": roof / ms,
                   "bytes_GB": bytes / 1e9, "mean_context": ctx,
                   "step_graphs": target.step_graphs_on(),
                   "note": "plain greedy decoding of the e2e request (warm engine, host work and read-back included)"}),
        );
    }
    out.insert("e2e".into(), e2e_fig);
    if matches!(family.target, FamilyTarget::Hybrid(_)) && target.fast_kernels() {
        // The hybrid's decode graphs against the eager fused step, same weights and request:
        // decode_through_engine ran the default, this the other setting; greedy tokens must be
        // identical both ways.
        let on = target.step_graphs_on();
        let other = target.clone().with_step_graphs(!on);
        let other_setup = e2e::E2eSetup {
            target: &other,
            ..setup
        };
        // Recorded, not fatal: the figures above still come back if the other setting fails.
        let fig = match e2e::plain_warm_tok_per_s(&other_setup) {
            Ok(tps) => json!({"ms_per_token": 1e3 / tps, "fraction_of_roofline": roof * tps / 1e3,
                   "note": "decode_through_engine's request with the hybrid decode graphs switched the other way"}),
            Err(e) => json!({"error": format!("{e:#}")}),
        };
        out.insert(
            format!("decode_step_graphs_{}", if on { "off" } else { "on" }),
            fig,
        );
        if !args.no_e2e_check {
            let (with, without) = if on {
                (&setup, &other)
            } else {
                (&other_setup, &target_g)
            };
            let check = e2e::graph_check(with, without)
                .unwrap_or_else(|e| json!({"error": format!("{e:#}")}));
            out.insert("e2e_step_graph_check".into(), check);
        }
    }
    if args.e2e_batch > 0 {
        out.insert(
            "e2e_batched".into(),
            e2e_batched::run(&setup, args.e2e_batch)?,
        );
    }
    if !args.e2e_only {
        // Recorded, not fatal: the figures above still come back if a fused kernel fails.
        let checks = kernel_checks(&target).unwrap_or_else(|e| json!({"error": format!("{e:#}")}));
        eprintln!("kernel_checks {checks}");
        out.insert("kernel_checks".into(), checks);
    }
    Ok(out)
}

/// The fused forwards against the plain candle path on the same weights (CUDA; the CPU has
/// only the plain path): the last prompt row of a 1000-token prefill (not a multiple of the
/// GDN scan's 16-token tiles), then 1 and 16 new tokens over it (a decode step and a chain
/// verify, rolled back after each, so they also check the state the prefill left): max abs
/// logit difference and argmax agreement per forward.
fn kernel_checks(target: &Target) -> Result<Value> {
    let fused = target.clone().with_fast_kernels(true);
    if !fused.fast_kernels() {
        return Ok(json!({"skipped": "the fused kernels need a CUDA device and bf16"}));
    }
    let plain = target.clone().with_fast_kernels(false);
    let vocab = dflash_models::DraftTarget::vocab_size(target);
    const PROMPT: usize = 1000;
    let prompt = tokens(PROMPT, 21, vocab);
    let run = |m: &Target| -> Result<Vec<candle_core::Tensor>> {
        let mut cache = m.new_cache(PROMPT + 64, 16)?;
        let mut out = Vec::new();
        let step = |cache: &mut dflash_models::SequenceCache,
                    toks: &[u32],
                    start: usize,
                    rows: &[usize]| {
            let pos: Vec<u32> = (start as u32..(start + toks.len()) as u32).collect();
            m.forward(
                &mut [SeqForward {
                    cache,
                    tokens: toks,
                    positions: &pos,
                    pattern: &AttnPattern::Causal,
                    logit_rows: rows,
                }],
                &[],
            )?
            .logits
            .context("no logits")
        };
        out.push(step(&mut cache, &prompt, 0, &[PROMPT - 1])?);
        for n in [1usize, 16] {
            let toks = tokens(n, 23, vocab);
            let rows: Vec<usize> = (0..n).collect();
            out.push(step(&mut cache, &toks, PROMPT, &rows)?);
            cache.truncate(PROMPT)?;
        }
        Ok(out)
    };
    let (a, b) = (run(&fused)?, run(&plain)?);
    let mut res = Map::new();
    for (name, (x, y)) in ["prefill_1000_last_row", "decode_1", "verify_chain_16"]
        .iter()
        .zip(a.iter().zip(&b))
    {
        let (x, y) = (x.to_dtype(DType::F32)?, y.to_dtype(DType::F32)?);
        let diff = (&x - &y)?
            .abs()?
            .flatten_all()?
            .max(0)?
            .to_scalar::<f32>()?;
        let scale = y.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
        let (am, bm) = (
            x.argmax(1)?.to_vec1::<u32>()?,
            y.argmax(1)?.to_vec1::<u32>()?,
        );
        let same = am.iter().zip(&bm).filter(|(p, q)| p == q).count();
        res.insert(
            (*name).into(),
            json!({"max_abs_logit_diff": diff, "max_abs_logit_plain": scale,
                   "argmax_equal_rows": same, "rows": am.len()}),
        );
    }
    // The varlen attention the fused prefill's gated-attention layers take, alone.
    #[cfg(feature = "cuda")]
    {
        let mut attn = Vec::new();
        dflash_models::cuda::check::varlen_attention_errors(
            dflash_models::DraftTarget::device(target),
            &mut attn,
        )?;
        for (name, err, scale) in attn {
            res.insert(name, json!({"max_abs_diff": err, "max_abs_plain": scale}));
        }
        // The chunked delta rule a long hybrid prefill may take, against the scan.
        if matches!(target, Target::Hybrid(_)) {
            let dev = dflash_models::DraftTarget::device(target);
            res.extend(dflash_models::cuda::check::gdn_chunked_report(dev)?);
        }
    }
    Ok(Value::Object(res))
}

/// Seconds for one prefill of `n` tokens into a fresh cache (median of `reps`).
fn prefill_seconds(target: &Target, n: usize, reps: usize) -> Result<f64> {
    let dev = dflash_models::DraftTarget::device(target).clone();
    let ms = time_ms(&dev, reps.max(1), || prefill_once(target, n))?;
    Ok(ms / 1e3)
}

/// One prefill of `n` tokens into a fresh cache (the last row's logits).
fn prefill_once(target: &Target, n: usize) -> Result<()> {
    let vocab = dflash_models::DraftTarget::vocab_size(target);
    let toks = tokens(n, 3, vocab);
    let pos: Vec<u32> = (0..n as u32).collect();
    let mut cache = target.new_cache(n + 8, 0)?;
    target
        .forward(
            &mut [SeqForward {
                cache: &mut cache,
                tokens: &toks,
                positions: &pos,
                pattern: &AttnPattern::Causal,
                logit_rows: &[n - 1],
            }],
            &[],
        )?
        .logits
        .context("prefill returned no logits")?;
    Ok(())
}
