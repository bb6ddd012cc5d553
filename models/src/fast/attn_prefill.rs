//! Launch wrapper of attn_prefill.cu: causal attention of many new tokens (prefill pieces) in
//! one pass over the keys, K/V tiles shared by every q-head of a KV head through shared memory,
//! output written directly (no split partials, no combine launch).

use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
use candle_core::{bail, DType, Result, Tensor};

use super::cuda::{alloc_bf16, cfg, check_bf16, cuda, go, ptr};

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/attn_prefill.ptx"));
const MODULE: &str = "dflash_attn_prefill";

/// Kernel variants `(name, warps per block)`; the first is the one [`attention_prefill`] runs.
pub const VARIANTS: [(&str, usize); 3] = [
    ("attn_prefill_w4", 4),
    ("attn_prefill_w4_occ3", 4),
    ("attn_prefill_w8", 8),
];

/// Fewest blocks (query tiles x KV heads) for which the one-pass kernel beats the split-K path:
/// below this the split path's parallelism over the keys wins (few new tokens over a long
/// cache, e.g. verifies).
pub const MIN_BLOCKS: usize = 256;

/// Whether a causal forward of `t` new tokens should take [`attention_prefill`].
pub fn worth_it(t: usize, nh: usize, nkv: usize) -> bool {
    let rows = t * (nh / nkv.max(1));
    rows.div_ceil(16 * VARIANTS[0].1) * nkv >= MIN_BLOCKS
}

/// Causal attention of q `[t, nh, d]` (d = 128) over cache rows `[0, cache_len[0] + t)` of
/// `kc`, `vc` (`[nkv, cap, d]`): committed rows are visible to every token, new token j to
/// token i when `j <= i`. Returns `[t, nh * d]` bf16.
pub fn attention_prefill(
    q: &Tensor,
    kc: &Tensor,
    vc: &Tensor,
    cache_len: &Tensor,
) -> Result<Tensor> {
    attention_prefill_variant(VARIANTS[0].0, q, kc, vc, cache_len)
}

/// [`attention_prefill`] through one of [`VARIANTS`] (for the timings in `check`).
pub fn attention_prefill_variant(
    name: &str,
    q: &Tensor,
    kc: &Tensor,
    vc: &Tensor,
    cache_len: &Tensor,
) -> Result<Tensor> {
    let Some(&(_, warps)) = VARIANTS.iter().find(|(n, _)| *n == name) else {
        bail!("attention_prefill: unknown variant {name}")
    };
    let dev = cuda(q)?;
    check_bf16("q", q)?;
    check_bf16("k cache", kc)?;
    check_bf16("v cache", vc)?;
    let (t, nh, d) = q.dims3()?;
    let (nkv, cap, kd) = kc.dims3()?;
    if d != 128 || kd != d || vc.dims3()? != (nkv, cap, d) || nkv == 0 || nh % nkv != 0 {
        bail!(
            "attention_prefill: q {:?}, caches {:?} / {:?} (head_dim 128, heads a multiple of kv heads)",
            q.shape(),
            kc.shape(),
            vc.shape()
        )
    }
    if cache_len.dtype() != DType::U32 || cache_len.elem_count() != 1 {
        bail!("attention_prefill: cache_len must be one u32")
    }
    let out = alloc_bf16(&dev, (t, nh * d))?;
    if t == 0 {
        return Ok(out);
    }
    let args = [ptr(q)?, ptr(kc)?, ptr(vc)?, ptr(cache_len)?, ptr(&out)?];
    let (ti, nhi, nkvi, capi) = (t as i32, nh as i32, nkv as i32, cap as i32);
    let scale = 1.0f32 / (d as f32).sqrt();
    let f = dev.get_or_load_custom_func(name, MODULE, PTX)?;
    let mut b = f.builder();
    for a in &args {
        b.arg(a);
    }
    b.arg(&ti).arg(&nhi).arg(&nkvi).arg(&capi).arg(&scale);
    let tiles = (t * (nh / nkv)).div_ceil(16 * warps);
    go(
        &mut b,
        cfg((nkv as u32, tiles as u32, 1), (32 * warps) as u32),
        name,
    )?;
    Ok(out)
}
