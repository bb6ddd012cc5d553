//! The o-projection, the router GEMV and the routing of one decode row in one launch
//! (moe_route.cu's `moe_oproj_router_route`, behind [`super::moe_oproj_router`]): a dense-attention
//! MoE layer's (Qwen3-Coder-30B-A3B's) `gemv_resid` + [`router_route`](super::router_route), one
//! launch fewer per layer, bit for bit the pair's outputs (`gpu_check --moe`'s
//! `moe_oproj_router_route` compares them).

use std::sync::Mutex;

use candle_core::cuda_backend::DeviceId;
use candle_core::{bail, DType, Result, Tensor};

use super::gemv::RowNorm;
use super::launch::{alloc_bf16, alloc_f32, cfg, check_bf16, cuda, ptr, KernelArgs};
use super::moe_route::{alloc_u32, device_word, route_counter, MoeRouting, MODULE, PTX};
use super::{MOE_MAX_EXPERTS, MOE_MAX_TOP_K};

/// The flag the o-projection's last block raises for the router blocks of the same launch, one
/// per device for the process's lifetime; the last router block lowers it again.
static FLAGS: Mutex<Vec<(DeviceId, Tensor)>> = Mutex::new(Vec::new());

/// `(y, ss, routing)` for one row: `y = resid + attn @ o_projᵀ` and its sum of squares `ss`
/// (what [`gemv_resid`](super::gemv_resid) returns with `counter`, the router weights
/// prefetched into L2 as the decoder stack asks it), and the routing of `RMSNorm(y)` (`norm`'s
/// weight and eps; its `ss` is not read) over `e` experts, top `k`, renormalised when
/// `norm_topk` (what [`router_route`](super::router_route) returns). No shared expert.
#[allow(clippy::too_many_arguments)]
pub fn oproj_router_route(
    attn: &Tensor,
    o_proj: &Tensor,
    resid: &Tensor,
    counter: &Tensor,
    norm: RowNorm<'_>,
    router: &Tensor,
    e: usize,
    k: usize,
    norm_topk: bool,
) -> Result<(Tensor, Tensor, MoeRouting)> {
    let dev = cuda(attn)?;
    for (what, t) in [
        ("attn", attn),
        ("o_proj", o_proj),
        ("resid", resid),
        ("router", router),
        ("norm weight", norm.weight),
    ] {
        check_bf16(&format!("oproj_router_route {what}"), t)?;
    }
    let (t, kd) = attn.dims2()?;
    let (n, kw) = o_proj.dims2()?;
    let (nr, h) = router.dims2()?;
    let fits = t == 1
        && kw == kd
        && kd.is_multiple_of(512)
        && resid.dims2()? == (1, n)
        && h == n
        && n.is_multiple_of(256)
        && nr == e
        && e.is_multiple_of(32)
        && e <= MOE_MAX_EXPERTS
        && (1..=MOE_MAX_TOP_K.min(e)).contains(&k)
        && norm.weight.dims1()? == n
        && counter.dtype() == DType::U32
        && counter.elem_count() == 1;
    if !fits {
        bail!(
            "oproj_router_route: attn {:?}, o_proj {:?}, resid {:?}, router {:?}, top {k}: needs one row, attention width % 512 == 0, hidden % 256 == 0, experts % 32 == 0 and <= {MOE_MAX_EXPERTS}, a u32 [1] counter",
            attn.shape(),
            o_proj.shape(),
            resid.shape(),
            router.shape()
        )
    }
    for t in [attn, o_proj, resid, router, norm.weight] {
        if ptr(t)? % 16 != 0 {
            bail!("oproj_router_route: operands must be 16-byte aligned")
        }
    }
    // The o-projection's residual kernel: 4 output columns a block (2 warps split K); the
    // router's blocks (8 rows each) are the first of the grid's second row.
    let grid = n / 4;
    let nrb = e.div_ceil(8);
    if nrb > grid {
        bail!("oproj_router_route: {e} experts need more router blocks than the grid's {grid} columns")
    }
    let y = alloc_bf16(&dev, (1, n))?;
    let ss = alloc_f32(&dev, 1)?;
    let part = alloc_f32(&dev, grid)?;
    let logits = alloc_bf16(&dev, (1, e))?;
    let meta = alloc_u32(&dev, 2 + 6 * k)?;
    let wts = alloc_f32(&dev, 2 * k)?;
    let (ap, op, yp, rp) = (ptr(attn)?, ptr(o_proj)?, ptr(&y)?, ptr(resid)?);
    let (sp, pp, cp) = (ptr(&ss)?, ptr(&part)?, ptr(counter)?);
    let (wrp, lp, nwp, mp, wp) = (
        ptr(router)?,
        ptr(&logits)?,
        ptr(norm.weight)?,
        ptr(&meta)?,
        ptr(&wts)?,
    );
    let pf_bytes = (router.elem_count() * 2) as u64;
    let rc = route_counter(&dev, attn)?;
    let fl = device_word(&FLAGS, &dev, attn, "oproj_router_route flag")?;
    let (ni, ki, nri, ei, kk) = (n as i32, kd as i32, nr as i32, e as i32, k as i32);
    let (eps, nti, shared, nrbi) = (norm.eps as f32, norm_topk as i32, 0i32, nrb as i32);
    let name = "moe_oproj_router_route";
    let f = dev.get_or_load_custom_func(name, MODULE, PTX)?;
    let mut b = KernelArgs::new();
    b.arg(&ap)
        .arg(&op)
        .arg(&yp)
        .arg(&ni)
        .arg(&ki)
        .arg(&rp)
        .arg(&sp)
        .arg(&pp)
        .arg(&cp)
        .arg(&wrp)
        .arg(&pf_bytes);
    b.arg(&wrp)
        .arg(&lp)
        .arg(&nri)
        .arg(&nwp)
        .arg(&eps)
        .arg(&ei)
        .arg(&kk)
        .arg(&nti)
        .arg(&shared)
        .arg(&mp)
        .arg(&wp)
        .arg(&rc)
        .arg(&fl)
        .arg(&nrbi);
    // Row 0 of the grid: the o-projection's blocks; row 1: the router's (the rest exit).
    b.launch(&dev, &f, cfg((grid as u32, 2, 1), 128), name)?;
    Ok((
        y,
        ss.reshape(1)?,
        MoeRouting {
            meta,
            wts,
            rows: 1,
            k,
            shared: false,
            wide: false,
        },
    ))
}
