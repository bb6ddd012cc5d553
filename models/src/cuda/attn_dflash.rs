//! Launch wrappers of attn_dflash.cu: the DFlash training attention forward (one warp per
//! query row, online softmax, log-sum-exp saved) and backward (dq query-major, dk/dv
//! key-major, no atomics; in bf16 at block size 16 the forward, dq and the context keys' dk/dv
//! run on tensor cores instead, `attn_dflash_tc.rs`). See [`crate::training::attn_dflash`]; the CPU reference is
//! [`crate::training::attn_dflash_ref`].

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{DevicePtr, PushKernelArg};
use candle_core::cuda_backend::{CudaDevice, CudaStorage};
use candle_core::{bail, DType, Layout, Result, Tensor};

use super::attn_dflash_dims::Dims;
use super::launch::{alloc_bf16, alloc_f32, cfg, cuda, go, ptr, storage_ptr};

pub(super) const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/attn_dflash.ptx"));
pub(super) const MODULE: &str = "dflash_attn_dflash";
/// Warps per CTA of the key-major backward (DKV_WARPS in the .cu).
const DKV_WARPS: usize = 8;

fn suffix(dtype: DType, d: usize) -> Result<&'static str> {
    Ok(match (dtype, d) {
        (DType::BF16, 64) => "bf16_d64",
        (DType::BF16, 128) => "bf16_d128",
        (DType::F32, 64) => "f32_d64",
        (DType::F32, 128) => "f32_d128",
        other => bail!("dflash attention: {other:?} is not (bf16|f32, 64|128)"),
    })
}

fn alloc(dev: &CudaDevice, dtype: DType, shape: (usize, usize, usize)) -> Result<Tensor> {
    match dtype {
        DType::BF16 => alloc_bf16(dev, shape),
        _ => alloc_f32(dev, shape.0 * shape.1 * shape.2)?.reshape(shape),
    }
}

/// Pointers: q, kc, vc, kb, vb, blocks, out, lse.
fn launch_fwd(dev: &CudaDevice, dtype: DType, x: &Dims, p: [u64; 8]) -> Result<()> {
    if super::attn_dflash_tc::applies(dtype, x) {
        return super::attn_dflash_tc::launch_fwd(dev, x, p);
    }
    let name = format!("dflash_attn_fwd_{}", suffix(dtype, x.d)?);
    let [hi, kvi, ri, _, csi, bsi, bi, wi] = x.ints();
    let scale = x.scale();
    let f = dev.get_or_load_custom_func(&name, MODULE, PTX)?;
    let mut b = f.builder();
    for v in &p {
        b.arg(v);
    }
    for v in [&hi, &kvi, &ri, &csi, &bsi, &bi, &wi] {
        b.arg(v);
    }
    b.arg(&scale);
    let grid = ((x.r / x.block) as u32, x.h as u32, 1);
    go(&mut b, cfg(grid, 32 * x.block as u32), &name)
}

/// `(out [R, H * D], lse f32 [H, R])` for q `[H, R, D]`, kc/vc `[KV, C, D]`, kb/vb
/// `[KV, R, D]` (contiguous, one dtype: bf16 or f32; D = 64 or 128), `blocks` u32
/// `[R / block_size, 2]` (context offset, anchor) and `window` (0: full attention).
#[allow(clippy::too_many_arguments)]
pub fn dflash_attention_fwd(
    q: &Tensor,
    kc: &Tensor,
    vc: &Tensor,
    kb: &Tensor,
    vb: &Tensor,
    blocks: &Tensor,
    block_size: usize,
    window: usize,
) -> Result<(Tensor, Tensor)> {
    let dev = cuda(q)?;
    let (h, r, d) = q.dims3()?;
    let (kv, c, d2) = kc.dims3()?;
    let dtype = q.dtype();
    let same = [kc, vc, kb, vb]
        .iter()
        .all(|t| t.dtype() == dtype && t.is_contiguous())
        && q.is_contiguous()
        && vc.dims3()? == (kv, c, d)
        && kb.dims3()? == (kv, r, d)
        && vb.dims3()? == (kv, r, d);
    if !same || d != d2 {
        bail!(
            "dflash attention: q {:?}, context {:?}, block {:?} do not fit",
            q.shape(),
            kc.shape(),
            kb.shape()
        )
    }
    let x = Dims {
        h,
        kv,
        r,
        c,
        d,
        block: block_size,
        window,
        cs: c,
        bs: r,
    };
    x.check(blocks)?;
    // Every element of both outputs is written by the kernel.
    let out = alloc(&dev, dtype, (r, h, d))?.reshape((r, h * d))?;
    let lse = alloc_f32(&dev, h * r)?.reshape((h, r))?;
    let mut p = [0u64; 8];
    for (a, t) in p.iter_mut().zip([q, kc, vc, kb, vb, blocks, &out, &lse]) {
        *a = ptr(t)?;
    }
    launch_fwd(&dev, dtype, &x, p)?;
    Ok((out, lse))
}

/// Packed layout of K and V for the custom op: `[KV, C + R, D]`, each head's `ctx` context rows
/// first, then its block rows.
fn packed_dims(
    q: (usize, usize, usize),
    k: (usize, usize, usize),
    ctx: usize,
    block_size: usize,
    window: usize,
) -> Result<Dims> {
    let (h, r, d) = q;
    let (kv, rows, d2) = k;
    if d != d2 || rows != ctx + r {
        bail!("dflash attention: q {q:?} and packed keys {k:?} (context {ctx}) do not fit")
    }
    Ok(Dims {
        h,
        kv,
        r,
        c: ctx,
        d,
        block: block_size,
        window,
        cs: ctx + r,
        bs: ctx + r,
    })
}

/// The forward on storages (for [`crate::training::attn_dflash`]'s custom op): q `[H, R, D]`,
/// packed k and v `[KV, ctx + R, D]`; returns the out storage (`[R, H * D]`, q's dtype) and
/// the lse `[H, R]`.
#[allow(clippy::too_many_arguments)]
pub fn dflash_attention_fwd_packed(
    q: (&CudaStorage, &Layout),
    k: (&CudaStorage, &Layout),
    v: (&CudaStorage, &Layout),
    blocks: &Tensor,
    ctx: usize,
    block_size: usize,
    window: usize,
) -> Result<(CudaStorage, Tensor)> {
    let dtype = q.0.dtype();
    if k.0.dtype() != dtype || v.0.dtype() != dtype || k.1.shape() != v.1.shape() {
        bail!("dflash attention: q, k and v must share dtype and k/v shape")
    }
    let x = packed_dims(
        q.1.shape().dims3()?,
        k.1.shape().dims3()?,
        ctx,
        block_size,
        window,
    )?;
    x.check(blocks)?;
    let dev = q.0.device.clone();
    let n = x.r * x.h * x.d;
    let stream = dev.cuda_stream();
    // Every element of both outputs is written by the kernel.
    let (out, op) = match dtype {
        DType::BF16 => {
            let s = unsafe { dev.alloc::<half::bf16>(n)? };
            let p = s.device_ptr(&stream).0;
            (CudaStorage::wrap_cuda_slice(s, dev.clone()), p)
        }
        _ => {
            let s = unsafe { dev.alloc::<f32>(n)? };
            let p = s.device_ptr(&stream).0;
            (CudaStorage::wrap_cuda_slice(s, dev.clone()), p)
        }
    };
    let lse = alloc_f32(&dev, x.h * x.r)?.reshape((x.h, x.r))?;
    let (qp, kp, vp) = (
        storage_ptr(q.0, q.1)?,
        storage_ptr(k.0, k.1)?,
        storage_ptr(v.0, v.1)?,
    );
    let off = (x.c * x.d * dtype.size_in_bytes()) as u64;
    launch_fwd(
        &dev,
        dtype,
        &x,
        [qp, kp, vp, kp + off, vp + off, ptr(blocks)?, op, ptr(&lse)?],
    )?;
    Ok((out, lse))
}

/// The backward of [`dflash_attention_fwd_packed`]: `(dq [H, R, D], dk, dv [KV, ctx + R, D])`
/// in q's dtype from `out` / `dout` `[R, H * D]`, the forward's lse, the blocks, `seqs` u32
/// `[nseq, 3]` (context offset, first block, end block) and `ctx_seq` u32 `[ctx]` (each context
/// row's sequence, u32::MAX for none).
#[allow(clippy::too_many_arguments)]
pub fn dflash_attention_bwd_packed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &Tensor,
    dout: &Tensor,
    lse: &Tensor,
    blocks: &Tensor,
    seqs: &Tensor,
    ctx_seq: &Tensor,
    ctx: usize,
    block_size: usize,
    window: usize,
) -> Result<(Tensor, Tensor, Tensor)> {
    let dev = cuda(q)?;
    let dtype = q.dtype();
    let x = packed_dims(q.dims3()?, k.dims3()?, ctx, block_size, window)?;
    x.check(blocks)?;
    let all_fit = [k, v, out, dout]
        .iter()
        .all(|t| t.dtype() == dtype && t.is_contiguous())
        && q.is_contiguous()
        && v.shape() == k.shape()
        && out.dims2()? == (x.r, x.h * x.d)
        && dout.dims2()? == (x.r, x.h * x.d)
        && lse.dims2()? == (x.h, x.r)
        && lse.dtype() == DType::F32
        && ctx_seq.elem_count() == ctx.max(1)
        && seqs.dim(1)? == 3;
    if !all_fit {
        bail!(
            "dflash attention backward: out {:?} / dout {:?} / lse {:?} do not fit q {:?}",
            out.shape(),
            dout.shape(),
            lse.shape(),
            q.shape()
        )
    }
    let dq = alloc(&dev, dtype, (x.h, x.r, x.d))?;
    let delta = alloc_f32(&dev, x.h * x.r)?;
    let dk = alloc(&dev, dtype, (x.kv, x.c + x.r, x.d))?;
    let dv = alloc(&dev, dtype, (x.kv, x.c + x.r, x.d))?;
    let off = (x.c * x.d * dtype.size_in_bytes()) as u64;
    let (qp, kp, vp, bp) = (ptr(q)?, ptr(k)?, ptr(v)?, ptr(blocks)?);
    let (op, dop, lp, dlp) = (ptr(out)?, ptr(dout)?, ptr(lse)?, ptr(&delta)?);
    let [hi, kvi, ri, ci, csi, bsi, bi, wi] = x.ints();
    let scale = x.scale();
    let suf = suffix(dtype, x.d)?;

    let (kbp, vbp, dqp) = (kp + off, vp + off, ptr(&dq)?);
    let (sp, csp, dkp, dvp) = (ptr(seqs)?, ptr(ctx_seq)?, ptr(&dk)?, ptr(&dv)?);
    let (dkbp, dvbp) = (dkp + off, dvp + off);
    // The tensor-core kernels take dq and the context rows' dk/dv; the scalar key-major
    // kernel then only the block rows (from row C).
    let tc = super::attn_dflash_tc::applies(dtype, &x);
    if tc {
        super::attn_dflash_tc::launch_bwd_dq(
            &dev,
            &x,
            [qp, kp, vp, kbp, vbp, bp, op, dop, lp, dqp, dlp],
        )?;
        super::attn_dflash_tc::launch_bwd_dkv_ctx(
            &dev,
            &x,
            [qp, kp, vp, bp, sp, csp, dop, lp, dlp, dkp, dvp],
        )?;
    } else {
        let name = format!("dflash_attn_bwd_dq_{suf}");
        let f = dev.get_or_load_custom_func(&name, MODULE, PTX)?;
        let mut b = f.builder();
        for p in [&qp, &kp, &vp, &kbp, &vbp, &bp, &op, &dop, &lp, &dqp, &dlp] {
            b.arg(p);
        }
        for i in [&hi, &kvi, &ri, &csi, &bsi, &bi, &wi] {
            b.arg(i);
        }
        b.arg(&scale);
        let grid = ((x.r / x.block) as u32, x.h as u32, 1);
        go(&mut b, cfg(grid, 32 * x.block as u32), &name)?;
    }

    let name = format!("dflash_attn_bwd_dkv_{suf}");
    let f = dev.get_or_load_custom_func(&name, MODULE, PTX)?;
    let mut b = f.builder();
    for p in [
        &qp, &kp, &vp, &kbp, &vbp, &bp, &sp, &csp, &dop, &lp, &dlp, &dkp, &dvp, &dkbp, &dvbp,
    ] {
        b.arg(p);
    }
    for i in [&hi, &kvi, &ri, &ci, &csi, &bsi, &bi, &wi] {
        b.arg(i);
    }
    b.arg(&scale);
    let w0 = if tc { x.c } else { 0 };
    let w0i = w0 as i32;
    b.arg(&w0i);
    let rows = x.c + x.r - w0;
    if rows > 0 {
        let grid = (rows.div_ceil(DKV_WARPS) as u32, x.kv as u32, 1);
        go(&mut b, cfg(grid, 32 * DKV_WARPS as u32), &name)?;
    }
    Ok((dq, dk, dv))
}
