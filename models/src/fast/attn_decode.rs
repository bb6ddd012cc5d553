//! Launch wrapper of attn_decode.cu: a layer's whole attention for forwards of few rows in
//! one kernel — q/k norm + RoPE from the raw qkv GEMM output, the new K/V into the cache,
//! split-K attention and the merge of the splits — instead of `qk_norm_rope_cache` followed
//! by [`super::attention`] (three launches). Same results up to the f32 summation order of the
//! attention partials (the q/k rows themselves are bit-identical).

use candle_core::cuda_backend::cudarc::driver::sys::CUfunction_attribute_enum;
use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig, PushKernelArg};
use candle_core::{bail, DType, Result, Tensor};

use super::cuda::{alloc_bf16, alloc_f32, check_bf16, cuda, go, ptr, CHUNK};

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/attn_decode.ptx"));
const MODULE: &str = "dflash_attn_decode";

/// Most new tokens of one sequence the fused kernel takes; longer forwards (prefill pieces,
/// wide trees) take `qk_norm_rope_cache` + [`super::attention`].
pub const FUSED_ATTN_MAX_TOKENS: usize = 64;

/// Bytes per shared K/V/q row (KPAD bf16 in attn_decode.cu).
const ROW_BYTES: usize = 136 * 2;

/// The kernel's parameter block (`Args` in attn_decode.cu, same field order).
#[repr(C)]
struct Args {
    qkv: u64,
    qw: u64,
    kw: u64,
    cos: u64,
    sin: u64,
    positions: u64,
    cache_len: u64,
    kc: u64,
    vc: u64,
    tree_mask: u64,
    acc: u64,
    ml: u64,
    counter: u64,
    out: u64,
    words: i32,
    t: i32,
    nh: i32,
    nkv: i32,
    cap: i32,
    cps: i32,
    scale: f32,
    eps: f32,
}

// SAFETY: plain old data with the C layout the kernel declares.
unsafe impl DeviceRepr for Args {}

/// Attention of the `t` rows of `qkv` (`[t, (nh + 2 nkv) d]`, the raw GEMM output) over the
/// cache `kc`/`vc` (`[nkv, cap, d]`): q/k RMSNorm (`q_norm`, `k_norm`) and RoPE (f32 tables
/// `[max_pos, d/2]` at `positions`) as `qk_norm_rope_cache` rounds them, the new K/V written at
/// cache rows `cache_len[0] ..`, committed rows visible to every token and new token j visible
/// to token i when `j <= i` (`tree` None) or bit j of `tree[i * words + j / 64]` is set.
/// `split`: as for [`super::attention`] (see [`super::split_plan`]). Returns `[t, nh * d]`.
#[allow(clippy::too_many_arguments)]
pub fn fused_attention(
    qkv: &Tensor,
    q_norm: &Tensor,
    k_norm: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    positions: &Tensor,
    cache_len: &Tensor,
    kc: &Tensor,
    vc: &Tensor,
    (nh, nkv, d): (usize, usize, usize),
    eps: f64,
    tree: Option<&Tensor>,
    (nsplit, cps): (usize, usize),
) -> Result<Tensor> {
    let dev = cuda(qkv)?;
    check_bf16("qkv", qkv)?;
    check_bf16("q_norm", q_norm)?;
    check_bf16("k_norm", k_norm)?;
    check_bf16("k cache", kc)?;
    check_bf16("v cache", vc)?;
    let (t, w) = qkv.dims2()?;
    let (kv_heads, cap, hd) = kc.dims3()?;
    if w != (nh + 2 * nkv) * d || kv_heads != nkv || hd != d || d != 128 || nh % nkv != 0 {
        bail!(
            "fused_attention: qkv {w} wide, cache {:?}, heads {nh}/{nkv}, d {d} (needs 128)",
            kc.shape()
        )
    }
    if t == 0 || t > FUSED_ATTN_MAX_TOKENS {
        bail!("fused_attention: {t} tokens, takes 1 to {FUSED_ATTN_MAX_TOKENS}")
    }
    if vc.dims3()? != (nkv, cap, d) || q_norm.dims1()? != d || k_norm.dims1()? != d {
        bail!("fused_attention: v cache {:?} or norm weights differ", vc.shape())
    }
    if positions.dims1()? != t || positions.dtype() != DType::U32 {
        bail!("fused_attention: positions must be u32 [{t}]")
    }
    if cos.dtype() != DType::F32 || sin.dtype() != DType::F32 || cos.dim(1)? != d / 2 {
        bail!("fused_attention: RoPE tables must be f32 [max_pos, {}]", d / 2)
    }
    if nsplit == 0 || cps == 0 {
        bail!("fused_attention: split plan ({nsplit}, {cps}) is empty")
    }
    let words = t.div_ceil(64);
    let tree_mask = match tree {
        Some(m) => {
            if m.dims2()? != (t, words) || m.dtype() != DType::I64 {
                bail!(
                    "fused_attention: tree mask must be i64 [{t}, {words}], got {:?}",
                    m.shape()
                )
            }
            ptr(m)?
        }
        None => 0u64,
    };
    let rows = t * (nh / nkv);
    // Row tiles of 16 per block: 1, 2 or 4 (the kernel's RT), the rest over grid.z.
    let rt = match rows {
        0..=16 => 1,
        17..=32 => 2,
        _ => 4,
    };
    let tiles = rows.div_ceil(16 * rt);
    // Few splits of several chunks each: the last block reads every split's partial of its
    // rows, so their number bounds the merge's tail (a block streams its chunks double
    // buffered). The plan's coverage of the keys is kept.
    let max_splits = match rt {
        1 => 32,
        2 => 16,
        _ => 8,
    };
    let per = nsplit.div_ceil(max_splits);
    let (nsplit, cps) = ((nsplit * cps).div_ceil(cps * per), cps * per);
    let stages = if cps > 1 { 2 } else { 1 };
    let smem = stages * 2 * CHUNK * ROW_BYTES + 16 * rt * ROW_BYTES;
    let acc = alloc_f32(&dev, nsplit * t * nh * d)?;
    let ml = alloc_f32(&dev, nsplit * t * nh * 2)?;
    let out = alloc_bf16(&dev, (t, nh * d))?;
    // The last block of each (KV head, row tile) re-arms its counter.
    let counter = Tensor::zeros(nkv * tiles, DType::U32, qkv.device())?;
    let args = Args {
        qkv: ptr(qkv)?,
        qw: ptr(q_norm)?,
        kw: ptr(k_norm)?,
        cos: ptr(cos)?,
        sin: ptr(sin)?,
        positions: ptr(positions)?,
        cache_len: ptr(cache_len)?,
        kc: ptr(kc)?,
        vc: ptr(vc)?,
        tree_mask,
        acc: ptr(&acc)?,
        ml: ptr(&ml)?,
        counter: ptr(&counter)?,
        out: ptr(&out)?,
        words: words as i32,
        t: t as i32,
        nh: nh as i32,
        nkv: nkv as i32,
        cap: cap as i32,
        cps: cps as i32,
        scale: 1.0 / (d as f32).sqrt(),
        eps: eps as f32,
    };
    let name = format!("attn_decode_rt{rt}");
    let f = dev.get_or_load_custom_func(&name, MODULE, PTX)?;
    f.set_attribute(
        CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        smem as i32,
    )
    .map_err(|e| candle_core::Error::Msg(format!("{name}: shared memory {smem}: {e}")))?;
    let mut b = f.builder();
    b.arg(&args);
    let cfg = LaunchConfig {
        grid_dim: (nkv as u32, nsplit as u32, tiles as u32),
        block_dim: (128, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    go(&mut b, cfg, &name)?;
    // acc/ml/counter are freed stream-ordered after the kernel.
    drop((acc, ml, counter));
    Ok(out)
}
