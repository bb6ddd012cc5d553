//! The optimizer state a checkpoint is written from: taken between two steps, then handed to
//! the writer thread (`ckpt_writer.rs`), which turns it into per-tensor tensors there.
//!
//! The reference optimizer's snapshot is per-tensor host copies. The fused one's is its three
//! flat f32 buffers (masters, both moments) copied whole to the host, one copy each, with the
//! segments to cut them by: the loop stands still for those copies only, and the cutting
//! (another copy of every byte) runs on the writer thread. On CUDA the host buffers are
//! page-locked (`dflash_models::cuda::PinnedStaging`: a pageable copy of 12.6 GB took ~25 s),
//! allocated at the first snapshot and reused for the run: a snapshot gives them back to its
//! [`StagingPool`] when dropped (once cut, or when its write failed), and the writer waits for
//! the previous write before the next snapshot is taken, so one set exists at a time.
//!
//! A flat snapshot is cut with the offsets and shapes the fused optimizer lays its buffers out
//! by, as `TrainOptimizer::tensors` cuts them, so a checkpoint's bytes do not depend on which
//! form it was written from.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use candle_core::{Device, Shape, Tensor};
#[cfg(feature = "cuda")]
use dflash_models::cuda::PinnedStaging;

use super::checkpoint::OptimizerTensors;
use super::error::TrainResult;

/// The optimizer state of one step, on the host, untouched by later steps.
pub enum OptimizerSnapshot {
    /// Per-tensor host tensors (the reference optimizer).
    Tensors(OptimizerTensors),
    /// The fused optimizer's flat buffers, cut per tensor by [`Self::into_tensors`].
    Flat(FlatSnapshot),
}

impl OptimizerSnapshot {
    /// The state per tensor, as a checkpoint stores it (flat: cut now, and the buffers go back
    /// to their pool).
    pub fn into_tensors(self) -> TrainResult<OptimizerTensors> {
        match self {
            Self::Tensors(t) => Ok(t),
            Self::Flat(f) => f.into_tensors(),
        }
    }
}

impl From<OptimizerTensors> for OptimizerSnapshot {
    fn from(t: OptimizerTensors) -> Self {
        Self::Tensors(t)
    }
}

/// A host copy of one flat f32 buffer.
enum HostBuffer {
    /// Pageable memory: the CPU, or CUDA where page-locking failed.
    Pageable(Vec<f32>),
    #[cfg(feature = "cuda")]
    Pinned(PinnedStaging),
}

impl HostBuffer {
    /// A buffer for copies of `like`: page-locked for a CUDA tensor, pageable if that fails
    /// (slower checkpoints rather than a stopped run).
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    fn for_copies_of(like: &Tensor) -> Self {
        #[cfg(feature = "cuda")]
        if let Device::Cuda(dev) = like.device() {
            match PinnedStaging::new(dev, like.elem_count()) {
                Ok(p) => return Self::Pinned(p),
                Err(e) => tracing::warn!(
                    "checkpoint snapshots use pageable host memory (slower copies): {e}"
                ),
            }
        }
        Self::Pageable(Vec::new())
    }

    fn fill(&mut self, src: &Tensor) -> TrainResult<()> {
        match self {
            Self::Pageable(v) => *v = src.to_vec1::<f32>()?,
            #[cfg(feature = "cuda")]
            Self::Pinned(p) => p.fill_from(src)?,
        }
        Ok(())
    }

    fn as_slice(&self) -> TrainResult<&[f32]> {
        match self {
            Self::Pageable(v) => Ok(v),
            #[cfg(feature = "cuda")]
            Self::Pinned(p) => Ok(p.as_slice()?),
        }
    }
}

/// Host copies of the master weights and both moments.
struct FlatBuffers {
    master: HostBuffer,
    m: HostBuffer,
    v: HostBuffer,
}

/// Where a snapshot's buffers wait for the next one.
type Idle = Arc<Mutex<Option<FlatBuffers>>>;

/// A poisoned lock only means a writer thread panicked; the buffers in it are still whole
/// (the next fill overwrites them all).
fn lock(idle: &Idle) -> MutexGuard<'_, Option<FlatBuffers>> {
    idle.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The fused optimizer's host buffers for snapshots: allocated at the first, reused after.
#[derive(Default)]
pub struct StagingPool {
    /// The buffers while no snapshot holds them.
    idle: Idle,
    /// Sets allocated so far: one, unless a snapshot was taken while the previous one was
    /// still held (correct, but another 12 bytes a parameter of host memory).
    allocated: AtomicUsize,
}

impl StagingPool {
    /// A snapshot of the flat f32 buffers `[master, m, v]`, to be cut by `segments` (offset,
    /// shape) into tensors named `names`. Returns once the copies are complete.
    pub fn snapshot(
        &self,
        [master, m, v]: [&Tensor; 3],
        names: Vec<String>,
        segments: Vec<(usize, Shape)>,
    ) -> TrainResult<FlatSnapshot> {
        let idle = lock(&self.idle).take();
        let buffers = idle.unwrap_or_else(|| {
            if self.allocated.fetch_add(1, Ordering::Relaxed) > 0 {
                tracing::warn!(
                    "a checkpoint snapshot was taken while the previous one still held its host \
                     buffers; allocating another set"
                );
            }
            FlatBuffers {
                master: HostBuffer::for_copies_of(master),
                m: HostBuffer::for_copies_of(m),
                v: HostBuffer::for_copies_of(v),
            }
        });
        // Held by the snapshot before the fills, so a failed fill still returns them.
        let mut snap = FlatSnapshot {
            names,
            segments,
            buffers: Some(buffers),
            home: Arc::clone(&self.idle),
        };
        if let Some(b) = snap.buffers.as_mut() {
            b.master.fill(master)?;
            b.m.fill(m)?;
            b.v.fill(v)?;
        }
        Ok(snap)
    }

    /// Whether the buffers are back (no snapshot holds them).
    pub fn is_idle(&self) -> bool {
        lock(&self.idle).is_some()
    }

    /// Sets of host buffers allocated so far (1 in a run that waits for each write).
    pub fn sets_allocated(&self) -> usize {
        self.allocated.load(Ordering::Relaxed)
    }
}

/// The fused optimizer's state as whole host copies of its flat buffers.
pub struct FlatSnapshot {
    names: Vec<String>,
    segments: Vec<(usize, Shape)>,
    /// Some until dropped, when they go back `home`.
    buffers: Option<FlatBuffers>,
    home: Idle,
}

impl FlatSnapshot {
    /// Per-tensor host tensors, in checkpoint order (the buffers go back when `self` drops).
    pub fn into_tensors(self) -> TrainResult<OptimizerTensors> {
        let Some(b) = self.buffers.as_ref() else {
            return Err(candle_core::Error::Msg("snapshot buffers already returned".into()).into());
        };
        let cut = |buf: &HostBuffer| -> TrainResult<Vec<Tensor>> {
            let host = buf.as_slice()?;
            self.segments
                .iter()
                .map(|(off, shape)| {
                    let n = shape.elem_count();
                    let part = host.get(*off..off + n).ok_or_else(|| {
                        candle_core::Error::Msg(format!(
                            "snapshot: segment {off}+{n} past a buffer of {}",
                            host.len()
                        ))
                    })?;
                    Ok(Tensor::from_slice(part, shape, &Device::Cpu)?)
                })
                .collect()
        };
        let params = self.names.iter().cloned().zip(cut(&b.master)?).collect();
        Ok(OptimizerTensors {
            params,
            m: cut(&b.m)?,
            v: cut(&b.v)?,
        })
    }
}

impl Drop for FlatSnapshot {
    /// Back to the pool for the next snapshot, unless another set got there first (then this
    /// one is freed: the pool keeps one).
    fn drop(&mut self) {
        if let Some(b) = self.buffers.take() {
            let mut idle = lock(&self.home);
            if idle.is_none() {
                *idle = Some(b);
            }
        }
    }
}

#[cfg(test)]
mod tests;
