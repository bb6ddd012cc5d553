//! The CUDA graph of the hybrid's fused decode step (`qwen3_5/graph.rs`) against the eager
//! fused step on the same weights and cache (`gpu-check cuda --hybrid`): 20 consecutive
//! decode steps from the committed prefix (the live keys cross a boundary of the attention's
//! key splits), then a rollback into the middle of them and 3 more steps (the graph must copy
//! the cache's state back in), each step's logits compared bit for bit; a cache the graph was
//! not captured for must be refused. Then decode timed both ways.

use anyhow::Result;
use candle_core::{Device, Tensor};
use dflash_models::{Qwen35Model, SequenceCache};
use serde_json::{json, Value};

use crate::hybrid_fused::logits;

/// Steps whose logits differ in any bit, and the largest difference.
fn bit_compare(graph: &[Tensor], eager: &[Tensor]) -> Result<(usize, f32)> {
    let (mut differ, mut max) = (0usize, 0f32);
    for (g, e) in graph.iter().zip(eager) {
        let (g, e) = (
            g.flatten_all()?.to_vec1::<f32>()?,
            e.flatten_all()?.to_vec1::<f32>()?,
        );
        anyhow::ensure!(g.len() == e.len(), "logit widths differ");
        let mut same = true;
        for (a, b) in g.iter().zip(&e) {
            if a.to_bits() != b.to_bits() {
                same = false;
                max = max.max((a - b).abs());
            }
        }
        differ += usize::from(!same);
    }
    Ok((differ, max))
}

/// `roofline_ms`: the decode step's memory roofline, as the bench computes it.
pub fn graph_vs_eager(
    dev: &Device,
    m: &Qwen35Model,
    cache: &mut SequenceCache,
    vocab: u32,
    roofline_ms: f64,
) -> Result<Value> {
    let start = cache.len();
    let n = 20usize;
    let tokens: Vec<u32> = (0..n as u32).map(|i| (i * 7919 + 5) % vocab).collect();
    let mut eager = Vec::with_capacity(n);
    for (i, &tok) in tokens.iter().enumerate() {
        eager.push(logits(m, cache, &[tok], start + i)?);
    }
    cache.truncate(start)?;
    let mut g = m.capture_decode_graph(cache)?;
    let kps = g.keys_per_split();
    let mut graph = Vec::with_capacity(n);
    for (i, &tok) in tokens.iter().enumerate() {
        graph.push(g.step(cache, tok, (start + i) as u32)?);
    }
    let (differ, max_diff) = bit_compare(&graph, &eager)?;
    // Roll back into the steps just made and go on from there.
    let back = 5usize;
    cache.truncate(start + back)?;
    let mut again = Vec::new();
    for (i, &tok) in tokens.iter().enumerate().skip(back).take(3) {
        again.push(g.step(cache, tok, (start + i) as u32)?);
    }
    let (differ_rb, max_diff_rb) = bit_compare(&again, &eager[back..back + 3])?;
    cache.truncate(start)?;
    let mut other = m.new_cache_with_rollback(64, 64)?;
    let stale_refused = g.step(&mut other, tokens[0], 0).is_err();
    drop(other);

    let steps = 10usize;
    let eager_ms = crate::time_ms(dev, 5, || {
        for (i, &tok) in tokens.iter().enumerate().take(steps) {
            logits(m, cache, &[tok], start + i)?;
        }
        cache.truncate(start)?;
        Ok(())
    })? / steps as f64;
    let graph_ms = crate::time_ms(dev, 5, || {
        for (i, &tok) in tokens.iter().enumerate().take(steps) {
            g.step(cache, tok, (start + i) as u32)?;
        }
        cache.truncate(start)?;
        Ok(())
    })? / steps as f64;
    let live = (start + 1, start + n);
    Ok(json!({
        "steps": n,
        "live_keys": format!("{} ..= {}", live.0, live.1),
        "keys_per_split": kps,
        "split_boundaries_crossed": live.1 / kps - live.0 / kps,
        "steps_not_bit_equal": differ,
        "max_abs_diff": max_diff,
        "after_rollback_steps_not_bit_equal": format!("{differ_rb}/3"),
        "after_rollback_max_abs_diff": max_diff_rb,
        "other_cache_refused": stale_refused,
        "bit_exact": differ == 0 && differ_rb == 0,
        "decode_eager_ms": eager_ms,
        "decode_graph_ms": graph_ms,
        "roofline_ms": roofline_ms,
        "eager_fraction_of_roofline": roofline_ms / eager_ms,
        "graph_fraction_of_roofline": roofline_ms / graph_ms,
        "timing": format!("per step, {steps} consecutive steps from {start} committed rows then a truncate, median of 5"),
    }))
}
