//! Launch wrappers of moe.cu: the sparse-MoE block (`layers/moe.rs`'s math) on the device for
//! up to [`MOE_MAX_ROWS`] rows per launch set, routing included, with no host round trip (so a
//! CUDA graph can capture it) and reading only the selected experts' weights. One row (decode):
//! router GEMV (the post-attention norm applied as the row streams in), routing, gate/up, and
//! down with the weighted combine and the residual add in its epilogue: 4 launches. 2..64 rows:
//! the norm, router, routing, one tensor-core gate/up and one down launch over every used
//! expert (each expert's weights read once for all the rows routed to it), the combine: 6.
//! A shared expert of the routed width rides along at one row ([`SharedExpertRefs`]): still
//! 4 launches for the whole block. Shapes are checked here because the kernels trust them.

use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
use candle_core::cuda_backend::CudaDevice;
use candle_core::{bail, DType, Result, Tensor};

use super::gemv::{gemv, k_splits, rms_apply, row_sumsq, RowNorm};
use super::launch::{alloc_bf16, alloc_f32, cfg, check_bf16, cuda, go, opt_ptr, ptr, KernelArgs};
use super::{moe_shape_fits, MOE_MAX_EXPERTS, MOE_MAX_ROWS, MOE_MAX_TOP_K};

pub(super) const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/moe.ptx"));
pub(super) const MODULE: &str = "dflash_moe";

/// A sparse-MoE block's weights as the kernels read them: the router `[E, H]`, the experts'
/// gate and up rows stacked `[E, 2I, H]` (gate rows first) and their down projections
/// `[E, H, I]`.
#[derive(Clone, Copy)]
pub struct MoeWeights<'a> {
    pub router: &'a Tensor,
    pub gate_up: &'a Tensor,
    pub down: &'a Tensor,
    pub top_k: usize,
    pub norm_topk_prob: bool,
    /// A shared expert run inside the block at one row (None: the block has none, or the
    /// caller runs it apart).
    pub shared: Option<SharedExpertRefs<'a>>,
}

/// A shared expert of the routed experts' width, gated by `sigmoid(x g)`, as the one-row block
/// runs it: `router_gate` is `[E + 16, H]`, the router's E rows, the gate row `g`, zero rows
/// (the GEMV's 16-row multiple); `gate_up` `[2I, H]`, `down` `[H, I]`.
#[derive(Clone, Copy)]
pub struct SharedExpertRefs<'a> {
    pub router_gate: &'a Tensor,
    pub gate_up: &'a Tensor,
    pub down: &'a Tensor,
}

/// Rows of [`SharedExpertRefs::router_gate`] past the E experts: the gate row and padding.
pub const SHARED_ROUTER_PAD: usize = 16;

impl MoeWeights<'_> {
    /// `(E, H, I)`, checked against each other and against what the kernels take.
    pub fn dims(&self) -> Result<(usize, usize, usize)> {
        let (e, h) = self.router.dims2()?;
        let (e2, i2, h2) = self.gate_up.dims3()?;
        let (e3, h3, i) = self.down.dims3()?;
        if e2 != e || e3 != e || h2 != h || h3 != h || i2 != 2 * i {
            bail!(
                "moe: router {:?}, gate_up {:?}, down {:?} disagree",
                self.router.shape(),
                self.gate_up.shape(),
                self.down.shape()
            )
        }
        if let Some(sh) = &self.shared {
            let fits = sh.router_gate.dims2()? == (e + SHARED_ROUTER_PAD, h)
                && sh.gate_up.dims2()? == (2 * i, h)
                && sh.down.dims2()? == (h, i)
                && self.top_k < MOE_MAX_TOP_K;
            if !fits {
                bail!(
                    "moe: shared expert router_gate {:?}, gate_up {:?}, down {:?} against {e} experts of width {i}, hidden {h}, top {} (< {MOE_MAX_TOP_K})",
                    sh.router_gate.shape(),
                    sh.gate_up.shape(),
                    sh.down.shape(),
                    self.top_k
                )
            }
        }
        if !moe_shape_fits(e, h, i, self.top_k) {
            bail!(
                "moe: {e} experts (top {}), hidden {h}, width {i}: the kernels need experts % 32 == 0 and <= {MOE_MAX_EXPERTS}, top-k <= {MOE_MAX_TOP_K}, hidden and width % 256 == 0, width <= 1024",
                self.top_k
            )
        }
        Ok((e, h, i))
    }
}

/// The routing of a forward's rows, on the device (layout: moe.cu's header).
pub struct MoeRouting {
    meta: Tensor,
    wts: Tensor,
    rows: usize,
    /// Pairs per row: the top k, plus one when the shared expert rides along.
    k: usize,
    shared: bool,
    /// Routed by [`moe_route_wide`]: the used-expert entries are tiles of at most
    /// [`MOE_MAX_ROWS`] pairs.
    wide: bool,
}

impl MoeRouting {
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Every row's `(expert, weight)` top k, highest first, as `layers::moe::route` returns
    /// them (a host copy: for checks).
    pub fn to_host(&self) -> Result<Vec<Vec<(usize, f32)>>> {
        let p = self.rows * self.k;
        let ids = self.meta.narrow(0, 1, p)?.to_vec1::<u32>()?;
        let w = self.wts.narrow(0, 0, p)?.to_vec1::<f32>()?;
        Ok((0..self.rows)
            .map(|r| {
                (0..self.k)
                    .map(|j| (ids[r * self.k + j] as usize, w[r * self.k + j]))
                    .collect()
            })
            .collect())
    }

    /// How many distinct experts the rows use (a host copy).
    pub fn experts_used(&self) -> Result<usize> {
        Ok(self.meta.narrow(0, 0, 1)?.to_vec1::<u32>()?[0] as usize)
    }
}

fn alloc_u32(dev: &CudaDevice, n: usize) -> Result<Tensor> {
    use candle_core::cuda_backend::CudaStorage;
    // Every element the expert kernels read is written by the routing kernel first.
    let s = unsafe { dev.alloc::<u32>(n)? };
    Ok(Tensor::from_storage(
        candle_core::Storage::Cuda(CudaStorage::wrap_cuda_slice(s, dev.clone())),
        n,
        candle_core::op::BackpropOp::none(),
        false,
    ))
}

/// Routes `logits` (`[t <= 64, E]`, bf16 or f32): softmax in f32, the top `k` (ties to the
/// lower expert), renormalised when `norm`; and groups the (row, expert) pairs by expert.
pub fn moe_route(logits: &Tensor, k: usize, norm: bool) -> Result<MoeRouting> {
    let e = logits.dims2()?.1;
    route(logits, e, k, norm, false)
}

/// [`moe_route`] of the first `e` columns of `logits` (`[t, e + SHARED_ROUTER_PAD]`), with
/// every row's shared-expert pair (id `e`, weight `sigmoid(logits[r, e])`) after its top k.
pub fn moe_route_shared(logits: &Tensor, e: usize, k: usize, norm: bool) -> Result<MoeRouting> {
    if logits.dims2()?.1 != e + SHARED_ROUTER_PAD || k >= MOE_MAX_TOP_K {
        bail!(
            "moe_route_shared: logits {:?} for {e} experts (top {k} < {MOE_MAX_TOP_K})",
            logits.shape()
        )
    }
    route(logits, e, k, norm, true)
}

/// The routing kernels' `is_bf16` flag for `logits` (`[t, stride]`) routed over `e` experts,
/// top `k`, with the checks both routings need (`max_rows`: the most rows `who` takes).
fn routable(logits: &Tensor, e: usize, k: usize, max_rows: usize, who: &str) -> Result<i32> {
    let is_bf16 = match logits.dtype() {
        DType::BF16 => 1,
        DType::F32 => 0,
        other => bail!("{who}: logits must be bf16 or f32, got {other:?}"),
    };
    let t = logits.dims2()?.0;
    if !logits.is_contiguous()
        || t == 0
        || t > max_rows
        || !e.is_multiple_of(32)
        || e > MOE_MAX_EXPERTS
        || k == 0
        || k > MOE_MAX_TOP_K.min(e)
    {
        bail!(
            "{who}: logits {:?}, top {k}: needs 1..={max_rows} contiguous rows, experts % 32 == 0 and <= {MOE_MAX_EXPERTS}, 1 <= k <= {MOE_MAX_TOP_K}",
            logits.shape()
        )
    }
    Ok(is_bf16)
}

fn route(logits: &Tensor, e: usize, k: usize, norm: bool, shared: bool) -> Result<MoeRouting> {
    let dev = cuda(logits)?;
    let (t, stride) = logits.dims2()?;
    let is_bf16 = routable(logits, e, k, MOE_MAX_ROWS, "moe_route")?;
    let kk = k + shared as usize;
    let p = t * kk;
    let meta = alloc_u32(&dev, 2 + 6 * p)?;
    let wts = alloc_f32(&dev, 2 * p)?;
    let (lp, mp, wp) = (ptr(logits)?, ptr(&meta)?, ptr(&wts)?);
    let (ti, ei, ki, ni) = (t as i32, e as i32, k as i32, norm as i32);
    let (si, shi) = (stride as i32, shared as i32);
    let f = dev.get_or_load_custom_func("moe_route", MODULE, PTX)?;
    let mut b = KernelArgs::new();
    b.arg(&lp).arg(&is_bf16).arg(&ti).arg(&ei).arg(&ki);
    b.arg(&ni).arg(&mp).arg(&wp).arg(&si).arg(&shi);
    b.launch(&dev, &f, cfg((1, 1, 1), 256), "moe_route")?;
    Ok(MoeRouting {
        meta,
        wts,
        rows: t,
        k: kk,
        shared,
        wide: false,
    })
}

/// [`moe_route`] for any number of rows (`logits` `[t, E]`, bf16 or f32; no shared expert):
/// the same top k and weights, with the pairs of an expert in tiles of at most
/// [`MOE_MAX_ROWS`] (prefills: every expert's weights read once per 64 of its pairs, where
/// pieces of 64 rows would each read nearly every expert). Three launches (a memset, the
/// routing of every row, the grouping by expert), no host round trip.
pub fn moe_route_wide(logits: &Tensor, k: usize, norm: bool) -> Result<MoeRouting> {
    let dev = cuda(logits)?;
    let (t, e) = logits.dims2()?;
    // The u32 routing metadata holds 2 + 6 t k entries.
    let is_bf16 = routable(
        logits,
        e,
        k,
        (u32::MAX as usize / 8) / k.max(1),
        "moe_route_wide",
    )?;
    let p = t * k;
    let meta = alloc_u32(&dev, 2 + 6 * p)?;
    let wts = alloc_f32(&dev, 2 * p)?;
    let sorted = alloc_u32(&dev, p)?;
    let counts = Tensor::zeros(e, DType::U32, logits.device())?;
    let (lp, mp, wp, sp, cp) = (
        ptr(logits)?,
        ptr(&meta)?,
        ptr(&wts)?,
        ptr(&sorted)?,
        ptr(&counts)?,
    );
    let (ti, ei, ki, ni) = (t as i32, e as i32, k as i32, norm as i32);
    let f = dev.get_or_load_custom_func("moe_route_rows", MODULE, PTX)?;
    let mut b = f.builder();
    b.arg(&lp).arg(&is_bf16).arg(&ti).arg(&ei).arg(&ki).arg(&ni);
    b.arg(&mp).arg(&wp).arg(&sp).arg(&cp);
    go(
        &mut b,
        cfg((t.div_ceil(8) as u32, 1, 1), 256),
        "moe_route_rows",
    )?;
    let f = dev.get_or_load_custom_func("moe_route_tiles", MODULE, PTX)?;
    let mut b = f.builder();
    b.arg(&cp).arg(&sp).arg(&ti).arg(&ei).arg(&ki).arg(&mp);
    go(&mut b, cfg((e as u32, 1, 1), 256), "moe_route_tiles")?;
    Ok(MoeRouting {
        meta,
        wts,
        rows: t,
        k,
        shared: false,
        wide: true,
    })
}

/// The experts of a routed block: `(y, ss)` with `y = resid + sum_k w_k expert_k(norm(x))`
/// (`[t, H]` bf16; without `resid` the sum alone) and, when `want_ss`, its row sums of
/// squares (f32 `[t]`, for the next [`RowNorm`]). `routing` must come from `x`'s rows.
pub fn moe_experts(
    x: &Tensor,
    norm: Option<RowNorm<'_>>,
    w: &MoeWeights<'_>,
    routing: &MoeRouting,
    resid: Option<&Tensor>,
    want_ss: bool,
) -> Result<(Tensor, Option<Tensor>)> {
    let dev = cuda(x)?;
    let (e, h, i) = w.dims()?;
    check_bf16("moe x", x)?;
    let shared_parts = w
        .shared
        .iter()
        .flat_map(|sh| [("shared gate_up", sh.gate_up), ("shared down", sh.down)]);
    for (name, t) in [
        ("router", w.router),
        ("gate_up", w.gate_up),
        ("down", w.down),
    ]
    .into_iter()
    .chain(shared_parts)
    {
        check_bf16(name, t)?;
        if ptr(t)? % 16 != 0 {
            bail!("moe: {name} must start on a 16-byte boundary")
        }
    }
    let t = x.dims2()?.0;
    // The shared expert rides along at one row only (the rows kernels; the tensor-core path
    // has no pointer for it).
    let shared = match (routing.shared, &w.shared) {
        (false, _) => None,
        (true, Some(sh)) if t == 1 => Some(*sh),
        (true, _) => bail!("moe: a shared-expert routing needs one row and the shared weights"),
    };
    if x.dims2()? != (routing.rows, h)
        || routing.k != w.top_k + routing.shared as usize
        || ptr(x)? % 16 != 0
    {
        bail!(
            "moe: x {:?} against {} routed rows of top {} (hidden {h})",
            x.shape(),
            routing.rows,
            routing.k
        )
    }
    if let Some(r) = resid {
        check_bf16("moe residual", r)?;
        if r.dims2()? != (t, h) {
            bail!("moe: residual must be [{t}, {h}]")
        }
    }
    let k = routing.k;
    let p = t * k;
    let (sgu, sdn) = match shared {
        Some(sh) => (ptr(sh.gate_up)?, ptr(sh.down)?),
        None => (0u64, 0u64),
    };
    let ei = e as i32;
    let (pi, hi, ii, ki) = (p as i32, h as i32, i as i32, k as i32);
    let (mp, wp) = (ptr(&routing.meta)?, ptr(&routing.wts)?);
    let y = alloc_bf16(&dev, (t, h))?;
    let act = alloc_bf16(&dev, (p, i))?;
    let (gp, dp, ap, yp, rp) = (
        ptr(w.gate_up)?,
        ptr(w.down)?,
        ptr(&act)?,
        ptr(&y)?,
        opt_ptr(resid)?,
    );
    if t == 1 {
        // Decode: one pair per block row of gate/up, the norm applied as x streams in; down
        // combines and adds the residual in its epilogue.
        let summed;
        let (name, nw, eps, ss_in) = match norm {
            Some(nm) => {
                check_bf16("moe norm weight", nm.weight)?;
                if nm.weight.dims1()? != h {
                    bail!("moe: norm weight must be [{h}]")
                }
                let ss = match nm.ss {
                    Some(ss) => ss,
                    None => {
                        summed = row_sumsq(x)?;
                        &summed
                    }
                };
                if ss.dtype() != DType::F32 || ss.dims1()? != t {
                    bail!("moe: norm sums must be f32 [{t}]")
                }
                (
                    "moe_gate_up_rows_norm",
                    ptr(nm.weight)?,
                    nm.eps as f32,
                    ptr(ss)?,
                )
            }
            None => ("moe_gate_up_rows", 0u64, 0f32, 0u64),
        };
        let xp = ptr(x)?;
        let f = dev.get_or_load_custom_func(name, MODULE, PTX)?;
        let mut b = KernelArgs::new();
        b.arg(&xp).arg(&gp).arg(&ap).arg(&ii).arg(&hi).arg(&mp);
        b.arg(&pi).arg(&nw).arg(&eps).arg(&ss_in).arg(&sgu).arg(&ei);
        let grid = (i.div_ceil(8) as u32, p as u32, 1);
        b.launch(&dev, &f, cfg(grid, 128), name)?;
        let name = format!("moe_down_rows_sp{}", i / 256);
        let f = dev.get_or_load_custom_func(&name, MODULE, PTX)?;
        let mut b = KernelArgs::new();
        b.arg(&ap).arg(&dp).arg(&yp).arg(&rp).arg(&hi).arg(&ki);
        b.arg(&mp).arg(&wp).arg(&pi).arg(&sdn).arg(&ei);
        b.launch(&dev, &f, cfg((h.div_ceil(8) as u32, 1, 1), 128), &name)?;
        let ss = want_ss.then(|| row_sumsq(&y)).transpose()?;
        return Ok((y, ss));
    }
    // 2..64 rows: every used expert's weights once for the rows routed to it; wider routings:
    // once per tile of up to 64 of its pairs.
    let normed;
    let h_in = match norm {
        Some(nm) => {
            normed = rms_apply(x, nm)?;
            &normed
        }
        None => x,
    };
    let (mt, slots) = if routing.wide {
        (
            MOE_MAX_ROWS / 16,
            p.min(e + p.div_ceil(MOE_MAX_ROWS)) as u32,
        )
    } else {
        (t.div_ceil(16), e.min(p) as u32)
    };
    let pair_out = alloc_bf16(&dev, (p, h))?;
    let op = ptr(&pair_out)?;
    let xp = ptr(h_in)?;
    for (name, src, wgt, dst, n, kk) in [
        (format!("moe_gate_up_mma_m{mt}"), xp, gp, ap, i, h),
        (format!("moe_down_mma_m{mt}"), ap, dp, op, h, i),
    ] {
        let ks = k_splits(n / 8);
        let (ni, kki, ksi) = (n as i32, kk as i32, ks as i32);
        let f = dev.get_or_load_custom_func(&name, MODULE, PTX)?;
        let mut b = f.builder();
        b.arg(&src)
            .arg(&wgt)
            .arg(&dst)
            .arg(&ni)
            .arg(&kki)
            .arg(&ksi)
            .arg(&mp)
            .arg(&pi);
        go(
            &mut b,
            cfg(((n / 8).div_ceil(4 / ks) as u32, slots, 1), 128),
            &name,
        )?;
    }
    let ss = if want_ss {
        Some(alloc_f32(&dev, t)?)
    } else {
        None
    };
    let sp = opt_ptr(ss.as_ref())?;
    let f = dev.get_or_load_custom_func("moe_combine", MODULE, PTX)?;
    let mut b = f.builder();
    b.arg(&op)
        .arg(&rp)
        .arg(&yp)
        .arg(&sp)
        .arg(&hi)
        .arg(&ki)
        .arg(&mp)
        .arg(&wp)
        .arg(&pi);
    go(&mut b, cfg((t as u32, 1, 1), 256), "moe_combine")?;
    Ok((y, ss))
}

/// The whole block on the device for `x: [t, H]` (any `t`; past [`MOE_MAX_ROWS`] rows routed
/// by [`moe_route_wide`]): `norm(x)` (RMSNorm with `norm`'s weight, or x itself), the router,
/// the routing, the experts, `+ resid`. Returns `(y, ss)` as [`moe_experts`].
pub fn moe_block(
    x: &Tensor,
    norm: Option<RowNorm<'_>>,
    w: &MoeWeights<'_>,
    resid: Option<&Tensor>,
    want_ss: bool,
) -> Result<(Tensor, Option<Tensor>)> {
    let t = x.dims2()?.0;
    if t == 1 {
        // The one-row GEMV applies the norm itself; so does the gate/up kernel.
        let routing = match &w.shared {
            Some(sh) => {
                let e = w.dims()?.0;
                let logits = gemv(x, sh.router_gate, norm)?;
                moe_route_shared(&logits, e, w.top_k, w.norm_topk_prob)?
            }
            None => moe_route(&gemv(x, w.router, norm)?, w.top_k, w.norm_topk_prob)?,
        };
        return moe_experts(x, norm, w, &routing, resid, want_ss);
    }
    if w.shared.is_some() {
        bail!("moe: the shared expert rides along at one row only")
    }
    let h = match norm {
        Some(nm) => rms_apply(x, nm)?,
        None => x.clone(),
    };
    let routing = if t <= MOE_MAX_ROWS {
        moe_route(&gemv(&h, w.router, None)?, w.top_k, w.norm_topk_prob)?
    } else {
        // Past the skinny GEMMs' rows the router is a cuBLAS product (the plain block's).
        let logits = crate::layers::ops::linear(&h, w.router)?;
        moe_route_wide(&logits, w.top_k, w.norm_topk_prob)?
    };
    moe_experts(&h, None, w, &routing, resid, want_ss)
}
