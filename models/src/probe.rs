//! Device probes shared by `dflash-serve bench` and `gpu_check`: a median timer and the copy
//! bandwidth that both report their rooflines against (one probe, so the two tools agree).

use std::time::Instant;

use candle_core::{DType, Device, Tensor};

/// Median wall time in ms of `reps` runs of `f` (after one warm-up), device synchronised.
pub fn time_ms<E: From<candle_core::Error>>(
    dev: &Device,
    reps: usize,
    mut f: impl FnMut() -> Result<(), E>,
) -> Result<f64, E> {
    f()?;
    dev.synchronize()?;
    let mut v = Vec::with_capacity(reps.max(1));
    for _ in 0..reps.max(1) {
        let t = Instant::now();
        f()?;
        dev.synchronize()?;
        v.push(t.elapsed().as_secs_f64() * 1e3);
    }
    v.sort_by(|a, b| a.total_cmp(b));
    Ok(v[v.len() / 2])
}

/// Device copy bandwidth (bytes read + written per second) of one device-to-device copy of
/// `bytes` into a preallocated buffer. On CUDA it times the driver's memcpy: candle's
/// `slice_set` goes through a generic copy kernel that reaches about a quarter of it (1112 vs
/// 4256 GB/s measured on an H200), which would understate every roofline fraction.
pub fn copy_bandwidth(dev: &Device, bytes: usize) -> candle_core::Result<f64> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(cd) = dev {
        let src = cd.alloc_zeros::<u8>(bytes)?;
        let mut dst = cd.alloc_zeros::<u8>(bytes)?;
        let ms = time_ms(dev, 5, || cd.memcpy_dtod(&src, &mut dst))?;
        return Ok(2.0 * bytes as f64 / (ms / 1e3));
    }
    let n = bytes / 2;
    let src = Tensor::zeros(n, DType::BF16, dev)?;
    let dst = Tensor::zeros(n, DType::BF16, dev)?;
    let ms = time_ms(dev, 5, || dst.slice_set(&src, 0, 0))?;
    Ok(2.0 * (2 * n) as f64 / (ms / 1e3))
}

/// `(free, total)` bytes of `device`'s memory as the driver reports them; `None` on the CPU.
pub fn device_memory(device: &Device) -> candle_core::Result<Option<(usize, usize)>> {
    match device {
        #[cfg(feature = "cuda")]
        Device::Cuda(d) => d
            .cuda_stream()
            .context()
            .mem_get_info()
            .map(Some)
            .map_err(|e| candle_core::Error::Msg(format!("cuMemGetInfo: {e}"))),
        _ => Ok(None),
    }
}
