//! The paged K/V pool on the GPU (`gpu-check cuda out.json --pooled`): sequences of
//! different lengths, paged out of order in one pool, step together (a decode step, a
//! 16-token chain verify and a 16-node tree verify, each three times so that the batched CUDA
//! graph is captured and replayed) and every sequence's logits are compared with its own
//! forward alone in a cache of its own (the fused forward without graphs). bf16, a
//! Qwen3-shaped model with head_dim 128 so the fused kernels run.

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use dflash_common::{LayerType, Qwen3Config, RopeScaling};
use dflash_models::{AttnPattern, OpsMode, Qwen3Model, SeqForward, SequenceCache};
use serde_json::{json, Value};

fn config() -> Qwen3Config {
    Qwen3Config {
        vocab_size: 4096,
        hidden_size: 1024,
        intermediate_size: 3072,
        num_hidden_layers: 4,
        num_attention_heads: 16,
        num_key_value_heads: 8,
        head_dim: 128,
        rms_norm_eps: 1e-6,
        rope_theta: 1e6,
        rope_scaling: RopeScaling::Default,
        max_position_embeddings: 4096,
        tie_word_embeddings: false,
        eos_token_ids: vec![],
        bos_token_id: None,
        layer_types: vec![LayerType::FullAttention; 4],
        sliding_window: None,
        moe: None,
    }
}

/// One forward of `tokens[s]` (positions from each cache's length, `pattern`) over `caches`
/// as a batch; the logits of every row, per sequence.
fn step(
    m: &Qwen3Model,
    caches: &mut [SequenceCache],
    tokens: &[Vec<u32>],
    pattern: &AttnPattern,
) -> Result<Vec<Tensor>> {
    let positions: Vec<Vec<u32>> = caches
        .iter()
        .zip(tokens)
        .map(|(c, t)| match pattern {
            AttnPattern::Tree { .. } => tree_positions(c.len(), pattern),
            _ => (c.len() as u32..(c.len() + t.len()) as u32).collect(),
        })
        .collect();
    let rows: Vec<Vec<usize>> = tokens.iter().map(|t| (0..t.len()).collect()).collect();
    let mut batch: Vec<SeqForward<'_>> = caches
        .iter_mut()
        .enumerate()
        .map(|(s, cache)| SeqForward {
            cache,
            tokens: &tokens[s],
            positions: &positions[s],
            pattern,
            logit_rows: &rows[s],
        })
        .collect();
    let out = m.forward(&mut batch, &[])?;
    let logits = out.logits.context("logits")?;
    (0..caches.len())
        .map(|s| {
            let (a, b) = (out.logit_offsets[s], out.logit_offsets[s + 1]);
            Ok(logits.narrow(0, a, b - a)?)
        })
        .collect()
}

fn tree_positions(len: usize, pattern: &AttnPattern) -> Vec<u32> {
    let AttnPattern::Tree { parents } = pattern else {
        return Vec::new();
    };
    let mut depth = vec![0u32; parents.len()];
    for (i, p) in parents.iter().enumerate() {
        depth[i] = p.map_or(0, |p| depth[p] + 1);
    }
    depth.iter().map(|d| len as u32 + d).collect()
}

/// A mixed step (the engine's prefill chunk in the decode forward): every pooled sequence
/// decodes one token while a new sequence prefills a 128-token piece after 250 prompt tokens,
/// in one forward (a pooled run and a single); each sequence's logits against its forward
/// alone. Two rounds.
fn mixed(
    m: &Qwen3Model,
    alone: &Qwen3Model,
    pool: &dflash_models::cache::KvPool,
    pooled: &mut Vec<SequenceCache>,
    own: &mut [SequenceCache],
) -> Result<Value> {
    let prompt: Vec<u32> = (0..250u32).map(|i| (i * 13 + 7) % 4096).collect();
    let mut long_pooled = m.new_cache_in(pool, 600)?;
    let mut long_own = alone.new_cache(600)?;
    step(
        m,
        std::slice::from_mut(&mut long_pooled),
        &[prompt.clone()],
        &AttnPattern::Causal,
    )?;
    step(
        alone,
        std::slice::from_mut(&mut long_own),
        &[prompt],
        &AttnPattern::Causal,
    )?;
    pooled.push(long_pooled);
    let mut worst = 0f32;
    for round in 0..2 {
        let mut tokens: Vec<Vec<u32>> = (0..own.len())
            .map(|s| vec![((round * 331 + s * 17) % 4096) as u32])
            .collect();
        tokens.push(
            (0..128)
                .map(|i| ((round * 128 + i) * 29 % 4096) as u32)
                .collect(),
        );
        let p = step(m, pooled, &tokens, &AttnPattern::Causal)?;
        for (s, cache) in own
            .iter_mut()
            .chain(std::iter::once(&mut long_own))
            .enumerate()
        {
            let o = step(
                alone,
                std::slice::from_mut(cache),
                &tokens[s..s + 1],
                &AttnPattern::Causal,
            )?;
            worst = worst.max(rel_diff(&p[s], &o[0])?);
        }
    }
    pooled.pop();
    println!("pooled mixed (6 decode rows + a 128-token piece): worst relative logit difference {worst:.2e}");
    if worst > 2e-2 {
        bail!("mixed step: logits differ from each sequence alone by {worst} (relative)");
    }
    Ok(json!({"worst_rel_diff": worst}))
}

/// Largest |a - b| over the largest |b|.
fn rel_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    let d = (a - b)?.abs()?.max_all()?.to_scalar::<f32>()?;
    let s = b.abs()?.max_all()?.to_scalar::<f32>()?;
    Ok(d / s.max(1e-6))
}

pub fn run(dev: &Device) -> Result<Value> {
    let cfg = config();
    let m = Qwen3Model::random(cfg.clone(), 5, DType::BF16, dev, 4096, OpsMode::Fused)?;
    if !m.fast_kernels() {
        bail!("the pooled check needs the fused kernels (CUDA, bf16)");
    }
    let alone = m.clone().with_step_graphs(false);
    let pool = m.new_kv_pool(128)?;
    // Every other page held by another cache while ours are made: their page tables have gaps.
    let mut holders: Vec<SequenceCache> = (0..10)
        .map(|_| m.new_cache_in(&pool, 64))
        .collect::<Result<_, _>>()?;
    for i in (0..holders.len()).rev().step_by(2) {
        holders.remove(i);
    }
    let lens = [37usize, 300, 64, 129, 5, 700];
    let mut pooled: Vec<SequenceCache> = Vec::new();
    let mut own: Vec<SequenceCache> = Vec::new();
    for (s, &l) in lens.iter().enumerate() {
        pooled.push(m.new_cache_in(&pool, l + 160)?);
        own.push(alone.new_cache(l + 160)?);
        let prompt: Vec<u32> = (0..l).map(|i| ((i * 7 + s * 131) % 4096) as u32).collect();
        let p = step(
            &m,
            std::slice::from_mut(&mut pooled[s]),
            &[prompt.clone()],
            &AttnPattern::Causal,
        )?;
        let o = step(
            &alone,
            std::slice::from_mut(&mut own[s]),
            &[prompt],
            &AttnPattern::Causal,
        )?;
        let d = rel_diff(&p[0], &o[0])?;
        if d > 2e-2 {
            bail!("prefill of sequence {s} ({l} tokens) in the pool differs: {d}");
        }
    }
    drop(holders);
    let mut report = serde_json::Map::new();
    let tree: Vec<Option<usize>> = (0..16)
        .map(|i| if i == 0 { None } else { Some((i - 1) / 2) })
        .collect();
    let cases = [
        ("decode", 1usize, AttnPattern::Causal, false),
        ("chain16", 16, AttnPattern::Causal, true),
        ("tree16", 16, AttnPattern::Tree { parents: tree }, true),
    ];
    for (name, t, pattern, rollback) in cases {
        let mut worst = 0f32;
        let mut argmax_agree = 0usize;
        let mut rows = 0usize;
        for round in 0..3 {
            let starts: Vec<usize> = own.iter().map(|c| c.len()).collect();
            let tokens: Vec<Vec<u32>> = (0..lens.len())
                .map(|s| {
                    (0..t)
                        .map(|i| ((round * 977 + s * 31 + i * 5) % 4096) as u32)
                        .collect()
                })
                .collect();
            let p = step(&m, &mut pooled, &tokens, &pattern)?;
            let mut o = Vec::new();
            for (s, cache) in own.iter_mut().enumerate() {
                o.push(
                    step(
                        &alone,
                        std::slice::from_mut(cache),
                        &tokens[s..s + 1],
                        &pattern,
                    )?
                    .remove(0),
                );
            }
            for (a, b) in p.iter().zip(&o) {
                worst = worst.max(rel_diff(a, b)?);
                let am = a.argmax(1)?.to_vec1::<u32>()?;
                let bm = b.argmax(1)?.to_vec1::<u32>()?;
                argmax_agree += am.iter().zip(&bm).filter(|(x, y)| x == y).count();
                rows += am.len();
            }
            if rollback {
                for (c, &s0) in pooled.iter_mut().zip(&starts) {
                    c.truncate(s0)?;
                }
                for (c, &s0) in own.iter_mut().zip(&starts) {
                    c.truncate(s0)?;
                }
            }
        }
        println!("pooled {name}: worst relative logit difference {worst:.2e}, argmax agrees on {argmax_agree}/{rows}");
        if worst > 2e-2 {
            bail!("pooled {name}: logits differ from each sequence alone by {worst} (relative)");
        }
        report.insert(
            name.into(),
            json!({"worst_rel_diff": worst, "argmax_agree": argmax_agree, "rows": rows}),
        );
    }
    report.insert(
        "mixed".into(),
        mixed(&m, &alone, &pool, &mut pooled, &mut own)?,
    );
    report.insert("graphs_held".into(), json!(m.step_graphs_held()));
    report.insert("drafter".into(), super::pooled_draft::run(&m)?);
    report.insert("pool_free_pages".into(), json!(pool.free_pages()));
    Ok(Value::Object(report))
}
