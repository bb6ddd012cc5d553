//! The device's default memory pool (what candle allocates from, with `cuMemAllocAsync`).
//!
//! Its release threshold is 0 by default: at every synchronisation the driver takes back all
//! memory freed into the pool, and the next step maps it again (large buffers such as a verify's
//! logits or a training step's activations cost a remap each time). Raising the threshold
//! keeps the process's high-water mark in the pool, as PyTorch's caching allocator does.
//! `DFLASH_CUDA_POOL_TRIM=1` keeps the driver's default (for A/B measurements). Measured so
//! far: the trainer (whole steps of tens of GB); in the server, the 32K-interference run of
//! h200-2026-12-06-s16-interf showed no difference on plain decoding with step graphs (few
//! per-step buffers); the speculative rounds (verify logits, gathers, drafter buffers outside
//! graphs) are not measured yet.

use candle_core::cuda_backend::cudarc::driver::{result, sys};
use candle_core::Device;

/// Keeps memory freed into `device`'s default pool instead of returning it at each
/// synchronisation (no-op on the CPU, or with `DFLASH_CUDA_POOL_TRIM=1`).
pub fn keep_freed_memory(device: &Device) -> Result<(), String> {
    let Device::Cuda(cd) = device else {
        return Ok(());
    };
    if std::env::var("DFLASH_CUDA_POOL_TRIM").is_ok_and(|v| v == "1") {
        return Ok(());
    }
    let dev = cd.cuda_stream().context().cu_device();
    let mut threshold = u64::MAX;
    // SAFETY: `dev` comes from a live context; the attribute takes a u64 (CUDA docs).
    unsafe {
        let pool = result::device::get_default_mem_pool(dev).map_err(|e| e.to_string())?;
        result::mem_pool::set_attribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut threshold as *mut u64).cast(),
        )
        .map_err(|e| format!("cannot keep freed memory in the CUDA pool: {e}"))
    }
}
