//! The explicit engine's projection pieces (issue 18): RMSNorm over the last dimension and
//! neox RoPE, forward and written-out backward, and a head projection
//! `x -> reshape(x Wᵀ) -> per-head norm -> RoPE -> [heads, rows, d]` (the drafter's q / k path,
//! `DecoderLayer::project`) with its backward. Composed candle ops on any device: the
//! reference the CUDA forms (the fused `qk_bwd` / `rms_bwd` kernels) are checked against;
//! the tests check these against candle's autograd.

use candle_core::{DType, Result, Tensor, D};

/// `n = x r w` over the last dimension (`r = 1 / sqrt(mean(x^2) + eps)` in f32, the product
/// cast back before the weight, as `layers::ops::rms_norm`). Returns `(n, r)` with `r` f32
/// shaped as `x` with a last dimension of 1.
pub fn rms_forward(x: &Tensor, w: &Tensor, eps: f64) -> Result<(Tensor, Tensor)> {
    let xf = x.to_dtype(DType::F32)?;
    let r = (xf.sqr()?.mean_keepdim(D::Minus1)? + eps)?
        .sqrt()?
        .recip()?;
    let n = xf
        .broadcast_mul(&r)?
        .to_dtype(x.dtype())?
        .broadcast_mul(w)?;
    Ok((n, r))
}

/// `(dx, dw)` of [`rms_forward`] from `dn`: `dw = Σ dn x r` over every leading index,
/// `dx = r (dn w) - x r³ mean(dn w x)`.
pub fn rms_backward(x: &Tensor, r: &Tensor, w: &Tensor, dn: &Tensor) -> Result<(Tensor, Tensor)> {
    let (dnf, xf) = (dn.to_dtype(DType::F32)?, x.to_dtype(DType::F32)?);
    let last = xf.dim(D::Minus1)?;
    let xr = xf.broadcast_mul(r)?;
    let dw = (&dnf * &xr)?
        .reshape(((), last))?
        .sum(0)?
        .to_dtype(w.dtype())?;
    let dnw = dnf.broadcast_mul(&w.to_dtype(DType::F32)?)?;
    let mean = (&dnw * &xf)?.mean_keepdim(D::Minus1)?;
    let dx = (dnw.broadcast_mul(r)? - xf.broadcast_mul(&(mean * r.powf(3.0)?)?)?)?;
    Ok((dx.to_dtype(x.dtype())?, dw))
}

/// `[cos, cos]` and `[sin, sin]` over the last dimension, shaped to broadcast over heads.
fn full(cos: &Tensor, sin: &Tensor, dtype: DType) -> Result<(Tensor, Tensor)> {
    let c = Tensor::cat(&[cos, cos], D::Minus1)?
        .unsqueeze(1)?
        .to_dtype(dtype)?;
    let s = Tensor::cat(&[sin, sin], D::Minus1)?
        .unsqueeze(1)?
        .to_dtype(dtype)?;
    Ok((c, s))
}

/// `rotate_half(x) = [-x2, x1]`.
fn rotate_half(x: &Tensor) -> Result<Tensor> {
    let half = x.dim(D::Minus1)? / 2;
    let (x1, x2) = (
        x.narrow(D::Minus1, 0, half)?,
        x.narrow(D::Minus1, half, half)?,
    );
    Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)
}

/// Neox RoPE of `x: [tokens, heads, d]` with `cos, sin: [tokens, d / 2]`.
pub fn rope_forward(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (c, s) = full(cos, sin, x.dtype())?;
    x.broadcast_mul(&c)? + rotate_half(x)?.broadcast_mul(&s)?
}

/// The rotation's transpose: `dx = dy cos - rotate_half(dy sin)` (`rotate_half`ᵀ = -`rotate_half`).
pub fn rope_backward(dy: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let (c, s) = full(cos, sin, dy.dtype())?;
    dy.broadcast_mul(&c)? - rotate_half(&dy.broadcast_mul(&s)?)?
}

/// What [`project_backward`] reads.
pub struct ProjSaved {
    x: Tensor,
    /// The projection before its norm, `[rows, heads, d]` (None without a norm).
    pre_norm: Option<(Tensor, Tensor)>,
    heads: usize,
    d: usize,
}

/// `x: [rows, H]` -> `[heads, rows, d]` contiguous: `x Wᵀ`, the per-head norm (`norm`), RoPE
/// (`rot`), as `DecoderLayer::project`.
pub fn project_forward(
    x: &Tensor,
    w: &Tensor,
    norm: Option<(&Tensor, f64)>,
    heads: usize,
    rot: Option<(&Tensor, &Tensor)>,
) -> Result<(Tensor, ProjSaved)> {
    let rows = x.dim(0)?;
    let d = w.dim(0)? / heads;
    let mut y = x.matmul(&w.t()?)?.reshape((rows, heads, d))?;
    let mut pre_norm = None;
    if let Some((nw, eps)) = norm {
        let (n, r) = rms_forward(&y, nw, eps)?;
        pre_norm = Some((y, r));
        y = n;
    }
    if let Some((cos, sin)) = rot {
        y = rope_forward(&y, cos, sin)?;
    }
    let saved = ProjSaved {
        x: x.clone(),
        pre_norm,
        heads,
        d,
    };
    Ok((y.transpose(0, 1)?.contiguous()?, saved))
}

/// `(dx, dW, dnorm)` of [`project_forward`] from `dy: [heads, rows, d]`.
pub fn project_backward(
    s: &ProjSaved,
    dy: &Tensor,
    w: &Tensor,
    norm: Option<&Tensor>,
    rot: Option<(&Tensor, &Tensor)>,
) -> Result<(Tensor, Tensor, Option<Tensor>)> {
    let rows = s.x.dim(0)?;
    let mut g = dy.transpose(0, 1)?.contiguous()?;
    if let Some((cos, sin)) = rot {
        g = rope_backward(&g, cos, sin)?;
    }
    let mut dnorm = None;
    if let (Some((pre, r)), Some(nw)) = (&s.pre_norm, norm) {
        let (dx, dw) = rms_backward(pre, r, nw, &g)?;
        g = dx;
        dnorm = Some(dw);
    }
    let g = g.reshape((rows, s.heads * s.d))?;
    let dw = g.t()?.matmul(&s.x)?;
    let dx = g.matmul(w)?;
    Ok((dx, dw, dnorm))
}

#[cfg(test)]
mod tests {
    use super::{project_backward, project_forward};
    use crate::layers::ops::{qk_norm_rope, OpsMode};
    use crate::random::WeightRng;
    use candle_core::{DType, Device, Tensor, Var};

    fn max_rel(a: &Tensor, b: &Tensor) -> f32 {
        let d = (a - b).unwrap().abs().unwrap().max_all().unwrap();
        let m = b.abs().unwrap().max_all().unwrap();
        d.to_scalar::<f32>().unwrap() / m.to_scalar::<f32>().unwrap().max(1e-12)
    }

    /// The q/k head projection (projection, per-head RMSNorm, RoPE, head-major) and its
    /// written-out backward against candle's autograd of the composed path, f32: dx, dW and
    /// the norm weight's gradient within 1e-5; RoPE's backward with the sine's sign flipped
    /// must fail.
    #[test]
    fn the_explicit_head_projection_backward_equals_autograd() {
        let dev = Device::Cpu;
        let (rows, h, heads, d) = (6, 16, 2, 8);
        let mut rng = WeightRng::new(5);
        let mut t = |shape: &[usize], m: f32, std: f32| {
            rng.normal(shape, m, std, DType::F32, &dev).unwrap()
        };
        let x = Var::from_tensor(&t(&[rows, h], 0.0, 1.0)).unwrap();
        let w = Var::from_tensor(&t(&[heads * d, h], 0.0, 0.3)).unwrap();
        let nw = Var::from_tensor(&t(&[d], 1.0, 0.1)).unwrap();
        let pos: Vec<f32> = (0..rows).map(|p| p as f32 * 0.7).collect();
        let freq: Vec<f32> = (0..d / 2)
            .map(|i| 1.0 / 10f32.powf(i as f32 / 2.0))
            .collect();
        let ang: Vec<f32> = pos
            .iter()
            .flat_map(|p| freq.iter().map(move |f| p * f))
            .collect();
        let ang = Tensor::from_vec(ang, (rows, d / 2), &dev).unwrap();
        let (cos, sin) = (ang.cos().unwrap(), ang.sin().unwrap());
        let probe = t(&[heads, rows, d], 0.0, 1.0);
        let eps = 1e-6;

        let y_ref = qk_norm_rope(
            &x.as_tensor()
                .matmul(&w.t().unwrap())
                .unwrap()
                .reshape((rows, heads, d))
                .unwrap(),
            nw.as_tensor(),
            &cos,
            &sin,
            eps,
            OpsMode::Differentiable,
        )
        .unwrap();
        let grads = (&y_ref * &probe)
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();

        let rot = Some((&cos, &sin));
        let (y, saved) = project_forward(
            x.as_tensor(),
            w.as_tensor(),
            Some((nw.as_tensor(), eps)),
            heads,
            rot,
        )
        .unwrap();
        assert!(max_rel(&y, &y_ref) < 1e-6);
        let (dx, dw, dn) =
            project_backward(&saved, &probe, w.as_tensor(), Some(nw.as_tensor()), rot).unwrap();
        for (name, got, var) in [("x", &dx, &x), ("w", &dw, &w), ("norm", &dn.unwrap(), &nw)] {
            let e = max_rel(got, grads.get(var.as_tensor()).unwrap());
            assert!(e < 1e-5, "d{name}: rel err {e}");
        }
        // Wrong case: the backward rotating the other way.
        let neg_sin = sin.neg().unwrap();
        let (dx_wrong, _, _) = project_backward(
            &saved,
            &probe,
            w.as_tensor(),
            Some(nw.as_tensor()),
            Some((&cos, &neg_sin)),
        )
        .unwrap();
        let e = max_rel(&dx_wrong, grads.get(x.as_tensor()).unwrap());
        assert!(e > 1e-2, "a wrong rotation passed: {e}");
    }
}
