//! Fused RMSNorm, per-head q/k RMSNorm + RoPE and SiLU-gate product for training on CUDA:
//! candle custom ops whose `bwd` runs our backward kernels (`cuda/train_ops.cu`), so they sit
//! in the autograd graph where [`super::ops`]'s compositions would, one kernel forward and one
//! or two backward instead of ~8 elementwise ops and their autograd chains over the ~131K
//! block rows of a training step.
//!
//! [`super::ops`] routes `OpsMode::Differentiable` here only for CUDA tensors while
//! [`fused_train_ops`] is on (the default); the CPU, and CUDA with the switch off,
//! keep the compositions, which stay the reference the GPU check (`gpu_check --train`)
//! compares these ops and their gradients with. Shapes the kernels do not take (a head_dim
//! that is not a multiple of 64 or above 256, a RoPE table narrower than half the head)
//! also keep the compositions.

use candle_core::{DType, Tensor};

static FUSED_TRAIN_OPS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Turns the fused trainable RMSNorm, q/k-norm + RoPE and SiLU-gate kernels
/// (this module) on or off (off: candle's compositions, the reference), for
/// comparisons (`gpu_check --train`, `dflash-train --train-ops composed`). On by default;
/// process-wide. A no-op without CUDA.
pub fn set_fused_train_ops(on: bool) {
    FUSED_TRAIN_OPS.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// Whether [`set_fused_train_ops`] left them on.
pub fn fused_train_ops() -> bool {
    FUSED_TRAIN_OPS.load(std::sync::atomic::Ordering::Relaxed)
}

/// Whether the fused forms apply to `x` (CUDA build, CUDA tensor, bf16 or f32, switch on).
pub fn applies(x: &Tensor) -> bool {
    cfg!(feature = "cuda")
        && x.device().is_cuda()
        && matches!(x.dtype(), DType::BF16 | DType::F32)
        && fused_train_ops()
}

#[cfg(feature = "cuda")]
pub use imp::{qk_norm_rope, qk_norm_rope_with_table, rms_norm, silu_mul};

#[cfg(feature = "cuda")]
mod imp {
    use candle_core::{
        bail, CpuStorage, CudaStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor,
        D,
    };

    use crate::cuda::train_ops as k;

    fn cpu_refused(name: &str) -> Result<(CpuStorage, Shape)> {
        bail!("{name}: the fused training op runs on CUDA only (the CPU uses the composition)")
    }

    struct RmsNorm {
        eps: f32,
    }

    impl CustomOp2 for RmsNorm {
        fn name(&self) -> &'static str {
            "train-rms-norm"
        }
        fn cpu_fwd(
            &self,
            _: &CpuStorage,
            _: &Layout,
            _: &CpuStorage,
            _: &Layout,
        ) -> Result<(CpuStorage, Shape)> {
            cpu_refused(self.name())
        }
        fn cuda_fwd(
            &self,
            x: &CudaStorage,
            lx: &Layout,
            w: &CudaStorage,
            lw: &Layout,
        ) -> Result<(CudaStorage, Shape)> {
            Ok((
                k::rms_norm_fwd((x, lx), (w, lw), self.eps)?,
                lx.shape().clone(),
            ))
        }
        fn bwd(
            &self,
            x: &Tensor,
            w: &Tensor,
            _: &Tensor,
            dy: &Tensor,
        ) -> Result<(Option<Tensor>, Option<Tensor>)> {
            let dy = dy.to_dtype(x.dtype())?.contiguous()?;
            let (dx, dw) = k::rms_norm_bwd(x, w, &dy, self.eps)?;
            Ok((Some(dx), Some(dw.reshape(w.shape())?.to_dtype(w.dtype())?)))
        }
    }

    /// `x * rsqrt(mean(x^2) + eps) * weight` over the last dimension, differentiable in both.
    pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
        let w = weight.to_dtype(x.dtype())?.contiguous()?;
        x.contiguous()?.apply_op2(&w, RmsNorm { eps: eps as f32 })
    }

    struct QkNormRope {
        eps: f32,
    }

    impl CustomOp3 for QkNormRope {
        fn name(&self) -> &'static str {
            "train-qk-norm-rope"
        }
        fn cpu_fwd(
            &self,
            _: &CpuStorage,
            _: &Layout,
            _: &CpuStorage,
            _: &Layout,
            _: &CpuStorage,
            _: &Layout,
        ) -> Result<(CpuStorage, Shape)> {
            cpu_refused(self.name())
        }
        fn cuda_fwd(
            &self,
            x: &CudaStorage,
            lx: &Layout,
            w: &CudaStorage,
            lw: &Layout,
            cs: &CudaStorage,
            lc: &Layout,
        ) -> Result<(CudaStorage, Shape)> {
            let (t, h, d) = k::qk_dims(lx.shape(), lw.shape(), lc.shape())?;
            let out = k::qk_norm_rope_fwd((x, lx), (w, lw), (cs, lc), self.eps)?;
            Ok((out, Shape::from((h, t, d))))
        }
        fn bwd(
            &self,
            x: &Tensor,
            w: &Tensor,
            cs: &Tensor,
            _: &Tensor,
            dz: &Tensor,
        ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
            let dz = dz.to_dtype(x.dtype())?.contiguous()?;
            let (dx, dw) = k::qk_norm_rope_bwd(x, w, cs, &dz, self.eps)?;
            let dw = dw.reshape(w.shape())?.to_dtype(w.dtype())?;
            // The RoPE table is a constant of the positions: no gradient.
            Ok((Some(dx), Some(dw), None))
        }
    }

    /// `rope(rmsnorm(x) * weight)` per head of `x: [tokens, heads, head_dim]` with per-token
    /// `cos`/`sin: [tokens, head_dim / 2]`, returned head-major `[heads, tokens, head_dim]`
    /// (contiguous, the layout attention reads). `None` when the kernels do not take the
    /// shape (the caller composes).
    pub fn qk_norm_rope(
        x: &Tensor,
        weight: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        eps: f64,
    ) -> Result<Option<Tensor>> {
        Ok(qk_norm_rope_with_table(x, weight, cos, sin, eps)?.map(|(z, _)| z))
    }

    /// [`qk_norm_rope`] and the f32 `[tokens, head_dim]` cos|sin table its kernels read (the
    /// explicit engine hands it to `cuda::train_ops::qk_norm_rope_bwd` itself).
    pub fn qk_norm_rope_with_table(
        x: &Tensor,
        weight: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        eps: f64,
    ) -> Result<Option<(Tensor, Tensor)>> {
        let (t, _, d) = x.dims3()?;
        if d % 64 != 0 || d > k::QK_MAX_HEAD_DIM || cos.dims2()? != (t, d / 2) {
            return Ok(None);
        }
        // The composition rounds the table to x's dtype before using it.
        let table = |c: &Tensor| c.to_dtype(x.dtype())?.to_dtype(DType::F32);
        let cs = Tensor::cat(&[&table(cos)?, &table(sin)?], D::Minus1)?
            .contiguous()?
            .detach();
        let w = weight.to_dtype(x.dtype())?.contiguous()?;
        let z = x
            .contiguous()?
            .apply_op3(&w, &cs, QkNormRope { eps: eps as f32 })?;
        Ok(Some((z, cs)))
    }

    struct SiluMul;

    impl CustomOp2 for SiluMul {
        fn name(&self) -> &'static str {
            "train-silu-mul"
        }
        fn cpu_fwd(
            &self,
            _: &CpuStorage,
            _: &Layout,
            _: &CpuStorage,
            _: &Layout,
        ) -> Result<(CpuStorage, Shape)> {
            cpu_refused(self.name())
        }
        fn cuda_fwd(
            &self,
            g: &CudaStorage,
            lg: &Layout,
            u: &CudaStorage,
            lu: &Layout,
        ) -> Result<(CudaStorage, Shape)> {
            Ok((k::silu_mul_fwd((g, lg), (u, lu))?, lg.shape().clone()))
        }
        fn bwd(
            &self,
            g: &Tensor,
            u: &Tensor,
            _: &Tensor,
            dy: &Tensor,
        ) -> Result<(Option<Tensor>, Option<Tensor>)> {
            let dy = dy.to_dtype(g.dtype())?.contiguous()?;
            let (dg, du) = k::silu_mul_bwd(g, u, &dy)?;
            Ok((Some(dg), Some(du)))
        }
    }

    /// `silu(gate) * up`, differentiable in both.
    pub fn silu_mul(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        if gate.dtype() != up.dtype() || gate.shape() != up.shape() {
            bail!(
                "silu_mul: gate {:?} and up {:?} differ",
                gate.shape(),
                up.shape()
            )
        }
        gate.contiguous()?.apply_op2(&up.contiguous()?, SiluMul)
    }
}
