//! Launch wrappers of attn_prefill.cu: attention in blocks of 64 query rows whose four warps
//! share every K/V tile they stage in shared memory. Causal prefill pieces take one pass over
//! the keys with the output written directly (no split partials, no combine launch); verify
//! forwards and draft blocks (a few dozen rows over a long cache, causal or tree) split the
//! keys over many blocks and leave partials for `attn_combine` (see `cuda::attention_split`).

use candle_core::cuda_backend::cudarc::driver::{CudaFunction, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::CudaDevice;
use candle_core::{bail, DType, Result, Tensor};

use super::launch::{
    alloc_bf16, check_bf16, cuda, function_with_smem, go, opt_ptr, page_stride, ptr,
};

pub(super) const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/attn_prefill.ptx"));
pub(super) const MODULE: &str = "dflash_attn_prefill";

/// Kernel name, warps per block (16 query rows each), bf16 per shared K/V/Q row and keys per
/// tile (PPAD and PCH in attn_prefill.cu).
const KERNEL: &str = "attn_prefill";
const SPLIT_KERNEL: &str = "attn_split_flash";
const SPLIT_KERNEL_8: &str = "attn_split_flash8";
const WARPS: usize = 4;
const PPAD: usize = 136;
const PCH: usize = 64;

/// Fewest blocks (query tiles x KV heads) for which the one-pass kernel beats the split-K path.
/// Measured on the H200 (Qwen3-8B heads, `check::attention_timings`): 128 new tokens over 4096
/// cached ones (64 blocks) ran 0.204 ms against 0.194 ms split; 256 over 4096 (128 blocks)
/// 0.212 against 0.346 ms; every wider or shorter-context case favoured it by 1.5-3.5x.
pub const MIN_BLOCKS: usize = 128;

/// Whether a causal forward of `t` new tokens should take [`attention_prefill`].
pub fn worth_it(t: usize, nh: usize, nkv: usize) -> bool {
    let rows = t * (nh / nkv.max(1));
    rows.div_ceil(16 * WARPS) * nkv >= MIN_BLOCKS
}

/// Committed rows from which a piece whose one-pass grid is short of [`ONE_PASS_ANY_CONTEXT_BLOCKS`]
/// splits the keys instead: each one-pass block walks every key serially. Measured on the
/// H200 (Qwen3-8B heads, `check_scale::piece_attention_timings`,
/// deploy/bench/results/h200-2026-12-03-scale2): 256 tokens (128 blocks) over 8K / 16K / 32K
/// committed rows took 0.431 / 0.832 / 1.636 ms per layer one-pass against 0.360 / 0.686 /
/// 1.334 split; over 1K (and 4K, session 6) the one-pass kernel won.
pub const LONG_CONTEXT: usize = 8192;

/// One-pass blocks from which the one-pass kernel wins at any context: 512 tokens (256
/// blocks) over 8K / 16K / 32K took 0.512 / 0.975 / 1.914 ms per layer one-pass against
/// 0.707 / 1.354 / 2.675 split (same measurement).
pub const ONE_PASS_ANY_CONTEXT_BLOCKS: usize = 256;

/// [`worth_it`], also knowing the most committed rows of any sequence (0: unknown).
pub fn one_pass_wins(t: usize, nh: usize, nkv: usize, committed: usize) -> bool {
    let blocks = (t * (nh / nkv.max(1))).div_ceil(16 * WARPS) * nkv;
    worth_it(t, nh, nkv) && (committed < LONG_CONTEXT || blocks >= ONE_PASS_ANY_CONTEXT_BLOCKS)
}

/// Causal attention of q `[t, nh, d]` (d = 128) over cache rows `[0, cache_len[0] + t)` of
/// `kc`, `vc` (`[nkv, cap, d]`; rows placed by the page table `pages`, u32 `[1, n]`, or in
/// order): committed rows are visible to every token, new token j to token i when `j <= i`.
/// Returns `[t, nh * d]` bf16.
pub fn attention_prefill(
    q: &Tensor,
    kc: &Tensor,
    vc: &Tensor,
    pages: Option<&Tensor>,
    cache_len: &Tensor,
) -> Result<Tensor> {
    let dev = cuda(q)?;
    check_bf16("q", q)?;
    check_bf16("k cache", kc)?;
    check_bf16("v cache", vc)?;
    let (total, nh, d) = q.dims3()?;
    let (nkv, cap, kd) = kc.dims3()?;
    let seqs = cache_len.elem_count().max(1);
    let t = total / seqs;
    if d != 128
        || kd != d
        || vc.dims3()? != (nkv, cap, d)
        || nkv == 0
        || nh % nkv != 0
        || total % seqs != 0
    {
        bail!(
            "attention_prefill: q {:?}, caches {:?} / {:?} (head_dim 128, heads a multiple of kv heads)",
            q.shape(),
            kc.shape(),
            vc.shape()
        )
    }
    if cache_len.dtype() != DType::U32 {
        bail!("attention_prefill: cache_len must be u32, one per sequence")
    }
    let out = alloc_bf16(&dev, (total, nh * d))?;
    if t == 0 {
        return Ok(out);
    }
    let pt_stride = page_stride(pages, seqs, "attention_prefill")? as i32;
    let args = [
        ptr(q)?,
        ptr(kc)?,
        ptr(vc)?,
        ptr(cache_len)?,
        opt_ptr(pages)?,
        ptr(&out)?,
    ];
    let (ti, nhi, nkvi, capi) = (t as i32, nh as i32, nkv as i32, cap as i32);
    let scale = 1.0f32 / (d as f32).sqrt();
    let (f, cfg) = prepare(&dev, KERNEL, t * (nh / nkv), (nkv * seqs, 1))?;
    let stream = dev.cuda_stream();
    let mut b = stream.launch_builder(&f);
    for a in &args {
        b.arg(a);
    }
    b.arg(&ti)
        .arg(&nhi)
        .arg(&nkvi)
        .arg(&capi)
        .arg(&scale)
        .arg(&pt_stride);
    go(&mut b, cfg, KERNEL)?;
    Ok(out)
}

/// Device addresses and shape of one split launch (`attn_split_flash`), checked by the caller
/// (`cuda::attention_with`, which owns the partial buffers and the combine launch).
pub(super) struct SplitArgs {
    pub q: u64,
    pub kc: u64,
    pub vc: u64,
    pub cache_len: u64,
    /// The page table (0: rows in order).
    pub pt: u64,
    /// 0: causal.
    pub tree_mask: u64,
    pub words: i32,
    pub acc: u64,
    pub ml: u64,
    /// (t, nh, nkv, cap).
    pub shape: (i32, i32, i32, i32),
    pub scale: f32,
    /// The most splits (the grid's z); the kernel sets the chunks per split from the live
    /// length.
    pub nsplit: usize,
    /// Sequences of `shape.0` tokens each (the grid's x is sequence x KV head).
    pub seqs: usize,
    /// Page-table entries per sequence.
    pub pt_stride: i32,
    /// Warps per block (16 query rows each): 4 (`attn_split_flash`) or 8 (`attn_split_flash8`).
    pub warps: usize,
}

/// Launches the split partials of `rows` query rows per KV head (at most `a.nsplit` splits),
/// for `attn_combine` to merge.
pub(super) fn launch_split(dev: &CudaDevice, a: &SplitArgs, rows: usize) -> Result<()> {
    let name = match a.warps {
        4 => SPLIT_KERNEL,
        8 => SPLIT_KERNEL_8,
        w => bail!("attn_split_flash: {w} warps per block (4 or 8)"),
    };
    let (f, cfg) = prepare_warps(
        dev,
        name,
        rows,
        (a.shape.2 as usize * a.seqs, a.nsplit),
        a.warps,
    )?;
    let stream = dev.cuda_stream();
    let mut b = stream.launch_builder(&f);
    for p in [&a.q, &a.kc, &a.vc, &a.cache_len, &a.pt, &a.tree_mask] {
        b.arg(p);
    }
    b.arg(&a.words).arg(&a.acc).arg(&a.ml);
    let (t, nh, nkv, cap) = &a.shape;
    b.arg(t)
        .arg(nh)
        .arg(nkv)
        .arg(cap)
        .arg(&a.scale)
        .arg(&a.pt_stride);
    go(&mut b, cfg, name)
}

/// The function `name` of this module, its shared-memory limit raised, and its launch over
/// grid (KV heads, query tiles of `rows`, splits).
fn prepare(
    dev: &CudaDevice,
    name: &str,
    rows: usize,
    grid: (usize, usize),
) -> Result<(CudaFunction, LaunchConfig)> {
    prepare_warps(dev, name, rows, grid, WARPS)
}

/// [`prepare`] for blocks of `warps` warps.
fn prepare_warps(
    dev: &CudaDevice,
    name: &str,
    rows: usize,
    (nkv, nsplit): (usize, usize),
    warps: usize,
) -> Result<(CudaFunction, LaunchConfig)> {
    // K and V tiles and the block's Q rows: over the 48 KB static limit.
    let smem = (2 * PCH + 16 * warps) * PPAD * 2;
    let f = function_with_smem(dev, (MODULE, PTX), name, smem)?;
    let cfg = LaunchConfig {
        grid_dim: (nkv as u32, rows.div_ceil(16 * warps) as u32, nsplit as u32),
        block_dim: ((32 * warps) as u32, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    Ok((f, cfg))
}
