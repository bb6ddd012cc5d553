//! Optional GPU-timeline profile of a forward by phase, for the benches (`gpu_check --hybrid`):
//! while a profile is open, [`mark`] records a CUDA event on the device stream at a labelled
//! point, and [`finish`] sums, per label, the time between each mark and the next. The events
//! sit in the stream, so an interval is what the GPU spent from one point to the next: kernel
//! time where the GPU is the bottleneck, kernel time plus launch gaps where the host is. No
//! profile open (every request path): one relaxed atomic load per mark.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use candle_core::cuda_backend::cudarc::driver::{sys as dsys, CudaEvent};
use candle_core::{Device, Result};

static OPEN: AtomicBool = AtomicBool::new(false);
static MARKS: Mutex<Vec<(&'static str, CudaEvent)>> = Mutex::new(Vec::new());

fn drv(e: impl std::fmt::Debug) -> candle_core::Error {
    candle_core::Error::Msg(format!("phase profile: {e:?}"))
}

/// Starts recording marks (dropping any left from an unfinished profile).
pub fn start() {
    if let Ok(mut m) = MARKS.lock() {
        m.clear();
    }
    OPEN.store(true, Ordering::Relaxed);
}

/// Records the start of phase `label` on `dev`'s stream when a profile is open (it ends at the
/// next mark). Errors are ignored: a profile must never fail a forward.
pub fn mark(dev: &Device, label: &'static str) {
    if !OPEN.load(Ordering::Relaxed) {
        return;
    }
    let Device::Cuda(cd) = dev else { return };
    if let Ok(ev) = cd
        .cuda_stream()
        .record_event(Some(dsys::CUevent_flags::CU_EVENT_DEFAULT))
    {
        if let Ok(mut m) = MARKS.lock() {
            m.push((label, ev));
        }
    }
}

/// Closes the profile: waits for the last mark and returns `(label, total ms, count)` per label,
/// in the order labels first appeared. Each interval runs from a mark to the next one; the
/// last mark only ends the one before it (mark "end" last).
pub fn finish() -> Result<Vec<(&'static str, f64, usize)>> {
    OPEN.store(false, Ordering::Relaxed);
    let marks = std::mem::take(&mut *MARKS.lock().map_err(drv)?);
    let mut out: Vec<(&'static str, f64, usize)> = Vec::new();
    if let Some((_, last)) = marks.last() {
        last.synchronize().map_err(drv)?;
    }
    for w in marks.windows(2) {
        let ms = w[0].1.elapsed_ms(&w[1].1).map_err(drv)? as f64;
        match out.iter_mut().find(|(l, _, _)| *l == w[0].0) {
            Some(e) => {
                e.1 += ms;
                e.2 += 1;
            }
            None => out.push((w[0].0, ms, 1)),
        }
    }
    Ok(out)
}
