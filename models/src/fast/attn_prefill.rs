//! Launch wrapper of attn_prefill.cu: causal attention of many new tokens (prefill pieces) in
//! one pass over the keys, K/V tiles shared by every q-head of a KV head through shared memory,
//! output written directly (no split partials, no combine launch).

use candle_core::cuda_backend::cudarc::driver::sys::CUfunction_attribute_enum;
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::{bail, DType, Result, Tensor};

use super::cuda::{alloc_bf16, check_bf16, cuda, go, ptr};

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/attn_prefill.ptx"));
const MODULE: &str = "dflash_attn_prefill";

/// Kernel name, warps per block (16 query rows each), bf16 per shared K/V/Q row and keys per
/// tile (PPAD and PCH in attn_prefill.cu).
const KERNEL: &str = "attn_prefill";
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

/// Causal attention of q `[t, nh, d]` (d = 128) over cache rows `[0, cache_len[0] + t)` of
/// `kc`, `vc` (`[nkv, cap, d]`): committed rows are visible to every token, new token j to
/// token i when `j <= i`. Returns `[t, nh * d]` bf16.
pub fn attention_prefill(
    q: &Tensor,
    kc: &Tensor,
    vc: &Tensor,
    cache_len: &Tensor,
) -> Result<Tensor> {
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
    let f = dev.get_or_load_custom_func(KERNEL, MODULE, PTX)?;
    // K and V tiles and the block's Q rows: over the 48 KB static limit, so the function must be
    // allowed that much dynamic shared memory (a per-function setting, cheap to repeat).
    let smem = (2 * PCH + 16 * WARPS) * PPAD * 2;
    f.set_attribute(
        CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        smem as i32,
    )
    .map_err(|e| candle_core::Error::Msg(format!("{KERNEL}: shared memory {smem} B: {e}")))?;
    let mut b = f.builder();
    for a in &args {
        b.arg(a);
    }
    b.arg(&ti).arg(&nhi).arg(&nkvi).arg(&capi).arg(&scale);
    let tiles = (t * (nh / nkv)).div_ceil(16 * WARPS);
    let cfg = LaunchConfig {
        grid_dim: (nkv as u32, tiles as u32, 1),
        block_dim: ((32 * WARPS) as u32, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    go(&mut b, cfg, KERNEL)?;
    Ok(out)
}
