//! Launch wrappers of moe.cu: the sparse-MoE block (`layers/moe.rs`'s math) on the device for
//! up to [`MOE_MAX_ROWS`] rows per launch set, routing (moe_route.rs) included, with no host
//! round trip (so a CUDA graph can capture it) and reading only the selected experts' weights.
//! One row (decode): the router GEMV and the routing in one launch (the post-attention norm
//! applied as the row streams in), gate/up, and down with the weighted combine and the residual
//! add in its epilogue: 3 launches. 2..64 rows: the norm, router, routing, one tensor-core
//! gate/up and one down launch over every used expert (each expert's weights read once for all
//! the rows routed to it), the combine: 6. A shared expert of the routed width rides along at
//! one row ([`SharedExpertRefs`]): still 3 launches for the whole block. Past 512 rows outside
//! graph capture (prefills) the experts are cuBLAS grouped GEMMs instead of the 64-pair tiles
//! (moe_grouped.rs: one host copy of the per-expert counts). Shapes are checked here because
//! the kernels trust them.

use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
use candle_core::{bail, DType, Result, Tensor};

use super::gemv::{gemv, k_splits, rms_apply, row_sumsq, RowNorm};
use super::launch::{
    alloc_bf16, alloc_f32, capturing, cfg, check_bf16, cuda, go, opt_ptr, ptr, KernelArgs,
};
use super::moe_grouped::{grouped_pair_outputs, GROUPED_MIN_ROWS};
use super::moe_route::{moe_route, moe_route_wide, router_route, MoeRouting, SHARED_ROUTER_PAD};
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
    let (gp, dp, yp, rp) = (ptr(w.gate_up)?, ptr(w.down)?, ptr(&y)?, opt_ptr(resid)?);
    // The per-pair SiLU activations of the launches below (the grouped path makes its own).
    let new_act = || -> Result<(Tensor, u64)> {
        let act = alloc_bf16(&dev, (p, i))?;
        let ap = ptr(&act)?;
        Ok((act, ap))
    };
    if t == 1 {
        let (_act, ap) = new_act()?;
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
    // Wide routings of many rows outside graph capture: cuBLAS grouped GEMMs
    // (moe_grouped.rs); else the tiled tensor-core kernels.
    let grouped = match (
        &routing.counts,
        t >= GROUPED_MIN_ROWS && super::moe_grouped_gemm(),
    ) {
        (Some(counts), true) if !capturing(&dev)? => Some(counts),
        _ => None,
    };
    let pair_out = if let Some(counts) = grouped {
        let pair_row = routing.meta.narrow(0, 2 + 3 * p, p)?;
        super::phases::mark(x.device(), "mlp.route");
        let counts = counts.to_vec1::<u32>()?;
        super::phases::mark(x.device(), "mlp.gather");
        let xg = if super::moe_gather_kernel() {
            gather_rows(h_in, &pair_row)?
        } else {
            h_in.index_select(&pair_row, 0)?
        };
        grouped_pair_outputs(&xg, w.gate_up, w.down, &counts)?
    } else {
        let (mt, slots) = if routing.wide {
            (
                MOE_MAX_ROWS / 16,
                p.min(e + p.div_ceil(MOE_MAX_ROWS)) as u32,
            )
        } else {
            (t.div_ceil(16), e.min(p) as u32)
        };
        let (_act, ap) = new_act()?;
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
        pair_out
    };
    let ss = if want_ss {
        Some(alloc_f32(&dev, t)?)
    } else {
        None
    };
    let (sp, op) = (opt_ptr(ss.as_ref())?, ptr(&pair_out)?);
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
        // The router-and-routing kernel applies the norm itself; so does the gate/up kernel.
        let e = w.dims()?.0;
        let routing = match &w.shared {
            Some(sh) => router_route(x, norm, sh.router_gate, e, w.top_k, w.norm_topk_prob, true)?,
            None => router_route(x, norm, w.router, e, w.top_k, w.norm_topk_prob, false)?,
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

/// `x[pair_row]` (`x: [t, H]` bf16 contiguous, `pair_row: [P]` u32 of rows < t): the rows of
/// a wide routing's pairs, gathered with 16-byte copies (`moe_gather_rows`).
fn gather_rows(x: &Tensor, pair_row: &Tensor) -> Result<Tensor> {
    let dev = cuda(x)?;
    check_bf16("moe gather x", x)?;
    let (_, h) = x.dims2()?;
    let p = pair_row.dims1()?;
    if !x.is_contiguous() || pair_row.dtype() != DType::U32 || h % 8 != 0 || ptr(x)? % 16 != 0 {
        bail!(
            "moe gather: x {:?} must be contiguous, 16-byte aligned, width % 8 == 0, rows u32",
            x.shape()
        )
    }
    let out = alloc_bf16(&dev, (p, h))?;
    let (xp, rp, op) = (ptr(x)?, ptr(pair_row)?, ptr(&out)?);
    let (pi, hi) = (p as i32, h as i32);
    let blocks = (p * h / 8).div_ceil(256).min(8192) as u32;
    let f = dev.get_or_load_custom_func("moe_gather_rows", MODULE, PTX)?;
    let mut b = f.builder();
    b.arg(&xp).arg(&rp).arg(&op).arg(&pi).arg(&hi);
    go(&mut b, cfg((blocks, 1, 1), 256), "moe_gather_rows")?;
    Ok(out)
}
