//! The DFlash drafter's block forward through the fused CUDA kernels (see `qwen3_fast.rs`):
//! the block's K/V go into the rows just past the committed context, every block token sees
//! the whole context and the whole block (the Full pattern as all-ones bit rows), and `len`
//! stays unchanged, exactly as the plain path in `dflash.rs`.

use candle_core::Tensor;

use crate::dflash::{DFlashDrafter, DraftInput};
use crate::error::{ModelError, ModelResult};
use crate::fast;
use crate::kv_cache::LayerCache;
use crate::ops::rms_norm;

impl DFlashDrafter {
    /// Final-normed hidden states of every block slot, `[batch * block_size, hidden]`, for
    /// already-appended context; `ids`/`pos` hold the blocks' tokens and positions.
    pub(crate) fn block_fast(
        &self,
        batch: &[DraftInput<'_>],
        ids: &Tensor,
        pos: &Tensor,
    ) -> ModelResult<Tensor> {
        let b = self.config().block_size;
        let dev = self.device().clone();
        let eps = self.config().layers.rms_norm_eps;
        let layers = self.layers();
        let (nh, nkv, d) = layers[0].heads();
        let (cos, sin) = self.rotary().tables();
        let full: Vec<i64> = vec![(u64::MAX >> (64 - b)) as i64; b];
        let full = Tensor::from_vec(full, (b, 1), &dev)?;
        let lens = batch
            .iter()
            .map(|i| Tensor::new(&[i.cache.len() as u32], &dev))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let mut x = self.embed_weight().index_select(ids, 0)?;
        let mut h = rms_norm(&x, layers[0].norm_weights().0, eps, self.mode())?;
        for (li, layer) in layers.iter().enumerate() {
            let fused = layer
                .fused()
                .ok_or_else(|| ModelError::BadInput("fused draft on unfused weights".into()))?;
            let (_, post_norm, q_norm, k_norm) = layer.norm_weights();
            let qkv = fast::linear(&h, &fused.qkv)?;
            let mut outs = Vec::with_capacity(batch.len());
            for (s, item) in batch.iter().enumerate() {
                let LayerCache::Attention(kv) = item.cache.layer(li);
                let (kc, vc) = kv.buffers();
                let q = fast::qk_norm_rope_cache(
                    &qkv.narrow(0, s * b, b)?,
                    q_norm,
                    k_norm,
                    cos,
                    sin,
                    &pos.narrow(0, s * b, b)?,
                    &lens[s],
                    kc,
                    vc,
                    (nh, nkv, d),
                    eps,
                )?;
                let split = fast::split_plan(item.cache.len() + b, b, nh, nkv);
                outs.push(fast::attention(&q, kc, vc, &lens[s], Some(&full), split)?);
            }
            let attn = if outs.len() == 1 {
                outs.swap_remove(0)
            } else {
                Tensor::cat(&outs, 0)?
            };
            let o = fast::linear(&attn, layer.o_proj())?;
            let (x1, h1) = fast::add_rmsnorm(&x, &o, post_norm, eps)?;
            let act = fast::silu_mul(&fast::linear(&h1, &fused.gate_up)?)?;
            let down = fast::linear(&act, layer.down_proj())?;
            let next_norm = match layers.get(li + 1) {
                Some(next) => next.norm_weights().0,
                None => self.final_norm_weight(),
            };
            let (x2, h2) = fast::add_rmsnorm(&x1, &down, next_norm, eps)?;
            x = x2;
            h = h2;
        }
        Ok(h)
    }

    /// The context path fused: per layer one q/k/v GEMM over the new context rows and the
    /// norm + RoPE + cache-write kernel (its q output is dropped: context rows only provide
    /// K/V), then every cache advances past its new rows. `ctx` holds the fused features of
    /// all sequences' new rows in batch order, `pos` their positions.
    pub(crate) fn append_context_fast(
        &self,
        batch: &mut [DraftInput<'_>],
        ctx: &Tensor,
        pos: &Tensor,
    ) -> ModelResult<()> {
        let dev = self.device().clone();
        let eps = self.config().layers.rms_norm_eps;
        let layers = self.layers();
        let (nh, nkv, d) = layers[0].heads();
        let (cos, sin) = self.rotary().tables();
        let mut spans = Vec::with_capacity(batch.len());
        let mut off = 0;
        for item in batch.iter() {
            let n = item.context.map(|c| c.dim(0)).transpose()?.unwrap_or(0);
            let len = Tensor::new(&[item.cache.len() as u32], &dev)?;
            spans.push((off, n, len));
            off += n;
        }
        for (li, layer) in layers.iter().enumerate() {
            let fused = layer
                .fused()
                .ok_or_else(|| ModelError::BadInput("fused draft on unfused weights".into()))?;
            let (_, _, q_norm, k_norm) = layer.norm_weights();
            let qkv = fast::linear(ctx, &fused.qkv)?;
            for (item, (off, n, len)) in batch.iter().zip(&spans) {
                if *n == 0 {
                    continue;
                }
                let LayerCache::Attention(kv) = item.cache.layer(li);
                let (kc, vc) = kv.buffers();
                fast::qk_norm_rope_cache(
                    &qkv.narrow(0, *off, *n)?,
                    q_norm,
                    k_norm,
                    cos,
                    sin,
                    &pos.narrow(0, *off, *n)?,
                    len,
                    kc,
                    vc,
                    (nh, nkv, d),
                    eps,
                )?;
            }
        }
        for (item, (_, n, _)) in batch.iter_mut().zip(&spans) {
            item.cache.advance(*n);
        }
        Ok(())
    }
}
