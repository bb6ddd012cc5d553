//! Launch wrappers of gdn.cu: the Gated DeltaNet token mixer of one sequence's short causal
//! chain (decode steps and chain verifies of up to [`GDN_MAX_CHAIN`] tokens) in two launches,
//! which open as programmatic dependents (`cuda::pdl`).
//! Shapes are checked here because the kernels trust them.

use candle_core::{bail, DType, Result, Tensor};

use super::launch::{alloc_bf16, alloc_f32, cfg, check_bf16, cuda, ptr, KernelArgs};
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

/// What a chain launch writes besides its output: the states and the conv window rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChainOut {
    /// The state after every token `[t, hv, dk, dv]` and every row of [window; new rows]
    /// `[K-1+t, conv_dim]`, fresh (a forward that may be rolled back stages each row's).
    EveryRow,
    /// The state after the last token `[1, hv, dk, dv]` and the window after it `[K-1,
    /// conv_dim]`, fresh.
    LastRow,
    /// The state and window after the last token written over `s0` and `win` themselves (a
    /// decode graph's own buffers), which are returned.
    InPlace,
}

/// The mixer over `t` new tokens from the conv window `win` (bf16 `[K-1, conv_dim]`, the
/// cached pre-conv rows) and the state `s0` (f32 `[hv, dk, dv]`): `proj` bf16 `[t, P]` is the
/// whole in-projection (its first `conv_dim` columns the new pre-conv rows; z, b and a).
/// Returns the gated-norm output `[t, hv * dv]` (bf16, before `out_proj`), the states and the
/// window rows `out` asks for.
pub fn gdn_chain(
    win: &Tensor,
    proj: &Tensor,
    s0: &Tensor,
    w: &GdnWeights<'_>,
    out: ChainOut,
) -> Result<(Tensor, Tensor, Tensor)> {
    let dev = cuda(proj)?;
    let ChainDims { t, p, kernel, c } = check_chain(
        "gdn_chain",
        ("gdn window", win),
        false,
        GDN_MAX_CHAIN,
        proj,
        s0,
        w,
    )?;
    let (d, hk, hv) = (GDN_HEAD_DIM, w.hk, w.hv);
    let o = alloc_f32(&dev, t * hv * d)?;
    let (states, window) = match out {
        ChainOut::EveryRow => (
            alloc_f32(&dev, t * hv * d * d)?.reshape((t, hv, d, d))?,
            alloc_bf16(&dev, (kernel - 1 + t, c))?,
        ),
        ChainOut::LastRow => (
            alloc_f32(&dev, hv * d * d)?.reshape((1, hv, d, d))?,
            alloc_bf16(&dev, (kernel - 1, c))?,
        ),
        ChainOut::InPlace => (s0.reshape((1, hv, d, d))?, win.clone()),
    };
    let (wp, pp, tp, ap, bp, sp, op, outp) = (
        ptr(win)?,
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
        (out == ChainOut::EveryRow) as i32,
        hk as i32,
        hv as i32,
        c as i32,
        p as i32,
        kernel as i32,
    );
    let off_b = (c + hv * d) as i32;
    mark(proj.device(), "gdn.chain");
    let f = dev.get_or_load_custom_func("gdn_chain", MODULE, PTX)?;
    let mut b = KernelArgs::new();
    b.arg(&wp).arg(&pp).arg(&tp).arg(&ap).arg(&bp).arg(&sp);
    b.arg(&op)
        .arg(&outp)
        .arg(&ti)
        .arg(&alli)
        .arg(&hki)
        .arg(&hvi);
    b.arg(&ci).arg(&pi).arg(&ki).arg(&off_b);
    b.launch(
        &dev,
        &f,
        cfg((hv as u32, (d / 32) as u32, 1), 128),
        "gdn_chain",
    )?;

    mark(proj.device(), "gdn.norm");
    let first = if out == ChainOut::EveryRow { 0 } else { t };
    let rows = WindowRows {
        win,
        out: &window,
        first,
    };
    let y = gated_norm(&o, proj, w, t, Some(rows))?;
    drop(o);
    Ok((y, states, window))
}

/// The conv window rows [`gated_norm`] writes: rows `[first, K-1+t)` of the window `win`
/// followed by the new rows, into `out` (which may be `win` itself when `first == t`).
pub(super) struct WindowRows<'a> {
    pub win: &'a Tensor,
    pub out: &'a Tensor,
    pub first: usize,
}

/// `gdn_gated_norm` of the raw outputs `o` (f32 `[t, hv, dv]`) with the gate z of `proj`
/// (`[t, P]`, z at column `conv_dim`): bf16 `[t, hv * dv]`, the input of `out_proj`; and the
/// conv window rows `window` asks for.
pub(super) fn gated_norm(
    o: &Tensor,
    proj: &Tensor,
    w: &GdnWeights<'_>,
    t: usize,
    window: Option<WindowRows<'_>>,
) -> Result<Tensor> {
    let dev = cuda(proj)?;
    let (d, hv) = (GDN_HEAD_DIM, w.hv);
    let p = proj.dim(1)?;
    let (kernel, c) = w.conv_taps.dims2()?;
    let y = alloc_bf16(&dev, (t, hv * d))?;
    let (win_p, out_p, first) = match &window {
        Some(r) => {
            check_bf16("gdn window", r.win)?;
            check_bf16("gdn window out", r.out)?;
            if r.win.dims2()? != (kernel - 1, c)
                || r.first > kernel - 1 + t
                || r.out.dims2()? != (kernel - 1 + t - r.first, c)
                || (r.first == 0 && ptr(r.win)? == ptr(r.out)?)
            {
                bail!(
                    "gdn window rows: window {:?}, out {:?}, from row {} of {} + {t}",
                    r.win.shape(),
                    r.out.shape(),
                    r.first,
                    kernel - 1
                )
            }
            (ptr(r.win)?, ptr(r.out)?, r.first as i32)
        }
        None => (0u64, 0u64, 0i32),
    };
    let (op, pp, wp, yp) = (ptr(o)?, ptr(proj)?, ptr(w.norm)?, ptr(&y)?);
    let (hvi, pi) = (hv as i32, p as i32);
    let (z_off, eps) = (c as i32, w.eps as f32);
    let (ki, ci, ti) = (kernel as i32, c as i32, t as i32);
    let f = dev.get_or_load_custom_func("gdn_gated_norm", MODULE, PTX)?;
    let mut b = KernelArgs::new();
    b.arg(&op).arg(&pp).arg(&wp).arg(&yp).arg(&hvi).arg(&pi);
    b.arg(&z_off).arg(&eps).arg(&win_p).arg(&out_p).arg(&first);
    b.arg(&ki).arg(&ci).arg(&ti);
    b.launch(
        &dev,
        &f,
        cfg((hv as u32, t as u32, 1), 128),
        "gdn_gated_norm",
    )?;
    Ok(y)
}
