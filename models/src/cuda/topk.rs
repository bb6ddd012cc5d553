//! Launch wrapper of topk.cu: the `k` largest entries of each row of an f32 matrix, selected on
//! the device (ties to the lower column, as the host's [`crate::speculative::tree::TopK`] rule).

use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
use candle_core::cuda_backend::CudaStorage;
use candle_core::op::BackpropOp;
use candle_core::{bail, DType, Result, Storage, Tensor};

use super::launch::{cfg, cuda, go, ptr};

pub(super) const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/topk.ptx"));
pub(super) const MODULE: &str = "dflash_topk";

/// `(indices u32 [rows, k], values f32 [rows, k])` of the `k` largest entries of each row of
/// `x: [rows, cols]` (contiguous f32), unordered within a row.
pub fn topk_rows(x: &Tensor, k: usize) -> Result<(Tensor, Tensor)> {
    let dev = cuda(x)?;
    let (rows, cols) = x.dims2()?;
    if x.dtype() != DType::F32 || !x.is_contiguous() || k == 0 || k > cols {
        bail!(
            "topk_rows: needs contiguous f32 rows and 1 <= k <= {cols}, got {:?} k {k}",
            x.dtype()
        )
    }
    // Every slot is written by the kernel (exactly k per row).
    let idx = unsafe { dev.alloc::<u32>(rows * k)? };
    let val = unsafe { dev.alloc::<f32>(rows * k)? };
    let wrap = |s: CudaStorage| {
        Tensor::from_storage(Storage::Cuda(s), (rows, k), BackpropOp::none(), false)
    };
    let idx = wrap(CudaStorage::wrap_cuda_slice(idx, dev.clone()));
    let val = wrap(CudaStorage::wrap_cuda_slice(val, dev.clone()));
    let (xp, ip, vp) = (ptr(x)?, ptr(&idx)?, ptr(&val)?);
    let (ci, ki) = (cols as i32, k as i32);
    let f = dev.get_or_load_custom_func("topk_rows", MODULE, PTX)?;
    let mut b = f.builder();
    b.arg(&xp).arg(&ci).arg(&ki).arg(&ip).arg(&vp);
    go(&mut b, cfg((rows as u32, 1, 1), 1024), "topk_rows")?;
    Ok((idx, val))
}
