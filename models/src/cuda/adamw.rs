//! Launch wrappers of adamw.cu: the device side of [`crate::training::adamw::FlatAdamW`] (sum of
//! squares, the step plan, the fused update), stream-ordered with no host read.

use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
use candle_core::{bail, DType, Result, Tensor};

use super::adamw_consts::AdamWConsts;
use super::launch::{alloc_f32, cfg, cuda, go, opt_ptr, ptr};

pub(super) const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/adamw.ptx"));
pub(super) const MODULE: &str = "dflash_adamw";
/// Partial sums of the gradient norm (SUMSQ_BLOCKS in adamw.cu).
pub const SUMSQ_BLOCKS: usize = 1024;
const SUMSQ_THREADS: u32 = 256;
const APPLY_THREADS: u32 = 256;
/// Blocks of the update (grid-stride over the flat buffers).
const APPLY_BLOCKS: u32 = 132 * 8;

fn check_f32(name: &str, t: &Tensor, n: usize) -> Result<()> {
    if t.dtype() != DType::F32 || !t.is_contiguous() || t.elem_count() != n {
        bail!(
            "adamw: {name} must be contiguous f32 with {n} elements, got {:?} {:?}",
            t.dtype(),
            t.shape()
        )
    }
    Ok(())
}

/// One step: `state` (f32 `[7]`, layout in adamw.cu) is updated with the plan and, when the
/// step runs, `p`, `m`, `v` and `working` (bf16, optional) are updated from `g`. `partials`
/// is f32 scratch of [`SUMSQ_BLOCKS`] elements.
#[allow(clippy::too_many_arguments)]
pub fn adamw_step(
    p: &Tensor,
    m: &Tensor,
    v: &Tensor,
    working: Option<&Tensor>,
    g: &Tensor,
    loss: Option<&Tensor>,
    state: &Tensor,
    partials: &Tensor,
    c: AdamWConsts,
) -> Result<()> {
    let n = p.elem_count();
    for (name, t) in [("master", p), ("m", m), ("v", v), ("gradient", g)] {
        check_f32(name, t, n)?;
    }
    check_f32("state", state, 7)?;
    check_f32("partials", partials, SUMSQ_BLOCKS)?;
    if let Some(w) = working {
        if w.dtype() != DType::BF16 || !w.is_contiguous() || w.elem_count() != n {
            bail!("adamw: the working copy must be contiguous bf16 with {n} elements")
        }
    }
    if let Some(l) = loss {
        check_f32("loss", l, 1)?;
    }
    let dev = cuda(p)?;
    let nn = n as i64;
    let (gp, pp, sp) = (ptr(g)?, ptr(partials)?, ptr(state)?);
    let f = dev.get_or_load_custom_func("adamw_sumsq", MODULE, PTX)?;
    let mut b = f.builder();
    b.arg(&gp).arg(&nn).arg(&pp);
    go(
        &mut b,
        cfg((SUMSQ_BLOCKS as u32, 1, 1), SUMSQ_THREADS),
        "adamw_sumsq",
    )?;
    let lp = opt_ptr(loss)?;
    let parts = SUMSQ_BLOCKS as i32;
    let f = dev.get_or_load_custom_func("adamw_plan", MODULE, PTX)?;
    let mut b = f.builder();
    b.arg(&pp)
        .arg(&parts)
        .arg(&lp)
        .arg(&sp)
        .arg(&c.clip)
        .arg(&c.beta1)
        .arg(&c.beta2);
    go(&mut b, cfg((1, 1, 1), 256), "adamw_plan")?;
    let (xp, mp, vp, wp) = (ptr(p)?, ptr(m)?, ptr(v)?, opt_ptr(working)?);
    let f = dev.get_or_load_custom_func("adamw_apply", MODULE, PTX)?;
    let mut b = f.builder();
    b.arg(&xp)
        .arg(&mp)
        .arg(&vp)
        .arg(&wp)
        .arg(&gp)
        .arg(&nn)
        .arg(&sp)
        .arg(&c.lr)
        .arg(&c.beta1)
        .arg(&c.one_minus_beta1)
        .arg(&c.beta2)
        .arg(&c.one_minus_beta2)
        .arg(&c.eps)
        .arg(&c.lr_wd);
    let blocks = (n.div_ceil(APPLY_THREADS as usize) as u32).clamp(1, APPLY_BLOCKS);
    go(&mut b, cfg((blocks, 1, 1), APPLY_THREADS), "adamw_apply")
}

/// Threads per block of the packing kernels.
const PACK_THREADS: u32 = 256;

/// `parts` (bf16 or f32, on one device, in order) as one new contiguous f32 buffer of all
/// their elements: one launch per part, the cast and the packing in one pass.
pub fn pack_f32(parts: &[Tensor]) -> Result<Tensor> {
    let Some(first) = parts.first() else {
        bail!("pack_f32: no parts")
    };
    let dev = cuda(first)?;
    let total: usize = parts.iter().map(|p| p.elem_count()).sum();
    // Every element is written below: the parts cover the buffer exactly.
    let flat = alloc_f32(&dev, total)?;
    let base = ptr(&flat)?;
    let mut at = 0u64;
    for part in parts {
        let n = part.elem_count();
        let name = match part.dtype() {
            DType::BF16 => "pack_bf16_f32",
            DType::F32 => "pack_f32_f32",
            other => bail!("pack_f32: parts must be bf16 or f32, got {other:?}"),
        };
        if n > 0 {
            let part = part.contiguous()?;
            let (sp, dp, nn) = (ptr(&part)?, base + at * 4, n as i64);
            let f = dev.get_or_load_custom_func(name, MODULE, PTX)?;
            let mut b = f.builder();
            b.arg(&sp).arg(&dp).arg(&nn);
            let blocks = (n.div_ceil(8 * PACK_THREADS as usize) as u32).clamp(1, APPLY_BLOCKS);
            go(&mut b, cfg((blocks, 1, 1), PACK_THREADS), name)?;
        }
        at += n as u64;
    }
    Ok(flat)
}
