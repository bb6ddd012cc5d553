//! The sparse-MoE MLP of every MoE target (HF `Qwen3MoeSparseMoeBlock`,
//! `Qwen3_5MoeSparseMoeBlock`, `Qwen3NextSparseMoeBlock`), and [`FeedForward`], a decoder layer's
//! choice between it and the dense [`Mlp`].
//!
//! Per token: `p = softmax_f32(gate(x))`, the top-k experts by `p` (ties to the lower index, as
//! `torch.topk` on the CPU), weights `p_i` renormalised to sum 1 when `norm_topk_prob`, cast to
//! the model dtype; the output is `sum_i w_i * expert_i(x)`, plus
//! `sigmoid(shared_expert_gate(x)) * shared_expert(x)` for the hybrids, whose block has a shared
//! expert (`qwen3_moe`'s has none). Here routing runs on the host (a handful of floats per
//! token, and the exact top-k order decides which experts run): this is the reference, and the
//! path of wide forwards. The fused CUDA stack runs the same math on the device for a few rows
//! (`cuda/moe.rs`, over the experts stacked by [`SparseMoe::stack_experts`]).
//!
//! Experts load from either on-disk form: the 3D tensors `experts.gate_up_proj` `[E, 2I, H]`
//! (gate rows, then up rows) and `experts.down_proj` `[E, H, I]` that the Qwen3.5-MoE releases
//! and transformers 5 use, or one 2D tensor per expert (`experts.{e}.gate_proj.weight`, ...) as
//! in the Qwen3-30B-A3B, Qwen3-Coder-30B-A3B and Qwen3-Next releases.

use candle_core::{DType, Device, Result, Tensor};
use dflash_common::{MoeConfig, WeightError, WeightFiles};

use crate::error::{ModelError, ModelResult};
use crate::layers::mlp::Mlp;
use crate::layers::ops::linear;
use crate::random::WeightRng;

/// A decoder layer's MLP: dense, or the sparse-MoE block where the config makes the layer sparse.
#[derive(Debug, Clone)]
pub enum FeedForward {
    Dense(Mlp),
    Sparse(SparseMoe),
}

impl FeedForward {
    /// Loads the MLP under `p` (`...layers.{i}.mlp`): the sparse block of shape `moe` where the
    /// config makes the layer sparse (`Some`), else a dense MLP of hidden size `h` and width
    /// `intermediate`.
    pub fn load(
        w: &WeightFiles,
        p: &str,
        h: usize,
        intermediate: usize,
        moe: Option<&MoeConfig>,
        dtype: DType,
        device: &Device,
    ) -> ModelResult<Self> {
        if let Some(moe) = moe {
            return Ok(Self::Sparse(SparseMoe::load(w, p, moe, h, dtype, device)?));
        }
        if w.contains(&format!("{p}.gate.weight")) {
            return Err(ModelError::Inconsistent(format!(
                "{}: config.json makes `{p}` a dense MLP, but the checkpoint has a MoE router (`{p}.gate.weight`) there: check model_type, num_experts, mlp_only_layers and decoder_sparse_step",
                w.dir().display()
            )));
        }
        Ok(Self::Dense(Mlp::load(
            w,
            p,
            h,
            intermediate,
            dtype,
            device,
        )?))
    }

    pub fn random(
        rng: &mut WeightRng,
        h: usize,
        intermediate: usize,
        moe: Option<&MoeConfig>,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        Ok(match moe {
            Some(moe) => Self::Sparse(SparseMoe::random(rng, moe, h, dtype, device)?),
            None => Self::Dense(Mlp::random(rng, h, intermediate, dtype, device)?),
        })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Self::Dense(m) => m.forward(x),
            Self::Sparse(m) => m.forward(x),
        }
    }

    pub fn dense(&self) -> Option<&Mlp> {
        match self {
            Self::Dense(m) => Some(m),
            Self::Sparse(_) => None,
        }
    }

    /// Every tensor with its checkpoint name relative to the MLP's prefix (experts in the
    /// one-tensor-per-expert form).
    pub fn named_tensors(&self) -> Vec<(String, &Tensor)> {
        match self {
            Self::Dense(m) => mlp("", m),
            Self::Sparse(m) => {
                let mut out = vec![("gate.weight".to_string(), &m.gate)];
                for (e, expert) in m.experts.iter().enumerate() {
                    out.extend(mlp(&format!("experts.{e}."), expert));
                }
                if let Some(s) = &m.shared {
                    out.extend(mlp("shared_expert.", &s.mlp));
                    out.push(("shared_expert_gate.weight".to_string(), &s.gate));
                }
                out
            }
        }
    }
}

/// A SwiGLU MLP's three tensors named as in the checkpoint, under `prefix`.
fn mlp<'a>(prefix: &str, m: &'a Mlp) -> Vec<(String, &'a Tensor)> {
    let (g, u, d) = m.weights();
    vec![
        (format!("{prefix}gate_proj.weight"), g),
        (format!("{prefix}up_proj.weight"), u),
        (format!("{prefix}down_proj.weight"), d),
    ]
}

#[derive(Debug, Clone)]
pub struct SparseMoe {
    /// Router `[E, H]`.
    gate: Tensor,
    experts: Vec<Mlp>,
    /// The hybrids' shared expert (None for `qwen3_moe`).
    shared: Option<SharedExpert>,
    top_k: usize,
    norm_topk_prob: bool,
}

/// An expert every token goes through, scaled by `sigmoid(gate(x))`.
#[derive(Debug, Clone)]
struct SharedExpert {
    mlp: Mlp,
    /// `[1, H]`: the scalar gate per token.
    gate: Tensor,
}

impl SparseMoe {
    pub fn load(
        w: &WeightFiles,
        p: &str,
        moe: &MoeConfig,
        h: usize,
        dtype: DType,
        device: &Device,
    ) -> ModelResult<Self> {
        let (e, i) = (moe.num_experts, moe.moe_intermediate_size);
        let t = |name: &str, shape: &[usize]| -> ModelResult<Tensor> {
            w.tensor(&format!("{p}.{name}"), shape, dtype, device)
                .map_err(|err| name_the_key(err, name))
        };
        let gate = t("gate.weight", &[e, h])?;
        let experts = if w.contains(&format!("{p}.experts.gate_up_proj")) {
            let gate_up = t("experts.gate_up_proj", &[e, 2 * i, h])?;
            let down = t("experts.down_proj", &[e, h, i])?;
            (0..e)
                .map(|x| {
                    let gu = gate_up.get(x)?;
                    Ok(Mlp::from_parts(
                        gu.narrow(0, 0, i)?,
                        gu.narrow(0, i, i)?,
                        down.get(x)?,
                    ))
                })
                .collect::<Result<Vec<_>>>()?
        } else {
            if w.contains(&format!("{p}.experts.{e}.gate_proj.weight")) {
                return Err(ModelError::Inconsistent(format!(
                    "{}: `{p}.experts.{e}.*` exists but config.json num_experts is {e} (experts 0..{e}): the config and the weights disagree on the expert count",
                    w.dir().display()
                )));
            }
            (0..e)
                .map(|x| {
                    Mlp::load(w, &format!("{p}.experts.{x}"), h, i, dtype, device)
                        .map_err(|err| name_the_key(err, "experts"))
                })
                .collect::<ModelResult<Vec<_>>>()?
        };
        let shared = match moe.shared_expert_intermediate_size {
            Some(si) => Some(SharedExpert {
                mlp: Mlp::load(w, &format!("{p}.shared_expert"), h, si, dtype, device)
                    .map_err(|err| name_the_key(err, "shared_expert"))?,
                gate: t("shared_expert_gate.weight", &[1, h])?,
            }),
            None => None,
        };
        Ok(Self {
            gate,
            experts,
            shared,
            top_k: moe.num_experts_per_tok,
            norm_topk_prob: moe.norm_topk_prob,
        })
    }

    pub fn random(
        rng: &mut WeightRng,
        moe: &MoeConfig,
        h: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let i = moe.moe_intermediate_size;
        Ok(Self {
            gate: rng.linear(moe.num_experts, h, dtype, device)?,
            experts: (0..moe.num_experts)
                .map(|_| Mlp::random(rng, h, i, dtype, device))
                .collect::<Result<_>>()?,
            shared: match moe.shared_expert_intermediate_size {
                Some(si) => Some(SharedExpert {
                    mlp: Mlp::random(rng, h, si, dtype, device)?,
                    gate: rng.linear(1, h, dtype, device)?,
                }),
                None => None,
            },
            top_k: moe.num_experts_per_tok,
            norm_topk_prob: moe.norm_topk_prob,
        })
    }

    /// The same block with every weight cast to `dtype` (a bf16 block and its exact f32 copy
    /// for the kernel checks).
    pub fn to_dtype(&self, dtype: DType) -> Result<Self> {
        let cast = |m: &Mlp| -> Result<Mlp> {
            let (g, u, d) = m.weights();
            Ok(Mlp::from_parts(
                g.to_dtype(dtype)?,
                u.to_dtype(dtype)?,
                d.to_dtype(dtype)?,
            ))
        };
        Ok(Self {
            gate: self.gate.to_dtype(dtype)?,
            experts: self.experts.iter().map(cast).collect::<Result<_>>()?,
            shared: match &self.shared {
                Some(s) => Some(SharedExpert {
                    mlp: cast(&s.mlp)?,
                    gate: s.gate.to_dtype(dtype)?,
                }),
                None => None,
            },
            top_k: self.top_k,
            norm_topk_prob: self.norm_topk_prob,
        })
    }

    /// Whether the block has the hybrids' shared expert.
    pub fn has_shared_expert(&self) -> bool {
        self.shared.is_some()
    }

    /// The router `[E, H]`.
    pub fn router(&self) -> &Tensor {
        &self.gate
    }

    /// `[T, H] -> [T, H]`; every row is routed on its own, so any batch of rows (prefill,
    /// decode, verify trees) gives each token exactly what a one-token forward would.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let logits = linear(x, &self.gate)?
            .to_dtype(DType::F32)?
            .to_vec2::<f32>()?;
        // Per expert: the rows routed to it and their weights.
        let mut rows: Vec<Vec<u32>> = vec![Vec::new(); self.experts.len()];
        let mut weights: Vec<Vec<f32>> = vec![Vec::new(); self.experts.len()];
        for (t, row) in logits.iter().enumerate() {
            for (e, wgt) in route(row, self.top_k, self.norm_topk_prob) {
                rows[e].push(t as u32);
                weights[e].push(wgt);
            }
        }
        let out = self.combine(x, &rows, &weights)?;
        match &self.shared {
            Some(s) => {
                let g = candle_nn::ops::sigmoid(&linear(x, &s.gate)?)?;
                out + s.mlp.forward(x)?.broadcast_mul(&g)?
            }
            None => Ok(out),
        }
    }

    /// The routed experts' weighted outputs summed per row: `rows[e]` / `weights[e]` are the
    /// rows routed to expert `e` and their weights. Each row's sum starts from zero and adds
    /// its experts in ascending order, every addition rounded to `x`'s dtype: what
    /// transformers' `index_add_` per expert computes. Done with one gather of the inputs in
    /// expert order, one weighting, and one gather-and-add per top-k slot over all rows,
    /// instead of an upload, a gather, a weighting and an `index_add` per expert: candle's
    /// dim-0 `index_add` runs one thread per column looping over the expert's rows, and a
    /// prefill of 4K rows at the 35B-A3B shape made 256 such launches a layer.
    fn combine(&self, x: &Tensor, rows: &[Vec<u32>], weights: &[Vec<f32>]) -> Result<Tensor> {
        let (dtype, n) = (x.dtype(), x.dim(0)?);
        let dev = x.device();
        let mut out = x.zeros_like()?;
        // Every (row, expert) pair in ascending expert order: the rows to gather, their
        // weights, each used expert's span, and each row's pair positions in that order. Two
        // uploads for the whole block, not two per expert.
        let (mut order, mut wts, mut spans) = (Vec::new(), Vec::new(), Vec::new());
        let mut row_pairs: Vec<Vec<u32>> = vec![Vec::with_capacity(self.top_k); n];
        for (e, (r, w)) in rows.iter().zip(weights).enumerate() {
            if r.is_empty() {
                continue;
            }
            spans.push((e, order.len(), r.len()));
            for &row in r {
                row_pairs[row as usize].push(order.len() as u32);
                order.push(row);
            }
            wts.extend_from_slice(w);
        }
        if order.is_empty() {
            return Ok(out);
        }
        let pairs = order.len() as u32;
        let gathered = x.index_select(&Tensor::new(order.as_slice(), dev)?, 0)?;
        let parts = spans
            .iter()
            .map(|&(e, at, len)| self.experts[e].forward(&gathered.narrow(0, at, len)?))
            .collect::<Result<Vec<_>>>()?;
        let w = Tensor::new(wts.as_slice(), dev)?
            .to_dtype(dtype)?
            .unsqueeze(1)?;
        let weighted = Tensor::cat(&parts, 0)?.broadcast_mul(&w)?;
        // A zero row after the pairs for rows with fewer pairs than the most (none: every
        // row takes top_k experts; kept so the gather never reads past the stack).
        let stacked = Tensor::cat(&[weighted, Tensor::zeros((1, x.dim(1)?), dtype, dev)?], 0)?;
        let depth = row_pairs.iter().map(Vec::len).max().unwrap_or(0);
        for j in 0..depth {
            let idx: Vec<u32> = row_pairs
                .iter()
                .map(|p| p.get(j).copied().unwrap_or(pairs))
                .collect();
            out = (out + stacked.index_select(&Tensor::new(idx.as_slice(), dev)?, 0)?)?;
        }
        Ok(out)
    }
}

/// A sparse block's weights stacked for the device kernels (`cuda/moe.rs`): the experts'
/// gate and up rows `[E, 2I, H]` (gate rows first in each expert) and down projections
/// `[E, H, I]`, with the router and the routing switches.
#[derive(Debug, Clone)]
pub struct StackedExperts {
    pub router: Tensor,
    pub gate_up: Tensor,
    pub down: Tensor,
    pub top_k: usize,
    pub norm_topk_prob: bool,
}

impl SparseMoe {
    /// Stacks the routed experts into [`StackedExperts`] and re-points every expert at views of
    /// the stacks (same values; the per-expert tensors are freed, so nothing is stored twice).
    /// A shared expert (the hybrids') is not part of it: [`Self::stack_shared`].
    pub fn stack_experts(&mut self) -> Result<Option<StackedExperts>> {
        let (mut gates, mut ups, mut downs) = (Vec::new(), Vec::new(), Vec::new());
        for m in &self.experts {
            let (g, u, d) = m.weights();
            gates.push(g.clone());
            ups.push(u.clone());
            downs.push(d.clone());
        }
        let gate_up = Tensor::cat(&[Tensor::stack(&gates, 0)?, Tensor::stack(&ups, 0)?], 1)?;
        let down = Tensor::stack(&downs, 0)?;
        drop((gates, ups, downs));
        let i = gate_up.dim(1)? / 2;
        for (x, m) in self.experts.iter_mut().enumerate() {
            let gu = gate_up.get(x)?;
            *m = Mlp::from_parts(gu.narrow(0, 0, i)?, gu.narrow(0, i, i)?, down.get(x)?);
        }
        Ok(Some(StackedExperts {
            router: self.gate.clone(),
            gate_up,
            down,
            top_k: self.top_k,
            norm_topk_prob: self.norm_topk_prob,
        }))
    }
}

impl SparseMoe {
    /// The shared expert for the device path: its `[gate; up]` stacked `[2S, H]` (the expert
    /// re-pointed at views of it), its down projection `[H, S]` and its gate row `[1, H]`.
    /// None for a block without one (`qwen3_moe`).
    pub fn stack_shared(&mut self) -> Result<Option<SharedExpertWeights>> {
        let Some(s) = &mut self.shared else {
            return Ok(None);
        };
        let gate_up = s.mlp.stack_gate_up()?;
        Ok(Some(SharedExpertWeights {
            gate_up,
            down: s.mlp.weights().2.clone(),
            gate: s.gate.clone(),
        }))
    }
}

impl SparseMoe {
    /// The shared expert's gate row `[1, H]`, stacked `[gate; up]` `[2S, H]` and down `[H, S]`
    /// (copies; for checks that rebuild the block from its pieces). Errors without one.
    pub fn shared_parts_for_checks(&self) -> Result<(Tensor, Tensor, Tensor)> {
        let Some(s) = &self.shared else {
            candle_core::bail!("the block has no shared expert")
        };
        let (g, u, d) = s.mlp.weights();
        Ok((s.gate.clone(), Tensor::cat(&[g, u], 0)?, d.clone()))
    }
}

/// A shared expert's weights as the device path reads them ([`SparseMoe::stack_shared`]).
#[derive(Debug, Clone)]
pub struct SharedExpertWeights {
    /// `[2S, H]`, gate rows first.
    pub gate_up: Tensor,
    /// `[H, S]`.
    pub down: Tensor,
    /// `[1, H]`: `sigmoid(x @ gateᵀ)` scales the expert's output per token.
    pub gate: Tensor,
}

/// One token's routing: `(expert, weight)` for the top `k` of `softmax(logits)` computed in
/// f32, highest first, ties to the lower index; weights renormalised over the k when `norm`.
pub fn route(logits: &[f32], k: usize, norm: bool) -> Vec<(usize, f32)> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let exp: Vec<f32> = logits.iter().map(|&l| (l - max).exp()).collect();
    let sum: f32 = exp.iter().sum();
    let mut order: Vec<usize> = (0..logits.len()).collect();
    // Stable sort: equal probabilities keep ascending expert order.
    order.sort_by(|&a, &b| exp[b].total_cmp(&exp[a]));
    let mut top: Vec<(usize, f32)> = order[..k].iter().map(|&e| (e, exp[e] / sum)).collect();
    if norm {
        let s: f32 = top.iter().map(|&(_, p)| p).sum();
        for (_, p) in &mut top {
            *p /= s;
        }
    }
    top
}

/// A shape mismatch on an MoE tensor names the config key that sets that shape.
fn name_the_key(err: impl Into<ModelError>, what: &str) -> ModelError {
    match err.into() {
        ModelError::Weights(WeightError::ShapeMismatch {
            file,
            name,
            expected,
            found,
        }) => {
            let key = match what {
                w if w.starts_with("gate") => "num_experts / hidden_size",
                w if w.starts_with("shared_expert_gate") => "hidden_size",
                w if w.starts_with("shared_expert") => "shared_expert_intermediate_size",
                _ => "num_experts / moe_intermediate_size",
            };
            ModelError::Inconsistent(format!(
                "{}: `{name}` has shape {found:?} but config.json ({key}) makes it {expected:?}",
                file.display()
            ))
        }
        other => other,
    }
}

#[cfg(test)]
mod tests;
