//! Steps of several sequences at once, as a server runs them: B sequences paged in one K/V
//! pool, each with `ctx` committed positions, take a decode step (one token each, the argmax
//! copied to the host) or a 16-token chain verify together. Reported per batch size against
//! the memory roofline of the step (the weights once plus every sequence's K/V, at the
//! measured copy bandwidth), with and without the batched CUDA graph.

use std::time::Instant;

use anyhow::{Context, Result};
use dflash_models::cache::pages_for;
use dflash_models::{AttnPattern, Qwen3Model, SeqForward, SequenceCache};
use serde_json::{json, Map, Value};

use super::measure::{fill_context, tokens};

/// One forward of `t` causal tokens per sequence over `caches` (positions from each length),
/// every row's logits; with `t == 1` the argmax comes to the host, as a decode loop does.
fn batch_step(m: &Qwen3Model, caches: &mut [SequenceCache], t: usize, salt: u32) -> Result<()> {
    let toks: Vec<Vec<u32>> = (0..caches.len())
        .map(|s| tokens(t, salt + s as u32, m.config().vocab_size))
        .collect();
    let pos: Vec<Vec<u32>> = caches
        .iter()
        .map(|c| (c.len() as u32..(c.len() + t) as u32).collect())
        .collect();
    let rows: Vec<usize> = (0..t).collect();
    let mut batch: Vec<SeqForward<'_>> = caches
        .iter_mut()
        .enumerate()
        .map(|(s, cache)| SeqForward {
            cache,
            tokens: &toks[s],
            positions: &pos[s],
            pattern: &AttnPattern::Causal,
            logit_rows: &rows,
        })
        .collect();
    let out = m.forward(&mut batch, &[])?;
    let logits = out.logits.context("no logits")?;
    if t == 1 {
        logits.argmax(1)?.to_vec1::<u32>()?;
    }
    Ok(())
}

/// Milliseconds per step of `steps` consecutive steps of `t` tokens (after three warm-up
/// steps, which capture the graph when graphs are on); every cache truncated back to `ctx`.
fn time_steps(
    m: &Qwen3Model,
    caches: &mut [SequenceCache],
    ctx: usize,
    t: usize,
    steps: usize,
) -> Result<f64> {
    let reset = |caches: &mut [SequenceCache]| -> Result<()> {
        for c in caches.iter_mut() {
            c.truncate(ctx)?;
        }
        Ok(())
    };
    for w in 0..3 {
        batch_step(m, caches, t, w)?;
        if t > 1 {
            reset(caches)?;
        }
    }
    reset(caches)?;
    m.device().synchronize()?;
    let start = Instant::now();
    for s in 0..steps {
        batch_step(m, caches, t, 100 + s as u32)?;
        if t > 1 {
            reset(caches)?;
        }
    }
    m.device().synchronize()?;
    let ms = start.elapsed().as_secs_f64() * 1e3 / steps as f64;
    reset(caches)?;
    Ok(ms)
}

/// Milliseconds of the step's GEMMs alone at `b` rows: every layer's q/k/v, o, gate/up and
/// down projections (cuBLAS, as the wide layer path runs them) plus the LM head, each timed
/// on its own (median of 20) and summed over the layers.
fn gemm_ms(m: &Qwen3Model, b: usize) -> Result<Value> {
    let cfg = m.config();
    let dev = m.device();
    let (h, i, l) = (
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.num_hidden_layers,
    );
    let q = cfg.num_attention_heads * cfg.head_dim;
    let kv = cfg.num_key_value_heads * cfg.head_dim;
    let mut total = 0.0;
    let mut parts = Map::new();
    for (name, n, k, times) in [
        ("qkv", q + 2 * kv, h, l),
        ("o_proj", h, q, l),
        ("gate_up", 2 * i, h, l),
        ("down", h, i, l),
        ("lm_head", cfg.vocab_size, h, 1),
    ] {
        let w = candle_core::Tensor::zeros((n, k), m.dtype(), dev)?;
        let x = candle_core::Tensor::zeros((b, k), m.dtype(), dev)?;
        let ms = super::measure::time_ms(dev, 20, || {
            x.matmul(&w.t()?)?;
            Ok(())
        })?;
        parts.insert(name.into(), json!(ms));
        total += ms * times as f64;
    }
    parts.insert("step_total".into(), json!(total));
    Ok(Value::Object(parts))
}

/// The batched figures for each of `sizes` sequences at `ctx` positions: decode and chain-16
/// steps, graph on and off; `weights` and `kv_pos` in bytes, `bw` in bytes per second.
pub fn run(
    m: &Qwen3Model,
    sizes: &[usize],
    ctx: usize,
    steps: usize,
    (weights, kv_pos, bw): (f64, f64, f64),
) -> Result<Value> {
    let mut out = Map::new();
    let eager = m.clone().with_step_graphs(false);
    let capacity = ctx + 64;
    for &b in sizes {
        let pool = m.new_kv_pool(b * (pages_for(capacity) + 2) + 1)?;
        let mut caches = (0..b)
            .map(|_| m.new_cache_in(&pool, capacity))
            .collect::<Result<Vec<_>, _>>()?;
        for c in caches.iter_mut() {
            fill_context(m, c, ctx)?;
        }
        let roof = |t: usize| (weights + b as f64 * kv_pos * (ctx + t) as f64) / bw * 1e3;
        let graph = time_steps(m, &mut caches, ctx, 1, steps)?;
        // The same step over 16 positions: what the K/V reads cost is the difference.
        let mut short = (0..b)
            .map(|_| m.new_cache_in(&pool, 80))
            .collect::<Result<Vec<_>, _>>()?;
        for c in short.iter_mut() {
            fill_context(m, c, 16)?;
        }
        let graph_ctx16 = time_steps(m, &mut short, 16, 1, steps)?;
        drop(short);
        let gemms = gemm_ms(m, b)?;
        let plain = time_steps(&eager, &mut caches, ctx, 1, steps)?;
        let chain_graph = time_steps(m, &mut caches, ctx, 16, steps / 2)?;
        let chain = time_steps(&eager, &mut caches, ctx, 16, steps / 2)?;
        out.insert(
            format!("b{b}_ctx{ctx}"),
            json!({
                "decode_ms": plain,
                "decode_cuda_graph_ms": graph,
                "decode_cuda_graph_ctx16_ms": graph_ctx16,
                "gemm_alone_ms": gemms,
                "decode_roofline_ms": roof(1),
                "decode_fraction_of_roofline": roof(1) / plain,
                "decode_cuda_graph_fraction_of_roofline": roof(1) / graph,
                "decode_tok_per_s": b as f64 * 1e3 / graph.min(plain),
                "chain16_ms": chain,
                "chain16_cuda_graph_ms": chain_graph,
                "chain16_ratio_to_decode_step": chain_graph.min(chain) / graph.min(plain),
            }),
        );
        tracing::info!("batched b={b}: decode {plain:.2} ms, graph {graph:.2} ms (roofline {:.2}); chain-16 {chain:.2} / {chain_graph:.2} ms", roof(1));
    }
    Ok(Value::Object(out))
}
