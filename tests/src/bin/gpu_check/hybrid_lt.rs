//! The 27B-shaped hybrid's verify forwards with their products on cuBLASLt
//! (`cuda::set_hybrid_verify_lt`: the fused chain forward's every projection, the plain tree
//! path's dense MLP) against the default, from the same 1K prefix (`gpu-check cuda --hybrid`,
//! issue 20): the time of each forward (then truncated back, as the bench's `verify_chain_16`
//! and trees), a GPU-timeline profile by phase (`cuda::phases`) each way, and the logits of
//! the two against each other (bf16 rounding of different accumulation orders: rel err and
//! argmax agreement; the chain's against the plain path are in `gdn_paths_whole_model`).

use anyhow::{Context, Result};
use candle_core::Device;
use dflash_models::cuda::{self, phases};
use dflash_models::{Qwen35Model, SequenceCache};
use serde_json::{json, Value};

use crate::hybrid::{run, shape_inputs, SHAPES};
use crate::hybrid_fused::compare;

/// One forward's GPU time by phase (after warm runs).
fn profile(
    dev: &Device,
    once: &mut dyn FnMut() -> Result<Option<candle_core::Tensor>>,
) -> Result<Value> {
    dev.synchronize()?;
    phases::start();
    phases::mark(dev, "start");
    once()?;
    phases::mark(dev, "end");
    let mut prof = serde_json::Map::new();
    let mut total = 0.0;
    for (l, ms, count) in phases::finish()? {
        total += ms;
        prof.insert(l.into(), json!({"ms": ms, "count": count}));
    }
    prof.insert("total_ms".into(), json!(total));
    Ok(Value::Object(prof))
}

pub fn verify_lt(
    dev: &Device,
    m: &Qwen35Model,
    cache: &mut SequenceCache,
    vocab: u32,
    decode_ms: f64,
) -> Result<Value> {
    let was = cuda::hybrid_verify_lt();
    let start = cache.len();
    let mut res = serde_json::Map::new();
    // The verify shapes: every one but the decode step.
    for (name, n, kind) in SHAPES.into_iter().filter(|s| s.1 > 1) {
        let (tokens, pattern, positions) = shape_inputs(start, n, kind, vocab);
        let rows: Vec<usize> = (0..n).collect();
        let mut out = serde_json::Map::new();
        let mut logits = Vec::new();
        for lt in [false, true] {
            cuda::set_hybrid_verify_lt(lt);
            let mut once = || -> Result<Option<candle_core::Tensor>> {
                let l = run(m, cache, &tokens, &positions, &pattern, &rows)?;
                cache.truncate(start)?;
                Ok(l)
            };
            let ms = crate::time_ms(dev, 7, || once().map(|_| ()))?;
            let prof = profile(dev, &mut once)?;
            logits.push(once()?.context("logits")?);
            let key = if lt { "lt" } else { "default" };
            out.insert(
                key.into(),
                json!({"ms": ms, "over_decode": ms / decode_ms, "profile": prof}),
            );
        }
        out.insert("lt_vs_default".into(), compare(&logits[1], &logits[0])?);
        res.insert(name.into(), Value::Object(out));
    }
    cuda::set_hybrid_verify_lt(was);
    res.insert("decode_ms".into(), json!(decode_ms));
    Ok(Value::Object(res))
}
