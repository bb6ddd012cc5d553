//! Launch wrapper of attn_varlen.cu: cache-less causal attention over the packed sequences of
//! a batch in one launch (the trainer's target forward, `Qwen3Model::forward_taps`; the
//! hybrids' gated attention over a prefill from an empty cache, head dim 256).

use candle_core::cuda_backend::cudarc::driver::sys::CUfunction_attribute_enum;
use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::{bail, Result, Tensor};

use super::launch::{alloc_bf16, check_bf16, cuda, go, ptr};

pub(super) const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/attn_varlen.ptx"));
pub(super) const MODULE: &str = "dflash_attn_varlen";

/// Whether [`attention_varlen_causal`] takes tensors of this head dim.
pub fn varlen_head_dim_supported(d: usize) -> bool {
    d == 64 || d == 128 || d == 256
}

/// Causal attention of each sequence of a packed batch over its own rows only: q `[nh, total,
/// d]`, k and v `[nkv, total, d]` (bf16, d 64, 128 or 256, the layouts the projections produce),
/// sequence `s` on rows `offsets[s]..offsets[s + 1]` (u32 `[seqs + 1]` on the device), `tiles`
/// from [`super::varlen_plan::varlen_tiles`] (u32 on the device). Returns `[total, nh * d]` bf16
/// (rows in no sequence left unwritten).
pub fn attention_varlen_causal(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    offsets: &Tensor,
    tiles: &Tensor,
) -> Result<Tensor> {
    let dev = cuda(q)?;
    check_bf16("q", q)?;
    check_bf16("k", k)?;
    check_bf16("v", v)?;
    let (nh, total, d) = q.dims3()?;
    let (nkv, kt, kd) = k.dims3()?;
    if !varlen_head_dim_supported(d)
        || kd != d
        || kt != total
        || v.dims3()? != (nkv, total, d)
        || nkv == 0
        || nh % nkv != 0
    {
        bail!(
            "attention_varlen_causal: q {:?}, k {:?}, v {:?} (head_dim 64, 128 or 256, heads a multiple of kv heads)",
            q.shape(),
            k.shape(),
            v.shape()
        )
    }
    let ntiles = tiles.elem_count() / 2;
    let out = alloc_bf16(&dev, (total, nh * d))?;
    if total == 0 || ntiles == 0 {
        return Ok(out);
    }
    if ntiles > 65535 {
        bail!("attention_varlen_causal: {ntiles} tiles exceed the grid's 65535 rows")
    }
    let name = match d {
        64 => "attn_varlen_causal_d64",
        128 => "attn_varlen_causal_d128",
        _ => "attn_varlen_causal_d256",
    };
    let f = dev
        .get_or_load_custom_func(name, MODULE, PTX)?
        .into_cuda_function();
    // K, V and Q tiles of 64 rows: 52 KB at d 128 (101 KB at 256), over the 48 KB static limit.
    let smem = 3 * 64 * (d + 8) * 2;
    f.set_attribute(
        CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        smem as i32,
    )
    .map_err(|e| candle_core::Error::Msg(format!("{name}: shared memory {smem} B: {e}")))?;
    let cfg = LaunchConfig {
        grid_dim: (nkv as u32, ntiles as u32, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    let args = [
        ptr(q)?,
        ptr(k)?,
        ptr(v)?,
        ptr(offsets)?,
        ptr(tiles)?,
        ptr(&out)?,
    ];
    let (ti, nhi, nkvi) = (total as i32, nh as i32, nkv as i32);
    let scale = 1.0f32 / (d as f32).sqrt();
    let stream = dev.cuda_stream();
    let mut b = stream.launch_builder(&f);
    for a in &args {
        b.arg(a);
    }
    b.arg(&ti).arg(&nhi).arg(&nkvi).arg(&scale);
    go(&mut b, cfg, name)?;
    Ok(out)
}
