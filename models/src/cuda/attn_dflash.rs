//! Launch wrapper of attn_dflash.cu: the DFlash training attention forward (one warp per query
//! row, online softmax, log-sum-exp saved). See [`crate::training::attn_dflash`].

use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
use candle_core::{bail, DType, Result, Tensor};

use super::launch::{alloc_bf16, alloc_f32, cfg, cuda, go, ptr};

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/attn_dflash.ptx"));
const MODULE: &str = "dflash_attn_dflash";

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
    if !same || d != d2 || kv == 0 || h % kv != 0 {
        bail!(
            "dflash attention: q {:?}, context {:?}, block {:?} do not fit",
            q.shape(),
            kc.shape(),
            kb.shape()
        )
    }
    if block_size == 0 || block_size > 32 || r % block_size != 0 {
        bail!("dflash attention: block size {block_size} (1..=32) must divide {r} rows")
    }
    let nblocks = r / block_size;
    if blocks.dtype() != DType::U32 || blocks.dims2()? != (nblocks, 2) || !blocks.is_contiguous() {
        bail!("dflash attention: blocks must be u32 [{nblocks}, 2]")
    }
    let name = match (dtype, d) {
        (DType::BF16, 64) => "dflash_attn_fwd_bf16_d64",
        (DType::BF16, 128) => "dflash_attn_fwd_bf16_d128",
        (DType::F32, 64) => "dflash_attn_fwd_f32_d64",
        (DType::F32, 128) => "dflash_attn_fwd_f32_d128",
        other => bail!("dflash attention: {other:?} is not (bf16|f32, 64|128)"),
    };
    // Every element of both outputs is written by the kernel.
    let out = match dtype {
        DType::BF16 => alloc_bf16(&dev, (r, h * d))?,
        _ => alloc_f32(&dev, r * h * d)?.reshape((r, h * d))?,
    };
    let lse = alloc_f32(&dev, h * r)?.reshape((h, r))?;
    let (qp, kcp, vcp, kbp, vbp, bp, op, lp) = (
        ptr(q)?,
        ptr(kc)?,
        ptr(vc)?,
        ptr(kb)?,
        ptr(vb)?,
        ptr(blocks)?,
        ptr(&out)?,
        ptr(&lse)?,
    );
    let (hi, kvi, ri, ci, bi, wi) = (
        h as i32,
        kv as i32,
        r as i32,
        c as i32,
        block_size as i32,
        window as i32,
    );
    let scale = 1.0f32 / (d as f32).sqrt();
    let f = dev.get_or_load_custom_func(name, MODULE, PTX)?;
    let mut b = f.builder();
    b.arg(&qp)
        .arg(&kcp)
        .arg(&vcp)
        .arg(&kbp)
        .arg(&vbp)
        .arg(&bp)
        .arg(&op)
        .arg(&lp)
        .arg(&hi)
        .arg(&kvi)
        .arg(&ri)
        .arg(&ci)
        .arg(&bi)
        .arg(&wi)
        .arg(&scale);
    go(
        &mut b,
        cfg((nblocks as u32, h as u32, 1), 32 * block_size as u32),
        name,
    )?;
    Ok((out, lse))
}
