//! `gpu_check cuda out.json --scale --attn-only`: the batched decode attention (B sequences
//! in one launch through their page tables) alone, its kernel variants and target block
//! counts checked against one launch per sequence and timed (K/V GB/s), then the batched
//! decode steps `decode_b{16,32,64}_ctx640_graph` with each variant and their fraction of the
//! memory roofline (weights + K/V at the measured copy bandwidth).

use anyhow::{bail, Result};
use candle_core::{DType, Device};
use dflash_models::cuda::check_attn_batch;
use dflash_models::cuda::{set_batch_launch, BatchKernel, BATCH_SPLIT_BLOCKS};
use dflash_models::random::WeightRng;
use dflash_models::{OpsMode, Qwen3Model, SequenceCache};
use serde_json::{json, Map, Value};

use crate::scale::{fill, qwen3_8b, time_step};

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
        } else if name.ends_with(":repeat") {
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
            set_batch_launch(BatchKernel::Base, BATCH_SPLIT_BLOCKS)?;
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

/// Fails when [`run`]'s report lists failed checks (after the report is written).
pub fn verdict(report: &Value) -> Result<()> {
    match report.get("failed_checks").and_then(Value::as_array) {
        Some(f) if !f.is_empty() => bail!("batched attention checks failed: {f:?}"),
        _ => Ok(()),
    }
}
