//! Launch wrapper of argmax.cu: each row's argmax (ties to the lower column) and its
//! log-probability, two small launches, the result packed for one copy to the host.

use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
use candle_core::cuda_backend::CudaStorage;
use candle_core::op::BackpropOp;
use candle_core::{bail, DType, Result, Storage, Tensor};

use super::launch::{cfg, cuda, go, ptr};

pub(super) const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/argmax.ptx"));
pub(super) const MODULE: &str = "dflash_argmax";
/// Blocks per row (PARTS in argmax.cu).
const PARTS: usize = 32;
/// Threads per block of the first launch (THREADS in argmax.cu).
const THREADS: u32 = 256;
/// Most blocks on a CUDA grid's y axis.
const MAX_GRID_Y: usize = 65_535;

/// u32 `[rows, 2]` for `x: [rows, cols]` (contiguous f32 or bf16, bf16 read as is): per row the lowest column holding
/// the maximum and the bits of its log-probability `-ln sum_j exp(x_j - max)` (read them
/// with `f32::from_bits`). A row without a finite entry gives column `u32::MAX`, log-prob -inf.
pub fn argmax_logprob(x: &Tensor) -> Result<Tensor> {
    let dev = cuda(x)?;
    let (rows, cols) = x.dims2()?;
    let (partial, elem) = match x.dtype() {
        DType::F32 => ("argmax_partial", 4),
        DType::BF16 => ("argmax_partial_bf16", 2),
        other => bail!("argmax_logprob: needs f32 or bf16 logits, got {other:?}"),
    };
    if !x.is_contiguous() || rows == 0 || cols == 0 || cols > i32::MAX as usize {
        bail!(
            "argmax_logprob: needs a non-empty contiguous matrix, got {:?} {:?}",
            x.dtype(),
            x.shape()
        )
    }
    // Every slot is written: one partial per (row, part), one pair per row.
    let part = unsafe { dev.alloc::<u32>(rows * PARTS * 3)? };
    let out = unsafe { dev.alloc::<u32>(rows * 2)? };
    let wrap = |s, n: (usize, usize)| {
        Tensor::from_storage(
            Storage::Cuda(CudaStorage::wrap_cuda_slice(s, dev.clone())),
            n,
            BackpropOp::none(),
            false,
        )
    };
    let part = wrap(part, (rows, PARTS * 3));
    let out = wrap(out, (rows, 2));
    let (xp, pp, op) = (ptr(x)?, ptr(&part)?, ptr(&out)?);
    let ci = cols as i32;
    let f = dev.get_or_load_custom_func(partial, MODULE, PTX)?;
    // Rows go on the grid's y axis (at most 65,535 per launch).
    for first in (0..rows).step_by(MAX_GRID_Y) {
        let n = (rows - first).min(MAX_GRID_Y);
        let xs = xp + (first * cols * elem) as u64;
        let ps = pp + (first * PARTS * 3 * 4) as u64;
        let mut b = f.builder();
        b.arg(&xs).arg(&ci).arg(&ps);
        go(&mut b, cfg((PARTS as u32, n as u32, 1), THREADS), partial)?;
    }
    let f = dev.get_or_load_custom_func("argmax_final", MODULE, PTX)?;
    let mut b = f.builder();
    b.arg(&pp).arg(&op);
    go(&mut b, cfg((rows as u32, 1, 1), 32), "argmax_final")?;
    Ok(out)
}
