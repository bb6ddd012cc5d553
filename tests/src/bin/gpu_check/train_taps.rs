//! `gpu-check --train`, target part: the trainer's target forward (`Qwen3Model::forward_taps`:
//! packed sequences, no cache, one varlen causal attention launch per layer, cut after the
//! deepest tap) against the forward it replaced (`Qwen3Model::forward` over the batch, a fresh
//! cache per sequence: per-sequence materialised attention), bf16 on the GPU, taps 0, 1, 2 of
//! tiny-coder-demo (head_dim 64) at the trainer's batch shape (32 sequences of 100..1400
//! tokens), and of a random target of the same shape with head_dim 128. The error is
//! max |a - b| / max |b| over each tap's columns; tolerance 2e-2 (both round P to bf16, at
//! different points, and sum in different orders). Then the time of one forward of each
//! alone on the GPU.

use anyhow::{ensure, Result};
use candle_core::{DType, Device, Tensor};
use dflash_common::Qwen3Config;
use dflash_models::{AttnPattern, OpsMode, Qwen3Model, SeqForward};
use dflash_tests::demo_model;
use serde_json::{json, Value};

use super::time_ms;

const TAPS: [usize; 3] = [0, 1, 2];
const TOL: f32 = 2e-2;

fn lengths() -> Vec<usize> {
    // 32 lengths spread over 100..1400 (mean ~750), shuffled deterministically.
    (0..32usize).map(|i| 100 + (i * 13 % 32) * 42).collect()
}

fn tokens(len: usize, seed: usize, vocab: usize) -> Vec<u32> {
    (0..len)
        .map(|i| ((i * 2_654_435_761 + seed * 40_503) % (vocab - 10) + 5) as u32)
        .collect()
}

/// The old trainer path: one batched forward, a fresh cache per sequence.
fn full_forward(m: &Qwen3Model, seqs: &[Vec<u32>]) -> Result<Tensor> {
    let mut caches = seqs
        .iter()
        .map(|s| m.new_cache(s.len()))
        .collect::<Result<Vec<_>, _>>()?;
    let positions: Vec<Vec<u32>> = seqs.iter().map(|s| (0..s.len() as u32).collect()).collect();
    let mut batch: Vec<SeqForward<'_>> = caches
        .iter_mut()
        .zip(seqs)
        .zip(&positions)
        .map(|((cache, s), pos)| SeqForward {
            cache,
            tokens: s,
            positions: pos,
            pattern: &AttnPattern::Causal,
            logit_rows: &[],
        })
        .collect();
    let out = m.forward(&mut batch, &TAPS)?;
    out.taps
        .ok_or_else(|| anyhow::anyhow!("the full forward returned no taps"))
}

fn rel_errs(a: &Tensor, b: &Tensor, hidden: usize) -> Result<Vec<f32>> {
    (0..TAPS.len())
        .map(|i| {
            let (x, y) = (
                a.narrow(1, i * hidden, hidden)?.to_dtype(DType::F32)?,
                b.narrow(1, i * hidden, hidden)?.to_dtype(DType::F32)?,
            );
            let d = (&x - &y)?
                .abs()?
                .flatten_all()?
                .max(0)?
                .to_scalar::<f32>()?;
            let m = y.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
            Ok(d / m.max(f32::MIN_POSITIVE))
        })
        .collect()
}

fn case(dev: &Device, name: &str, m: Qwen3Model) -> Result<Value> {
    let m = m.stop_after_layer(2)?;
    let vocab = m.config().vocab_size;
    let hidden = m.config().hidden_size;
    let seqs: Vec<Vec<u32>> = lengths()
        .into_iter()
        .enumerate()
        .map(|(s, l)| tokens(l, s, vocab))
        .collect();
    let refs: Vec<&[u32]> = seqs.iter().map(|s| s.as_slice()).collect();
    let new = m.forward_taps(&refs, &TAPS)?;
    let old = full_forward(&m, &seqs)?;
    ensure!(
        new.features.dims() == old.dims(),
        "{name}: shapes {:?} vs {:?}",
        new.features.dims(),
        old.dims()
    );
    let errs = rel_errs(&new.features, &old, hidden)?;
    let worst = errs.iter().cloned().fold(0f32, f32::max);
    let new_ms = time_ms(dev, 10, || {
        m.forward_taps(&refs, &TAPS)?;
        Ok(())
    })?;
    let old_ms = time_ms(dev, 5, || {
        full_forward(&m, &seqs)?;
        Ok(())
    })?;
    let rows: usize = seqs.iter().map(Vec::len).sum();
    let v = json!({
        "case": name, "rows": rows, "seqs": seqs.len(), "head_dim": m.config().head_dim,
        "rel_err_per_tap": errs, "tolerance": TOL, "pass": worst <= TOL,
        "forward_taps_ms": new_ms, "full_forward_ms": old_ms,
        "forward_taps_tok_per_s": rows as f64 / new_ms * 1e3,
    });
    println!("train_taps {v}");
    Ok(v)
}

pub fn run(dev: &Device) -> Result<Value> {
    let demo = Qwen3Model::load(&demo_model(), DType::BF16, dev, 2048, OpsMode::Fused)?;
    let mut cfg: Qwen3Config = demo.config().clone();
    cfg.head_dim = 128;
    let d128 = Qwen3Model::random(cfg, 7, DType::BF16, dev, 2048, OpsMode::Fused)?;
    let mut out = Vec::new();
    for (name, m) in [("tiny-coder-demo d64", demo), ("random d128", d128)] {
        out.push(
            case(dev, name, m).unwrap_or_else(
                |e| json!({"case": name, "error": format!("{e:#}"), "pass": false}),
            ),
        );
    }
    Ok(json!(out))
}
