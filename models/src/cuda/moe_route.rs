//! Launch wrappers of moe_route.cu: the sparse-MoE block's routing on the device (`layers/moe.rs`'s
//! math; the metadata layout of moe.cuh), for the experts of moe.rs. One row (decode): the router
//! GEMV and the routing in one launch ([`router_route`]); up to [`MOE_MAX_ROWS`] rows: one
//! block ([`moe_route`]); any number: rows, then tiles ([`moe_route_wide`]).

use std::sync::Mutex;

use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
use candle_core::cuda_backend::{CudaDevice, DeviceId};
use candle_core::{bail, DType, Result, Tensor};

use super::gemv::RowNorm;
use super::launch::{alloc_bf16, alloc_f32, cfg, check_bf16, cuda, go, ptr, KernelArgs};
use super::{MOE_MAX_EXPERTS, MOE_MAX_ROWS, MOE_MAX_TOP_K};

pub(super) const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/moe_route.ptx"));
pub(super) const MODULE: &str = "dflash_moe_route";

/// Rows of a shared expert's `router_gate` (`moe::SharedExpertRefs`) past the E experts: the
/// gate row and padding (the one-row GEMV's 16-row multiple).
pub const SHARED_ROUTER_PAD: usize = 16;

/// The routing of a forward's rows, on the device (layout: moe.cuh).
pub struct MoeRouting {
    pub(super) meta: Tensor,
    pub(super) wts: Tensor,
    pub(super) rows: usize,
    /// Pairs per row: the top k, plus one when the shared expert rides along.
    pub(super) k: usize,
    pub(super) shared: bool,
    /// Routed by [`moe_route_wide`]: the used-expert entries are tiles of at most
    /// [`MOE_MAX_ROWS`] pairs.
    pub(super) wide: bool,
    /// A wide routing's pairs per expert (u32 `[E]`), for the grouped GEMMs.
    pub(super) counts: Option<Tensor>,
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
        counts: None,
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
        counts: Some(counts),
    })
}

/// The merge counter of [`router_route`], one per device for the process's lifetime (a launch
/// adds no memset to a CUDA graph): launches on a device's stream run one after another and
/// the kernel's last block re-arms it.
static ROUTE_COUNTERS: Mutex<Vec<(DeviceId, Tensor)>> = Mutex::new(Vec::new());

fn route_counter(dev: &CudaDevice, like: &Tensor) -> Result<u64> {
    let mut all = ROUTE_COUNTERS
        .lock()
        .map_err(|_| candle_core::Error::Msg("router_route: counter lock poisoned".into()))?;
    if let Some((_, c)) = all.iter().find(|(d, _)| *d == dev.id()) {
        return ptr(c);
    }
    let c = Tensor::zeros(1, DType::U32, like.device())?;
    let at = ptr(&c)?;
    all.push((dev.id(), c));
    Ok(at)
}

/// One row's router GEMV and routing in one launch (decode): `logits = norm(x) @ routerᵀ`
/// (the one-row GEMV's logits bit for bit: the same `rows_impl`) and, by the block that
/// finishes last, the routing of `e` experts, top `k`, renormalised when `norm_topk` —
/// [`moe_route`]'s result bit for bit, or with `shared` [`moe_route_shared`]'s (`router`
/// then holds the E experts' rows, the shared gate row and padding: `[e + SHARED_ROUTER_PAD,
/// h]`). One launch instead of two, and the routing itself in two warp reductions per pick
/// instead of moe_route's shared-memory scans: 13.2 us a Qwen3-Coder-30B-A3B decode layer
/// against 7.3 (router GEMV) + 9-15 (moe_route) (H100, ncu, session 27); `gpu_check --moe`'s
/// `moe_router_route` checks it against the two launches bit for bit.
pub fn router_route(
    x: &Tensor,
    norm: Option<RowNorm<'_>>,
    router: &Tensor,
    e: usize,
    k: usize,
    norm_topk: bool,
    shared: bool,
) -> Result<MoeRouting> {
    let dev = cuda(x)?;
    check_bf16("router_route x", x)?;
    check_bf16("router_route router", router)?;
    let (t, h) = x.dims2()?;
    let (n, hw) = router.dims2()?;
    let rows = if shared { e + SHARED_ROUTER_PAD } else { e };
    if t != 1
        || hw != h
        || n != rows
        || !h.is_multiple_of(256)
        || !e.is_multiple_of(32)
        || e > MOE_MAX_EXPERTS
        || k == 0
        || k > e
        || k + shared as usize > MOE_MAX_TOP_K
        || ptr(x)? % 16 != 0
        || ptr(router)? % 16 != 0
    {
        bail!(
            "router_route: x {:?}, router {:?}, {e} experts top {k} (shared: {shared}): needs one row, hidden % 256 == 0, experts % 32 == 0 and <= {MOE_MAX_EXPERTS}, k + shared <= {MOE_MAX_TOP_K}, 16-byte aligned",
            x.shape(),
            router.shape()
        )
    }
    let (name, nw, eps) = match norm {
        Some(nm) => {
            check_bf16("router_route norm weight", nm.weight)?;
            if nm.weight.dims1()? != h {
                bail!("router_route: norm weight must be [{h}]")
            }
            ("moe_router_route_norm", ptr(nm.weight)?, nm.eps as f32)
        }
        None => ("moe_router_route", 0u64, 0f32),
    };
    let kk = k + shared as usize;
    let logits = alloc_bf16(&dev, (1, n))?;
    let meta = alloc_u32(&dev, 2 + 6 * kk)?;
    let wts = alloc_f32(&dev, 2 * kk)?;
    let counter = route_counter(&dev, x)?;
    let (xp, rp, lp, mp, wp) = (
        ptr(x)?,
        ptr(router)?,
        ptr(&logits)?,
        ptr(&meta)?,
        ptr(&wts)?,
    );
    let (ni, hi, ei, ki) = (n as i32, h as i32, e as i32, k as i32);
    let (nti, shi) = (norm_topk as i32, shared as i32);
    let f = dev.get_or_load_custom_func(name, MODULE, PTX)?;
    let mut b = KernelArgs::new();
    b.arg(&xp)
        .arg(&rp)
        .arg(&lp)
        .arg(&ni)
        .arg(&hi)
        .arg(&nw)
        .arg(&eps);
    b.arg(&ei)
        .arg(&ki)
        .arg(&nti)
        .arg(&shi)
        .arg(&mp)
        .arg(&wp)
        .arg(&counter);
    // 4 warps x 2 router rows a block, as the one-row GEMV.
    b.launch(&dev, &f, cfg((n.div_ceil(8) as u32, 1, 1), 128), name)?;
    Ok(MoeRouting {
        meta,
        wts,
        rows: 1,
        k: kk,
        shared,
        wide: false,
        counts: None,
    })
}
