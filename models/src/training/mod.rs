//! The training engine's pieces, above the kernels they launch: the fused linear +
//! cross-entropy over the frozen LM head (`linear_ce.rs`: chunked logits, the gradient of the
//! hidden states only) and the multi-tensor AdamW on flat f32 buffers with the clip and the
//! non-finite skip on the device (`adamw.rs`), and the DFlash block-sparse attention, forward
//! with its log-sum-exp and backward, as a differentiable candle op (`attn_dflash.rs`, its f32
//! CPU reference in `attn_dflash_ref.rs`). Each has a CPU reference beside it, tested in
//! CI; the GPU kernels are checked against the references and the candle path by the GPU
//! check binary (`tests/src/bin/gpu_check`).

pub mod adamw;
pub mod attn_dflash;
pub mod attn_dflash_ref;
pub mod explicit_attn;
pub mod explicit_mlp;
pub mod explicit_proj;
pub mod linear_ce;

/// max |a - b| / max |b| (the explicit engine's tests).
#[cfg(test)]
pub(crate) fn max_rel(a: &candle_core::Tensor, b: &candle_core::Tensor) -> f32 {
    let d = (a - b).unwrap().abs().unwrap().max_all().unwrap();
    let m = b.abs().unwrap().max_all().unwrap();
    d.to_scalar::<f32>().unwrap() / m.to_scalar::<f32>().unwrap().max(1e-12)
}
