//! The drafter's context caches in a paged pool (`gpu-check cuda out.json --pooled`): six
//! sequences of different context lengths, paged out of order in one drafter pool, draft
//! together (their block attention one pooled launch set per layer, their context rows written
//! through the page tables) for a few rounds of new context, and one sequence drafts alone on
//! its pooled cache until its round graph is captured and replayed; every draft's logits are
//! compared with the same sequence in a drafter cache of its own without graphs.

use anyhow::{bail, Result};
use candle_core::{DType, Tensor};
use dflash_common::DFlashConfig;
use dflash_models::{DFlashDrafter, DraftInput, OpsMode, Qwen3Model, SequenceCache};
use serde_json::{json, Value};

/// Random bf16 features `[n, width]`, deterministic in `seed`.
fn features(n: usize, width: usize, seed: usize, dev: &candle_core::Device) -> Result<Tensor> {
    let v: Vec<f32> = (0..n * width)
        .map(|i| (((i * 2654435761 + seed * 97) % 2001) as f32 / 1000.0 - 1.0) * 0.5)
        .collect();
    Ok(Tensor::from_vec(v, (n, width), dev)?.to_dtype(DType::BF16)?)
}

fn rel_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    let d = (a - b)?.abs()?.max_all()?.to_scalar::<f32>()?;
    let s = b.abs()?.max_all()?.to_scalar::<f32>()?;
    Ok(d / s.max(1e-6))
}

/// Draft logits of one batch of `caches` with `contexts[s]` new rows each.
fn draft(
    d: &DFlashDrafter,
    caches: &mut [&mut SequenceCache],
    contexts: &[Tensor],
    blocks: &[Vec<u32>],
) -> Result<Tensor> {
    let mut inputs: Vec<DraftInput<'_>> = caches
        .iter_mut()
        .zip(contexts)
        .zip(blocks)
        .map(|((cache, ctx), block)| DraftInput {
            cache,
            context: Some(ctx),
            block,
        })
        .collect();
    Ok(d.draft_logits(&mut inputs)?)
}

/// Four rounds of the six sequences drafting together in one pool (the first round their
/// whole contexts, then 1..16 new rows each), every draft compared with the same sequence in
/// a drafter cache of its own without graphs: (worst relative logit difference, argmax agreeing
/// rows, rows), and the caches for the round-graph part.
#[allow(clippy::type_complexity)]
fn batch_rounds(
    d: &DFlashDrafter,
) -> Result<(
    f32,
    usize,
    usize,
    Vec<SequenceCache>,
    Vec<SequenceCache>,
    DFlashDrafter,
)> {
    let dev = d.device().clone();
    let cfg = d.config();
    let b = cfg.block_size;
    let width = cfg.target_layer_ids.len() * cfg.layers.hidden_size;
    let alone = d.clone().with_step_graphs(false);
    let pool = d.new_kv_pool(96)?;
    // Pages held by others while ours are taken: page tables with gaps.
    let mut holders: Vec<SequenceCache> = (0..8)
        .map(|_| d.new_cache_in(&pool, 64, 64))
        .collect::<Result<_, _>>()?;
    for i in (0..holders.len()).rev().step_by(2) {
        holders.remove(i);
    }
    let lens = [37usize, 300, 64, 129, 5, 700];
    let mut pooled = Vec::new();
    let mut own = Vec::new();
    for &l in &lens {
        pooled.push(d.new_cache_in(&pool, l + 200, 0)?);
        own.push(alone.new_cache(l + 200)?);
    }
    let mut worst = 0f32;
    let mut agree = 0usize;
    let mut rows = 0usize;
    for round in 0..4 {
        let contexts: Vec<Tensor> = lens
            .iter()
            .enumerate()
            .map(|(s, &l)| {
                let n = if round == 0 {
                    l
                } else {
                    1 + (s * 5 + round * 3) % b
                };
                features(n, width, s * 10 + round, &dev)
            })
            .collect::<Result<_>>()?;
        let blocks: Vec<Vec<u32>> = (0..lens.len())
            .map(|s| {
                let mut v = vec![4095u32; b];
                v[0] = ((round * 131 + s * 17) % 4000) as u32;
                v
            })
            .collect();
        for (c, ctx) in pooled.iter_mut().zip(&contexts) {
            c.grow_to(c.len() + ctx.dim(0)? + b)?;
        }
        let mut refs: Vec<&mut SequenceCache> = pooled.iter_mut().collect();
        let p = draft(&d, &mut refs, &contexts, &blocks)?;
        for (s, cache) in own.iter_mut().enumerate() {
            let o = draft(&alone, &mut [cache], &contexts[s..s + 1], &blocks[s..s + 1])?;
            let ps = p.narrow(0, s * (b - 1), b - 1)?;
            worst = worst.max(rel_diff(&ps, &o)?);
            let am = ps.argmax(1)?.to_vec1::<u32>()?;
            let bm = o.argmax(1)?.to_vec1::<u32>()?;
            agree += am.iter().zip(&bm).filter(|(x, y)| x == y).count();
            rows += am.len();
        }
        if pooled.iter().zip(&own).any(|(a, o)| a.len() != o.len()) {
            bail!("pooled drafter caches advanced differently from their own-buffer twins");
        }
    }
    drop(holders);
    Ok((worst, agree, rows, pooled, own, alone))
}

pub fn run(target: &Qwen3Model) -> Result<Value> {
    let dev = target.device().clone();
    let cfg = DFlashConfig::for_target(target.config(), 2, 16, 4095, Some(vec![1, 2]));
    let b = cfg.block_size;
    let width = cfg.target_layer_ids.len() * cfg.layers.hidden_size;
    let d = DFlashDrafter::random(cfg, target, 11, OpsMode::Fused)?;
    if !d.fast_kernels() {
        bail!("the pooled drafter check needs the fused kernels (CUDA, bf16)");
    }
    let mut batch = Vec::new();
    // The context rows written one launch per sequence per layer, then one per layer for the
    // whole batch (`cuda::set_batched_context_append`): both against each sequence alone.
    let mut last = None;
    let default = dflash_models::cuda::batched_context_append();
    for batched in [false, true] {
        dflash_models::cuda::set_batched_context_append(batched);
        let r = batch_rounds(&d);
        dflash_models::cuda::set_batched_context_append(default);
        let (worst, agree, rows, pooled, own, alone) = r?;
        println!("pooled drafter batch (batched context append {batched}): worst relative logit difference {worst:.2e}, argmax agrees on {agree}/{rows}");
        if worst > 2e-2 {
            bail!("pooled drafter (batched context append {batched}): logits differ from each sequence alone by {worst} (relative)");
        }
        batch.push(
            json!({"batched_context_append": batched, "worst_rel_diff": worst,
                          "argmax_agree": agree, "rows": rows}),
        );
        last = Some((pooled, own, alone, worst, agree, rows));
    }
    let Some((mut pooled, mut own, alone, worst, agree, rows)) = last else {
        bail!("no batch rounds ran");
    };
    // One sequence alone on its pooled cache: rounds of 3 new rows, the graph captured on the
    // second and replayed after.
    let mut graph_worst = 0f32;
    for round in 0..5 {
        let ctx = [features(3, width, 500 + round, &dev)?];
        let mut block = vec![4095u32; b];
        block[0] = (round * 7 + 3) as u32;
        let blocks = [block];
        let want = pooled[1].len() + 3 + b;
        pooled[1].grow_to(want)?;
        let p = draft(&d, &mut [&mut pooled[1]], &ctx, &blocks)?;
        let o = draft(&alone, &mut [&mut own[1]], &ctx, &blocks)?;
        graph_worst = graph_worst.max(rel_diff(&p, &o)?);
    }
    println!(
        "pooled drafter round graph: worst relative logit difference {graph_worst:.2e}, graphs held {}",
        d.step_graphs_held()
    );
    if graph_worst > 2e-2 {
        bail!("pooled drafter round graph: logits differ by {graph_worst} (relative)");
    }
    if d.step_graphs_held() == 0 {
        bail!("pooled drafter round graph was never captured");
    }
    Ok(json!({
        "batches": batch,
        "batch_worst_rel_diff": worst,
        "argmax_agree": agree,
        "rows": rows,
        "round_graph_worst_rel_diff": graph_worst,
        "graphs_held": d.step_graphs_held(),
    }))
}
