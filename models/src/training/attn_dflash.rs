//! DFlash block-sparse attention for training, forward (flash-style): each block's queries
//! against the context strictly before its anchor plus its own block (bidirectional; for a
//! sliding layer the windowed context and a causal block), the visibility of
//! [`crate::dflash::train::training_mask`], without any score-sized tensor. The log-sum-exp of
//! every query row is returned for the backward, which is not written yet: the trainer still
//! runs `dflash/train.rs`'s grouped candle attention, which is the reference this kernel is
//! checked against (`gpu_check --train`).

use candle_core::{Result, Tensor};

/// One block of the batch: where its sequence's context rows start in the context buffer,
/// and its anchor (the context rows it sees are `ctx_offset .. ctx_offset + anchor`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockSpan {
    pub ctx_offset: u32,
    pub anchor: u32,
}

/// `(out [R, H * D], lse f32 [H, R])` for the block rows' queries `q: [H, R, D]`, keys and
/// values `kb, vb: [KV, R, D]` (R = blocks x `block_size`, in block order), the context's
/// `kc, vc: [KV, C, D]`, one [`BlockSpan`] per block and `window` (`Some(W)` for a sliding
/// layer). CUDA only (bf16 or f32, head_dim 64 or 128).
#[allow(clippy::too_many_arguments)]
pub fn dflash_attention_forward(
    q: &Tensor,
    kc: &Tensor,
    vc: &Tensor,
    kb: &Tensor,
    vb: &Tensor,
    blocks: &[BlockSpan],
    block_size: usize,
    window: Option<usize>,
) -> Result<(Tensor, Tensor)> {
    let flat: Vec<u32> = blocks
        .iter()
        .flat_map(|b| [b.ctx_offset, b.anchor])
        .collect();
    let spans = Tensor::from_vec(flat, (blocks.len(), 2), q.device())?;
    #[cfg(feature = "cuda")]
    if q.device().is_cuda() {
        return crate::cuda::dflash_attention_fwd(
            q,
            kc,
            vc,
            kb,
            vb,
            &spans,
            block_size,
            window.unwrap_or(0),
        );
    }
    let _ = (kc, vc, kb, vb, spans, block_size, window);
    candle_core::bail!(
        "dflash_attention_forward runs on CUDA only (the CPU trains through dflash/train.rs)"
    )
}
