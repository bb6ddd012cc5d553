//! The split partials and merge counters of the one-launch attentions (`attn_decode.cu`,
//! `attn_step.cu`), one set per device for the process's lifetime.

use std::sync::Mutex;

use candle_core::cuda_backend::{CudaDevice, DeviceId};
use candle_core::{bail, DType, Result, Tensor};

use super::launch::{alloc_f32, capturing, ptr};

/// Merge counters per device (each launch uses `kv_heads * sequences * row tiles` of them).
pub(super) const COUNTERS: usize = 16384;

/// A device's split partials and merge counters, kept for the process's lifetime so that a
/// launch adds no allocation or memset to a CUDA graph: launches on one device's stream run
/// one after another, and the kernel re-arms every counter it uses. A larger partials buffer
/// replaces a smaller one (shapes only, so the uncaptured first run of a graph body grows
/// it); the old one stays allocated because captured graphs may still point at it.
struct Scratch {
    device: DeviceId,
    partials: Tensor,
    counters: Tensor,
    retired: Vec<Tensor>,
}

static SCRATCH: Mutex<Vec<Scratch>> = Mutex::new(Vec::new());

/// Device addresses of at least `floats` f32 partials and [`COUNTERS`] zeroed counters.
pub(super) fn scratch(dev: &CudaDevice, like: &Tensor, floats: usize) -> Result<(u64, u64)> {
    let mut all = SCRATCH
        .lock()
        .map_err(|_| candle_core::Error::Msg("fused_attention: scratch lock poisoned".into()))?;
    let idx = match all.iter().position(|s| s.device == dev.id()) {
        Some(i) => i,
        None => {
            all.push(Scratch {
                device: dev.id(),
                partials: alloc_f32(dev, floats.next_power_of_two())?,
                counters: Tensor::zeros(COUNTERS, DType::U32, like.device())?,
                retired: Vec::new(),
            });
            all.len() - 1
        }
    };
    let s = &mut all[idx];
    if s.partials.elem_count() < floats {
        if capturing(dev)? {
            bail!("fused_attention: scratch would grow during graph capture; run the body once uncaptured first")
        }
        let bigger = alloc_f32(dev, floats.next_power_of_two())?;
        s.retired.push(std::mem::replace(&mut s.partials, bigger));
    }
    Ok((ptr(&s.partials)?, ptr(&s.counters)?))
}
