//! Launch wrappers of kernels.cu: candle tensors in, candle tensors out, raw device pointers
//! in between. Every input must be contiguous on the CUDA device; shapes are checked here
//! because the kernels trust them.

use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
use candle_core::{bail, DType, Result, Tensor};

use super::launch::{alloc_bf16, alloc_f32, cfg, check_bf16, cuda, go, opt_ptr, page_stride, ptr};

pub(super) const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/fast.ptx"));
pub(super) const MODULE: &str = "dflash_fast";
/// Keys per attention split (CH in kernels.cu).
pub const CHUNK: usize = 64;
/// Query rows per attention block (ROWS in kernels.cu).
const ROWS: usize = 16;

/// One forward's q/k/v GEMM output `qkv` (`[t, (nh + 2 nkv) d]`) with what its per-head q/k
/// RMSNorm, RoPE and cache write read: the norm weights, the f32 RoPE tables
/// (`[max_pos, d/2]`) and the positions (u32 `[t]`), the committed length (u32 `[1]`) and the
/// cache buffers `kc`, `vc` (`[nkv, cap, d]`) the new K/V go into at rows `cache_len[0] ..`
/// (through the page table `pages`, u32 `[1, n]`, when the buffers are a shared pool's). The
/// one-launch attention ([`super::fused_attention`]) also takes a batch: `seqs` sequences of
/// `t / seqs` rows each, `cache_len` u32 `[seqs]` and `pages` `[seqs, n]`.
#[derive(Clone, Copy)]
pub struct QkvRows<'a> {
    pub qkv: &'a Tensor,
    pub q_norm: &'a Tensor,
    pub k_norm: &'a Tensor,
    pub cos: &'a Tensor,
    pub sin: &'a Tensor,
    pub positions: &'a Tensor,
    pub cache_len: &'a Tensor,
    pub kc: &'a Tensor,
    pub vc: &'a Tensor,
    /// Page tables of the sequences (None: one sequence whose rows are in order).
    pub pages: Option<&'a Tensor>,
    /// (q heads, KV heads, head dim).
    pub heads: (usize, usize, usize),
    pub eps: f64,
}

impl QkvRows<'_> {
    /// The shapes and dtypes the kernels trust, checked for `who`: `(new tokens, cache rows)`.
    /// `with_q`: the rows hold the q heads before K and V (otherwise K and V only).
    pub(super) fn check(&self, who: &str, with_q: bool) -> Result<(usize, usize)> {
        let (nh, nkv, d) = self.heads;
        let nq = if with_q { nh } else { 0 };
        for (name, t) in [
            ("qkv", self.qkv),
            ("q_norm", self.q_norm),
            ("k_norm", self.k_norm),
            ("k cache", self.kc),
            ("v cache", self.vc),
        ] {
            check_bf16(name, t)?;
        }
        let (t, w) = self.qkv.dims2()?;
        let (kv_heads, cap, hd) = self.kc.dims3()?;
        if w != (nq + 2 * nkv) * d || kv_heads != nkv || hd != d || d != 128 {
            bail!(
                "{who}: qkv {w} wide ({nq} q heads), cache {:?}, heads {nh}/{nkv}, d {d} (needs 128)",
                self.kc.shape()
            )
        }
        if self.vc.dims3()? != (nkv, cap, d)
            || self.q_norm.dims1()? != d
            || self.k_norm.dims1()? != d
        {
            bail!(
                "{who}: v cache {:?} or norm weights differ",
                self.vc.shape()
            )
        }
        if self.positions.dims1()? != t || self.positions.dtype() != DType::U32 {
            bail!("{who}: positions must be u32 [{t}]")
        }
        if self.cos.dtype() != DType::F32
            || self.sin.dtype() != DType::F32
            || self.cos.dim(1)? != d / 2
        {
            bail!("{who}: RoPE tables must be f32 [max_pos, {}]", d / 2)
        }
        let seqs = self.seqs();
        if self.cache_len.dtype() != DType::U32 || seqs == 0 || t % seqs != 0 {
            bail!(
                "{who}: cache_len must be u32 [sequences] dividing the {t} rows, got {:?}",
                self.cache_len.shape()
            )
        }
        page_stride(self.pages, seqs, who)?;
        Ok((t, cap))
    }

    /// Sequences in the batch (one committed length each).
    pub(super) fn seqs(&self) -> usize {
        self.cache_len.elem_count()
    }
}

/// Per-head q/k RMSNorm + RoPE of `rows.qkv`, K/V written into the cache buffers; returns q
/// `[t, nh, d]`.
pub fn qk_norm_rope_cache(rows: &QkvRows<'_>) -> Result<Tensor> {
    match norm_rope_cache(rows, true)? {
        Some(q) => Ok(q),
        None => bail!("qk_norm_rope_cache: no q rows"),
    }
}

/// [`qk_norm_rope_cache`] for rows that only provide K/V (the drafter's context rows):
/// `rows.qkv` holds the K and V heads alone (`[t, 2 nkv d]`, the K/V rows of the fused q/k/v
/// weight), which go into the cache; `q_norm` is not read.
pub fn kv_norm_rope_cache(rows: &QkvRows<'_>) -> Result<()> {
    norm_rope_cache(rows, false).map(|_| ())
}

/// The launch of both: `with_q`, the rows hold the q heads first and q comes back.
fn norm_rope_cache(rows: &QkvRows<'_>, with_q: bool) -> Result<Option<Tensor>> {
    let QkvRows {
        qkv,
        q_norm,
        k_norm,
        cos,
        sin,
        positions,
        cache_len,
        kc,
        vc,
        pages,
        heads: (nh, nkv, d),
        eps,
    } = *rows;
    let name = if with_q {
        "qk_norm_rope_cache"
    } else {
        "kv_norm_rope_cache"
    };
    let (t, cap) = rows.check(name, with_q)?;
    let seqs = rows.seqs();
    let pt_stride = page_stride(pages, seqs, name)? as i32;
    let t_per = (t / seqs) as i32;
    let dev = cuda(qkv)?;
    let q = with_q.then(|| alloc_bf16(&dev, (t, nh, d))).transpose()?;
    // Kernel parameters in order (kernels.cu): the q pointers only for rows with q heads.
    let mut args = vec![ptr(qkv)?];
    if with_q {
        args.push(ptr(q_norm)?);
    }
    for x in [k_norm, cos, sin, positions, cache_len] {
        args.push(ptr(x)?);
    }
    args.push(opt_ptr(pages)?);
    for x in [kc, vc] {
        args.push(ptr(x)?);
    }
    if let Some(q) = &q {
        args.push(ptr(q)?);
    }
    let heads = if with_q { nh + 2 * nkv } else { 2 * nkv };
    let (nh, nkv, d, cap, eps) = (nh as i32, nkv as i32, d as i32, cap as i32, eps as f32);
    let f = dev.get_or_load_custom_func(name, MODULE, PTX)?;
    let mut b = f.builder();
    for a in &args {
        b.arg(a);
    }
    b.arg(&nh).arg(&nkv).arg(&d).arg(&cap).arg(&eps);
    b.arg(&t_per).arg(&pt_stride);
    go(&mut b, cfg((heads as u32, t as u32, 1), d as u32), name)?;
    Ok(q)
}

/// Attention of q `[t, nh, d]` over cache rows `[0, cache_len[0] + t)` (placed by the page
/// table `pages`, u32 `[1, n]`, or in order when None): committed rows are
/// visible to every token; new token j is visible to token i when `j <= i` (`tree_mask` None)
/// or when bit j of `tree_mask[i * words + j / 64]` is set (`[t, words]` i64 bit rows).
/// Returns `[t, nh * d]`. Causal forwards with enough query rows (prefill pieces) take the
/// one-pass kernel of `attn_prefill.cu`; the rest the split-K path of [`attention_split`].
/// A batch (`cache_len` u32 `[seqs]`, `pages` `[seqs, n]`) attends `t / seqs` rows of each
/// sequence in the same launches, sequence s owning rows `[s t / seqs, (s + 1) t / seqs)`.
pub fn attention(
    q: &Tensor,
    kc: &Tensor,
    vc: &Tensor,
    pages: Option<&Tensor>,
    cache_len: &Tensor,
    tree_mask: Option<&Tensor>,
) -> Result<Tensor> {
    attention_for_context(q, kc, vc, pages, cache_len, tree_mask, 0)
}

/// [`attention`] knowing on the host that no sequence has more than `committed` committed
/// rows (0: unknown): a causal piece over a long context then takes the split-K path even
/// with enough query tiles for the one-pass kernel, whose few blocks would each walk every
/// key (see [`super::attn_prefill::one_pass_wins`]). The context only decides for pieces
/// of at least 128 one-pass blocks (256 tokens of Qwen3-8B), longer than any CUDA graph
/// step ([`super::graphs::GRAPH_MAX_TOKENS`]), so a graph and an eager forward of one step
/// always take the same kernel.
pub fn attention_for_context(
    q: &Tensor,
    kc: &Tensor,
    vc: &Tensor,
    pages: Option<&Tensor>,
    cache_len: &Tensor,
    tree_mask: Option<&Tensor>,
    committed: usize,
) -> Result<Tensor> {
    let (t, nh, _) = q.dims3()?;
    let nkv = kc.dims3()?.0;
    let seqs = cache_len.elem_count().max(1);
    if tree_mask.is_none()
        && super::attn_prefill::one_pass_wins(t / seqs, nh, nkv * seqs, committed)
    {
        return super::attn_prefill::attention_prefill(q, kc, vc, pages, cache_len);
    }
    attention_split(q, kc, vc, pages, cache_len, tree_mask, None)
}

/// Blocks the split-K attention aims at: at most `SPLIT_BLOCKS / (query tiles x KV heads)`
/// splits of 64-row blocks. Measured on the H200 (Qwen3-8B heads, one layer in a graph,
/// `attention_us_*`): 16 tokens over 1K, one chunk per split (136 blocks) 15.8 us against 17.5
/// with two; 64 tokens over 1K 34.5 us with one chunk per split (544 blocks), 25.3 with two;
/// over 8K, 16 tokens 81 -> 35 us and 64 tokens 178 -> 94 us with four.
pub const SPLIT_BLOCKS: usize = 512;

/// [`attention`] always on the split-K path: `attn_split_flash` partials (64 query rows per
/// block, K/V tiles shared by its four warps, see attn_prefill.cu) + `attn_combine`. The grid
/// holds `max_splits` splits (default: [`SPLIT_BLOCKS`] over the blocks of one split); the
/// kernels divide the live keys among them at run time (`ceil(chunks / max_splits)` chunks of
/// [`CHUNK`] keys per split), so one launch, or one CUDA graph, is right for any cache length
/// and an eager forward and its replay add the same partials in the same order.
pub(super) fn attention_split(
    q: &Tensor,
    kc: &Tensor,
    vc: &Tensor,
    pages: Option<&Tensor>,
    cache_len: &Tensor,
    tree_mask: Option<&Tensor>,
    max_splits: Option<usize>,
) -> Result<Tensor> {
    attention_split_with(q, kc, vc, pages, cache_len, tree_mask, max_splits, 4)
}

/// [`attention_split`] from blocks of `warps` warps (4 or 8; 16 query rows each), so that
/// each staged K/V tile serves `16 warps` rows. 8 warps are a measured variant only
/// (`check_scale`): on the H200 they won 1-9% for 128-512-token pieces past 16K committed
/// rows and lost up to 1.8x at 1K-8K, too little to be worth a context-dependent choice.
#[allow(clippy::too_many_arguments)]
pub(super) fn attention_split_with(
    q: &Tensor,
    kc: &Tensor,
    vc: &Tensor,
    pages: Option<&Tensor>,
    cache_len: &Tensor,
    tree_mask: Option<&Tensor>,
    max_splits: Option<usize>,
    warps: usize,
) -> Result<Tensor> {
    let (t, nh, _) = q.dims3()?;
    let nkv = kc.dims3()?.0.max(1);
    let seqs = cache_len.elem_count().max(1);
    let tiles = ((t / seqs) * (nh / nkv)).div_ceil(16 * warps).max(1);
    let splits = max_splits
        .unwrap_or(SPLIT_BLOCKS / (tiles * nkv * seqs))
        .clamp(1, COMBINE_SPLITS);
    let kernel = if warps == 8 {
        SplitKernel::Flash8
    } else {
        SplitKernel::Flash
    };
    attention_with(kernel, q, kc, vc, pages, cache_len, tree_mask, splits, 0)
}

/// Splits `attn_combine` stages in shared memory (COMBINE_SMEM in kernels.cu).
const COMBINE_SPLITS: usize = 1024;

/// Which kernel computes the split partials that `attn_combine` merges.
#[derive(Clone, Copy, PartialEq, Eq)]
enum SplitKernel {
    CudaCores,
    Flash,
    Flash8,
}

/// [`attention`] on CUDA cores (the first version, 4 query rows per warp), kept to check the
/// tensor-core kernel against.
pub fn attention_simt(
    q: &Tensor,
    kc: &Tensor,
    vc: &Tensor,
    pages: Option<&Tensor>,
    cache_len: &Tensor,
    tree_mask: Option<&Tensor>,
    nsplit: usize,
) -> Result<Tensor> {
    attention_with(
        SplitKernel::CudaCores,
        q,
        kc,
        vc,
        pages,
        cache_len,
        tree_mask,
        nsplit,
        1,
    )
}

#[allow(clippy::too_many_arguments)]
fn attention_with(
    kernel: SplitKernel,
    q: &Tensor,
    kc: &Tensor,
    vc: &Tensor,
    pages: Option<&Tensor>,
    cache_len: &Tensor,
    tree_mask: Option<&Tensor>,
    nsplit: usize,
    cps: usize,
) -> Result<Tensor> {
    let dev = cuda(q)?;
    let seqs = cache_len.elem_count();
    let pt_stride = page_stride(pages, seqs, "attention")?;
    let pt = opt_ptr(pages)?;
    check_bf16("q", q)?;
    let (total, nh, d) = q.dims3()?;
    let (nkv, cap, _) = kc.dims3()?;
    if d != 128 || nh % nkv != 0 || cache_len.dtype() != DType::U32 || total % seqs != 0 {
        bail!("attention: head_dim {d} (needs 128), heads {nh}/{nkv}, {total} rows over {seqs} u32 cache lengths")
    }
    if kernel == SplitKernel::CudaCores && seqs != 1 {
        bail!("attention_simt: one sequence per launch")
    }
    let t = total / seqs;
    let words = t.div_ceil(64);
    let mask_ptr = match tree_mask {
        Some(m) => {
            if m.dims2()? != (total, words) || m.dtype() != DType::I64 {
                bail!(
                    "attention: tree mask must be i64 [{total}, {words}], got {:?}",
                    m.shape()
                )
            }
            ptr(m)?
        }
        None => 0u64,
    };
    let rows = t * (nh / nkv);
    let acc = alloc_f32(&dev, seqs * nsplit * t * nh * d)?;
    let ml = alloc_f32(&dev, seqs * nsplit * t * nh * 2)?;
    let out = alloc_bf16(&dev, (total, nh * d))?;
    let args = [ptr(q)?, ptr(kc)?, ptr(vc)?, ptr(cache_len)?, mask_ptr];
    let (acc_p, ml_p, out_p) = (ptr(&acc)?, ptr(&ml)?, ptr(&out)?);
    let (words, ti, nhi, nkvi, capi) = (words as i32, t as i32, nh as i32, nkv as i32, cap as i32);
    let scale = 1.0f32 / (d as f32).sqrt();
    // cps 0: the flash kernel and the combine derive it from the live length.
    let cpsi = cps as i32;
    if kernel != SplitKernel::CudaCores {
        let a = super::attn_prefill::SplitArgs {
            q: args[0],
            kc: args[1],
            vc: args[2],
            cache_len: args[3],
            pt,
            tree_mask: mask_ptr,
            words,
            acc: acc_p,
            ml: ml_p,
            shape: (ti, nhi, nkvi, capi),
            scale,
            nsplit,
            seqs,
            pt_stride: pt_stride as i32,
            warps: if kernel == SplitKernel::Flash8 { 8 } else { 4 },
        };
        super::attn_prefill::launch_split(&dev, &a, rows)?;
    } else {
        // CUDA cores: four warps per ROWS query rows.
        let name = "attn_partial";
        let f = dev.get_or_load_custom_func(name, MODULE, PTX)?;
        let mut b = f.builder();
        for a in &args[..4] {
            b.arg(a);
        }
        b.arg(&pt).arg(&args[4]);
        b.arg(&words).arg(&acc_p).arg(&ml_p);
        b.arg(&ti).arg(&nhi).arg(&nkvi).arg(&capi).arg(&scale);
        let grid = (nkv as u32, nsplit as u32, rows.div_ceil(ROWS) as u32);
        go(&mut b, cfg(grid, 128), name)?;
    }
    let (di, ns) = (d as i32, nsplit as i32);
    let len_p = args[3];
    let f = dev.get_or_load_custom_func("attn_combine", MODULE, PTX)?;
    let mut b = f.builder();
    b.arg(&acc_p).arg(&ml_p).arg(&len_p).arg(&out_p);
    b.arg(&ti).arg(&nhi).arg(&di).arg(&ns).arg(&cpsi);
    go(
        &mut b,
        cfg(((seqs * t * nh) as u32, 1, 1), d as u32),
        "attn_combine",
    )?;
    // acc/ml are freed stream-ordered after the combine kernel.
    drop((acc, ml));
    Ok(out)
}

/// `silu(gu[:, :i]) * gu[:, i:]` for `gu: [rows, 2i]`.
pub fn silu_mul(gu: &Tensor) -> Result<Tensor> {
    let dev = cuda(gu)?;
    check_bf16("gate_up", gu)?;
    let (rows, w) = gu.dims2()?;
    let inter = w / 2;
    let out = alloc_bf16(&dev, (rows, inter))?;
    let (a, o) = (ptr(gu)?, ptr(&out)?);
    let (r, i) = (rows as i32, inter as i32);
    let blocks = (rows * inter).div_ceil(256).min(4096) as u32;
    let f = dev.get_or_load_custom_func("silu_mul", MODULE, PTX)?;
    let mut b = f.builder();
    b.arg(&a).arg(&o).arg(&r).arg(&i);
    go(&mut b, cfg((blocks, 1, 1), 256), "silu_mul")?;
    Ok(out)
}

/// `(x + delta, rmsnorm(x + delta) * w)`, the sum rounded to bf16 first as the plain path does.
pub fn add_rmsnorm(x: &Tensor, delta: &Tensor, w: &Tensor, eps: f64) -> Result<(Tensor, Tensor)> {
    let dev = cuda(x)?;
    check_bf16("x", x)?;
    check_bf16("delta", delta)?;
    let (rows, hidden) = x.dims2()?;
    if delta.dims2()? != (rows, hidden) || w.dims1()? != hidden {
        bail!(
            "add_rmsnorm: shapes {:?} {:?} {:?}",
            x.shape(),
            delta.shape(),
            w.shape()
        )
    }
    let xo = alloc_bf16(&dev, (rows, hidden))?;
    let ho = alloc_bf16(&dev, (rows, hidden))?;
    let args = [ptr(x)?, ptr(delta)?, ptr(w)?, ptr(&xo)?, ptr(&ho)?];
    let (hi, e) = (hidden as i32, eps as f32);
    // The vector kernel holds up to ADD_VEC (4) 16-byte pieces per thread of 256.
    let vec = hidden % 8 == 0 && hidden <= 256 * 8 * 4 && args.iter().all(|p| p % 16 == 0);
    let name = if vec {
        "add_rmsnorm_vec"
    } else {
        "add_rmsnorm"
    };
    let f = dev.get_or_load_custom_func(name, MODULE, PTX)?;
    let mut b = f.builder();
    for a in &args {
        b.arg(a);
    }
    b.arg(&hi).arg(&e);
    go(&mut b, cfg((rows as u32, 1, 1), 256), name)?;
    Ok((xo, ho))
}

/// `x @ wᵀ` for `x: [m, k]`, `w: [n, k]`: cuBLAS, for products wider than the skinny
/// kernels of [`super::gemv`] take (prefill chunks, wide trees).
pub fn linear(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    x.matmul(&w.t()?)
}

/// How to split `live_keys` keys for `t` query tokens: `(splits, chunks per split)`. Few query
/// rows (decode, small verifies) get one chunk per split, for parallelism over the keys; many
/// rows (prefill chunks, wide trees) walk several chunks per split, so the f32 partials the
/// combine step reads stay small.
pub fn split_plan(live_keys: usize, t: usize, nh: usize, nkv: usize) -> (usize, usize) {
    let chunks = live_keys.div_ceil(CHUNK).max(1);
    let tiles = (t * (nh / nkv.max(1))).div_ceil(16);
    let want = (2048 / (tiles * nkv).max(1)).max(1);
    if want >= chunks {
        (chunks, 1)
    } else {
        let cps = chunks.div_ceil(want);
        (chunks.div_ceil(cps), cps)
    }
}
