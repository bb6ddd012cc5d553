//! The explicit engine's projection pieces (issue 18): RMSNorm over the last dimension and
//! neox RoPE, forward and written-out backward, and a head projection
//! `x -> reshape(x Wᵀ) -> per-head norm -> RoPE -> [heads, rows, d]` (the drafter's q / k path,
//! `DecoderLayer::project`) with its backward. Composed candle ops on any device: the
//! reference the CUDA forms (the fused `qk_bwd` / `rms_bwd` kernels) are checked against;
//! the tests check these against candle's autograd.

use candle_core::{DType, Result, Tensor, D};

/// What [`rms_backward`] reads: the input and, on the composed path, `r` per row (f32, shaped
/// as `x` with a last dimension of 1). The fused CUDA backward recomputes `r` instead.
pub struct RmsSaved {
    x: Tensor,
    inv_rms: Option<Tensor>,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    eps: f64,
}

/// `n = x r w` over the last dimension (`r = 1 / sqrt(mean(x^2) + eps)` in f32, the product
/// cast back before the weight, as `layers::ops::rms_norm`): one fused kernel on CUDA while
/// `layers::train_ops` applies, else composed.
pub fn rms_forward(x: &Tensor, w: &Tensor, eps: f64) -> Result<(Tensor, RmsSaved)> {
    #[cfg(feature = "cuda")]
    if crate::layers::train_ops::applies(x) {
        let n = crate::layers::train_ops::rms_norm(x, w, eps)?;
        let saved = RmsSaved {
            x: x.clone(),
            inv_rms: None,
            eps,
        };
        return Ok((n, saved));
    }
    let xf = x.to_dtype(DType::F32)?;
    let r = (xf.sqr()?.mean_keepdim(D::Minus1)? + eps)?
        .sqrt()?
        .recip()?;
    let n = xf
        .broadcast_mul(&r)?
        .to_dtype(x.dtype())?
        .broadcast_mul(w)?;
    let saved = RmsSaved {
        x: x.clone(),
        inv_rms: Some(r),
        eps,
    };
    Ok((n, saved))
}

/// `(dx, dw)` of [`rms_forward`] from `dn`: `dw = Σ dn x r` over every leading index,
/// `dx = r (dn w) - x r³ mean(dn w x)`.
pub fn rms_backward(s: &RmsSaved, w: &Tensor, dn: &Tensor) -> Result<(Tensor, Tensor)> {
    let Some(r) = &s.inv_rms else {
        return fused_rms_backward(s, w, dn);
    };
    let x = &s.x;
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

#[cfg(feature = "cuda")]
fn fused_rms_backward(s: &RmsSaved, w: &Tensor, dn: &Tensor) -> Result<(Tensor, Tensor)> {
    let dt = s.x.dtype();
    let (dx, dw) = crate::cuda::train_ops::rms_norm_bwd(
        &s.x.contiguous()?,
        &w.to_dtype(dt)?.contiguous()?,
        &dn.to_dtype(dt)?.contiguous()?,
        s.eps as f32,
    )?;
    Ok((dx, dw.reshape(w.shape())?.to_dtype(w.dtype())?))
}

#[cfg(not(feature = "cuda"))]
fn fused_rms_backward(_: &RmsSaved, _: &Tensor, _: &Tensor) -> Result<(Tensor, Tensor)> {
    candle_core::bail!("rms_backward: a fused forward without the CUDA build")
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

/// How a projection's heads were shaped after the GEMM (what its backward reads).
enum HeadShaping {
    /// Neither norm nor RoPE (v).
    Plain,
    /// Composed: the per-head norm (when given), then RoPE (when given).
    Composed(Option<RmsSaved>),
    /// One fused norm + RoPE kernel (CUDA): the pre-norm projection `[rows, heads, d]`, the
    /// f32 cos|sin table and eps.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    FusedQk {
        pre: Tensor,
        table: Tensor,
        eps: f64,
    },
}

/// What [`project_backward`] reads.
pub struct ProjSaved {
    x: Tensor,
    shaping: HeadShaping,
    heads: usize,
    d: usize,
}

/// `x: [rows, H]` -> `[heads, rows, d]` contiguous: `x Wᵀ`, the per-head norm (`norm`), RoPE
/// (`rot`), as `DecoderLayer::project`. Norm and RoPE together run as one fused kernel on CUDA
/// while `layers::train_ops` applies and takes the shape.
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
    let saved = |shaping| ProjSaved {
        x: x.clone(),
        shaping,
        heads,
        d,
    };
    #[cfg(feature = "cuda")]
    if let (Some((nw, eps)), Some((cos, sin))) = (norm, rot) {
        if crate::layers::train_ops::applies(&y) {
            if let Some((z, table)) =
                crate::layers::train_ops::qk_norm_rope_with_table(&y, nw, cos, sin, eps)?
            {
                return Ok((z, saved(HeadShaping::FusedQk { pre: y, table, eps })));
            }
        }
    }
    if norm.is_none() && rot.is_none() {
        return Ok((y.transpose(0, 1)?.contiguous()?, saved(HeadShaping::Plain)));
    }
    let mut pre_norm = None;
    if let Some((nw, eps)) = norm {
        let (n, r) = rms_forward(&y, nw, eps)?;
        pre_norm = Some(r);
        y = n;
    }
    if let Some((cos, sin)) = rot {
        y = rope_forward(&y, cos, sin)?;
    }
    Ok((
        y.transpose(0, 1)?.contiguous()?,
        saved(HeadShaping::Composed(pre_norm)),
    ))
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
    let mut dnorm = None;
    let g = match &s.shaping {
        HeadShaping::Plain => dy.transpose(0, 1)?.contiguous()?,
        HeadShaping::Composed(pre_norm) => {
            let mut g = dy.transpose(0, 1)?.contiguous()?;
            if let Some((cos, sin)) = rot {
                g = rope_backward(&g, cos, sin)?;
            }
            if let (Some(r), Some(nw)) = (pre_norm, norm) {
                let (dx, dw) = rms_backward(r, nw, &g)?;
                g = dx;
                dnorm = Some(dw);
            }
            g
        }
        HeadShaping::FusedQk { pre, table, eps } => {
            let nw = norm.ok_or_else(|| {
                candle_core::Error::Msg(
                    "project_backward: a fused q/k norm needs its weight".into(),
                )
            })?;
            let (g, dw) = fused_qk_backward(pre, table, *eps, nw, dy)?;
            dnorm = Some(dw);
            g
        }
    };
    let g = g.reshape((rows, s.heads * s.d))?;
    let dw = g.t()?.matmul(&s.x)?;
    let dx = g.matmul(w)?;
    Ok((dx, dw, dnorm))
}

/// `(d pre [rows, heads, d], d norm weight)` of the fused q/k norm + RoPE.
#[cfg(feature = "cuda")]
fn fused_qk_backward(
    pre: &Tensor,
    table: &Tensor,
    eps: f64,
    nw: &Tensor,
    dy: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let dt = pre.dtype();
    let (dx, dw) = crate::cuda::train_ops::qk_norm_rope_bwd(
        &pre.contiguous()?,
        &nw.to_dtype(dt)?.contiguous()?,
        table,
        &dy.to_dtype(dt)?.contiguous()?,
        eps as f32,
    )?;
    Ok((dx, dw.reshape(nw.shape())?.to_dtype(nw.dtype())?))
}

#[cfg(not(feature = "cuda"))]
fn fused_qk_backward(
    _: &Tensor,
    _: &Tensor,
    _: f64,
    _: &Tensor,
    _: &Tensor,
) -> Result<(Tensor, Tensor)> {
    candle_core::bail!("project_backward: a fused q/k forward without the CUDA build")
}

#[cfg(test)]
mod tests {
    use super::{project_backward, project_forward};
    use crate::layers::ops::{qk_norm_rope, OpsMode};
    use crate::random::WeightRng;
    use crate::training::max_rel;
    use candle_core::{DType, Device, Tensor, Var};

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
