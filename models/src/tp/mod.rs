//! Tensor parallelism for the Qwen3 dense target, the part that needs no second device: the
//! Megatron-style shards (`shard.rs`: which slice of each weight a rank holds, and the
//! rank-local forward pieces that return partial outputs), the two collectives written as
//! in-process reductions in rank order ([`all_reduce_sum`], [`all_gather_vocab`]), and a
//! driver that runs every rank in turn on one device ([`forward_sequential`]), which the tests
//! hold equal to the unsplit model.
//!
//! A multi-GPU driver keeps `shard.rs` as it is: each rank owns a [`RankShard`] and its
//! cache on its own device and calls the same pieces, with NCCL's all-reduce and all-gather in
//! place of the two functions here. NCCL does not promise rank order (a ring starts each chunk
//! at another rank), so a NCCL run matches these sums to rounding, not bit for bit; every rank
//! still receives the same reduced values, so the ranks never disagree with each other.

mod shard;

pub use shard::{shard_tensor, LayerShard, RankShard, TpPlan};

use candle_core::Tensor;

use crate::cache::SequenceCache;
use crate::error::ModelError;
use crate::layers::attention::AttnPattern;
use crate::qwen3::Qwen3Model;

#[derive(Debug, thiserror::Error)]
pub enum TpError {
    #[error("tensor parallelism needs at least one rank (tp = 0)")]
    ZeroRanks,
    #[error("tp = {tp} does not divide num_attention_heads = {heads}: every rank needs whole query heads")]
    QueryHeads { tp: usize, heads: usize },
    #[error(
        "tp = {tp} cannot split num_key_value_heads = {kv_heads}: tp must divide them, or be a \
         multiple of them (each KV head then replicated on tp / num_key_value_heads ranks)"
    )]
    KvHeads { tp: usize, kv_heads: usize },
    #[error("tp = {tp} does not divide {what} = {size}")]
    Indivisible {
        what: &'static str,
        tp: usize,
        size: usize,
    },
    #[error("rank {rank} out of range for tp = {tp}")]
    Rank { rank: usize, tp: usize },
    #[error("{given} {what} given for tp = {tp}")]
    RankCount {
        what: &'static str,
        given: usize,
        tp: usize,
    },
    #[error("tensor parallelism does not cover {0}")]
    Unsupported(String),
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

/// Every rank's shard of `model` for `tp` ranks (refused, saying why, where the config cannot
/// be split so).
pub fn shard_model(model: &Qwen3Model, tp: usize) -> Result<Vec<RankShard>, TpError> {
    let plan = TpPlan::new(model.config(), tp)?;
    (0..tp).map(|r| RankShard::of(model, &plan, r)).collect()
}

/// The sum of the ranks' partial outputs, added in rank order: one fixed order, so the
/// sequential TP=n result is deterministic (a NCCL all-reduce equals it to rounding).
pub fn all_reduce_sum(partials: &[Tensor]) -> Result<Tensor, TpError> {
    let (first, rest) = partials.split_first().ok_or(TpError::RankCount {
        what: "partials",
        given: 0,
        tp: 1,
    })?;
    let mut acc = first.clone();
    for p in rest {
        acc = (acc + p)?;
    }
    Ok(acc)
}

/// The ranks' vocabulary slices `[rows, vocab / tp]` joined in rank order: `[rows, vocab]`.
pub fn all_gather_vocab(parts: &[Tensor]) -> Result<Tensor, TpError> {
    Ok(Tensor::cat(parts, 1)?)
}

/// One sequence's forward with every rank run in turn on one device: the new `tokens` at
/// `positions` under `pattern`, their K/V appended to each rank's cache (`caches[r]` from
/// `shards[r].new_cache`); returns the f32 logits `[logit_rows, vocab]`. The residual stream
/// after each attention and MLP block is `x + all_reduce_sum(partials)`.
pub fn forward_sequential(
    shards: &[RankShard],
    caches: &mut [SequenceCache],
    tokens: &[u32],
    positions: &[u32],
    pattern: &AttnPattern,
    logit_rows: &[usize],
) -> Result<Tensor, TpError> {
    let tp = shards.first().map_or(0, |s| s.plan.tp);
    let ranks_ok = shards.iter().enumerate().all(|(r, s)| s.rank == r);
    if tp == 0 || shards.len() != tp || !ranks_ok {
        return Err(TpError::RankCount {
            what: "shards (one per rank, in rank order)",
            given: shards.len(),
            tp,
        });
    }
    if caches.len() != tp {
        return Err(TpError::RankCount {
            what: "caches",
            given: caches.len(),
            tp,
        });
    }
    if tokens.len() != positions.len() || tokens.is_empty() {
        return Err(ModelError::BadInput(format!(
            "{} tokens, {} positions",
            tokens.len(),
            positions.len()
        ))
        .into());
    }
    pattern
        .validate(tokens.len())
        .map_err(ModelError::BadInput)?;
    let max = shards[0].max_positions();
    if let Some(&p) = positions.iter().find(|&&p| p as usize >= max) {
        return Err(ModelError::PositionOutOfRange {
            position: p as usize,
            max,
        }
        .into());
    }
    let len = caches[0].len();
    if caches.iter().any(|c| c.len() != len) {
        return Err(
            ModelError::BadCacheOp("the ranks' caches hold different lengths".into()).into(),
        );
    }
    let dev = shards[0].device();
    let mask = pattern.mask(len, tokens.len(), dev)?;
    let (cos, sin) = shards[0].rotary(positions)?;
    let mut x = shards[0].embed(tokens)?;
    for li in 0..shards[0].layers.len() {
        let partials = shards
            .iter()
            .zip(caches.iter())
            .map(|(s, c)| s.layers[li].attention_partial(li, &x, &cos, &sin, c, mask.as_ref()))
            .collect::<Result<Vec<_>, _>>()?;
        x = (x + all_reduce_sum(&partials)?)?;
        let partials = shards
            .iter()
            .map(|s| s.layers[li].mlp_partial(&x))
            .collect::<Result<Vec<_>, _>>()?;
        x = (x + all_reduce_sum(&partials)?)?;
    }
    for c in caches.iter_mut() {
        c.advance(tokens.len());
    }
    if let Some(&r) = logit_rows.iter().find(|&&r| r >= tokens.len()) {
        return Err(
            ModelError::BadInput(format!("logit row {r} of {} tokens", tokens.len())).into(),
        );
    }
    let rows: Vec<u32> = logit_rows.iter().map(|&r| r as u32).collect();
    let rows = Tensor::new(rows.as_slice(), dev)?;
    let last = x.index_select(&rows, 0)?;
    let parts = shards
        .iter()
        .map(|s| s.logits_partial(&last))
        .collect::<Result<Vec<_>, _>>()?;
    all_gather_vocab(&parts)
}

#[cfg(test)]
mod tests;
