//! Launch wrapper of linear_ce.cu: the cross-entropy rows of one logits chunk of the fused
//! linear + cross-entropy ([`crate::training::linear_ce`]), gradient written over the logits.

use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
use candle_core::{bail, DType, Result, Tensor};

use super::launch::{alloc_f32, cfg, cuda, go, ptr};

pub(super) const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/linear_ce.ptx"));
pub(super) const MODULE: &str = "dflash_linear_ce";
/// Threads per row (CE_THREADS in linear_ce.cu).
const THREADS: u32 = 512;

/// For contiguous `logits: [rows, vocab]` (bf16 or f32) and u32 `labels: [rows]`: returns f32
/// `[rows, 2]` (per row the cross-entropy `lse - x[label]` and the argmax column) and
/// overwrites `logits` with `softmax(x) - onehot(label)`, row by row. `logits` must be a
/// buffer nothing else reads (a GEMM output made for this call).
pub fn ce_rows_in_place(logits: &Tensor, labels: &Tensor) -> Result<Tensor> {
    let dev = cuda(logits)?;
    let (rows, vocab) = logits.dims2()?;
    if !logits.is_contiguous() || !labels.is_contiguous() || labels.dtype() != DType::U32 {
        bail!("ce_rows_in_place: needs contiguous logits and contiguous u32 labels")
    }
    if labels.dims1()? != rows || rows == 0 || vocab == 0 || vocab > i32::MAX as usize {
        bail!(
            "ce_rows_in_place: logits {:?} and labels {:?} do not match",
            logits.shape(),
            labels.shape()
        )
    }
    let name = match logits.dtype() {
        DType::BF16 => "ce_rows_bf16",
        DType::F32 => "ce_rows_f32",
        other => bail!("ce_rows_in_place: logits must be bf16 or f32, got {other:?}"),
    };
    // Every slot is written (two per row).
    let stats = alloc_f32(&dev, rows * 2)?.reshape((rows, 2))?;
    let (xp, lp, sp) = (ptr(logits)?, ptr(labels)?, ptr(&stats)?);
    let v = vocab as i32;
    let f = dev.get_or_load_custom_func(name, MODULE, PTX)?;
    let mut b = f.builder();
    b.arg(&xp).arg(&lp).arg(&sp).arg(&v);
    go(&mut b, cfg((rows as u32, 1, 1), THREADS), name)?;
    Ok(stats)
}
