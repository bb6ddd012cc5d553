//! Launch wrappers of gdn_split.cu's batched commit: a path's recurrent state and conv window
//! settled on every Gated DeltaNet layer in two launches (`gdn_state_along_layers`,
//! `gdn_conv_window_layers`) instead of a state rebuild and a window copy per layer, whose
//! launches and host work made a 27B chain round's commit 1.6 ms (H200, session 29). Shapes are
//! checked here because the kernels trust them.

use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
use candle_core::{DType, Result, Tensor};

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

/// Why the kernels cannot take `layers` and `rows` (None: they can): every state, key, write
/// and log-decay contiguous f32 of the first layer's shapes, every conv window and pre-conv
/// block contiguous of one dtype (bf16 or f32) with rows of a multiple of 16 bytes, the rows
/// within the staged ones.
fn unfit(layers: &[SettleLayer<'_>], rows: &[u32]) -> Option<String> {
    let first = layers.first()?;
    let dims = |t: &Tensor| t.dims().to_vec();
    let (ssm, k, conv) = (dims(first.ssm), dims(first.k), dims(first.conv));
    let ([hv, dk, dv], [t, hk, kd], [_, cd]) = (ssm.as_slice(), k.as_slice(), conv.as_slice())
    else {
        return Some(format!("state {ssm:?}, k {k:?}, conv {conv:?}"));
    };
    let dtype = first.conv.dtype();
    let (t, hv) = (*t, *hv);
    if rows.is_empty()
        || kd != dk
        || *hk == 0
        || !hv.is_multiple_of(*hk)
        || !matches!(dtype, DType::BF16 | DType::F32)
        || !(cd * dtype.size_in_bytes()).is_multiple_of(16)
        || rows.iter().any(|&r| r as usize >= t)
    {
        return Some(format!(
            "state {ssm:?}, k {k:?}, conv {conv:?} {dtype:?}, rows {rows:?}"
        ));
    }
    let f32_of = |x: &Tensor, shape: &[usize]| {
        x.dtype() == DType::F32 && x.is_contiguous() && x.dims() == shape
    };
    let same =
        |x: &Tensor, shape: &[usize]| x.dtype() == dtype && x.is_contiguous() && x.dims() == shape;
    for l in layers {
        if !(f32_of(l.ssm, &ssm)
            && f32_of(l.k, &k)
            && f32_of(l.writes, &[t, hv, *dv])
            && f32_of(l.g, &[t, hv])
            && same(l.conv, &conv)
            && same(l.pre_conv, &[t, *cd]))
        {
            return Some(format!(
                "a layer's state {:?}, k {:?}, writes {:?}, g {:?}, conv {:?}, pre-conv {:?} against the first's",
                l.ssm.shape(),
                l.k.shape(),
                l.writes.shape(),
                l.g.shape(),
                l.conv.shape(),
                l.pre_conv.shape()
            ));
        }
    }
    None
}

/// Every layer's `(conv window, state)` after the staged rows `rows` (a path, in order): each
/// equal bit for bit to that layer's `gdn_state_along` and window copy. None (nothing launched)
/// where the kernels do not take the layers' shapes, dtypes or layouts.
pub fn gdn_settle_layers(
    layers: &[SettleLayer<'_>],
    rows: &[u32],
) -> Result<Option<Vec<(Tensor, Tensor)>>> {
    let Some(first) = layers.first() else {
        return Ok(Some(Vec::new()));
    };
    if let Some(why) = unfit(layers, rows) {
        tracing::debug!("batched GDN settle declined: {why}");
        return Ok(None);
    }
    let dev = cuda(first.ssm)?;
    let (hv, dk, dv) = first.ssm.dims3()?;
    let (_, hk, _) = first.k.dims3()?;
    let (w, cd) = first.conv.dims2()?;
    let dtype = first.conv.dtype();
    let row_bytes = cd * dtype.size_in_bytes();
    let m = rows.len();
    let mut states = Vec::with_capacity(layers.len() * 5);
    let mut windows = Vec::with_capacity(layers.len() * 3);
    let mut out = Vec::with_capacity(layers.len());
    for l in layers {
        let ssm = alloc_f32(&dev, hv * dk * dv)?.reshape((hv, dk, dv))?;
        let conv = match dtype {
            DType::BF16 => alloc_bf16(&dev, (w, cd))?,
            _ => alloc_f32(&dev, w * cd)?.reshape((w, cd))?,
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
    Ok(Some(out))
}
