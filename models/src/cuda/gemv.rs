//! Launch wrappers of gemv.cu: skinny products `x @ wᵀ` for at most
//! [`super::GEMV_MAX_ROWS`] rows of `x`, with the input RMSNorm, the residual add (and the
//! next norm's sums of squares) or the SiLU-gate product fused around them. Inputs must be
//! contiguous bf16 CUDA tensors with 16-byte aligned rows; shapes are checked here because the
//! kernels trust them.

use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
use candle_core::{bail, DType, Result, Tensor};

use super::launch::{alloc_bf16, alloc_f32, cfg, check_bf16, cuda, go, ptr, KernelArgs};
use super::GEMV_MAX_ROWS;

pub(super) const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/gemv.ptx"));
pub(super) const MODULE: &str = "dflash_gemv";

#[derive(Clone, Copy, PartialEq)]
enum Epi {
    Store,
    Resid,
    Silu,
}

/// Warps splitting K per 8-column tile in the tensor-core kernel (1, 2 or 4), from the shape
/// alone so that a row's result never depends on how many rows come with it.
pub(super) fn k_splits(tiles: usize) -> usize {
    match tiles {
        0..=1023 => 4,
        1024..=2047 => 2,
        _ => 1,
    }
}

/// The RMSNorm of a GEMM's input: `bf16(x * rsqrt(ss / k + eps) * weight)` per row, with `ss`
/// (f32 `[m]`) the row sums of squares from [`row_sumsq`] or [`gemv_resid`]. `None`: summed
/// from x where needed (by every block of the one-row [`gemv`] kernel itself, by
/// [`row_sumsq`] first elsewhere).
#[derive(Clone, Copy)]
pub struct RowNorm<'a> {
    pub ss: Option<&'a Tensor>,
    pub weight: &'a Tensor,
    pub eps: f64,
}

/// The next product's weights, of which the one-row kernels pull the leading `bytes` into L2
/// once their own loads are done (a hint: results never depend on it).
#[derive(Clone, Copy)]
pub struct Prefetch<'a> {
    pub weight: &'a Tensor,
    pub bytes: usize,
}

/// Which kernel runs a product: `(name, grid, k splits)`. One row streams on CUDA cores with
/// row-contiguous loads (2 output columns per warp, or per 2 warps for the residual epilogue),
/// the norm applied as x streams in; 2 to 64
/// rows on tensor cores (also one row with the `mma` variant), 17..64 with 2-4 m16 tiles per
/// warp sharing every weight fragment.
fn plan(m: usize, n: usize, epi: Epi, norm: bool, variant: Option<&str>) -> (String, usize, usize) {
    let epi_name = match epi {
        Epi::Store => "store",
        Epi::Resid => "resid",
        Epi::Silu => "silu",
    };
    let norm_name = if norm { "_norm" } else { "" };
    if m == 1 && variant.is_none_or(|v| v == "rows") {
        // 4 warps x 2 columns per block; the residual kernel splits K over 2 warps (KS in
        // gemv.cu), so its blocks own 4 columns.
        let cols = if epi == Epi::Resid { 4 } else { 8 };
        return (
            format!("gemv_rows2_{epi_name}{norm_name}"),
            n.div_ceil(cols),
            1,
        );
    }
    let ks = k_splits(n / 8);
    // m16 tiles per warp: the 17..64-row kernels share each weight fragment among 2-4.
    let tiles = match m.div_ceil(16) {
        0 | 1 => String::new(),
        t => format!("_m{t}"),
    };
    (
        format!("gemv_mma_{epi_name}{tiles}"),
        (n / 8).div_ceil(4 / ks),
        ks,
    )
}

struct Launch<'a> {
    x: &'a Tensor,
    w: &'a Tensor,
    /// Output columns (`w` has `2n` rows for SiLU).
    n: usize,
    epi: Epi,
    norm: Option<RowNorm<'a>>,
    /// Residual and counter of the residual epilogue (no counter: no sums of squares).
    resid: Option<(&'a Tensor, Option<&'a Tensor>)>,
    variant: Option<&'a str>,
    prefetch: Option<Prefetch<'a>>,
}

/// `(y, ss)`: `ss` (the row sums of squares of y) only for the residual epilogue.
fn launch(l: Launch<'_>) -> Result<(Tensor, Option<Tensor>)> {
    let dev = cuda(l.x)?;
    check_bf16("gemv x", l.x)?;
    check_bf16("gemv w", l.w)?;
    let (m, k) = l.x.dims2()?;
    let (wn, wk) = l.w.dims2()?;
    let rows_w = if l.epi == Epi::Silu { 2 * l.n } else { l.n };
    if m == 0
        || m > GEMV_MAX_ROWS
        || wk != k
        || wn != rows_w
        || !k.is_multiple_of(256)
        || !l.n.is_multiple_of(16)
    {
        bail!(
            "gemv: x {:?}, w {:?}, {} outputs: needs 1..={GEMV_MAX_ROWS} rows, k % 256 == 0, n % 16 == 0",
            l.x.shape(),
            l.w.shape(),
            l.n
        )
    }
    if ptr(l.x)? % 16 != 0 || ptr(l.w)? % 16 != 0 {
        bail!("gemv: x and w must start on 16-byte boundaries")
    }
    // Only the one-row kernels apply the norm on the fly; the tensor-core ones read it applied.
    let normed;
    let (x, norm) = match l.norm {
        Some(nm) if m > 1 || l.variant.is_some() => {
            normed = rms_apply(l.x, nm)?;
            (&normed, None)
        }
        other => (l.x, other),
    };
    let (name, grid, ks) = plan(m, l.n, l.epi, norm.is_some(), l.variant);
    let y = alloc_bf16(&dev, (m, l.n))?;
    // The one-row store kernel sums x's squares in every block; the SiLU one reads them.
    let summed;
    let (nw, ss_in, eps) = match norm {
        Some(nm) => {
            check_bf16("gemv norm weight", nm.weight)?;
            if nm.weight.dims1()? != k {
                bail!("gemv: norm weight must be [{k}]")
            }
            let ss = match (nm.ss, l.epi) {
                (_, Epi::Store) => None,
                (Some(ss), _) => Some(ss),
                (None, _) => {
                    summed = row_sumsq(x)?;
                    Some(&summed)
                }
            };
            if let Some(ss) = ss {
                if ss.dtype() != DType::F32 || ss.dims1()? != m {
                    bail!("gemv: norm sums must be f32 [{m}]")
                }
            }
            let ss_ptr = ss.map(ptr).transpose()?.unwrap_or(0);
            (ptr(nm.weight)?, ss_ptr, nm.eps as f32)
        }
        None => (0, 0, 0f32),
    };
    let (resid, counter, ss_out, part) = match (l.epi, l.resid) {
        (Epi::Resid, Some((r, c))) => {
            check_bf16("gemv residual", r)?;
            if r.dims2()? != (m, l.n) {
                bail!("gemv: residual must be [{m}, {}]", l.n)
            }
            match c {
                Some(c) => {
                    if c.dtype() != DType::U32 || c.elem_count() != 1 {
                        bail!("gemv: the residual counter must be u32 [1]")
                    }
                    let ss = alloc_f32(&dev, m)?;
                    let part = alloc_f32(&dev, grid * m)?;
                    (ptr(r)?, ptr(c)?, Some(ss), Some(part))
                }
                // Only the one-row kernel can leave the sums out (the tensor-core one always
                // writes them).
                None if name.starts_with("gemv_rows") => (ptr(r)?, 0, None, None),
                None => bail!("gemv: the residual epilogue of {m} rows needs a counter"),
            }
        }
        (Epi::Resid, None) => bail!("gemv: the residual epilogue needs a residual and a counter"),
        _ => (0, 0, None, None),
    };
    let opt = |t: Option<&Tensor>| t.map(ptr).transpose().map(|p| p.unwrap_or(0));
    let (xp, wp, yp, sp, pp) = (
        ptr(x)?,
        ptr(l.w)?,
        ptr(&y)?,
        opt(ss_out.as_ref())?,
        opt(part.as_ref())?,
    );
    let (mi, ni, ki, ksi) = (m as i32, l.n as i32, k as i32, ks as i32);
    let f = dev.get_or_load_custom_func(&name, MODULE, PTX)?;
    // Only the one-row kernels prefetch (their blocks finish with memory bandwidth to spare)
    // and launch as programmatic dependents (`cuda::pdl`).
    let rows_kernel = name.starts_with("gemv_rows");
    let (pf, pf_bytes) = match l.prefetch {
        Some(p) if rows_kernel => {
            check_bf16("gemv prefetch weight", p.weight)?;
            let bytes = p.bytes.min(p.weight.elem_count() * 2) & !15;
            (ptr(p.weight)?, bytes as u64)
        }
        _ => (0u64, 0u64),
    };
    if pf % 16 != 0 {
        bail!("gemv: the prefetched weight must start on a 16-byte boundary")
    }
    let pdl = rows_kernel && super::launch::pdl();
    // The kernels' GEMV_ARGS, in order.
    let mut b = KernelArgs::new();
    b.arg(&xp)
        .arg(&wp)
        .arg(&yp)
        .arg(&mi)
        .arg(&ni)
        .arg(&ki)
        .arg(&ksi);
    b.arg(&resid)
        .arg(&nw)
        .arg(&eps)
        .arg(&ss_in)
        .arg(&sp)
        .arg(&pp);
    b.arg(&counter).arg(&pf).arg(&pf_bytes);
    b.launch_as(&dev, &f, cfg((grid as u32, 1, 1), 128), pdl, &name)?;
    // The partials are freed stream-ordered after the kernel.
    drop(part);
    Ok((y, ss_out))
}

/// `norm(x) @ wᵀ` (`x` itself without a norm), `x: [m <= 64, k]`, `w: [n, k]`.
pub fn gemv(x: &Tensor, w: &Tensor, norm: Option<RowNorm<'_>>) -> Result<Tensor> {
    let n = w.dims2()?.0;
    Ok(launch(Launch {
        x,
        w,
        n,
        epi: Epi::Store,
        norm,
        resid: None,
        variant: None,
        prefetch: None,
    })?
    .0)
}

/// `silu(norm(x) @ gateᵀ) * (norm(x) @ upᵀ)` for `w = [gate; up]` (`[2i, k]`): `[m, i]`.
pub fn gemv_silu(x: &Tensor, w: &Tensor, norm: Option<RowNorm<'_>>) -> Result<Tensor> {
    let n = w.dims2()?.0 / 2;
    Ok(launch(Launch {
        x,
        w,
        n,
        epi: Epi::Silu,
        norm,
        resid: None,
        variant: None,
        prefetch: None,
    })?
    .0)
}

/// `(y, ss)` with `y = resid + x @ wᵀ` (the residual stream after a projection, rounded as
/// [`super::add_rmsnorm`] rounds it) and `ss` its row sums of squares (f32 `[m]`, for the next
/// [`RowNorm`]). `counter` is a u32 `[1]` tensor holding 0; the kernel leaves it 0 again, so
/// one counter serves consecutive launches on one stream. Without a counter (one row only) no
/// sums are made, which spares the kernel its last-block reduction. With one row, `prefetch`
/// names the next product's weights to start pulling into L2 (see [`Prefetch`]).
pub fn gemv_resid(
    x: &Tensor,
    w: &Tensor,
    resid: &Tensor,
    counter: Option<&Tensor>,
    prefetch: Option<Prefetch<'_>>,
) -> Result<(Tensor, Option<Tensor>)> {
    let n = w.dims2()?.0;
    launch(Launch {
        x,
        w,
        n,
        epi: Epi::Resid,
        norm: None,
        resid: Some((resid, counter)),
        variant: None,
        prefetch,
    })
}

/// Row sums of squares (f32 `[m]`) of `x: [m, k]`, for the first [`RowNorm`] of a forward.
pub fn row_sumsq(x: &Tensor) -> Result<Tensor> {
    let dev = cuda(x)?;
    check_bf16("row_sumsq x", x)?;
    let (m, k) = x.dims2()?;
    let ss = alloc_f32(&dev, m)?;
    let (xp, sp, ki) = (ptr(x)?, ptr(&ss)?, k as i32);
    let f = dev.get_or_load_custom_func("row_sumsq", MODULE, PTX)?;
    let mut b = f.builder();
    b.arg(&xp).arg(&sp).arg(&ki);
    go(&mut b, cfg((m as u32, 1, 1), 256), "row_sumsq")?;
    Ok(ss)
}

/// `norm(x)` materialised, `[m, k]` bf16.
pub fn rms_apply(x: &Tensor, norm: RowNorm<'_>) -> Result<Tensor> {
    let dev = cuda(x)?;
    check_bf16("rms_apply x", x)?;
    check_bf16("rms_apply weight", norm.weight)?;
    let summed;
    let ss = match norm.ss {
        Some(ss) => ss,
        None => {
            summed = row_sumsq(x)?;
            &summed
        }
    };
    let (m, k) = x.dims2()?;
    if k % 8 != 0 || norm.weight.dims1()? != k || ss.dims1()? != m {
        bail!(
            "rms_apply: x {:?}, weight {:?}",
            x.shape(),
            norm.weight.shape()
        )
    }
    let h = alloc_bf16(&dev, (m, k))?;
    let (xp, sp, wp, hp) = (ptr(x)?, ptr(ss)?, ptr(norm.weight)?, ptr(&h)?);
    let (ki, eps) = (k as i32, norm.eps as f32);
    let f = dev.get_or_load_custom_func("rms_apply", MODULE, PTX)?;
    let mut b = f.builder();
    b.arg(&xp).arg(&sp).arg(&wp).arg(&hp).arg(&ki).arg(&eps);
    go(
        &mut b,
        cfg(((k / 8).div_ceil(128) as u32, m as u32, 1), 128),
        "rms_apply",
    )?;
    Ok(h)
}

/// The store kernel as a named variant (`rows`, `mma`), for the bench.
pub fn gemv_variant(x: &Tensor, w: &Tensor, variant: &str) -> Result<Tensor> {
    let n = w.dims2()?.0;
    Ok(launch(Launch {
        x,
        w,
        n,
        epi: Epi::Store,
        norm: None,
        resid: None,
        variant: Some(variant),
        prefetch: None,
    })?
    .0)
}

/// `x @ wᵀ` through [`gemv`] for a single row (up to `max_rows`; measured on the H200 the
/// one-row kernel beats cuBLAS on an LM head, cuBLAS wins from 2 rows up), cuBLAS otherwise.
pub fn project(x: &Tensor, w: &Tensor, max_rows: usize) -> Result<Tensor> {
    let (m, k) = x.dims2()?;
    let n = w.dims2()?.0;
    let fits = m == 1
        && m <= max_rows
        && k % 256 == 0
        && n % 16 == 0
        && x.dtype() == DType::BF16
        && w.dtype() == DType::BF16
        && x.is_contiguous()
        && w.is_contiguous()
        && ptr(x)? % 16 == 0
        && ptr(w)? % 16 == 0;
    if fits {
        gemv(x, w, None)
    } else {
        super::kernels::linear(x, w)
    }
}
