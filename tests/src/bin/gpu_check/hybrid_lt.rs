//! The 27B-shaped hybrid's verify forwards with their larger unnormed products on cuBLASLt
//! (`cuda::set_hybrid_verify_lt`: the fused chain forward's o-projections, MLP and LM head, the
//! plain tree path's dense MLP) and, for trees, the fused tree forward
//! (`cuda::set_hybrid_fused_tree`, up to `cuda::HYBRID_FUSED_TREE_MAX_NODES` nodes) against every
//! product on the skinny kernels, from the same 1K prefix (`gpu-check cuda --hybrid`, issue 20):
//! the time of each forward (then truncated back, as the bench's `verify_chain_16` and trees), a
//! GPU-timeline profile by phase (`cuda::phases`), and against the skinny one (bf16 rounding of
//! other accumulation orders: rel err and argmax agreement) the verify's logits and those of a
//! decode step after committing a root-to-leaf path (8 rows of the chain), which reads the K/V
//! and recurrent state the commit kept.

use anyhow::{Context, Result};
use candle_core::Device;
use dflash_models::cuda::{self, phases};
use dflash_models::{AttnPattern, Qwen35Model, SequenceCache};
use serde_json::{json, Value};

use crate::hybrid::{run, shape_inputs, SHAPES};
use crate::hybrid_fused::{compare, logits};

/// The GPU time of one run of `once` (after warm runs) by phase: from `first` and each
/// `cuda::phases` mark inside it to the next, summed per label, and their total.
pub(crate) fn profile(
    dev: &Device,
    first: &'static str,
    once: &mut dyn FnMut() -> Result<()>,
) -> Result<Value> {
    dev.synchronize()?;
    phases::start();
    phases::mark(dev, first);
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

/// The verify forwards' configurations: `(name, cuBLASLt products where they pay, fused tree
/// forward, chunked GDN tree form)`; the first (every product on the skinny kernels, trees on
/// the plain path) is the reference, `fused_tree` the shipped defaults.
const CONFIGS: [(&str, bool, bool, bool); 4] = [
    ("skinny", false, false, false),
    ("lt", true, false, false),
    ("fused_tree", true, true, false),
    ("tree_chunked", true, true, true),
];

/// The verify shapes: [`SHAPES`]' but the decode step, and a 16-node tree (DDTree-16's size,
/// which the fused tree forward takes).
fn verify_shapes() -> Vec<(&'static str, usize, Option<bool>)> {
    let mut shapes: Vec<_> = SHAPES.into_iter().filter(|s| s.1 > 1).collect();
    shapes.insert(1, ("verify_tree_16_binary_depth4", 16, Some(true)));
    shapes
}

/// A root-to-leaf path of the tree `parents` (the first child at every depth), as absolute
/// cache rows from `start`.
fn first_path(parents: &[Option<usize>], start: usize) -> Vec<usize> {
    let mut path = vec![0usize];
    while let Some(c) = (0..parents.len()).find(|&c| parents[c] == path.last().copied()) {
        path.push(c);
    }
    path.into_iter().map(|i| start + i).collect()
}

/// The rows a timed verify from `start` commits: a tree's first root-to-leaf path, a chain's
/// first 8 rows.
fn kept_rows(pattern: &AttnPattern, start: usize) -> Vec<usize> {
    match pattern {
        AttnPattern::Tree { parents } => first_path(parents, start),
        _ => (start..start + 8).collect(),
    }
}

/// Verify, commit the rows `keep`, then decode `next`: that step's logits (they read the K/V
/// and the recurrent state the commit kept). On a clone of the cache.
pub(crate) fn commit_then_decode(
    m: &Qwen35Model,
    cache: &SequenceCache,
    (tokens, pattern, positions): (&[u32], &AttnPattern, &[u32]),
    keep: &[usize],
    next: u32,
) -> Result<candle_core::Tensor> {
    let mut c = cache.clone();
    let start = c.len();
    let rows: Vec<usize> = (0..tokens.len()).collect();
    run(m, &mut c, tokens, positions, pattern, &rows)?;
    c.compact(start, keep)?;
    logits(m, &mut c, &[next], start + keep.len())
}

pub fn verify_lt(
    dev: &Device,
    m: &Qwen35Model,
    cache: &mut SequenceCache,
    vocab: u32,
    decode_ms: f64,
) -> Result<Value> {
    let was = (
        cuda::hybrid_verify_lt(),
        cuda::hybrid_fused_tree(),
        cuda::gdn_tree_chunked_on(),
    );
    let start = cache.len();
    let mut res = serde_json::Map::new();
    for (name, n, kind) in verify_shapes() {
        let (tokens, pattern, positions) = shape_inputs(start, n, kind, vocab);
        let rows: Vec<usize> = (0..n).collect();
        let keep = kept_rows(&pattern, start);
        let mut out = serde_json::Map::new();
        let mut reference = None;
        for (key, lt, fused_tree, chunked) in CONFIGS {
            if fused_tree && kind.is_none() {
                continue;
            }
            cuda::set_hybrid_verify_lt(lt);
            cuda::set_hybrid_fused_tree(fused_tree);
            cuda::set_gdn_tree_chunked(chunked);
            let mut once = || -> Result<Option<candle_core::Tensor>> {
                let l = run(m, cache, &tokens, &positions, &pattern, &rows)?;
                cache.truncate(start)?;
                Ok(l)
            };
            let ms = crate::time_ms(dev, 7, || once().map(|_| ()))?;
            let prof = profile(dev, "start", &mut || once().map(|_| ()))?;
            let l = once()?.context("logits")?;
            let next = commit_then_decode(
                m,
                cache,
                (&tokens, &pattern, &positions),
                &keep,
                4242 % vocab,
            )?;
            let mut entry = json!({"ms": ms, "over_decode": ms / decode_ms, "profile": prof});
            match &reference {
                None => reference = Some((l, next)),
                Some((l0, n0)) => {
                    entry["vs_skinny"] = compare(&l, l0)?;
                    entry["commit_path_then_decode_vs_skinny"] = compare(&next, n0)?;
                }
            }
            out.insert(key.into(), entry);
        }
        out.insert("committed_rows".into(), json!(keep.len()));
        res.insert(name.into(), Value::Object(out));
    }
    cuda::set_hybrid_verify_lt(was.0);
    cuda::set_hybrid_fused_tree(was.1);
    cuda::set_gdn_tree_chunked(was.2);
    res.insert("decode_ms".into(), json!(decode_ms));
    res.insert(
        "batched_settle".into(),
        batched_settle(dev, m, cache, vocab)?,
    );
    Ok(Value::Object(res))
}

/// The commit settled on every GDN layer in one batch (`cuda::set_batched_gdn_settle`) against
/// layer by layer, after the default verify forwards (chain-16 keeping 8 rows, the DDTree-like
/// tree keeping its first root-to-leaf path): the verify + commit time each way, and the
/// logits of a decode step after the commit, which must be equal bit for bit (the same
/// operations in the same order).
fn batched_settle(
    dev: &Device,
    m: &Qwen35Model,
    cache: &mut SequenceCache,
    vocab: u32,
) -> Result<Value> {
    let was = cuda::batched_gdn_settle();
    let start = cache.len();
    let mut res = serde_json::Map::new();
    for (name, n, kind) in SHAPES.into_iter().filter(|s| s.1 > 1 && s.2 != Some(true)) {
        let (tokens, pattern, positions) = shape_inputs(start, n, kind, vocab);
        let rows: Vec<usize> = (0..n).collect();
        let keep = kept_rows(&pattern, start);
        let mut out = serde_json::Map::new();
        let mut next = Vec::new();
        for batched in [false, true] {
            cuda::set_batched_gdn_settle(batched);
            let ms = crate::time_ms(dev, 7, || {
                let mut c = cache.clone();
                run(m, &mut c, &tokens, &positions, &pattern, &rows)?;
                c.compact(start, &keep)?;
                Ok(())
            })?;
            next.push(commit_then_decode(
                m,
                cache,
                (&tokens, &pattern, &positions),
                &keep,
                4242 % vocab,
            )?);
            let key = if batched { "batched" } else { "per_layer" };
            out.insert(format!("{key}_verify_and_commit_ms"), json!(ms));
        }
        let diff = (&next[1] - &next[0])?
            .abs()?
            .flatten_all()?
            .max(0)?
            .to_scalar::<f32>()?;
        out.insert("next_logits_max_abs_diff".into(), json!(diff));
        out.insert("bit_equal".into(), json!(diff == 0.0));
        out.insert("committed_rows".into(), json!(keep.len()));
        res.insert(name.into(), Value::Object(out));
    }
    cuda::set_batched_gdn_settle(was);
    Ok(Value::Object(res))
}
