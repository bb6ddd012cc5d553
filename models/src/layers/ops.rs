//! The few primitive ops whose fused candle kernels drop gradients, in both forms.
//!
//! candle-nn 0.11's fused `rms_norm`, `softmax_last_dim` and `rope*` are `*_no_bwd` custom ops: a
//! backward pass through them silently yields no gradient. Inference wants the fused kernels,
//! the trainer needs gradients, and the layer math must exist once. So every layer takes an
//! [`OpsMode`], chosen once per model, and only these functions branch on it. On CUDA,
//! `Differentiable` takes the fused custom ops with backward kernels of [`super::train_ops`]
//! (RMSNorm, q/k-norm + RoPE, SiLU-gate) where they apply.

use candle_core::{DType, Result, Tensor, D};

/// `x @ wᵀ` for `x: [rows, in]`, `w: [out, in]` (a bias-free `nn.Linear`).
pub fn linear(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    x.matmul(&w.t()?)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OpsMode {
    /// candle's fused kernels: fastest, no backward pass.
    #[default]
    Fused,
    /// Plain tensor compositions that candle's autograd can differentiate.
    Differentiable,
}

/// Qwen3 RMSNorm: `x * rsqrt(mean(x^2) + eps)` in f32, cast back, times `weight`
/// (HF `Qwen3RMSNorm.forward`).
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64, mode: OpsMode) -> Result<Tensor> {
    match mode {
        OpsMode::Fused if x.is_contiguous() => candle_nn::ops::rms_norm(x, weight, eps as f32),
        #[cfg(feature = "cuda")]
        OpsMode::Differentiable if super::train_ops::applies(x) => {
            super::train_ops::rms_norm(x, weight, eps)
        }
        _ => {
            let dtype = x.dtype();
            // Half precisions accumulate in f32 as HF does; f32/f64 stay as they are.
            let xf = match dtype {
                DType::BF16 | DType::F16 => x.to_dtype(DType::F32)?,
                _ => x.clone(),
            };
            let var = xf.sqr()?.mean_keepdim(D::Minus1)?;
            let normed = xf.broadcast_div(&(var + eps)?.sqrt()?)?.to_dtype(dtype)?;
            normed.broadcast_mul(weight)
        }
    }
}

/// Per-head q/k norm then RoPE of a projection `x: [tokens, heads, head_dim]`, returned
/// head-major `[heads, tokens, head_dim]` and contiguous (the layout attention reads): one
/// fused differentiable kernel for training on CUDA ([`super::train_ops`]), else
/// [`rms_norm`], [`rope`] and the transpose.
pub fn qk_norm_rope(
    x: &Tensor,
    weight: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    eps: f64,
    mode: OpsMode,
) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if mode == OpsMode::Differentiable && super::train_ops::applies(x) {
        if let Some(y) = super::train_ops::qk_norm_rope(x, weight, cos, sin, eps)? {
            return Ok(y);
        }
    }
    let y = rope(&rms_norm(x, weight, eps, mode)?, cos, sin, mode)?;
    y.transpose(0, 1)?.contiguous()
}

/// `silu(gate) * up` (the SwiGLU product): one fused differentiable kernel for training on
/// CUDA ([`super::train_ops`]), else candle's `silu` and product.
pub fn silu_mul(gate: &Tensor, up: &Tensor, mode: OpsMode) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if mode == OpsMode::Differentiable && super::train_ops::applies(gate) {
        return super::train_ops::silu_mul(gate, up);
    }
    let _ = mode;
    gate.silu()? * up
}

/// Softmax over the last dimension.
pub fn softmax_last_dim(x: &Tensor, mode: OpsMode) -> Result<Tensor> {
    match mode {
        OpsMode::Fused => candle_nn::ops::softmax_last_dim(x),
        OpsMode::Differentiable => candle_nn::ops::softmax(x, D::Minus1),
    }
}

/// Neox-style ("rotate half") RoPE on `x: [tokens, heads, head_dim]` with per-token
/// `cos`/`sin: [tokens, head_dim / 2]` (HF `apply_rotary_pos_emb`).
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor, mode: OpsMode) -> Result<Tensor> {
    let dtype = x.dtype();
    let cos = cos.to_dtype(dtype)?;
    let sin = sin.to_dtype(dtype)?;
    match mode {
        OpsMode::Fused => {
            let x = x.contiguous()?.unsqueeze(0)?;
            candle_nn::rotary_emb::rope_thd(&x, &cos, &sin)?.squeeze(0)
        }
        OpsMode::Differentiable => {
            let half = x.dim(D::Minus1)? / 2;
            let cos = Tensor::cat(&[&cos, &cos], D::Minus1)?.unsqueeze(1)?;
            let sin = Tensor::cat(&[&sin, &sin], D::Minus1)?.unsqueeze(1)?;
            let x1 = x.narrow(D::Minus1, 0, half)?;
            let x2 = x.narrow(D::Minus1, half, half)?;
            let rotated = Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)?;
            x.broadcast_mul(&cos)? + rotated.broadcast_mul(&sin)?
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    fn close(a: &Tensor, b: &Tensor) -> f32 {
        (a - b)
            .unwrap()
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    }

    #[test]
    fn fused_and_differentiable_forms_agree() -> Result<()> {
        let dev = Device::Cpu;
        let x = Tensor::randn(0f32, 1.0, (5, 3, 8), &dev)?;
        let w = Tensor::randn(1f32, 0.2, 8, &dev)?;
        let a = rms_norm(&x, &w, 1e-6, OpsMode::Fused)?;
        let b = rms_norm(&x, &w, 1e-6, OpsMode::Differentiable)?;
        assert!(close(&a, &b) < 1e-5);
        let a = softmax_last_dim(&x, OpsMode::Fused)?;
        let b = softmax_last_dim(&x, OpsMode::Differentiable)?;
        assert!(close(&a, &b) < 1e-6);
        let cos = Tensor::randn(0f32, 1.0, (5, 4), &dev)?;
        let sin = Tensor::randn(0f32, 1.0, (5, 4), &dev)?;
        let a = rope(&x, &cos, &sin, OpsMode::Fused)?;
        let b = rope(&x, &cos, &sin, OpsMode::Differentiable)?;
        assert!(close(&a, &b) < 1e-5);
        Ok(())
    }

    /// Central finite differences against autograd for every differentiable op.
    #[test]
    fn differentiable_ops_pass_gradient_check() -> Result<()> {
        let dev = Device::Cpu;
        let x0 = Tensor::randn(0f64, 1.0, (2, 3, 4), &dev)?;
        let w = Tensor::randn(1f64, 0.2, 4, &dev)?;
        let cos = Tensor::randn(0f64, 1.0, (2, 2), &dev)?;
        let sin = Tensor::randn(0f64, 1.0, (2, 2), &dev)?;
        let probe = Tensor::randn(0f64, 1.0, (2, 3, 4), &dev)?;
        let fns: Vec<(&str, Box<dyn Fn(&Tensor) -> Result<Tensor>>)> = vec![
            (
                "rms_norm",
                Box::new(|x| rms_norm(x, &w, 1e-6, OpsMode::Differentiable)),
            ),
            (
                "softmax",
                Box::new(|x| softmax_last_dim(x, OpsMode::Differentiable)),
            ),
            (
                "rope",
                Box::new(|x| rope(x, &cos, &sin, OpsMode::Differentiable)),
            ),
        ];
        for (name, f) in fns {
            let var = Var::from_tensor(&x0)?;
            let loss = (f(var.as_tensor())? * &probe)?.sum_all()?;
            let grads = loss.backward()?;
            let g = grads
                .get(var.as_tensor())
                .expect("gradient reaches the input");
            let g: Vec<f64> = g.flatten_all()?.to_vec1()?;
            let base: Vec<f64> = x0.flatten_all()?.to_vec1()?;
            let eps = 1e-6;
            for i in 0..base.len() {
                let mut plus = base.clone();
                plus[i] += eps;
                let mut minus = base.clone();
                minus[i] -= eps;
                let lp = (f(&Tensor::from_vec(plus, x0.shape(), &dev)?)? * &probe)?
                    .sum_all()?
                    .to_scalar::<f64>()?;
                let lm = (f(&Tensor::from_vec(minus, x0.shape(), &dev)?)? * &probe)?
                    .sum_all()?
                    .to_scalar::<f64>()?;
                let numeric = (lp - lm) / (2.0 * eps);
                assert!(
                    (numeric - g[i]).abs() < 1e-5,
                    "{name}: d/dx[{i}] autograd {} vs numeric {numeric}",
                    g[i]
                );
            }
        }
        Ok(())
    }
}
