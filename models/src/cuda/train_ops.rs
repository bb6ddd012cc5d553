//! Launch wrappers of train_ops.cu: forward and backward of RMSNorm, per-head q/k RMSNorm +
//! RoPE and the SiLU-gate product for the trainer's differentiable ops
//! ([`crate::layers::train_ops`]). Forwards take the storages a candle custom op sees;
//! backwards take tensors and return untracked ones. Every input must be contiguous, bf16 or
//! f32, all of one dtype (the RoPE table is f32).

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{DevicePtr, PushKernelArg};
use candle_core::cuda_backend::{CudaDevice, CudaStorage};
use candle_core::op::BackpropOp;
use candle_core::{bail, DType, Layout, Result, Shape, Storage, Tensor};

use super::launch::{alloc_f32, cfg, cuda, go, ptr, storage_ptr};

pub(super) const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/train_ops.ptx"));
pub(super) const MODULE: &str = "dflash_train_ops";
/// Warps per block of the row kernels (WARPS in train_ops.cu).
const WARPS: usize = 8;
/// Most blocks a row kernel's grid-stride loop runs on (also the q/k weight-gradient parts).
const MAX_ROW_BLOCKS: usize = 2048;
/// Rows per weight-gradient part of the RMSNorm backward.
const DW_CHUNK: usize = 512;
/// Largest head_dim of the q/k kernels (QK_MAX_NPL * 32).
pub const QK_MAX_HEAD_DIM: usize = 256;

fn suffix(dtype: DType, who: &str) -> Result<&'static str> {
    match dtype {
        DType::BF16 => Ok("bf16"),
        DType::F32 => Ok("f32"),
        other => bail!("{who}: bf16 or f32 only, got {other:?}"),
    }
}

fn row_blocks(rows: usize) -> u32 {
    rows.div_ceil(WARPS).clamp(1, MAX_ROW_BLOCKS) as u32
}

/// An uninitialised buffer of `n` elements of `dtype` (bf16 or f32) and its address.
fn alloc(dev: &CudaDevice, dtype: DType, n: usize) -> Result<(CudaStorage, u64)> {
    let stream = dev.cuda_stream();
    // Every element is written by the kernel that receives the buffer.
    Ok(match dtype {
        DType::BF16 => {
            let s = unsafe { dev.alloc::<half::bf16>(n)? };
            let p = s.device_ptr(&stream).0;
            (CudaStorage::wrap_cuda_slice(s, dev.clone()), p)
        }
        DType::F32 => {
            let s = unsafe { dev.alloc::<f32>(n)? };
            let p = s.device_ptr(&stream).0;
            (CudaStorage::wrap_cuda_slice(s, dev.clone()), p)
        }
        other => bail!("train ops: bf16 or f32 only, got {other:?}"),
    })
}

fn tensor(s: CudaStorage, shape: impl Into<Shape>) -> Tensor {
    Tensor::from_storage(Storage::Cuda(s), shape, BackpropOp::none(), false)
}

fn same_dtype(who: &str, ts: &[&Tensor]) -> Result<DType> {
    let dtype = ts[0].dtype();
    if ts.iter().any(|t| t.dtype() != dtype || !t.is_contiguous()) {
        bail!("{who}: inputs must be contiguous and of one dtype")
    }
    Ok(dtype)
}

/// `y = rmsnorm(x) * w` over the last dimension `n` of `x` (`rows * n` elements).
pub fn rms_norm_fwd(
    x: (&CudaStorage, &Layout),
    w: (&CudaStorage, &Layout),
    eps: f32,
) -> Result<CudaStorage> {
    let dtype = x.0.dtype();
    let name = format!("rms_fwd_{}", suffix(dtype, "rms_norm")?);
    let n = *x.1.shape().dims().last().unwrap_or(&0);
    if w.0.dtype() != dtype || w.1.shape().elem_count() != n || n == 0 {
        bail!(
            "rms_norm: x {:?} and weight {:?} do not fit",
            x.1.shape(),
            w.1.shape()
        )
    }
    let rows = x.1.shape().elem_count() / n;
    let dev = x.0.device.clone();
    let (out, yp) = alloc(&dev, dtype, rows * n)?;
    let (xp, wp) = (storage_ptr(x.0, x.1)?, storage_ptr(w.0, w.1)?);
    let (r, n) = (rows as i32, n as i32);
    let f = dev.get_or_load_custom_func(&name, MODULE, PTX)?;
    let mut b = f.builder();
    b.arg(&xp).arg(&wp).arg(&yp).arg(&r).arg(&n).arg(&eps);
    go(
        &mut b,
        cfg((row_blocks(rows), 1, 1), (WARPS * 32) as u32),
        &name,
    )?;
    Ok(out)
}

/// `(dx, dw)` of [`rms_norm_fwd`] for the incoming gradient `dy` (dw in f32).
pub fn rms_norm_bwd(x: &Tensor, w: &Tensor, dy: &Tensor, eps: f32) -> Result<(Tensor, Tensor)> {
    let dtype = same_dtype("rms_norm backward", &[x, w, dy])?;
    let sfx = suffix(dtype, "rms_norm backward")?;
    let dev = cuda(x)?;
    let n = w.elem_count();
    let rows = x.elem_count() / n.max(1);
    if n == 0 || x.elem_count() != rows * n || dy.shape() != x.shape() {
        bail!(
            "rms_norm backward: x {:?}, w {:?}, dy {:?}",
            x.shape(),
            w.shape(),
            dy.shape()
        )
    }
    let (dx, dxp) = alloc(&dev, dtype, rows * n)?;
    let rstd = alloc_f32(&dev, rows.max(1))?;
    let (xp, wp, gp, rp) = (ptr(x)?, ptr(w)?, ptr(dy)?, ptr(&rstd)?);
    let (ri, ni) = (rows as i32, n as i32);
    let name = format!("rms_bwd_{sfx}");
    let f = dev.get_or_load_custom_func(&name, MODULE, PTX)?;
    let mut b = f.builder();
    b.arg(&xp)
        .arg(&wp)
        .arg(&gp)
        .arg(&dxp)
        .arg(&rp)
        .arg(&ri)
        .arg(&ni)
        .arg(&eps);
    go(
        &mut b,
        cfg((row_blocks(rows), 1, 1), (WARPS * 32) as u32),
        &name,
    )?;

    let parts = rows.div_ceil(DW_CHUNK).max(1);
    let part = alloc_f32(&dev, parts * n)?;
    let pp = ptr(&part)?;
    let chunk = DW_CHUNK as i32;
    let name = format!("rms_dw_part_{sfx}");
    let f = dev.get_or_load_custom_func(&name, MODULE, PTX)?;
    let mut b = f.builder();
    b.arg(&xp)
        .arg(&gp)
        .arg(&rp)
        .arg(&pp)
        .arg(&ri)
        .arg(&ni)
        .arg(&chunk);
    go(
        &mut b,
        cfg((n.div_ceil(256) as u32, parts as u32, 1), 256),
        &name,
    )?;
    let dw = sum_parts(&dev, &part, parts, n)?;
    Ok((tensor(dx, x.shape().clone()), dw))
}

fn sum_parts(dev: &CudaDevice, part: &Tensor, parts: usize, n: usize) -> Result<Tensor> {
    let out = alloc_f32(dev, n)?;
    let (pp, op) = (ptr(part)?, ptr(&out)?);
    let (pi, ni) = (parts as i32, n as i32);
    let f = dev.get_or_load_custom_func("sum_parts", MODULE, PTX)?;
    let mut b = f.builder();
    b.arg(&pp).arg(&op).arg(&pi).arg(&ni);
    go(
        &mut b,
        cfg((n.div_ceil(256) as u32, 1, 1), 256),
        "sum_parts",
    )?;
    Ok(out)
}

/// Checks a q/k projection `[t, h, d]` against its norm weight `[d]` and RoPE table `cs`
/// (f32 `[t, d]`: the cos half then the sin half); returns `(t, h, d)`.
pub fn qk_dims(x: &Shape, w: &Shape, cs: &Shape) -> Result<(usize, usize, usize)> {
    let (t, h, d) = x.dims3()?;
    if d == 0 || d % 64 != 0 || d > QK_MAX_HEAD_DIM || w.elem_count() != d || cs.dims2()? != (t, d)
    {
        bail!("qk_norm_rope: x {x:?}, weight {w:?}, table {cs:?} do not fit")
    }
    Ok((t, h, d))
}

/// Per-head `rope(rmsnorm(x) * w)` of `x: [t, h, d]`, written head-major `[h, t, d]`.
pub fn qk_norm_rope_fwd(
    x: (&CudaStorage, &Layout),
    w: (&CudaStorage, &Layout),
    cs: (&CudaStorage, &Layout),
    eps: f32,
) -> Result<CudaStorage> {
    let dtype = x.0.dtype();
    let name = format!("qk_fwd_{}", suffix(dtype, "qk_norm_rope")?);
    let (t, h, d) = qk_dims(x.1.shape(), w.1.shape(), cs.1.shape())?;
    if w.0.dtype() != dtype || cs.0.dtype() != DType::F32 {
        bail!("qk_norm_rope: weight must match x, the table must be f32")
    }
    let dev = x.0.device.clone();
    let (out, yp) = alloc(&dev, dtype, t * h * d)?;
    let (xp, wp, cp) = (
        storage_ptr(x.0, x.1)?,
        storage_ptr(w.0, w.1)?,
        storage_ptr(cs.0, cs.1)?,
    );
    let (ti, hi, di) = (t as i32, h as i32, d as i32);
    let f = dev.get_or_load_custom_func(&name, MODULE, PTX)?;
    let mut b = f.builder();
    b.arg(&xp)
        .arg(&wp)
        .arg(&cp)
        .arg(&yp)
        .arg(&ti)
        .arg(&hi)
        .arg(&di)
        .arg(&eps);
    go(
        &mut b,
        cfg((row_blocks(t * h), 1, 1), (WARPS * 32) as u32),
        &name,
    )?;
    Ok(out)
}

/// `(dx [t, h, d], dw [d] f32)` of [`qk_norm_rope_fwd`] for `dz: [h, t, d]`.
pub fn qk_norm_rope_bwd(
    x: &Tensor,
    w: &Tensor,
    cs: &Tensor,
    dz: &Tensor,
    eps: f32,
) -> Result<(Tensor, Tensor)> {
    let dtype = same_dtype("qk_norm_rope backward", &[x, w, dz])?;
    let name = format!("qk_bwd_{}", suffix(dtype, "qk_norm_rope backward")?);
    let (t, h, d) = qk_dims(x.shape(), w.shape(), cs.shape())?;
    if dz.dims3()? != (h, t, d) || cs.dtype() != DType::F32 || !cs.is_contiguous() {
        bail!(
            "qk_norm_rope backward: dz {:?} for x {:?}",
            dz.shape(),
            x.shape()
        )
    }
    let dev = cuda(x)?;
    let blocks = row_blocks(t * h) as usize;
    let (dx, dxp) = alloc(&dev, dtype, t * h * d)?;
    let part = alloc_f32(&dev, blocks * d)?;
    let (xp, wp, cp, gp, pp) = (ptr(x)?, ptr(w)?, ptr(cs)?, ptr(dz)?, ptr(&part)?);
    let (ti, hi, di) = (t as i32, h as i32, d as i32);
    let f = dev.get_or_load_custom_func(&name, MODULE, PTX)?;
    let mut b = f.builder();
    b.arg(&xp).arg(&wp).arg(&cp).arg(&gp).arg(&dxp).arg(&pp);
    b.arg(&ti).arg(&hi).arg(&di).arg(&eps);
    go(
        &mut b,
        cfg((blocks as u32, 1, 1), (WARPS * 32) as u32),
        &name,
    )?;
    let dw = sum_parts(&dev, &part, blocks, d)?;
    Ok((tensor(dx, x.shape().clone()), dw))
}

fn elem_blocks(n: usize) -> u32 {
    n.div_ceil(256).clamp(1, 8192) as u32
}

/// `silu(g) * u`, elementwise over equal shapes.
pub fn silu_mul_fwd(g: (&CudaStorage, &Layout), u: (&CudaStorage, &Layout)) -> Result<CudaStorage> {
    let dtype = g.0.dtype();
    let name = format!("silu_fwd_{}", suffix(dtype, "silu_mul")?);
    if u.0.dtype() != dtype || g.1.shape() != u.1.shape() {
        bail!(
            "silu_mul: gate {:?} and up {:?} differ",
            g.1.shape(),
            u.1.shape()
        )
    }
    let n = g.1.shape().elem_count();
    let dev = g.0.device.clone();
    let (out, yp) = alloc(&dev, dtype, n.max(1))?;
    let (gp, up) = (storage_ptr(g.0, g.1)?, storage_ptr(u.0, u.1)?);
    let f = dev.get_or_load_custom_func(&name, MODULE, PTX)?;
    let mut b = f.builder();
    b.arg(&gp).arg(&up).arg(&yp).arg(&n);
    go(&mut b, cfg((elem_blocks(n), 1, 1), 256), &name)?;
    Ok(out)
}

/// `(dg, du)` of [`silu_mul_fwd`] for the incoming gradient `dy`.
pub fn silu_mul_bwd(g: &Tensor, u: &Tensor, dy: &Tensor) -> Result<(Tensor, Tensor)> {
    let dtype = same_dtype("silu_mul backward", &[g, u, dy])?;
    let name = format!("silu_bwd_{}", suffix(dtype, "silu_mul backward")?);
    if g.shape() != u.shape() || g.shape() != dy.shape() {
        bail!("silu_mul backward: shapes differ")
    }
    let n = g.elem_count();
    let dev = cuda(g)?;
    let (dg, dgp) = alloc(&dev, dtype, n.max(1))?;
    let (du, dup) = alloc(&dev, dtype, n.max(1))?;
    let (gp, up, yp) = (ptr(g)?, ptr(u)?, ptr(dy)?);
    let f = dev.get_or_load_custom_func(&name, MODULE, PTX)?;
    let mut b = f.builder();
    b.arg(&gp).arg(&up).arg(&yp).arg(&dgp).arg(&dup).arg(&n);
    go(&mut b, cfg((elem_blocks(n), 1, 1), 256), &name)?;
    Ok((tensor(dg, g.shape().clone()), tensor(du, g.shape().clone())))
}
