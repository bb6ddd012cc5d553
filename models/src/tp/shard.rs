//! Megatron-style shards of a Qwen3 dense target for `tp` ranks: which slice of every weight a
//! rank holds ([`TpPlan`]) and the rank-local pieces of the forward ([`RankShard`]) that return
//! partial outputs for an all-reduce (or, for the LM head, a vocabulary slice for a gather).
//!
//! Per decoder layer (the residual stream `x` is replicated on every rank):
//! - q/k/v column-parallel by whole heads: rank r holds query heads `q_heads(r)` and the KV
//!   heads they read (`kv_heads(r)`), so its attention runs alone over its own K/V cache;
//! - o_proj row-parallel: rank r holds the input columns of its query heads, so
//!   `o_proj(attn)` splits into a sum over ranks of `o_proj[:, cols_r](attn_r)`;
//! - gate/up column-parallel, down row-parallel over the intermediate size, the same way;
//! - norms (input, post-attention, q/k per head, final) replicated: they act per row or per
//!   head, never across a split.
//!
//! The embedding is replicated; the LM head is vocabulary-parallel (rows of the vocabulary per
//! rank, then a gather in rank order).

use std::collections::HashMap;
use std::ops::Range;

use candle_core::{DType, Device, Tensor};
use dflash_common::Qwen3Config;

use super::TpError;
use crate::cache::SequenceCache;
use crate::error::ModelError;
use crate::layers::attention::attend;
use crate::layers::decoder_layer::{linear, DecoderLayer};
use crate::layers::ops::{rms_norm, OpsMode};
use crate::layers::rope::RotaryEmbedding;
use crate::qwen3::Qwen3Model;

/// How `tp` ranks split a Qwen3 dense config.
#[derive(Debug, Clone, PartialEq)]
pub struct TpPlan {
    pub tp: usize,
    /// Query heads per rank.
    pub q_heads: usize,
    /// KV heads per rank (1 where they are replicated).
    pub kv_heads: usize,
    /// Ranks that hold a copy of each KV head (1: KV heads are split, not replicated).
    pub kv_replicas: usize,
    pub head_dim: usize,
    /// Intermediate (MLP) width per rank.
    pub intermediate: usize,
    /// Vocabulary rows per rank.
    pub vocab: usize,
}

impl TpPlan {
    /// The split of `cfg` over `tp` ranks, or why it cannot be split. KV heads are split where
    /// `tp` divides them and replicated where `tp` is a multiple of them (SGLang's rule for
    /// tp > KV heads: each rank's query heads then all read one KV head).
    pub fn new(cfg: &Qwen3Config, tp: usize) -> Result<Self, TpError> {
        if tp == 0 {
            return Err(TpError::ZeroRanks);
        }
        let (nh, nkv) = (cfg.num_attention_heads, cfg.num_key_value_heads);
        if !nh.is_multiple_of(tp) {
            return Err(TpError::QueryHeads { tp, heads: nh });
        }
        let (kv_heads, kv_replicas) = if nkv.is_multiple_of(tp) {
            (nkv / tp, 1)
        } else if tp.is_multiple_of(nkv) {
            (1, tp / nkv)
        } else {
            return Err(TpError::KvHeads { tp, kv_heads: nkv });
        };
        if !cfg.intermediate_size.is_multiple_of(tp) {
            return Err(TpError::Indivisible {
                what: "intermediate_size",
                tp,
                size: cfg.intermediate_size,
            });
        }
        // NCCL's all-gather takes equal counts per rank; a ragged vocabulary would need padding.
        if !cfg.vocab_size.is_multiple_of(tp) {
            return Err(TpError::Indivisible {
                what: "vocab_size",
                tp,
                size: cfg.vocab_size,
            });
        }
        if cfg.moe.is_some() {
            return Err(TpError::Unsupported(
                "sparse-MoE layers (expert parallelism is another split)".into(),
            ));
        }
        Ok(Self {
            tp,
            q_heads: nh / tp,
            kv_heads,
            kv_replicas,
            head_dim: cfg.head_dim,
            intermediate: cfg.intermediate_size / tp,
            vocab: cfg.vocab_size / tp,
        })
    }

    fn check_rank(&self, rank: usize) -> Result<(), TpError> {
        if rank >= self.tp {
            return Err(TpError::Rank { rank, tp: self.tp });
        }
        Ok(())
    }

    /// Rank `rank`'s query heads.
    pub fn q_head_range(&self, rank: usize) -> Range<usize> {
        rank * self.q_heads..(rank + 1) * self.q_heads
    }

    /// The KV heads rank `rank`'s query heads read (HF `repeat_kv`: query head h reads KV head
    /// h / groups, and a rank's query heads are adjacent, so they read adjacent KV heads).
    pub fn kv_head_range(&self, rank: usize) -> Range<usize> {
        let first = rank / self.kv_replicas * self.kv_heads;
        first..first + self.kv_heads
    }

    pub fn intermediate_range(&self, rank: usize) -> Range<usize> {
        rank * self.intermediate..(rank + 1) * self.intermediate
    }

    pub fn vocab_range(&self, rank: usize) -> Range<usize> {
        rank * self.vocab..(rank + 1) * self.vocab
    }

    /// `cfg` with one rank's head counts and intermediate size: the shape of a rank's layer.
    pub fn rank_config(&self, cfg: &Qwen3Config) -> Qwen3Config {
        Qwen3Config {
            num_attention_heads: self.q_heads,
            num_key_value_heads: self.kv_heads,
            intermediate_size: self.intermediate,
            ..cfg.clone()
        }
    }
}

/// A fresh copy of `len` entries of `t` from `start` along `dim`: a rank's own memory, not a
/// view keeping the whole tensor alive.
fn slice(t: &Tensor, dim: usize, r: Range<usize>) -> Result<Tensor, TpError> {
    Ok(t.narrow(dim, r.start, r.len())?.force_contiguous()?)
}

/// Rank `rank`'s slice of the tensor named `name` (checkpoint name relative to the layer).
pub fn shard_tensor(plan: &TpPlan, rank: usize, name: &str, t: &Tensor) -> Result<Tensor, TpError> {
    let d = plan.head_dim;
    let heads = |r: Range<usize>| r.start * d..r.end * d;
    match name {
        "self_attn.q_proj.weight" => slice(t, 0, heads(plan.q_head_range(rank))),
        "self_attn.k_proj.weight" | "self_attn.v_proj.weight" => {
            slice(t, 0, heads(plan.kv_head_range(rank)))
        }
        "self_attn.o_proj.weight" => slice(t, 1, heads(plan.q_head_range(rank))),
        "mlp.gate_proj.weight" | "mlp.up_proj.weight" => slice(t, 0, plan.intermediate_range(rank)),
        "mlp.down_proj.weight" => slice(t, 1, plan.intermediate_range(rank)),
        _ => Ok(t.clone()),
    }
}

/// One rank's part of a dense decoder layer: a [`DecoderLayer`] of the rank's shape
/// ([`TpPlan::rank_config`]) holding its slices, so the layer's own ops (norms, q/k norm +
/// RoPE, attention) run unchanged on fewer heads.
#[derive(Debug, Clone)]
pub struct LayerShard {
    pub(crate) layer: DecoderLayer,
}

impl LayerShard {
    /// Rank `rank`'s slices of `full`, built by `pick(name, tensor)` (normally
    /// [`shard_tensor`]; tests pass a wrong split through here to see it fail).
    pub fn new(
        full: &DecoderLayer,
        rank_cfg: &Qwen3Config,
        mut pick: impl FnMut(&str, &Tensor) -> Result<Tensor, TpError>,
    ) -> Result<Self, TpError> {
        if full.is_sparse() {
            return Err(TpError::Unsupported("a sparse-MoE layer".into()));
        }
        let named: HashMap<String, &Tensor> = full.named_tensors().into_iter().collect();
        let layer = DecoderLayer::from_tensors(rank_cfg, full.mode(), |name, shape| {
            let t = named
                .get(name)
                .ok_or_else(|| ModelError::Inconsistent(format!("layer has no {name}")))?;
            let s = pick(name, t).map_err(|e| ModelError::Inconsistent(e.to_string()))?;
            if s.dims() != shape {
                return Err(ModelError::Inconsistent(format!(
                    "shard of {name} is {:?}, the rank's layer needs {shape:?}",
                    s.dims()
                )));
            }
            Ok(s)
        })?;
        Ok(Self { layer })
    }

    /// The rank's partial attention output for the rows `x: [rows, hidden]` (the layer's
    /// input, replicated): its heads' `o_proj` contribution, `[rows, hidden]`. Appends the
    /// rows' K/V to the rank's `cache` at row `cache.len()` of layer `li` (not advanced here:
    /// the caller advances after the last layer). `mask`: the attention pattern over
    /// `cache.len() + rows` keys.
    pub fn attention_partial(
        &self,
        li: usize,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        cache: &SequenceCache,
        mask: Option<&Tensor>,
    ) -> Result<Tensor, TpError> {
        let h = self.layer.input_norm(x)?;
        let (q, k, v) = self.layer.qkv(&h, cos, sin)?;
        let (len, t) = (cache.len(), x.dim(0)?);
        cache.write_kv(li, len, &k, &v)?;
        let (kc, vc) = cache.view_kv(li, len + t)?;
        let attn = attend(&q, &kc, &vc, mask, self.layer.mode())?;
        Ok(linear(&attn, self.layer.o_proj())?)
    }

    /// The rank's partial MLP output for `x` (the post-attention residual stream, replicated):
    /// `down[:, cols_r](silu(gate_r x) * up_r x)`.
    pub fn mlp_partial(&self, x: &Tensor) -> Result<Tensor, TpError> {
        let (_, post_norm, _, _) = self.layer.norm_weights();
        let h = rms_norm(x, post_norm, self.layer.eps(), self.layer.mode())?;
        let mlp = self
            .layer
            .mlp()
            .dense()
            .ok_or_else(|| TpError::Unsupported("a sparse-MoE layer".into()))?;
        Ok(mlp.forward_with(&h, self.layer.mode())?)
    }
}

/// Everything one rank holds: its layer shards, its vocabulary rows of the LM head, and the
/// replicated pieces (embedding, final norm, rotary tables).
#[derive(Debug, Clone)]
pub struct RankShard {
    pub rank: usize,
    pub plan: TpPlan,
    pub layers: Vec<LayerShard>,
    /// `[vocab / tp, hidden]`: rows `plan.vocab_range(rank)` of the LM head.
    pub lm_head: Tensor,
    embed_tokens: Tensor,
    norm: Tensor,
    rope: RotaryEmbedding,
    eps: f64,
    mode: OpsMode,
    dtype: DType,
    device: Device,
}

impl RankShard {
    /// Rank `rank`'s shard of `model` (a dense Qwen3 target).
    pub fn of(model: &Qwen3Model, plan: &TpPlan, rank: usize) -> Result<Self, TpError> {
        Self::with_split(model, plan, rank, |name, t| {
            shard_tensor(plan, rank, name, t)
        })
    }

    /// [`Self::of`] with each layer tensor's slice chosen by `pick(name, tensor)`.
    pub fn with_split(
        model: &Qwen3Model,
        plan: &TpPlan,
        rank: usize,
        mut pick: impl FnMut(&str, &Tensor) -> Result<Tensor, TpError>,
    ) -> Result<Self, TpError> {
        plan.check_rank(rank)?;
        let cfg = model.config();
        if TpPlan::new(cfg, plan.tp)? != *plan {
            return Err(TpError::Unsupported(
                "a plan made for another config".into(),
            ));
        }
        let rank_cfg = plan.rank_config(cfg);
        let layers = model
            .layers
            .iter()
            .map(|l| LayerShard::new(l, &rank_cfg, &mut pick))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            rank,
            plan: plan.clone(),
            layers,
            lm_head: slice(model.lm_head_weight(), 0, plan.vocab_range(rank))?,
            embed_tokens: model.embed_weight().clone(),
            norm: model.norm.clone(),
            rope: model.rope().clone(),
            eps: cfg.rms_norm_eps,
            mode: model.mode(),
            dtype: model.dtype(),
            device: model.device().clone(),
        })
    }

    /// A K/V cache for this rank's KV heads, `capacity` positions.
    pub fn new_cache(&self, capacity: usize) -> Result<SequenceCache, TpError> {
        Ok(SequenceCache::new_attention(
            self.layers.len(),
            self.plan.kv_heads,
            self.plan.head_dim,
            capacity,
            self.dtype,
            &self.device,
        )?)
    }

    /// Token embeddings `[n, hidden]` (replicated: every rank computes the same rows).
    pub fn embed(&self, tokens: &[u32]) -> Result<Tensor, TpError> {
        let ids = Tensor::new(tokens, &self.device)?;
        Ok(self.embed_tokens.index_select(&ids, 0)?)
    }

    /// Rotary rows for `positions`, in the model's dtype.
    pub fn rotary(&self, positions: &[u32]) -> Result<(Tensor, Tensor), TpError> {
        let p = Tensor::new(positions, &self.device)?;
        let (cos, sin) = self.rope.gather(&p)?;
        Ok((cos.to_dtype(self.dtype)?, sin.to_dtype(self.dtype)?))
    }

    pub fn max_positions(&self) -> usize {
        self.rope.max_positions()
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// This rank's vocabulary slice of the logits (f32) of the final-normed-to-be rows `x`:
    /// `[rows, vocab / tp]`, for a gather in rank order.
    pub fn logits_partial(&self, x: &Tensor) -> Result<Tensor, TpError> {
        let h = rms_norm(x, &self.norm, self.eps, self.mode)?;
        Ok(linear(&h, &self.lm_head)?.to_dtype(DType::F32)?)
    }
}
