//! Page-locked host staging for whole-buffer device -> host copies (the fused optimizer's
//! checkpoint snapshot: master weights and both moments, gigabytes each).
//!
//! A copy into pageable memory goes through the driver's small bounce buffers; on the VMs we
//! train on that ran 12.6 GB in ~25 s, on the training loop's thread. Into page-locked memory
//! it is one DMA at link speed. Page-locking gigabytes is itself slow, so a buffer is meant to
//! be allocated once and refilled for every snapshot.
//!
//! The memory is ordinary cached memory, not the write-combined kind cudarc's
//! `alloc_pinned` gives: the host reads these bytes back (to cut and serialise a checkpoint),
//! and host reads of write-combined memory bypass the caches and crawl.

use candle_core::cuda_backend::cudarc::driver::{DriverError, PinnedHostSlice};
use candle_core::cuda_backend::CudaDevice;
use candle_core::{bail, DType, Result, Storage, Tensor};

/// Page-locked `f32` host memory of a fixed length, filled whole from a CUDA tensor.
pub struct PinnedStaging {
    buf: PinnedHostSlice<f32>,
    /// Whether a fill completed: until then the memory is unset and never handed out.
    filled: bool,
}

fn driver(what: &str, e: DriverError) -> candle_core::Error {
    candle_core::Error::Msg(format!("pinned staging: {what}: {e}"))
}

impl PinnedStaging {
    /// `len` f32 of page-locked host memory in `dev`'s context.
    pub fn new(dev: &CudaDevice, len: usize) -> Result<Self> {
        let stream = dev.cuda_stream();
        // SAFETY: the memory is unset until `fill_from` writes all of it; `as_slice` refuses
        // to hand it out before. Flags 0: cached, not write-combined (see the module docs).
        let buf = unsafe { stream.context().alloc_pinned_with_flags::<f32>(len, 0) }
            .map_err(|e| driver(&format!("cannot page-lock {} bytes", len * 4), e))?;
        Ok(Self { buf, filled: false })
    }

    pub fn len(&self) -> usize {
        self.buf.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Copies all of `src` (a contiguous f32 CUDA tensor of [`Self::len`] elements, in the
    /// context this buffer was allocated in) here, and returns once the copy is complete: the
    /// bytes are those of `src` at this point of its stream, whatever later work does to it.
    pub fn fill_from(&mut self, src: &Tensor) -> Result<()> {
        if src.dtype() != DType::F32 || src.elem_count() != self.len() {
            bail!(
                "pinned staging: {} f32 elements cannot take {:?} {:?}",
                self.len(),
                src.dtype(),
                src.shape()
            )
        }
        let (storage, layout) = src.storage_and_layout();
        let Storage::Cuda(cs) = &*storage else {
            bail!("pinned staging: the source must be a CUDA tensor")
        };
        let Some((start, end)) = layout.contiguous_offsets() else {
            bail!("pinned staging: the source must be contiguous, got {layout:?}")
        };
        let stream = cs.device.cuda_stream();
        if stream.context() != self.buf.context() {
            bail!("pinned staging: the source is on another device than the buffer")
        }
        let view = cs.as_cuda_slice::<f32>()?.slice(start..end);
        // Lengths were checked above (cudarc asserts them). Ordered after the kernels that
        // wrote `src`; the synchronize makes the snapshot complete before the caller goes on.
        self.filled = false;
        stream
            .memcpy_dtoh(&view, &mut self.buf)
            .map_err(|e| driver("device -> host copy", e))?;
        stream
            .synchronize()
            .map_err(|e| driver("waiting for the copy", e))?;
        self.filled = true;
        Ok(())
    }

    /// The bytes of the last fill (waits for it; an error before any fill).
    pub fn as_slice(&self) -> Result<&[f32]> {
        if !self.filled {
            bail!("pinned staging: read before any fill")
        }
        self.buf
            .as_slice()
            .map_err(|e| driver("waiting for the copy", e))
    }
}
