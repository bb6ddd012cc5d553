//! Launch wrappers of gdn_split.cu's batched commit: a path's recurrent state and conv window
//! settled on every Gated DeltaNet layer in two launches (`gdn_state_along_layers`,
//! `gdn_conv_window_layers`) instead of a state rebuild and a window copy per layer, whose
//! launches and host work made a 27B chain round's commit 1.6 ms (H200, session 29). Shapes are
//! checked here because the kernels trust them.

use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
use candle_core::{bail, DType, Result, Tensor};

use super::gdn::check_f32;
use super::gdn_split::{MODULE, PTX};
use super::launch::{alloc_bf16, alloc_f32, cfg, cuda, go, ptr};

/// One layer's inputs: its base state and its staged rows of the forward (all layers' rows of
/// the same forward, so one path of row indices serves them all).
pub struct SettleLayer<'a> {
    /// f32 `[hv, dk, dv]`, the state before the path.
    pub ssm: &'a Tensor,
    /// `[w, conv_dim]` (model dtype), the conv window before the path.
    pub conv: &'a Tensor,
    /// The staged rows (`cache::RowInputs`): keys f32 `[t, hk, dk]`, writes f32 `[t, hv, dv]`,
    /// log-decays f32 `[t, hv]`, pre-conv rows `[t, conv_dim]` (model dtype).
    pub k: &'a Tensor,
    pub writes: &'a Tensor,
    pub g: &'a Tensor,
    pub pre_conv: &'a Tensor,
}

/// Every layer's `(conv window, state)` after the staged rows `rows` (a path, in order): each
/// equal bit for bit to that layer's `gdn_state_along` and window copy.
pub fn gdn_settle_layers(
    layers: &[SettleLayer<'_>],
    rows: &[u32],
) -> Result<Vec<(Tensor, Tensor)>> {
    let Some(first) = layers.first() else {
        return Ok(Vec::new());
    };
    let dev = cuda(first.ssm)?;
    let (hv, dk, dv) = first.ssm.dims3()?;
    let (t, hk, kd) = first.k.dims3()?;
    let (w, cd) = first.conv.dims2()?;
    let dtype = first.conv.dtype();
    let row_bytes = cd * dtype.size_in_bytes();
    let m = rows.len();
    if m == 0
        || kd != dk
        || hk == 0
        || !hv.is_multiple_of(hk)
        || !row_bytes.is_multiple_of(16)
        || rows.iter().any(|&r| r as usize >= t)
    {
        bail!(
            "gdn_settle_layers: state {:?}, k {:?}, conv {:?}, {m} rows of {t}",
            first.ssm.shape(),
            first.k.shape(),
            first.conv.shape()
        )
    }
    let mut states = Vec::with_capacity(layers.len() * 5);
    let mut windows = Vec::with_capacity(layers.len() * 3);
    let mut out = Vec::with_capacity(layers.len());
    for l in layers {
        check_f32("settle state", l.ssm, hv * dk * dv)?;
        check_f32("settle k", l.k, t * hk * dk)?;
        check_f32("settle writes", l.writes, t * hv * dv)?;
        check_f32("settle g", l.g, t * hv)?;
        if l.conv.dtype() != dtype
            || l.pre_conv.dtype() != dtype
            || l.conv.dims2()? != (w, cd)
            || l.pre_conv.dims2()? != (t, cd)
            || !l.conv.is_contiguous()
            || !l.pre_conv.is_contiguous()
        {
            bail!(
                "gdn_settle_layers: conv {:?} {:?} and pre-conv {:?} {:?} of another shape than the first layer's",
                l.conv.dtype(),
                l.conv.shape(),
                l.pre_conv.dtype(),
                l.pre_conv.shape()
            )
        }
        let ssm = alloc_f32(&dev, hv * dk * dv)?.reshape((hv, dk, dv))?;
        let conv = match dtype {
            DType::BF16 => alloc_bf16(&dev, (w, cd))?,
            DType::F32 => alloc_f32(&dev, w * cd)?.reshape((w, cd))?,
            other => bail!("gdn_settle_layers: conv windows of {other:?}"),
        };
        for p in [l.ssm, l.k, l.writes, l.g, &ssm] {
            states.push(ptr(p)? as i64);
        }
        for p in [l.conv, l.pre_conv, &conv] {
            windows.push(ptr(p)? as i64);
        }
        out.push((conv, ssm));
    }
    let n = layers.len() as u32;
    let states = Tensor::new(states.as_slice(), first.ssm.device())?;
    let windows = Tensor::new(windows.as_slice(), first.ssm.device())?;
    let idx = Tensor::new(rows, first.ssm.device())?;
    let (sp, wp, ip) = (ptr(&states)?, ptr(&windows)?, ptr(&idx)?);
    let (mi, hki, hvi, dki, dvi) = (m as i32, hk as i32, hv as i32, dk as i32, dv as i32);
    let f = dev.get_or_load_custom_func("gdn_state_along_layers", MODULE, PTX)?;
    let mut b = f.builder();
    b.arg(&sp)
        .arg(&ip)
        .arg(&mi)
        .arg(&hki)
        .arg(&hvi)
        .arg(&dki)
        .arg(&dvi);
    let blocks = (hv * dk * dv).div_ceil(256) as u32;
    go(&mut b, cfg((blocks, n, 1), 256), "gdn_state_along_layers")?;
    let (wi, rbi) = (w as i32, row_bytes as i32);
    let f = dev.get_or_load_custom_func("gdn_conv_window_layers", MODULE, PTX)?;
    let mut b = f.builder();
    b.arg(&wp).arg(&ip).arg(&mi).arg(&wi).arg(&rbi);
    let blocks = (w * row_bytes / 16).div_ceil(256).max(1) as u32;
    go(&mut b, cfg((blocks, n, 1), 256), "gdn_conv_window_layers")?;
    // The tables are freed stream-ordered after the launches.
    drop((states, windows, idx));
    Ok(out)
}
