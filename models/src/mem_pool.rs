//! How much freed device memory the CUDA driver keeps for reuse.
//!
//! candle allocates through cudarc's stream-ordered allocator (`cuMemAllocAsync` from the
//! device's default memory pool). That pool's release threshold defaults to 0: at every stream,
//! event or context synchronisation the driver returns all freed memory to the OS, and the
//! next allocation maps fresh pages. A speculative round synchronises two or three times (the
//! drafts and the verified tokens come back to the host) and allocates tens of megabytes of
//! logits and temporaries in between, so with the default each round would pay for mapping
//! them again. Keeping a bounded amount in the pool makes those allocations reuse memory.

use candle_core::Device;

use crate::error::ModelResult;

/// Freed memory the pool keeps by default (dflash-serve and the bench): well above what a
/// round or a prefill chunk allocates, and a small fraction of a serving GPU.
pub const DEFAULT_KEEP_BYTES: u64 = 4 << 30;

/// Lets the default memory pool of `dev` keep up to `bytes` of freed memory across
/// synchronisations (0: the driver's default, release everything). No-op off CUDA.
pub fn keep_freed_memory(dev: &Device, bytes: u64) -> ModelResult<()> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(cd) = dev {
        use candle_core::cuda_backend::cudarc::driver::sys;
        let cu_device = cd.cuda_stream().context().cu_device();
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        let mut value = bytes;
        // SAFETY: `pool` and `value` outlive the calls; the attribute takes a u64 (cuuint64_t).
        let r = unsafe {
            let r = sys::cuDeviceGetDefaultMemPool(&mut pool, cu_device);
            if r == sys::CUresult::CUDA_SUCCESS {
                sys::cuMemPoolSetAttribute(
                    pool,
                    sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                    (&mut value as *mut u64).cast(),
                )
            } else {
                r
            }
        };
        if r != sys::CUresult::CUDA_SUCCESS {
            return Err(crate::error::ModelError::Unsupported(format!(
                "setting the CUDA memory pool's release threshold: {r:?}"
            )));
        }
    }
    let _ = (dev, bytes);
    Ok(())
}
