//! The explicit engine's attention half of a drafter layer (issue 18):
//! `h1 = h + o(attn(q(x), [k(ctx); k(x)], [v(ctx); v(x)]))` with `x = rms_norm(h)`, q / k
//! through their per-head norms and RoPE (block rows at their positions, context rows at
//! theirs), the DFlash block-sparse attention ([`DFlashAttention`]: forward without autograd,
//! backward called directly), forward and written-out backward. The context's gradient is
//! returned per layer (the trainer sums it over the layers into `fc` / `hidden_norm`).

use candle_core::{Result, Tensor};

use super::attn_dflash::DFlashAttention;
use super::explicit_proj::{
    project_backward, project_forward, rms_backward, rms_forward, ProjSaved, RmsSaved,
};

/// One layer's attention-half weights (`[out, in]` projections, `[d]` q / k norms, `[H]`
/// input norm).
pub struct AttnWeights<'a> {
    pub input_norm: &'a Tensor,
    pub q: &'a Tensor,
    pub k: &'a Tensor,
    pub v: &'a Tensor,
    pub o: &'a Tensor,
    pub q_norm: &'a Tensor,
    pub k_norm: &'a Tensor,
    pub heads: usize,
    pub kv_heads: usize,
    pub eps: f64,
}

/// RoPE tables `(cos, sin)` `[rows, d / 2]` of the block rows and of the context rows.
#[derive(Clone, Copy)]
pub struct Rotations<'a> {
    pub block: (&'a Tensor, &'a Tensor),
    pub ctx: (&'a Tensor, &'a Tensor),
}

/// What [`backward`] reads.
pub struct AttnSaved {
    norm: RmsSaved,
    q: ProjSaved,
    kb: ProjSaved,
    vb: ProjSaved,
    kc: ProjSaved,
    vc: ProjSaved,
    q_heads: Tensor,
    k_packed: Tensor,
    v_packed: Tensor,
    out: Tensor,
}

/// The gradients of one attention half's weights (as the weights).
pub struct AttnGrads {
    pub input_norm: Tensor,
    pub q: Tensor,
    pub k: Tensor,
    pub v: Tensor,
    pub o: Tensor,
    pub q_norm: Tensor,
    pub k_norm: Tensor,
}

/// `h1` for block rows `h: [R, H]` over the context rows `ctx: [C, H]`.
pub fn forward(
    h: &Tensor,
    ctx: &Tensor,
    w: &AttnWeights<'_>,
    rot: Rotations<'_>,
    attn: &DFlashAttention,
) -> Result<(Tensor, AttnSaved)> {
    let (x, norm) = rms_forward(h, w.input_norm, w.eps)?;
    let qn = Some((w.q_norm, w.eps));
    let kn = Some((w.k_norm, w.eps));
    let (q_heads, q) = project_forward(&x, w.q, qn, w.heads, Some(rot.block))?;
    let (kb_heads, kb) = project_forward(&x, w.k, kn, w.kv_heads, Some(rot.block))?;
    let (vb_heads, vb) = project_forward(&x, w.v, None, w.kv_heads, None)?;
    let (kc_heads, kc) = project_forward(ctx, w.k, kn, w.kv_heads, Some(rot.ctx))?;
    let (vc_heads, vc) = project_forward(ctx, w.v, None, w.kv_heads, None)?;
    let (out, k_packed, v_packed) =
        attn.forward(&q_heads, &kc_heads, &vc_heads, &kb_heads, &vb_heads)?;
    let h1 = (h + out.matmul(&w.o.t()?)?)?;
    Ok((
        h1,
        AttnSaved {
            norm,
            q,
            kb,
            vb,
            kc,
            vc,
            q_heads,
            k_packed,
            v_packed,
            out,
        },
    ))
}

/// `(dh, dctx, grads)` from `dh1`.
pub fn backward(
    s: &AttnSaved,
    dh1: &Tensor,
    w: &AttnWeights<'_>,
    rot: Rotations<'_>,
    attn: &DFlashAttention,
) -> Result<(Tensor, Tensor, AttnGrads)> {
    let o = dh1.t()?.matmul(&s.out)?;
    let dout = dh1.matmul(w.o)?;
    let (dq, dkc, dvc, dkb, dvb) =
        attn.backward(&s.q_heads, &s.k_packed, &s.v_packed, &s.out, &dout)?;
    let (dx_q, q, q_norm) = project_backward(&s.q, &dq, w.q, Some(w.q_norm), Some(rot.block))?;
    let (dx_k, k_b, kn_b) = project_backward(&s.kb, &dkb, w.k, Some(w.k_norm), Some(rot.block))?;
    let (dx_v, v_b, _) = project_backward(&s.vb, &dvb, w.v, None, None)?;
    let (dctx_k, k_c, kn_c) = project_backward(&s.kc, &dkc, w.k, Some(w.k_norm), Some(rot.ctx))?;
    let (dctx_v, v_c, _) = project_backward(&s.vc, &dvc, w.v, None, None)?;
    let missing =
        || candle_core::Error::Msg("a normed projection returned no norm gradient".into());
    let (q_norm, kn_b, kn_c) = (
        q_norm.ok_or_else(missing)?,
        kn_b.ok_or_else(missing)?,
        kn_c.ok_or_else(missing)?,
    );
    let dx = ((dx_q + dx_k)? + dx_v)?;
    let (dh_norm, input_norm) = rms_backward(&s.norm, w.input_norm, &dx)?;
    let dh = (dh1 + dh_norm)?;
    let dctx = (dctx_k + dctx_v)?;
    Ok((
        dh,
        dctx,
        AttnGrads {
            input_norm,
            q,
            k: (k_b + k_c)?,
            v: (v_b + v_c)?,
            o,
            q_norm,
            k_norm: (kn_b + kn_c)?,
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::{backward, forward, AttnWeights, Rotations};
    use crate::layers::ops::{qk_norm_rope, rms_norm, OpsMode};
    use crate::random::WeightRng;
    use crate::training::attn_dflash::{dflash_attention, DFlashAttention};
    use crate::training::attn_dflash_ref::BlockSpan;
    use crate::training::max_rel;
    use candle_core::{DType, Device, Tensor, Var};

    fn tables(pos: &[usize], d: usize) -> (Tensor, Tensor) {
        let ang: Vec<f32> = pos
            .iter()
            .flat_map(|&p| (0..d / 2).map(move |i| p as f32 / 10f32.powf(i as f32 / 2.0)))
            .collect();
        let ang = Tensor::from_vec(ang, (pos.len(), d / 2), &Device::Cpu).unwrap();
        (ang.cos().unwrap(), ang.sin().unwrap())
    }

    /// The attention half's written-out backward against candle's autograd of the composed
    /// path (the trainer's fused-attention op on its CPU reference), f32, one sequence of 10
    /// context rows with blocks of 4 at anchors 3 and 7 (then a sliding window of 3): the block
    /// rows', the context's and every weight's gradient within 1e-4.
    #[test]
    fn the_explicit_attention_half_backward_equals_autograd() {
        let dev = Device::Cpu;
        let (hid, heads, kv, d, b) = (16, 2, 1, 8, 4);
        let anchors = [3usize, 7];
        let c = 7;
        let rows = anchors.len() * b;
        for window in [None, Some(3)] {
            let mut rng = WeightRng::new(9);
            let mut t = |shape: &[usize], m: f32, std: f32| {
                rng.normal(shape, m, std, DType::F32, &dev).unwrap()
            };
            let var = |x: Tensor| Var::from_tensor(&x).unwrap();
            let h = var(t(&[rows, hid], 0.0, 1.0));
            let ctx = var(t(&[c, hid], 0.0, 1.0));
            let in_norm = var(t(&[hid], 1.0, 0.1));
            let wq = var(t(&[heads * d, hid], 0.0, 0.3));
            let wk = var(t(&[kv * d, hid], 0.0, 0.3));
            let wv = var(t(&[kv * d, hid], 0.0, 0.3));
            let wo = var(t(&[hid, heads * d], 0.0, 0.3));
            let qn = var(t(&[d], 1.0, 0.1));
            let kn = var(t(&[d], 1.0, 0.1));
            let probe = t(&[rows, hid], 0.0, 1.0);
            let eps = 1e-6;
            let block_pos: Vec<usize> = anchors.iter().flat_map(|&a| a..a + b).collect();
            let ctx_pos: Vec<usize> = (0..c).collect();
            let (cb, sb) = tables(&block_pos, d);
            let (cc, sc) = tables(&ctx_pos, d);
            let spans: Vec<BlockSpan> = anchors
                .iter()
                .map(|&a| BlockSpan {
                    ctx_offset: 0,
                    anchor: a as u32,
                })
                .collect();

            // The composed path under autograd.
            let m = OpsMode::Differentiable;
            let proj = |x: &Tensor, w: &Var, n: usize| {
                x.matmul(&w.t().unwrap())
                    .unwrap()
                    .reshape((x.dim(0).unwrap(), n, d))
                    .unwrap()
            };
            let x = rms_norm(h.as_tensor(), in_norm.as_tensor(), eps, m).unwrap();
            let q = qk_norm_rope(&proj(&x, &wq, heads), qn.as_tensor(), &cb, &sb, eps, m).unwrap();
            let kb = qk_norm_rope(&proj(&x, &wk, kv), kn.as_tensor(), &cb, &sb, eps, m).unwrap();
            let vb = proj(&x, &wv, kv)
                .transpose(0, 1)
                .unwrap()
                .contiguous()
                .unwrap();
            let kc = qk_norm_rope(
                &proj(ctx.as_tensor(), &wk, kv),
                kn.as_tensor(),
                &cc,
                &sc,
                eps,
                m,
            )
            .unwrap();
            let vc = proj(ctx.as_tensor(), &wv, kv)
                .transpose(0, 1)
                .unwrap()
                .contiguous()
                .unwrap();
            let out = dflash_attention(&q, &kc, &vc, &kb, &vb, &spans, b, window).unwrap();
            let h1_ref = (h.as_tensor() + out.matmul(&wo.t().unwrap()).unwrap()).unwrap();
            let grads = (&h1_ref * &probe)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();

            let w = AttnWeights {
                input_norm: in_norm.as_tensor(),
                q: wq.as_tensor(),
                k: wk.as_tensor(),
                v: wv.as_tensor(),
                o: wo.as_tensor(),
                q_norm: qn.as_tensor(),
                k_norm: kn.as_tensor(),
                heads,
                kv_heads: kv,
                eps,
            };
            let rot = Rotations {
                block: (&cb, &sb),
                ctx: (&cc, &sc),
            };
            let attn = DFlashAttention::new(&spans, c, b, window, &dev).unwrap();
            let (h1, saved) = forward(h.as_tensor(), ctx.as_tensor(), &w, rot, &attn).unwrap();
            assert!(max_rel(&h1, &h1_ref) < 1e-5, "forward, window {window:?}");
            let (dh, dctx, g) = backward(&saved, &probe, &w, rot, &attn).unwrap();
            for (name, got, v) in [
                ("h", &dh, &h),
                ("ctx", &dctx, &ctx),
                ("input_norm", &g.input_norm, &in_norm),
                ("q", &g.q, &wq),
                ("k", &g.k, &wk),
                ("v", &g.v, &wv),
                ("o", &g.o, &wo),
                ("q_norm", &g.q_norm, &qn),
                ("k_norm", &g.k_norm, &kn),
            ] {
                let e = max_rel(got, grads.get(v.as_tensor()).unwrap());
                assert!(e < 1e-4, "d{name}, window {window:?}: rel err {e}");
            }
        }
    }
}
