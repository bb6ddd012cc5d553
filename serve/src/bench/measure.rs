//! Timed pieces of the benchmark: the two rooflines measured on the device, and the model
//! figures (decode, forward of n new tokens, drafter block, prefill). Every timing syncs the
//! device and reports the median of its repetitions.

use std::time::Instant;

use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor};
use dflash_models::{
    AttnPattern, DFlashDrafter, DraftInput, Qwen3Model, SeqForward, SequenceCache,
};

/// Median wall time of `reps` runs of `f` (the shared probe, with anyhow errors).
pub fn time_ms(dev: &Device, reps: usize, f: impl FnMut() -> Result<()>) -> Result<f64> {
    dflash_models::probe::time_ms(dev, reps, f)
}

/// Device copy bandwidth in bytes per second: the driver memcpy on CUDA (see
/// `dflash_models::probe::copy_bandwidth`).
pub fn copy_bandwidth(dev: &Device, bytes: usize) -> Result<f64> {
    Ok(dflash_models::probe::copy_bandwidth(dev, bytes)?)
}

/// Dense matmul rate (FLOP/s) of an `n x n x n` product in `dtype`.
pub fn matmul_rate(dev: &Device, n: usize, dtype: DType) -> Result<f64> {
    let a = Tensor::randn(0f32, 1.0, (n, n), dev)?.to_dtype(dtype)?;
    let b = Tensor::randn(0f32, 1.0, (n, n), dev)?.to_dtype(dtype)?;
    let ms = time_ms(dev, 5, || {
        a.matmul(&b)?;
        Ok(())
    })?;
    Ok(2.0 * (n as f64).powi(3) / (ms / 1e3))
}

/// Pseudo-random token ids below `vocab` (deterministic, no RNG state).
pub fn tokens(n: usize, salt: u32, vocab: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i.wrapping_mul(7919).wrapping_add(salt.wrapping_mul(104729))) % vocab as u32)
        .collect()
}

/// The test tree of `n` entries: node i's parent is (i - 1) / 2 (a binary tree, depth log2 n).
pub fn binary_tree(n: usize) -> Vec<Option<usize>> {
    (0..n)
        .map(|i| if i == 0 { None } else { Some((i - 1) / 2) })
        .collect()
}

/// Fills `cache` with `ctx` committed positions, in prefill chunks of at most 2048 tokens.
pub fn fill_context(m: &Qwen3Model, cache: &mut SequenceCache, ctx: usize) -> Result<()> {
    while cache.len() < ctx {
        let start = cache.len();
        append_causal(m, cache, (ctx - start).min(2048), start as u32)?;
    }
    Ok(())
}

/// One causal forward of `n` tokens (made from `seed`) appended to `cache`, the last row's
/// logits computed as a prefill does.
fn append_causal(m: &Qwen3Model, cache: &mut SequenceCache, n: usize, seed: u32) -> Result<()> {
    let start = cache.len() as u32;
    let toks = tokens(n, seed, m.config().vocab_size);
    let pos: Vec<u32> = (start..start + n as u32).collect();
    m.forward(
        &mut [SeqForward {
            cache,
            tokens: &toks,
            positions: &pos,
            pattern: &AttnPattern::Causal,
            logit_rows: &[n - 1],
        }],
        &[],
    )?;
    Ok(())
}

/// One forward of `n` new tokens over the cache (chain = causal, else the binary tree), all
/// rows' logits computed as verification needs them; the cache is truncated back after.
/// Returns the logits.
pub fn forward_n(
    m: &Qwen3Model,
    cache: &mut SequenceCache,
    n: usize,
    tree: bool,
) -> Result<Tensor> {
    let start = cache.len();
    let toks = tokens(n, 11, m.config().vocab_size);
    let (positions, pattern) = if tree {
        let parents = binary_tree(n);
        let mut depth = vec![0u32; n];
        for i in 1..n {
            depth[i] = depth[(i - 1) / 2] + 1;
        }
        (
            depth.iter().map(|d| start as u32 + d).collect::<Vec<_>>(),
            AttnPattern::Tree { parents },
        )
    } else {
        (
            (start as u32..(start + n) as u32).collect(),
            AttnPattern::Causal,
        )
    };
    let rows: Vec<usize> = (0..n).collect();
    let out = m.forward(
        &mut [SeqForward {
            cache,
            tokens: &toks,
            positions: &positions,
            pattern: &pattern,
            logit_rows: &rows,
        }],
        &[],
    )?;
    cache.truncate(start)?;
    out.logits.context("forward returned no logits")
}

/// Milliseconds per token of `steps` consecutive greedy decode steps (each: one token, argmax
/// copied to the host, as a decoding loop does), starting at the cache's length; the cache is
/// truncated back after.
pub fn decode_ms(m: &Qwen3Model, cache: &mut SequenceCache, steps: usize) -> Result<f64> {
    let start = cache.len();
    let dev = m.device().clone();
    let mut tok = 17u32;
    let mut run = |cache: &mut SequenceCache, steps: usize| -> Result<()> {
        for s in 0..steps {
            let pos = [(start + s) as u32];
            let out = m.forward(
                &mut [SeqForward {
                    cache,
                    tokens: &[tok],
                    positions: &pos,
                    pattern: &AttnPattern::Causal,
                    logit_rows: &[0],
                }],
                &[],
            )?;
            let logits = out.logits.context("decode returned no logits")?;
            tok = logits.argmax(1)?.to_vec1::<u32>()?[0];
        }
        Ok(())
    };
    run(cache, 4)?; // warm-up
    cache.truncate(start)?;
    dev.synchronize()?;
    let t = Instant::now();
    run(cache, steps)?;
    let ms = t.elapsed().as_secs_f64() * 1e3 / steps as f64;
    cache.truncate(start)?;
    Ok(ms)
}

/// Drafter block latency over `ctx` positions of context: (hidden-states forward, with logits
/// of the draft rows) in ms.
pub fn drafter_block_ms(drafter: &DFlashDrafter, ctx: usize, reps: usize) -> Result<(f64, f64)> {
    let dev = drafter.device().clone();
    let cfg = drafter.config();
    let width = cfg.target_layer_ids.len() * cfg.layers.hidden_size;
    let mut cache = drafter.new_cache(ctx + 64)?;
    // Context features in chunks (the drafter's context path is a GEMM per chunk).
    let mut done = 0;
    let mask = drafter.mask_token_id();
    let mut block = vec![mask; drafter.block_size()];
    block[0] = 5;
    while done < ctx {
        let n = (ctx - done).min(2048);
        let feats = Tensor::randn(0f32, 1.0, (n, width), &dev)?.to_dtype(drafter.dtype())?;
        drafter.forward(&mut [DraftInput {
            cache: &mut cache,
            context: Some(&feats),
            block: &block,
        }])?;
        done += n;
    }
    let hidden = time_ms(&dev, reps, || {
        drafter.forward(&mut [DraftInput {
            cache: &mut cache,
            context: None,
            block: &block,
        }])?;
        Ok(())
    })?;
    let logits = time_ms(&dev, reps, || {
        drafter.draft_logits(&mut [DraftInput {
            cache: &mut cache,
            context: None,
            block: &block,
        }])?;
        Ok(())
    })?;
    Ok((hidden, logits))
}

/// Seconds for one prefill of `n` tokens into an empty cache (median of `reps`).
pub fn prefill_s(m: &Qwen3Model, n: usize, reps: usize) -> Result<f64> {
    let mut cache = m.new_cache(n + 8)?;
    let dev = m.device().clone();
    let ms = time_ms(&dev, reps, || {
        cache.truncate(0)?;
        append_causal(m, &mut cache, n, 3)
    })?;
    Ok(ms / 1e3)
}

/// As [`decode_ms`], with each step replayed from a CUDA graph captured once for the cache.
#[cfg(feature = "cuda")]
pub fn decode_graph_ms(m: &Qwen3Model, cache: &mut SequenceCache, steps: usize) -> Result<f64> {
    let start = cache.len();
    let graph = m.capture_step(cache, 1, false)?;
    let mut tok = 17u32;
    let mut run = |cache: &mut SequenceCache, steps: usize| -> Result<()> {
        for s in 0..steps {
            let logits = graph.step(cache, &[tok], &[(start + s) as u32], None)?;
            tok = logits.argmax(1)?.to_vec1::<u32>()?[0];
        }
        Ok(())
    };
    run(cache, 4)?;
    cache.truncate(start)?;
    m.device().synchronize()?;
    let t = Instant::now();
    run(cache, steps)?;
    let ms = t.elapsed().as_secs_f64() * 1e3 / steps as f64;
    cache.truncate(start)?;
    Ok(ms)
}

/// As [`forward_n`] (timed, median of `reps`), replayed from a CUDA graph captured for `n`
/// tokens; also returns the graph's logits for the check against the plain forward.
#[cfg(feature = "cuda")]
pub fn forward_graph_ms(
    m: &Qwen3Model,
    cache: &mut SequenceCache,
    n: usize,
    tree: bool,
    reps: usize,
) -> Result<(f64, Tensor)> {
    let start = cache.len();
    let graph = m.capture_step(cache, n, tree)?;
    let toks = tokens(n, 11, m.config().vocab_size);
    let parents = binary_tree(n);
    let mut depth = vec![0u32; n];
    for i in 1..n {
        depth[i] = depth[(i - 1) / 2] + 1;
    }
    let positions: Vec<u32> = if tree {
        depth.iter().map(|d| start as u32 + d).collect()
    } else {
        (start as u32..(start + n) as u32).collect()
    };
    let mut last = None;
    let ms = time_ms(m.device(), reps, || {
        let l = graph.step(cache, &toks, &positions, tree.then_some(parents.as_slice()))?;
        cache.truncate(start)?;
        last = Some(l);
        Ok(())
    })?;
    Ok((ms, last.context("no replay")?))
}

/// Drafter block latency over `ctx` positions of context, replayed from a CUDA graph.
#[cfg(feature = "cuda")]
pub fn drafter_graph_ms(drafter: &DFlashDrafter, ctx: usize, reps: usize) -> Result<f64> {
    let dev = drafter.device().clone();
    let cfg = drafter.config();
    let width = cfg.target_layer_ids.len() * cfg.layers.hidden_size;
    let mut cache = drafter.new_cache(ctx + 64)?;
    let mut block = vec![drafter.mask_token_id(); drafter.block_size()];
    block[0] = 5;
    let mut done = 0;
    while done < ctx {
        let n = (ctx - done).min(2048);
        let feats = Tensor::randn(0f32, 1.0, (n, width), &dev)?.to_dtype(drafter.dtype())?;
        drafter.forward(&mut [DraftInput {
            cache: &mut cache,
            context: Some(&feats),
            block: &block,
        }])?;
        done += n;
    }
    let graph = drafter.capture_block(&cache)?;
    time_ms(&dev, reps, || {
        graph.draft(&cache, &block)?;
        Ok(())
    })
}
