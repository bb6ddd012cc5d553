//! NCCL collectives across the GPUs of one process (`nccl` feature: cudarc's NCCL bindings,
//! linked against libnccl, so a build without the feature never needs the library).
//!
//! [`NcclRanks`] holds one communicator per device, made together (`ncclCommInitAll`), each
//! bound to its candle device's stream: a collective is enqueued on the stream the rank's
//! tensors were computed on, so it waits for them, and whatever candle launches next on that
//! stream waits for it, with no host synchronisation. One thread drives all ranks inside an
//! NCCL group (NCCL requires the ranks' calls of one collective to be grouped when a single
//! thread issues them).
//!
//! NCCL's ring and tree algorithms do not sum in rank order, so results match an in-process
//! rank-order sum to rounding; every rank receives the same bits, so replicas never drift.

use candle_core::backend::BackendDevice;
use candle_core::cuda_backend::cudarc::nccl::{group_end, group_start, Comm, ReduceOp};
use candle_core::cuda_backend::{CudaDevice, CudaStorage};
use candle_core::op::BackpropOp;
use candle_core::{bail, DType, Device, Result, Storage, Tensor};

/// One NCCL communicator per device of a single-process group, rank `r` on `devices[r]`.
pub struct NcclRanks {
    comms: Vec<Comm>,
    devices: Vec<CudaDevice>,
}

fn nccl_err(what: &str, e: impl std::fmt::Debug) -> candle_core::Error {
    candle_core::Error::Msg(format!("NCCL {what}: {e:?}"))
}

impl NcclRanks {
    /// Communicators over `devices` (distinct GPUs; NCCL refuses two ranks on one GPU).
    pub fn new(devices: &[Device]) -> Result<Self> {
        let mut cuda = Vec::with_capacity(devices.len());
        for d in devices {
            let Device::Cuda(c) = d else {
                bail!("NCCL ranks need CUDA devices, got {d:?}")
            };
            if cuda.iter().any(|o: &CudaDevice| o.same_device(c)) {
                bail!("NCCL ranks need distinct GPUs, {d:?} is named twice")
            }
            cuda.push(c.clone());
        }
        if cuda.is_empty() {
            bail!("NCCL ranks need at least one device")
        }
        let streams = cuda.iter().map(|d| d.cuda_stream()).collect();
        let comms = Comm::from_devices(streams).map_err(|e| nccl_err("init", e))?;
        Ok(Self {
            comms,
            devices: cuda,
        })
    }

    pub fn world_size(&self) -> usize {
        self.comms.len()
    }

    /// Sums `per_rank` (one contiguous f32 tensor per rank, the same length, each on its
    /// rank's device) across the ranks; every rank gets the sum, a new tensor on its device.
    pub fn all_reduce_sum_f32(&self, per_rank: &[Tensor]) -> Result<Vec<Tensor>> {
        if per_rank.len() != self.comms.len() {
            bail!(
                "all-reduce over {} ranks got {} tensors",
                self.comms.len(),
                per_rank.len()
            )
        }
        let n = per_rank[0].elem_count();
        let mut outs = Vec::with_capacity(per_rank.len());
        for (t, dev) in per_rank.iter().zip(&self.devices) {
            if t.dtype() != DType::F32 || t.elem_count() != n || !t.is_contiguous() {
                bail!(
                    "all-reduce needs contiguous f32 tensors of {n} elements, got {:?} {:?}",
                    t.dtype(),
                    t.shape()
                )
            }
            if !matches!(t.device(), Device::Cuda(d) if d.same_device(dev)) {
                bail!("all-reduce: a rank's tensor is not on its device")
            }
            // Every element is written by the all-reduce before it is read.
            outs.push(unsafe { dev.alloc::<f32>(n)? });
        }
        let guards: Vec<_> = per_rank.iter().map(|t| t.storage_and_layout()).collect();
        let mut sends = Vec::with_capacity(guards.len());
        for (st, layout) in &guards {
            let Storage::Cuda(cs) = &**st else {
                bail!("all-reduce needs CUDA tensors")
            };
            let start = layout.start_offset();
            sends.push(cs.as_cuda_slice::<f32>()?.slice(start..start + n));
        }
        group_start().map_err(|e| nccl_err("group start", e))?;
        let mut failed = None;
        for ((comm, send), recv) in self.comms.iter().zip(&sends).zip(outs.iter_mut()) {
            if let Err(e) = comm.all_reduce(send, recv, &ReduceOp::Sum) {
                failed.get_or_insert(e);
            }
        }
        // The group is always closed, also after a failed enqueue, or NCCL stays in it.
        let ended = group_end();
        if let Some(e) = failed {
            return Err(nccl_err("all-reduce", e));
        }
        ended.map_err(|e| nccl_err("group end", e))?;
        drop(sends);
        drop(guards);
        Ok(outs
            .into_iter()
            .zip(&self.devices)
            .map(|(s, dev)| {
                Tensor::from_storage(
                    Storage::Cuda(CudaStorage::wrap_cuda_slice(s, dev.clone())),
                    n,
                    BackpropOp::none(),
                    false,
                )
            })
            .collect())
    }
}
