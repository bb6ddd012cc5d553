//! Launch wrappers of gdn_split.cu: the Gated DeltaNet chain mixer as a prologue (conv, norms,
//! gates: once per channel and token) and a warp-shuffle scan over twice the warps of
//! `gdn_chain`, which can skip the per-row states and write instead what the commit rebuilds
//! the accepted row's state from (`RowInputs`, see `cache/recurrent.rs`); and that rebuild.
//! Shapes are checked here because the kernels trust them.

use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
use candle_core::{bail, DType, Result, Tensor};

use super::gdn::{
    check_chain, check_f32, gated_norm, ChainDims, GdnWeights, GDN_HEAD_DIM, GDN_MAX_CHAIN,
};
use super::gdn_chunk::{chunked_delta_rule, tree_delta_rule, GDN_CHUNK, GDN_CHUNKED_MIN_T};
use super::launch::{alloc_f32, cfg, cuda, go, ptr};
use super::phases::mark;

pub(super) const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/gdn_split.ptx"));

/// Most tokens [`gdn_split`] takes without per-row states: a prefill of any chunk size.
pub const GDN_SPLIT_MAX_T: usize = 65_535;
pub(super) const MODULE: &str = "dflash_gdn_split";

/// Which recurrent states the scan writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScanStates {
    /// None (the commit rebuilds the accepted row's state from the written values).
    None,
    /// The state after the last token, `[1, hv, dk, dv]`.
    Last,
    /// The state after every token, `[t, hv, dk, dv]`.
    All,
}

/// What [`gdn_split`] returns.
pub struct SplitOut {
    /// The gated-norm output, bf16 `[t, hv * dv]` (before `out_proj`).
    pub y: Tensor,
    /// As asked: f32 `[1 or t, hv, dk, dv]`.
    pub states: Option<Tensor>,
    /// L2-normalised keys per key head, f32 `[t, hk, dk]`.
    pub k: Tensor,
    /// Log-decays, f32 `[t, hv]`.
    pub g: Tensor,
    /// The value each token wrote into the state, f32 `[t, hv, dv]` (when asked).
    pub u: Option<Tensor>,
}

/// What `gdn_prep` writes (f32): `q`, `k` `[t, hk, 128]`, `v` `[t, hv * 128]`, `g`, `beta`
/// `[t, hv]`.
struct Prepped {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
}

/// The prologue of [`gdn_split`] and [`gdn_tree`] (shapes checked by the caller): the conv
/// over `[win; proj rows]` (token i reading rows i .. i + K - 1, or `conv_rows`' u32 `[t, K]`
/// rows of a tree), SiLU, the q / k norms, decays and betas, one launch.
fn prep(
    win: &Tensor,
    proj: &Tensor,
    w: &GdnWeights<'_>,
    conv_rows: Option<&Tensor>,
    dims: ChainDims,
) -> Result<Prepped> {
    let dev = cuda(proj)?;
    let ChainDims { t, p, kernel, c } = dims;
    let (d, hk, hv) = (GDN_HEAD_DIM, w.hk, w.hv);
    let out = Prepped {
        q: alloc_f32(&dev, t * hk * d)?,
        k: alloc_f32(&dev, t * hk * d)?,
        v: alloc_f32(&dev, t * hv * d)?,
        g: alloc_f32(&dev, t * hv)?,
        beta: alloc_f32(&dev, t * hv)?,
    };
    let (hki, hvi, ci, pi, ki) = (hk as i32, hv as i32, c as i32, p as i32, kernel as i32);
    let off_b = (c + hv * d) as i32;
    // Null rows: token i's conv reads rows i .. i + K - 1.
    let rows = conv_rows.map_or(Ok(0u64), ptr)?;
    let (winp, pp, tp, ap, bp) = (
        ptr(win)?,
        ptr(proj)?,
        ptr(w.conv_taps)?,
        ptr(w.neg_a)?,
        ptr(w.dt_bias)?,
    );
    let (qp, kp, vp, gp, betap) = (
        ptr(&out.q)?,
        ptr(&out.k)?,
        ptr(&out.v)?,
        ptr(&out.g)?,
        ptr(&out.beta)?,
    );
    let f = dev.get_or_load_custom_func("gdn_prep", MODULE, PTX)?;
    let mut b = f.builder();
    b.arg(&winp).arg(&pp).arg(&tp).arg(&rows).arg(&ap).arg(&bp);
    b.arg(&qp).arg(&kp).arg(&vp).arg(&gp).arg(&betap);
    b.arg(&hki).arg(&hvi).arg(&ci).arg(&pi).arg(&ki).arg(&off_b);
    go(
        &mut b,
        cfg(((c / d + 1) as u32, t as u32, 1), 128),
        "gdn_prep",
    )?;
    Ok(out)
}

/// The mixer over `t` new tokens from the cached conv window `win` (bf16 `[K-1, conv_dim]`)
/// and state `s0` (f32 `[hv, dk, dv]`); `proj` bf16 `[t, P]` is the whole in-projection.
/// Three launches: `gdn_prep`, `gdn_scan`, `gdn_gated_norm` (a long prefill's last-state-only
/// run: two per 4096 tokens of the chunked form in place of `gdn_scan` when
/// [`super::gdn_chunked`] is on).
pub fn gdn_split(
    win: &Tensor,
    proj: &Tensor,
    s0: &Tensor,
    w: &GdnWeights<'_>,
    states: ScanStates,
    writes: bool,
) -> Result<SplitOut> {
    let dev = cuda(proj)?;
    let cdev = proj.device().clone();
    // A state per row is only for verify-sized chains (3 MiB a row at the 27B shape); the
    // outputs or the last state for any length up to the grid's y limit (one block row per
    // token in the prologue and the gated norm).
    let max_t = match states {
        ScanStates::All => GDN_MAX_CHAIN,
        ScanStates::None | ScanStates::Last => GDN_SPLIT_MAX_T,
    };
    let dims = check_chain("gdn_split", ("gdn win", win), false, max_t, proj, s0, w)?;
    let (t, d, hk, hv) = (dims.t, GDN_HEAD_DIM, w.hk, w.hv);
    mark(&cdev, "gdn.prep");
    let Prepped { q, k, v, g, beta } = prep(win, proj, w, None, dims)?;
    // A prefill's long run: the chunked form on the tensor cores (`gdn_chunk.rs`).
    if states == ScanStates::Last && !writes && t >= GDN_CHUNKED_MIN_T && super::gdn_chunked() {
        mark(&cdev, "gdn.scan");
        let (o, last) = chunked_delta_rule(&dev, s0, &q, &k, &v, &g, &beta, (t, hk, hv))?;
        mark(&cdev, "gdn.norm");
        let y = gated_norm(&o, proj, w, t, None)?;
        return Ok(SplitOut {
            y,
            states: Some(last.reshape((1, hv, d, d))?),
            k: k.reshape((t, hk, d))?,
            g: g.reshape((t, hv))?,
            u: None,
        });
    }
    let (hki, hvi, ti) = (hk as i32, hv as i32, t as i32);
    let (qp, kp, vp, gp, betap) = (ptr(&q)?, ptr(&k)?, ptr(&v)?, ptr(&g)?, ptr(&beta)?);
    let o = alloc_f32(&dev, t * hv * d)?;
    let u = if writes {
        Some(alloc_f32(&dev, t * hv * d)?)
    } else {
        None
    };
    let n_states = match states {
        ScanStates::None => 0,
        ScanStates::Last => 1,
        ScanStates::All => t,
    };
    let s_out = if n_states > 0 {
        Some(alloc_f32(&dev, n_states * hv * d * d)?)
    } else {
        None
    };
    let mode = match states {
        ScanStates::None => 0i32,
        ScanStates::Last => 1,
        ScanStates::All => 2,
    };
    let opt = |x: &Option<Tensor>| x.as_ref().map_or(Ok(0u64), ptr);
    let (sp, op, up, outp) = (ptr(s0)?, ptr(&o)?, opt(&u)?, opt(&s_out)?);
    mark(&cdev, "gdn.scan");
    let f = dev.get_or_load_custom_func("gdn_scan", MODULE, PTX)?;
    let mut b = f.builder();
    b.arg(&sp).arg(&qp).arg(&kp).arg(&vp).arg(&gp).arg(&betap);
    b.arg(&op).arg(&up).arg(&outp);
    b.arg(&ti).arg(&mode).arg(&hki).arg(&hvi);
    go(
        &mut b,
        cfg((hv as u32, (d / 16) as u32, 1), 128),
        "gdn_scan",
    )?;
    mark(&cdev, "gdn.norm");
    let y = gated_norm(&o, proj, w, t, None)?;
    Ok(SplitOut {
        y,
        states: s_out.map(|s| s.reshape((n_states, hv, d, d))).transpose()?,
        k: k.reshape((t, hk, d))?,
        g: g.reshape((t, hv))?,
        u: u.map(|u| u.reshape((t, hv, d))).transpose()?,
    })
}

/// Deepest tree [`gdn_tree`] takes (`GS_MAX_DEPTH` of gdn_split.cu: the scan's per-thread
/// stack of states by depth).
pub const GDN_TREE_MAX_DEPTH: usize = 32;

/// The mixer over a verify tree of `t` tokens from the cached conv window `win` and state `s0`
/// (as [`gdn_split`]): `conv_rows` (u32 `[t * K]`, `Forest::conv_taps` of the one segment) are
/// the rows of `[win; proj rows]` each token's conv reads, oldest first; `order` and `depth`
/// (u32 `[t]`) a depth-first pre-order of the tokens and each one's depth (see
/// [`crate::qwen3_5::delta_rule::dfs_order`]). Every output is in the tokens' own order: the gated-norm output, the keys,
/// log-decays and the value each token wrote (no states: the commit rebuilds the accepted
/// path's from them, as for `ScanStates::None`). Three launches for any tree shape.
pub fn gdn_tree(
    win: &Tensor,
    proj: &Tensor,
    s0: &Tensor,
    w: &GdnWeights<'_>,
    conv_rows: &Tensor,
    order: &Tensor,
    depth: &Tensor,
) -> Result<SplitOut> {
    let dev = cuda(proj)?;
    let rows = proj.dim(0)?;
    check_index("gdn_tree", "order", order, DType::U32, rows)?;
    check_index("gdn_tree", "depth", depth, DType::U32, rows)?;
    let (t, pre) = tree_front("gdn_tree", (win, proj, s0), w, conv_rows, GDN_SPLIT_MAX_T)?;
    let (d, hk, hv) = (GDN_HEAD_DIM, w.hk, w.hv);
    let Prepped { q, k, v, g, beta } = &pre;
    let (hki, hvi, ti) = (hk as i32, hv as i32, t as i32);
    let (qp, kp, vp, gp, betap) = (ptr(q)?, ptr(k)?, ptr(v)?, ptr(g)?, ptr(beta)?);
    let o = alloc_f32(&dev, t * hv * d)?;
    let u = alloc_f32(&dev, t * hv * d)?;
    let (sp, op, up, orp, dp) = (ptr(s0)?, ptr(&o)?, ptr(&u)?, ptr(order)?, ptr(depth)?);
    let f = dev.get_or_load_custom_func("gdn_scan_tree", MODULE, PTX)?;
    let mut b = f.builder();
    b.arg(&sp).arg(&qp).arg(&kp).arg(&vp).arg(&gp).arg(&betap);
    b.arg(&orp).arg(&dp).arg(&op).arg(&up);
    b.arg(&ti).arg(&hki).arg(&hvi);
    go(
        &mut b,
        cfg((hv as u32, (d / 16) as u32, 1), 128),
        "gdn_scan_tree",
    )?;
    tree_out(&o, u, pre, proj, w)
}

/// The checks and the prologue (`gdn_prep` with the tree's conv rows) of a tree launch of at
/// most `max_t` nodes: the node count and the delta rule's inputs.
fn tree_front(
    op: &str,
    (win, proj, s0): (&Tensor, &Tensor, &Tensor),
    w: &GdnWeights<'_>,
    conv_rows: &Tensor,
    max_t: usize,
) -> Result<(usize, Prepped)> {
    let dims = check_chain(op, ("gdn win", win), false, max_t, proj, s0, w)?;
    check_index(op, "conv rows", conv_rows, DType::U32, dims.t * dims.kernel)?;
    let t = dims.t;
    Ok((t, prep(win, proj, w, Some(conv_rows), dims)?))
}

/// A tree launch's outputs from its raw outputs `o` and writes `u` (f32 `[t * hv * 128]`):
/// the gated norm, the keys, log-decays and writes by node.
fn tree_out(
    o: &Tensor,
    u: Tensor,
    pre: Prepped,
    proj: &Tensor,
    w: &GdnWeights<'_>,
) -> Result<SplitOut> {
    let (t, d, hk, hv) = (proj.dim(0)?, GDN_HEAD_DIM, w.hk, w.hv);
    Ok(SplitOut {
        y: gated_norm(o, proj, w, t, None)?,
        states: None,
        k: pre.k.reshape((t, hk, d))?,
        g: pre.g.reshape((t, hv))?,
        u: Some(u.reshape((t, hv, d))?),
    })
}

/// `x` holds `n` contiguous elements of the index type `dtype`.
fn check_index(op: &str, name: &str, x: &Tensor, dtype: DType, n: usize) -> Result<()> {
    if x.dtype() != dtype || x.elem_count() != n || !x.is_contiguous() {
        bail!(
            "{op}: {name} must be {n} contiguous {dtype:?}, got {:?} {:?}",
            x.dtype(),
            x.shape()
        )
    }
    Ok(())
}

/// [`gdn_tree`] in the chunked form (`gdn_chunk.cu` with the ancestor mask): a tree of up to
/// [`GDN_CHUNK`] nodes, any depth, parents before children; `anc` (i64 `[t]`,
/// `cuda::tree_bits`) in place of the depth-first order. The same outputs, the delta rule's
/// products on the tensor cores (bf16 operands where the prefill's chunked form has them)
/// instead of one node after another. Four launches.
pub fn gdn_tree_chunked(
    win: &Tensor,
    proj: &Tensor,
    s0: &Tensor,
    w: &GdnWeights<'_>,
    conv_rows: &Tensor,
    anc: &Tensor,
) -> Result<SplitOut> {
    let dev = cuda(proj)?;
    let t = proj.dim(0)?;
    check_index("gdn_tree_chunked", "ancestor bits", anc, DType::I64, t)?;
    let (t, pre) = tree_front("gdn_tree_chunked", (win, proj, s0), w, conv_rows, GDN_CHUNK)?;
    let Prepped { q, k, v, g, beta } = &pre;
    let (o, u) = tree_delta_rule(&dev, s0, q, k, v, g, beta, anc, (t, w.hk, w.hv))?;
    tree_out(&o, u, pre, proj, w)
}

/// The state after `m` rows from `s0` (f32 `[hv, dk, dv]`), given their keys per key head `k`
/// (f32 `[m, hk, dk]`), written values `u` (f32 `[m, hv, dv]`) and log-decays `g` (f32
/// `[m, hv]`): the delta rule's `S_i = e^{g_i} S_{i-1} + k_i u_iᵀ` with `gdn_scan`'s operations
/// in its order, so rebuilding from the scan's writes gives its states bit for bit. One launch;
/// reads the state once and writes it once.
pub fn gdn_state_along(s0: &Tensor, k: &Tensor, u: &Tensor, g: &Tensor) -> Result<Tensor> {
    let dev = cuda(s0)?;
    let (hv, dk, dv) = s0.dims3()?;
    let (m, hk, kd) = k.dims3()?;
    let (um, uh, ud) = u.dims3()?;
    let (gm, gh) = g.dims2()?;
    if kd != dk
        || (um, uh, ud) != (m, hv, dv)
        || (gm, gh) != (m, hv)
        || hk == 0
        || !hv.is_multiple_of(hk)
    {
        bail!(
            "gdn_state_along: state {:?}, k {:?}, u {:?}, g {:?}",
            s0.shape(),
            k.shape(),
            u.shape(),
            g.shape()
        )
    }
    for (name, x) in [("state", s0), ("k", k), ("u", u), ("g", g)] {
        check_f32(name, x, x.elem_count())?;
    }
    let n = hv * dk * dv;
    let out = alloc_f32(&dev, n)?;
    let (sp, kp, upt, gp, op) = (ptr(s0)?, ptr(k)?, ptr(u)?, ptr(g)?, ptr(&out)?);
    let (mi, hki, hvi, dki, dvi) = (m as i32, hk as i32, hv as i32, dk as i32, dv as i32);
    let f = dev.get_or_load_custom_func("gdn_state_along", MODULE, PTX)?;
    let mut b = f.builder();
    b.arg(&sp).arg(&kp).arg(&upt).arg(&gp).arg(&op);
    b.arg(&mi).arg(&hki).arg(&hvi).arg(&dki).arg(&dvi);
    go(
        &mut b,
        cfg((n.div_ceil(256) as u32, 1, 1), 256),
        "gdn_state_along",
    )?;
    out.reshape((hv, dk, dv))
}
