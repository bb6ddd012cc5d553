//! The first piece of the explicit drafter engine (issue 18): a decoder layer's MLP half,
//! `y = x1 + down(silu(gate(n)) * up(n))` with `n = rms_norm(x1) * w`, forward and backward
//! written out with no autograd. candle's backprop makes a zero tensor for every gradient edge
//! and adds into it (`GradStore::or_insert`), and a weight used through `w.t()` costs a second,
//! strided add: on the 8B recipe that is ~49 ms of `badd` per sequence beside ~80 ms of GEMMs
//! (deploy/bench/results/h100-2026-12-06-s19, notes). Here each gradient is produced once,
//! weight gradients straight in `[out, in]` layout, so the step's only elementwise traffic is
//! the math itself.
//!
//! Math (rows independent; `r = 1 / sqrt(mean(x1^2) + eps)` per row, f32):
//! - `dW_down = dyᵀ a`, `da = dy W_down`;
//! - `a = silu(g) * u`: `du = da * silu(g)`, `dg = da * u * σ(g) (1 + g (1 - σ(g)))`;
//! - `dW_gate = dgᵀ n`, `dW_up = duᵀ n`, `dn = dg W_gate + du W_up`;
//! - `n = x1 r w`: `dw = Σ_rows dn * x1 r`, `dx1 = dy + r (dn w) - x1 r³ mean(dn w x1)`.
//!
//! This composed form (candle tensor ops, any device) is the reference the CUDA version (the
//! existing `rms_bwd` / `silu_bwd` kernels, cuBLASLt GEMMs accumulating into the flat gradient
//! buffer) will be checked against; the test checks it against candle's autograd.

use candle_core::{Result, Tensor};

use super::explicit_proj::{rms_backward, rms_forward, RmsSaved};

/// The MLP half's weights: the post-attention norm's `[H]`, gate and up `[I, H]`, down `[H, I]`.
pub struct MlpWeights<'a> {
    pub norm: &'a Tensor,
    pub gate: &'a Tensor,
    pub up: &'a Tensor,
    pub down: &'a Tensor,
    pub eps: f64,
}

/// What the backward reads from the forward.
pub struct MlpSaved {
    norm: RmsSaved,
    n: Tensor,
    g: Tensor,
    u: Tensor,
    a: Tensor,
}

/// The weight gradients of one MLP half (`[out, in]`, as the weights).
pub struct MlpGrads {
    pub norm: Tensor,
    pub gate: Tensor,
    pub up: Tensor,
    pub down: Tensor,
}

fn mm_t(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    x.matmul(&w.t()?)
}

/// `y = x1 + down(silu(gate(n)) * up(n))`, `x1: [rows, H]`; the norm in f32 as
/// [`crate::layers::ops::rms_norm`].
pub fn forward(x1: &Tensor, w: &MlpWeights<'_>) -> Result<(Tensor, MlpSaved)> {
    let (n, norm) = rms_forward(x1, w.norm, w.eps)?;
    let g = mm_t(&n, w.gate)?;
    let u = mm_t(&n, w.up)?;
    let a = silu_mul_forward(&g, &u)?;
    let y = (x1 + mm_t(&a, w.down)?)?;
    Ok((y, MlpSaved { norm, n, g, u, a }))
}

/// `silu(g) * u`: one kernel on CUDA while `layers::train_ops` applies, else composed.
fn silu_mul_forward(g: &Tensor, u: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if crate::layers::train_ops::applies(g) {
        return crate::layers::train_ops::silu_mul(g, u);
    }
    g.silu()? * u
}

/// `(dg, du)` of [`silu_mul_forward`] from `da`. The choice of form follows the forward's
/// (the switch is process-wide and a step sees one setting).
fn silu_mul_backward(g: &Tensor, u: &Tensor, da: &Tensor) -> Result<(Tensor, Tensor)> {
    #[cfg(feature = "cuda")]
    if crate::layers::train_ops::applies(g) {
        return crate::cuda::train_ops::silu_mul_bwd(
            &g.contiguous()?,
            &u.contiguous()?,
            &da.to_dtype(g.dtype())?.contiguous()?,
        );
    }
    let sig = candle_nn::ops::sigmoid(g)?;
    // silu'(g) = σ(g) (1 + g (1 - σ(g))).
    let dsilu = (&sig * ((g * (sig.ones_like()? - &sig)?)? + 1.0)?)?;
    let du = (da * g.silu()?)?;
    let dg = ((da * u)? * dsilu)?;
    Ok((dg, du))
}

/// The gradient of the input `x1` and of every weight, from `dy` (the gradient of `y`).
pub fn backward(s: &MlpSaved, dy: &Tensor, w: &MlpWeights<'_>) -> Result<(Tensor, MlpGrads)> {
    let down = dy.t()?.matmul(&s.a)?;
    let da = dy.matmul(w.down)?;
    let (dg, du) = silu_mul_backward(&s.g, &s.u, &da)?;
    let gate = dg.t()?.matmul(&s.n)?;
    let up = du.t()?.matmul(&s.n)?;
    let dn = (dg.matmul(w.gate)? + du.matmul(w.up)?)?;
    let (dx, norm) = rms_backward(&s.norm, w.norm, &dn)?;
    let dx1 = (dy + dx)?;
    Ok((
        dx1,
        MlpGrads {
            norm,
            gate,
            up,
            down,
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::{backward, forward, MlpWeights};
    use crate::layers::ops::{rms_norm, silu_mul, OpsMode};
    use crate::random::WeightRng;
    use crate::training::max_rel;
    use candle_core::{DType, Device, Var};

    /// The written-out backward against candle's autograd of the same layer half (the
    /// trainer's composed path) in f32: the input's and every weight's gradient within 1e-5;
    /// a wrong silu derivative (σ(g) alone) must fail.
    #[test]
    fn the_explicit_mlp_backward_equals_autograd() {
        let dev = Device::Cpu;
        let (rows, h, i) = (7, 16, 24);
        let mut rng = WeightRng::new(11);
        let mut t =
            |shape: &[usize], std: f32| rng.normal(shape, 0.0, std, DType::F32, &dev).unwrap();
        let x1 = Var::from_tensor(&t(&[rows, h], 1.0)).unwrap();
        let norm = Var::from_tensor(&(t(&[h], 0.1) + 1.0).unwrap()).unwrap();
        let gate = Var::from_tensor(&t(&[i, h], 0.3)).unwrap();
        let up = Var::from_tensor(&t(&[i, h], 0.3)).unwrap();
        let down = Var::from_tensor(&t(&[h, i], 0.3)).unwrap();
        let probe = t(&[rows, h], 1.0);
        let eps = 1e-6;
        // The composed path the trainer differentiates today.
        let n = rms_norm(
            x1.as_tensor(),
            norm.as_tensor(),
            eps,
            OpsMode::Differentiable,
        )
        .unwrap();
        let a = silu_mul(
            &n.matmul(&gate.t().unwrap()).unwrap(),
            &n.matmul(&up.t().unwrap()).unwrap(),
            OpsMode::Differentiable,
        )
        .unwrap();
        let y_ref = (x1.as_tensor() + a.matmul(&down.t().unwrap()).unwrap()).unwrap();
        let grads = (&y_ref * &probe)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();

        let w = MlpWeights {
            norm: norm.as_tensor(),
            gate: gate.as_tensor(),
            up: up.as_tensor(),
            down: down.as_tensor(),
            eps,
        };
        let (y, saved) = forward(x1.as_tensor(), &w).unwrap();
        assert!(max_rel(&y, &y_ref) < 1e-6);
        let (dx1, g) = backward(&saved, &probe, &w).unwrap();
        for (name, got, var) in [
            ("x1", &dx1, &x1),
            ("norm", &g.norm, &norm),
            ("gate", &g.gate, &gate),
            ("up", &g.up, &up),
            ("down", &g.down, &down),
        ] {
            let want = grads.get(var.as_tensor()).unwrap();
            let e = max_rel(got, want);
            assert!(e < 1e-5, "d{name}: rel err {e}");
        }

        // Wrong case: silu'(g) taken as σ(g) moves the gate and input gradients.
        let sig = candle_nn::ops::sigmoid(&saved.g).unwrap();
        let da = probe.matmul(w.down).unwrap();
        let wrong_dg = ((&da * &saved.u).unwrap() * sig).unwrap();
        let wrong_gate = wrong_dg.t().unwrap().matmul(&saved.n).unwrap();
        let e = max_rel(&wrong_gate, grads.get(gate.as_tensor()).unwrap());
        assert!(e > 1e-2, "a wrong silu derivative passed: {e}");
    }
}
