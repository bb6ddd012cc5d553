//! `gpu_check cuda out.json --scale --attn-only`: the batched decode attention (B sequences
//! in one launch through their page tables) alone, its kernel variants and target block
//! counts checked against one launch per sequence and timed (K/V GB/s), then the batched
//! decode steps `decode_b{16,32,64}_ctx640_graph` with each variant and their fraction of the
//! memory roofline (weights + K/V at the measured copy bandwidth).

use anyhow::{bail, Result};
use candle_core::{DType, Device};
use dflash_models::cuda::check_attn_batch;
use dflash_models::cuda::{
    set_batch_launch, BatchKernel, BATCH_SPLIT_BLOCKS, DEFAULT_BATCH_LAUNCH,
};
use dflash_models::random::WeightRng;
use dflash_models::{OpsMode, Qwen3Model, SequenceCache};
use serde_json::{json, Map, Value};

use crate::scale::{fill, qwen3_8b, step_logits, time_step};

/// Worst relative error a variant may show against one launch per sequence (bf16 output,
/// f32 partials merged in another order), and the least the wrong-sequence case must show.
const MAX_REL: f32 = 2e-2;
const MIN_WRONG_REL: f32 = 0.2;

/// Bytes a decode step of `b` sequences at `ctx` positions must read: every weight but the
/// embedding (one row each) and every layer's K/V.
fn step_bytes(b: usize, ctx: usize) -> f64 {
    let c = qwen3_8b(ctx);
    let (h, i, l) = (c.hidden_size, c.intermediate_size, c.num_hidden_layers);
    let q = c.num_attention_heads * c.head_dim;
    let kv = c.num_key_value_heads * c.head_dim;
    let per_layer = h * (q + 2 * kv) + q * h + 3 * h * i;
    let weights = (l * per_layer + c.vocab_size * h) as f64 * 2.0;
    weights + (b * l * ctx * kv * 2) as f64 * 2.0
}

pub fn run(dev: &Device, bw_bytes_per_s: f64) -> Result<Value> {
    let mut out = Map::new();
    let mut failed = Vec::new();
    for (name, e, s) in check_attn_batch::batch_attention_errors(dev)? {
        let rel = e / s.max(1e-30);
        let bad = if name.ends_with(":wrong_sequence") {
            rel < MIN_WRONG_REL
        } else if name.ends_with(":wrong_cache") {
            rel == 0.0
        } else if name.ends_with(":repeat") || name.ends_with(":cache") {
            rel != 0.0
        } else {
            rel > MAX_REL
        };
        println!(
            "scale {name}: rel err {rel:.3e}{}",
            if bad { " FAIL" } else { "" }
        );
        if bad {
            failed.push(name.clone());
        }
        out.insert(
            name,
            json!({"max_abs_err": e, "max_abs_ref": s, "rel": rel, "ok": !bad}),
        );
    }
    for (case, variant, us, gbps) in check_attn_batch::batch_attention_timings(dev)? {
        println!("scale batch attn {case} {variant}: {us:.1} us/launch, {gbps:.0} GB/s");
        out.insert(
            format!("batch_attn_{case}_{variant}"),
            json!({"us": us, "GBps": gbps}),
        );
    }
    let m = Qwen3Model::random_with(
        qwen3_8b(8192),
        &mut WeightRng::on_device(),
        DType::BF16,
        dev,
        8192,
        OpsMode::Fused,
    )?;
    let pool = m.new_kv_pool(64 * 12 + 8)?;
    let ctx = 640usize;
    let mut caches = (0..64)
        .map(|_| m.new_cache_in(&pool, ctx + 64))
        .collect::<Result<Vec<_>, _>>()?;
    for (i, c) in caches.iter_mut().enumerate() {
        fill(&m, c, ctx, i as u32)?;
    }
    for (name, rel, bad) in graph_checks(&m, &mut caches, ctx)? {
        println!(
            "scale {name}: rel err {rel:.3e}{}",
            if bad { " FAIL" } else { "" }
        );
        if bad {
            failed.push(name.clone());
        }
        out.insert(name, json!({"rel": rel, "ok": !bad}));
    }
    for b in [16usize, 32, 64] {
        let roof_ms = step_bytes(b, ctx) / bw_bytes_per_s * 1e3;
        let mut refs: Vec<&mut SequenceCache> = caches.iter_mut().take(b).collect();
        let ones = vec![1usize; b];
        let mut row = Map::new();
        for v in check_attn_batch::variants() {
            // A model of its own graph cache per variant: graphs keep the launch captured.
            let graphs = m.clone().with_tuned_rows(0).with_step_graphs(true);
            set_batch_launch(v.0, v.1)?;
            let ms = time_step(&graphs, &mut refs, &ones, 20);
            set_batch_launch(DEFAULT_BATCH_LAUNCH.0, DEFAULT_BATCH_LAUNCH.1)?;
            let ms = ms?;
            let name = check_attn_batch::variant_name(v);
            println!(
                "scale decode b{b} ctx{ctx} graph {name}: {ms:.3} ms, roofline {roof_ms:.3} ms, fraction {:.3}",
                roof_ms / ms
            );
            row.insert(
                name,
                json!({"ms": ms, "fraction_of_roofline": roof_ms / ms}),
            );
        }
        row.insert("roofline_ms".into(), json!(roof_ms));
        out.insert(format!("decode_b{b}_ctx{ctx}_graph"), Value::Object(row));
    }
    out.insert("failed_checks".into(), json!(failed));
    Ok(Value::Object(out))
}

/// The batched decode graph with each step-kernel variant against eager steps, 24 sequences
/// (a graph of 32: 8 padding sequences): `(name, relative error, failed)`. The graph is
/// captured on caches 24..48 at lengths 637 down to 384 and replayed on caches 0..24 (other
/// page tables) at 390 up to 597. `:not_replayed` 1 (failed) when that step did not come from
/// a graph; `:graph_vs_eager` the replay against an eager step of the same kernel on the same
/// caches, 0 required (the graph reads lengths and page tables from its buffers);
/// `:wrong_lengths` the replay against the eager step on the capture's caches, which must
/// differ (the check can fail); `:vs_base` the eager step against the eager step of the
/// general kernel (`base` at `BATCH_SPLIT_BLOCKS`: reported, not gated: bf16 roundings of the
/// attention carried through 36 random layers). The caches are refilled to `ctx` after.
fn graph_checks(
    m: &Qwen3Model,
    caches: &mut [SequenceCache],
    ctx: usize,
) -> Result<Vec<(String, f32, bool)>> {
    let n = 24usize;
    let (replay_set, capture_set) = caches.split_at_mut(n);
    for (i, c) in replay_set.iter_mut().enumerate() {
        c.truncate(ctx - 250 + 9 * i)?;
    }
    for (i, c) in capture_set.iter_mut().take(n).enumerate() {
        c.truncate(ctx - 3 - 11 * i)?;
    }
    let mut replay: Vec<&mut SequenceCache> = replay_set.iter_mut().collect();
    let mut capture: Vec<&mut SequenceCache> = capture_set.iter_mut().take(n).collect();
    let ones = vec![1usize; n];
    // A step's logits, every cache truncated back to its length after.
    let at = |model: &Qwen3Model, refs: &mut [&mut SequenceCache]| {
        let lens: Vec<usize> = refs.iter().map(|c| c.len()).collect();
        let logits = step_logits(model, refs, &ones, 7)?.copy()?;
        for (c, &l) in refs.iter_mut().zip(&lens) {
            c.truncate(l)?;
        }
        anyhow::Ok(logits)
    };
    let rel = |a: &candle_core::Tensor, b: &candle_core::Tensor| -> Result<f32> {
        let e = (a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
        let s = b.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
        Ok(e / s.max(1e-30))
    };
    let eager = m.clone().with_tuned_rows(0).with_step_graphs(false);
    set_batch_launch(BatchKernel::Base, BATCH_SPLIT_BLOCKS)?;
    let base = at(&eager, &mut replay);
    set_batch_launch(DEFAULT_BATCH_LAUNCH.0, DEFAULT_BATCH_LAUNCH.1)?;
    let base = base?;
    let mut out = Vec::new();
    for v in check_attn_batch::variants() {
        if !matches!(v.0, BatchKernel::Step3 | BatchKernel::Step2) {
            continue;
        }
        let name = check_attn_batch::variant_name(v);
        let graphs = m.clone().with_tuned_rows(0).with_step_graphs(true);
        set_batch_launch(v.0, v.1)?;
        let mut run = || -> Result<_> {
            let want = at(&eager, &mut replay)?;
            let wrong = at(&eager, &mut capture)?;
            at(&graphs, &mut capture)?;
            at(&graphs, &mut capture)?;
            let replays = graphs.graph_replays();
            let got = at(&graphs, &mut replay)?;
            Ok((want, wrong, got, graphs.graph_replays() > replays))
        };
        let r = run();
        set_batch_launch(DEFAULT_BATCH_LAUNCH.0, DEFAULT_BATCH_LAUNCH.1)?;
        let (want, wrong, got, replayed) = r?;
        let r = if replayed { 0.0 } else { 1.0 };
        out.push((format!("decode_graph:{name}:not_replayed"), r, !replayed));
        let g = rel(&got, &want)?;
        out.push((format!("decode_graph:{name}:graph_vs_eager"), g, g != 0.0));
        let w = rel(&got, &wrong)?;
        out.push((format!("decode_graph:{name}:wrong_lengths"), w, w == 0.0));
        out.push((
            format!("decode_graph:{name}:vs_base"),
            rel(&want, &base)?,
            false,
        ));
    }
    for (i, c) in caches.iter_mut().enumerate() {
        fill(m, c, ctx, i as u32)?;
    }
    Ok(out)
}

/// Fails when [`run`]'s report lists failed checks (after the report is written).
pub fn verdict(report: &Value) -> Result<()> {
    match report.get("failed_checks").and_then(Value::as_array) {
        Some(f) if !f.is_empty() => bail!("batched attention checks failed: {f:?}"),
        _ => Ok(()),
    }
}
