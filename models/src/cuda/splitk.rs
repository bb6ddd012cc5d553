//! Launch wrapper of splitk.cu: `x @ wᵀ` for 1..=[`super::TUNED_MAX_ROWS`] rows with K split
//! so that the grid fills the GPU, x staged once per block in shared memory, the partials
//! added in a fixed order (deterministic) by the last block of each column tile, and the
//! epilogue fused (store, residual add, SiLU product). Shapes are checked here because the
//! kernels trust them: contiguous bf16, `n % 64 == 0`, `k % 32 == 0`, 16-byte aligned rows.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
use candle_core::cuda_backend::DeviceId;
use candle_core::{bail, DType, Result, Tensor};

use super::launch::{alloc_bf16, alloc_f32, cfg, check_bf16, cuda, go, ptr};
use super::TUNED_MAX_ROWS;

pub(super) const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/splitk.ptx"));
pub(super) const MODULE: &str = "dflash_splitk";
/// Output columns per block (SK_BN in splitk.cu) and K per pipeline stage (SK_BK).
const BN: usize = 64;
const BK: usize = 32;
/// Blocks a product aims for: two per SM of the H200's 132, so a 4096-column output (64
/// column tiles) splits K 5 ways; more splits would add partial traffic (at 32 rows, 5 splits
/// of a 4096 x 4096 product write and read 2.6 MB each way against 32 MB of weights).
const TARGET_BLOCKS: usize = 264;
/// Most column tiles of one product (the LM head of a 152K vocabulary: 2374); the counters
/// re-arm themselves, so one zeroed buffer per device serves every launch.
const MAX_TILES: usize = 4096;

/// The fused epilogue of [`splitk_gemm`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum SplitkEpi {
    Store,
    /// `y = resid + x wᵀ`.
    Resid,
    /// `w` holds gate rows then up rows (`[2n, k]`); `y = silu(gate) * up`, `[m, n]`.
    Silu,
}

fn counters(dev: &candle_core::cuda_backend::CudaDevice) -> Result<Tensor> {
    static COUNTERS: OnceLock<Mutex<HashMap<DeviceId, Tensor>>> = OnceLock::new();
    let map = COUNTERS.get_or_init(|| Mutex::new(HashMap::new()));
    let mut g = map
        .lock()
        .map_err(|_| candle_core::Error::Msg("splitk counters poisoned".into()))?;
    if let Some(t) = g.get(&dev.id()) {
        return Ok(t.clone());
    }
    let t = Tensor::zeros(
        MAX_TILES,
        DType::U32,
        &candle_core::Device::Cuda(dev.clone()),
    )?;
    g.insert(dev.id(), t.clone());
    Ok(t)
}

/// K splits and 32-wide chunks per split for `tiles` column tiles over `k`: from the shape
/// alone, so a row's result never depends on the rows beside it.
pub fn split_plan(tiles: usize, k: usize, target_blocks: usize) -> (usize, usize) {
    let chunks = k / BK;
    let want = target_blocks.div_ceil(tiles).clamp(1, (chunks / 4).max(1));
    let per = chunks.div_ceil(want);
    (chunks.div_ceil(per), per)
}

/// `x @ wᵀ` with the `epi` epilogue; `x: [m, k]`, `w: [n, k]` (`[2n, k]` for SiLU),
/// `resid: [m, n]` for [`SplitkEpi::Resid`].
pub fn splitk_gemm(
    x: &Tensor,
    w: &Tensor,
    epi: SplitkEpi,
    resid: Option<&Tensor>,
) -> Result<Tensor> {
    splitk_gemm_blocks(x, w, epi, resid, TARGET_BLOCKS)
}

/// [`splitk_gemm`] aiming for `target_blocks` blocks (for measurements).
pub fn splitk_gemm_blocks(
    x: &Tensor,
    w: &Tensor,
    epi: SplitkEpi,
    resid: Option<&Tensor>,
    target_blocks: usize,
) -> Result<Tensor> {
    let dev = cuda(x)?;
    check_bf16("splitk x", x)?;
    check_bf16("splitk w", w)?;
    let (m, k) = x.dims2()?;
    let (wn, wk) = w.dims2()?;
    let n = if epi == SplitkEpi::Silu { wn / 2 } else { wn };
    if m == 0 || m > TUNED_MAX_ROWS || wk != k || k % BK != 0 || n % BN != 0 || n == 0 {
        bail!(
            "splitk: x {:?}, w {:?}: needs 1..={TUNED_MAX_ROWS} rows, k % {BK} == 0, {BN} | outputs",
            x.shape(),
            w.shape()
        )
    }
    if ptr(x)? % 16 != 0 || ptr(w)? % 16 != 0 {
        bail!("splitk: x and w must start on 16-byte boundaries")
    }
    let rp = match (epi, resid) {
        (SplitkEpi::Resid, Some(r)) => {
            check_bf16("splitk residual", r)?;
            if r.dims2()? != (m, n) {
                bail!("splitk: residual must be [{m}, {n}]")
            }
            ptr(r)?
        }
        (SplitkEpi::Resid, None) => bail!("splitk: the residual epilogue needs a residual"),
        _ => 0u64,
    };
    let tiles = n / BN;
    if tiles > MAX_TILES {
        bail!("splitk: {n} outputs exceed {MAX_TILES} column tiles")
    }
    let (splits, per) = split_plan(tiles, k, target_blocks.max(1));
    let mt = m.div_ceil(16);
    let wrows = if epi == SplitkEpi::Silu { 2 * BN } else { BN };
    let part = if splits > 1 {
        Some(alloc_f32(&dev, splits * tiles * mt * 16 * wrows)?)
    } else {
        None
    };
    let cnt = counters(&dev)?;
    let y = alloc_bf16(&dev, (m, n))?;
    let epi_name = match epi {
        SplitkEpi::Store => "store",
        SplitkEpi::Resid => "resid",
        SplitkEpi::Silu => "silu",
    };
    let name = format!("splitk_{epi_name}_m{mt}");
    let (xp, wp, yp, cp) = (ptr(x)?, ptr(w)?, ptr(&y)?, ptr(&cnt)?);
    let pp = part.as_ref().map(ptr).transpose()?.unwrap_or(0);
    let (mi, ni, ki, pi) = (m as i32, n as i32, k as i32, per as i32);
    let f = dev.get_or_load_custom_func(&name, MODULE, PTX)?;
    let mut b = f.builder();
    b.arg(&xp).arg(&wp).arg(&rp).arg(&yp).arg(&pp).arg(&cp);
    b.arg(&mi).arg(&ni).arg(&ki).arg(&pi);
    go(&mut b, cfg((tiles as u32, splits as u32, 1), 128), &name)?;
    // The partials are freed stream-ordered after the kernel.
    drop(part);
    Ok(y)
}
