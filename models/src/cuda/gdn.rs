//! Launch wrappers of gdn.cu: the Gated DeltaNet token mixer of one sequence's short causal
//! chain (decode steps and chain verifies of up to [`GDN_MAX_CHAIN`] tokens) in two launches.
//! Shapes are checked here because the kernels trust them.

use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
use candle_core::{bail, DType, Result, Tensor};

use super::launch::{alloc_bf16, alloc_f32, cfg, check_bf16, cuda, go, ptr};
use super::phases::mark;

pub(super) const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/gdn.ptx"));
pub(super) const MODULE: &str = "dflash_gdn";

/// Longest chain the fused mixer takes (its per-token inputs sit in shared memory).
pub const GDN_MAX_CHAIN: usize = 16;
/// Key and value head size the kernels are built for.
pub const GDN_HEAD_DIM: usize = 128;
/// Longest conv kernel the kernels take.
pub const GDN_MAX_CONV: usize = 4;

/// One GDN layer's weights and sizes as the fused mixer reads them.
pub struct GdnWeights<'a> {
    /// bf16 `[K, conv_dim]`.
    pub conv_taps: &'a Tensor,
    /// f32 `[hv]`: `-exp(A_log)` and `dt_bias`.
    pub neg_a: &'a Tensor,
    pub dt_bias: &'a Tensor,
    /// bf16 `[dv]`, the gated norm's plain weight.
    pub norm: &'a Tensor,
    pub hk: usize,
    pub hv: usize,
    pub eps: f64,
}

pub(crate) fn check_f32(name: &str, t: &Tensor, n: usize) -> Result<()> {
    if t.dtype() != DType::F32 || !t.is_contiguous() || t.elem_count() != n {
        bail!(
            "{name} must be contiguous f32 of {n} elements, got {:?} {:?}",
            t.dtype(),
            t.shape()
        )
    }
    Ok(())
}

/// Token count `t`, projection width `p`, conv kernel and conv channels `c` of a chain launch.
pub(crate) struct ChainDims {
    pub t: usize,
    pub p: usize,
    pub kernel: usize,
    pub c: usize,
}

/// The checks every chain launch makes (the kernels trust these shapes): bf16 inputs, `proj`
/// rows of `[q | k | v | z | b | a]`, the conv window `win` (labelled `win.0` in errors) holding
/// the `kernel - 1` cached pre-conv rows, followed by the `t` new ones when `with_new_rows`,
/// and the f32 gates and state.
pub(crate) fn check_chain(
    name: &str,
    win: (&str, &Tensor),
    with_new_rows: bool,
    max_t: usize,
    proj: &Tensor,
    s0: &Tensor,
    w: &GdnWeights<'_>,
) -> Result<ChainDims> {
    let (win_label, win) = win;
    check_bf16(win_label, win)?;
    let win_name = win_label.trim_start_matches("gdn ");
    check_bf16("gdn proj", proj)?;
    check_bf16("gdn conv taps", w.conv_taps)?;
    check_bf16("gdn norm", w.norm)?;
    let (d, hk, hv) = (GDN_HEAD_DIM, w.hk, w.hv);
    let (t, p) = proj.dims2()?;
    let (kernel, c) = w.conv_taps.dims2()?;
    let (win_rows, win_c) = win.dims2()?;
    let new_rows = if with_new_rows { t } else { 0 };
    if t == 0
        || t > max_t
        || kernel == 0
        || kernel > GDN_MAX_CONV
        || hk == 0
        || !hv.is_multiple_of(hk)
        || c != 2 * hk * d + hv * d
        || win_c != c
        || win_rows != kernel - 1 + new_rows
        || p != c + hv * d + 2 * hv
        || w.norm.dims1()? != d
    {
        bail!(
            "{name}: proj {:?}, {win_name} {:?}, taps {:?}, hk {hk}, hv {hv}: needs 1..={max_t} tokens, head size {d}, conv kernel <= {GDN_MAX_CONV}",
            proj.shape(),
            win.shape(),
            w.conv_taps.shape()
        )
    }
    check_f32("gdn neg_a", w.neg_a, hv)?;
    check_f32("gdn dt_bias", w.dt_bias, hv)?;
    check_f32("gdn state", s0, hv * d * d)?;
    Ok(ChainDims { t, p, kernel, c })
}

/// The mixer over `t` new tokens: `ext` bf16 `[K-1+t, conv_dim]` (the cached conv window
/// then the new rows' q|k|v projections), `proj` bf16 `[t, P]` (the whole in-projection, for
/// z, b and a), `s0` f32 `[hv, dk, dv]` (the state before the chain). Returns the gated-norm
/// output `[t, hv * dv]` (bf16, before `out_proj`) and the states, f32
/// `[all_states ? t : 1, hv, dk, dv]`: after every token, or only after the last.
pub fn gdn_chain(
    ext: &Tensor,
    proj: &Tensor,
    s0: &Tensor,
    w: &GdnWeights<'_>,
    all_states: bool,
) -> Result<(Tensor, Tensor)> {
    let dev = cuda(proj)?;
    let ChainDims { t, p, kernel, c } = check_chain(
        "gdn_chain",
        ("gdn ext", ext),
        true,
        GDN_MAX_CHAIN,
        proj,
        s0,
        w,
    )?;
    let (d, hk, hv) = (GDN_HEAD_DIM, w.hk, w.hv);
    let n_states = if all_states { t } else { 1 };
    let o = alloc_f32(&dev, t * hv * d)?;
    let states = alloc_f32(&dev, n_states * hv * d * d)?;
    let (ep, pp, tp, ap, bp, sp, op, outp) = (
        ptr(ext)?,
        ptr(proj)?,
        ptr(w.conv_taps)?,
        ptr(w.neg_a)?,
        ptr(w.dt_bias)?,
        ptr(s0)?,
        ptr(&o)?,
        ptr(&states)?,
    );
    let (ti, alli, hki, hvi, ci, pi, ki) = (
        t as i32,
        all_states as i32,
        hk as i32,
        hv as i32,
        c as i32,
        p as i32,
        kernel as i32,
    );
    let off_b = (c + hv * d) as i32;
    mark(proj.device(), "gdn.chain");
    let f = dev.get_or_load_custom_func("gdn_chain", MODULE, PTX)?;
    let mut b = f.builder();
    b.arg(&ep)
        .arg(&pp)
        .arg(&tp)
        .arg(&ap)
        .arg(&bp)
        .arg(&sp)
        .arg(&op)
        .arg(&outp);
    b.arg(&ti)
        .arg(&alli)
        .arg(&hki)
        .arg(&hvi)
        .arg(&ci)
        .arg(&pi)
        .arg(&ki)
        .arg(&off_b);
    go(
        &mut b,
        cfg((hv as u32, (d / 32) as u32, 1), 128),
        "gdn_chain",
    )?;

    mark(proj.device(), "gdn.norm");
    let y = gated_norm(&o, proj, w, t)?;
    drop(o);
    Ok((y, states.reshape((n_states, hv, d, d))?))
}

/// `gdn_gated_norm` of the raw outputs `o` (f32 `[t, hv, dv]`) with the gate z of `proj`
/// (`[t, P]`, z at column `conv_dim`): bf16 `[t, hv * dv]`, the input of `out_proj`.
pub(super) fn gated_norm(
    o: &Tensor,
    proj: &Tensor,
    w: &GdnWeights<'_>,
    t: usize,
) -> Result<Tensor> {
    let dev = cuda(proj)?;
    let (d, hv) = (GDN_HEAD_DIM, w.hv);
    let p = proj.dim(1)?;
    let c = w.conv_taps.dim(1)?;
    let y = alloc_bf16(&dev, (t, hv * d))?;
    let (op, pp, wp, yp) = (ptr(o)?, ptr(proj)?, ptr(w.norm)?, ptr(&y)?);
    let (hvi, pi) = (hv as i32, p as i32);
    let (z_off, eps) = (c as i32, w.eps as f32);
    let f = dev.get_or_load_custom_func("gdn_gated_norm", MODULE, PTX)?;
    let mut b = f.builder();
    b.arg(&op)
        .arg(&pp)
        .arg(&wp)
        .arg(&yp)
        .arg(&hvi)
        .arg(&pi)
        .arg(&z_off)
        .arg(&eps);
    go(&mut b, cfg((hv as u32, t as u32, 1), 128), "gdn_gated_norm")?;
    Ok(y)
}
