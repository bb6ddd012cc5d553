//! The fused-kernel forward of [`Qwen3Model`] (CUDA, bf16): per layer one GEMM for q/k/v, one
//! kernel for q/k norm + RoPE + cache write, split-K attention (two kernels) straight over the
//! preallocated cache, the o-projection GEMM, residual add + RMSNorm in one kernel, one GEMM
//! for gate/up, the SiLU product, the down GEMM, and the next residual add fused with the next
//! layer's input norm. About 10 launches per layer instead of about 40; same contract and
//! outputs as the plain path in `qwen3.rs` (to bf16 rounding), which stays the reference.

use std::collections::HashMap;

use candle_core::Tensor;

use crate::attention::AttnPattern;
use crate::error::{ModelError, ModelResult};
use crate::fast;
use crate::kv_cache::LayerCache;
use crate::layer::linear;
use crate::ops::rms_norm;
use crate::qwen3::{ForwardOutput, Qwen3Model, SeqForward};

/// Per-sequence device inputs of one fused forward.
struct SeqInputs {
    offset: usize,
    tokens: usize,
    /// `[1]` u32: committed rows before this forward.
    cache_len: Tensor,
    /// Rows of attention splits covering the live keys.
    nsplit: usize,
    tree: Option<Tensor>,
}

impl Qwen3Model {
    pub(crate) fn forward_fast(
        &self,
        batch: &mut [SeqForward<'_>],
        taps: &[usize],
    ) -> ModelResult<ForwardOutput> {
        let dev = self.device().clone();
        let mut token_offsets = vec![0];
        let mut logit_offsets = vec![0];
        let mut all_tokens = Vec::new();
        let mut all_positions = Vec::new();
        let mut logit_rows = Vec::new();
        let mut inputs = Vec::with_capacity(batch.len());
        for seq in batch.iter() {
            let off = all_tokens.len();
            let t = seq.tokens.len();
            all_tokens.extend_from_slice(seq.tokens);
            all_positions.extend_from_slice(seq.positions);
            logit_rows.extend(seq.logit_rows.iter().map(|&r| (off + r) as u32));
            token_offsets.push(all_tokens.len());
            logit_offsets.push(logit_rows.len());
            let len = seq.cache.len();
            let tree = match seq.pattern {
                AttnPattern::Causal => None,
                AttnPattern::Tree { parents } => {
                    let bits = fast::tree_bits(parents);
                    Some(Tensor::from_vec(bits, (t, t.div_ceil(64)), &dev)?)
                }
                other => {
                    return Err(ModelError::BadInput(format!(
                        "fused forward takes causal or tree patterns, got {other:?}"
                    )))
                }
            };
            inputs.push(SeqInputs {
                offset: off,
                tokens: t,
                cache_len: Tensor::new(&[len as u32], &dev)?,
                nsplit: (len + t).div_ceil(fast::CHUNK),
                tree,
            });
        }
        let positions = Tensor::new(all_positions.as_slice(), &dev)?;
        let (cos, sin) = self.rope.tables();
        let (nh, nkv, d) = self.layers[0].heads();
        let eps = self.cfg.rms_norm_eps;

        let mut x = self.embed(&all_tokens)?;
        let mut h = rms_norm(&x, self.layers[0].norm_weights().0, eps, self.mode())?;
        let mut tapped: HashMap<usize, Tensor> = HashMap::new();
        for (li, layer) in self.layers.iter().enumerate() {
            let fused = layer
                .fused()
                .ok_or_else(|| ModelError::BadInput("fused forward on unfused weights".into()))?;
            let (_, post_norm, q_norm, k_norm) = layer.norm_weights();
            let qkv = linear(&h, &fused.qkv)?;
            let mut outs = Vec::with_capacity(batch.len());
            for (seq, inp) in batch.iter().zip(&inputs) {
                let LayerCache::Attention(kv) = seq.cache.layer(li);
                let (kc, vc) = kv.buffers();
                let rows = qkv.narrow(0, inp.offset, inp.tokens)?;
                let pos = positions.narrow(0, inp.offset, inp.tokens)?;
                let q = fast::qk_norm_rope_cache(
                    &rows,
                    q_norm,
                    k_norm,
                    cos,
                    sin,
                    &pos,
                    &inp.cache_len,
                    kc,
                    vc,
                    (nh, nkv, d),
                    eps,
                )?;
                outs.push(fast::attention(
                    &q,
                    kc,
                    vc,
                    &inp.cache_len,
                    inp.tree.as_ref(),
                    inp.nsplit,
                )?);
            }
            let attn = if outs.len() == 1 {
                outs.pop().expect("one output")
            } else {
                Tensor::cat(&outs, 0)?
            };
            let o = linear(&attn, layer.o_proj())?;
            let (x1, h1) = fast::add_rmsnorm(&x, &o, post_norm, eps)?;
            let gu = linear(&h1, &fused.gate_up)?;
            let act = fast::silu_mul(&gu)?;
            let down = linear(&act, layer.down_proj())?;
            // The next layer's input norm, or the final norm after the last layer.
            let next_norm = match self.layers.get(li + 1) {
                Some(next) => next.norm_weights().0,
                None => &self.norm,
            };
            let (x2, h2) = fast::add_rmsnorm(&x1, &down, next_norm, eps)?;
            x = x2;
            h = h2;
            if taps.contains(&li) {
                tapped.insert(li, x.clone());
            }
        }
        for seq in batch.iter_mut() {
            seq.cache.advance(seq.tokens.len());
        }
        let taps = if taps.is_empty() {
            None
        } else {
            let parts: Vec<&Tensor> = taps.iter().map(|l| &tapped[l]).collect();
            Some(Tensor::cat(&parts, 1)?)
        };
        // `h` already holds the final norm of every row.
        let logits = if logit_rows.is_empty() {
            None
        } else if logit_rows.len() == all_tokens.len()
            && logit_rows.iter().enumerate().all(|(i, &r)| r as usize == i)
        {
            Some(self.lm_head(&h)?)
        } else {
            let rows = Tensor::new(logit_rows.as_slice(), &dev)?;
            Some(self.lm_head(&h.index_select(&rows, 0)?)?)
        };
        Ok(ForwardOutput {
            logits,
            taps,
            token_offsets,
            logit_offsets,
        })
    }
}
