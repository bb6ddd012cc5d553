//! Launch wrapper of gattn.cu: the hybrid's gated full attention (head dim 256, partial RoPE,
//! zero-centred q/k norms, sigmoid output gate) for one sequence's causal chain of new tokens
//! in three launches, from the stacked q|gate|k|v projection to the o_proj input. Shapes are
//! checked here because the kernels trust them.

use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
use candle_core::cuda_backend::CudaDevice;
use candle_core::{bail, DType, Result, Tensor};

use super::launch::{alloc_bf16, alloc_f32, cfg, cuda, go, ptr};

const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/gattn.ptx"));
const MODULE: &str = "dflash_gattn";

/// Head size the kernels are built for (one thread per dim).
pub const GATTN_HEAD_DIM: usize = 256;
/// Query rows per warp of the split kernel (`RPW` in gattn.cu) and its warps per block.
const ROWS_PER_WARP: usize = 8;
const WARPS: usize = 8;
/// Warps the split kernel aims at: its per-key loop is latency-bound, so short splits win
/// until the partials cost more than they save. Measured on the H200 at the 27B shape, 1K
/// context (`fused_attention_layer_vs_plain` of `gpu_check --hybrid`, per call): a decode step
/// 53 / 65 / 99 us at 16 / 32 / 64 keys per split, 16 tokens 146 / 125 / 129 us (49 keys: 159).
/// With keys per split rounded up to a power of two this picks 16 and 32 for those two.
const TARGET_WARPS: usize = 2048;

/// One gated-attention layer's inputs for [`gated_attention_chain`].
pub struct GattnRows<'a> {
    /// `[t, (2 nh + 2 nkv) * 256]`: per q head its query then gate dims, then K, then V heads.
    pub qkv: &'a Tensor,
    /// `[256]` each: the norms' multipliers (`1 + w`, folded at load).
    pub q_norm: &'a Tensor,
    pub k_norm: &'a Tensor,
    /// `[t, rotary_dim / 2]`: the new tokens' RoPE tables.
    pub cos: &'a Tensor,
    pub sin: &'a Tensor,
    /// The layer's cache buffers `[nkv, cap, 256]`; rows `[0, cache_len)` are committed and
    /// the new tokens' K/V go to `[cache_len, cache_len + t)` (not made live here).
    pub kc: &'a Tensor,
    pub vc: &'a Tensor,
    pub cache_len: usize,
    /// `(query heads, KV heads)`.
    pub heads: (usize, usize),
    pub rotary_dim: usize,
    pub eps: f64,
}

fn alloc(dev: &CudaDevice, dtype: DType, shape: (usize, usize)) -> Result<Tensor> {
    match dtype {
        DType::BF16 => alloc_bf16(dev, shape),
        _ => alloc_f32(dev, shape.0 * shape.1)?.reshape(shape),
    }
}

/// Keys per split and the split count for `live` keys and `row_groups` row groups per KV head.
fn split_plan(live: usize, nkv: usize, row_groups: usize) -> (usize, usize) {
    let kps = (live * nkv * row_groups)
        .div_ceil(TARGET_WARPS)
        .next_power_of_two()
        .clamp(16, 256);
    (kps, live.div_ceil(kps))
}

/// `attn * sigmoid(gate)` `[t, nh * 256]` (the o_proj input, the inputs' dtype: bf16 or f32)
/// of the `t` new tokens, each seeing the committed rows and the new rows up to itself, with
/// their normed and rotated K and their V written into the cache on the way.
pub fn gated_attention_chain(r: &GattnRows<'_>) -> Result<Tensor> {
    gated_attention_chain_split(r, None)
}

/// [`gated_attention_chain`] with the keys per split forced (None: by the plan), for the
/// checks' timings.
pub fn gated_attention_chain_split(
    r: &GattnRows<'_>,
    keys_per_split: Option<usize>,
) -> Result<Tensor> {
    let dev = cuda(r.qkv)?;
    let dtype = r.qkv.dtype();
    let suffix = match dtype {
        DType::BF16 => "bf16",
        DType::F32 => "f32",
        other => bail!("gated_attention_chain: bf16 or f32, got {other:?}"),
    };
    let (nh, nkv) = r.heads;
    let d = GATTN_HEAD_DIM;
    let (t, width) = r.qkv.dims2()?;
    let (kh, cap, kd) = r.kc.dims3()?;
    let rot = r.rotary_dim;
    let live = r.cache_len + t;
    if t == 0
        || nkv == 0
        || !nh.is_multiple_of(nkv)
        || width != (2 * nh + 2 * nkv) * d
        || (kh, kd) != (nkv, d)
        || r.vc.dims3()? != (nkv, cap, d)
        || live > cap
        || rot == 0
        || rot > d
        || !rot.is_multiple_of(2)
        || r.cos.dims2()? != (t, rot / 2)
        || r.sin.dims2()? != (t, rot / 2)
        || r.q_norm.dims1()? != d
        || r.k_norm.dims1()? != d
    {
        bail!(
            "gated_attention_chain: qkv {:?}, cache {:?}, cos {:?}, {nh}/{nkv} heads of {d}, rotary {rot}, {} committed rows",
            r.qkv.shape(),
            r.kc.shape(),
            r.cos.shape(),
            r.cache_len
        )
    }
    for (name, x) in [
        ("q_norm", r.q_norm),
        ("k_norm", r.k_norm),
        ("cos", r.cos),
        ("sin", r.sin),
        ("k cache", r.kc),
        ("v cache", r.vc),
    ] {
        if x.dtype() != dtype {
            bail!(
                "gated_attention_chain: {name} is {:?}, qkv {dtype:?}",
                x.dtype()
            )
        }
    }
    let (qkvp, qwp, kwp, cp, sp, kcp, vcp) = (
        ptr(r.qkv)?,
        ptr(r.q_norm)?,
        ptr(r.k_norm)?,
        ptr(r.cos)?,
        ptr(r.sin)?,
        ptr(r.kc)?,
        ptr(r.vc)?,
    );
    let (nhi, nkvi, roti, capi, ci, ti) = (
        nh as i32,
        nkv as i32,
        rot as i32,
        cap as i32,
        r.cache_len as i32,
        t as i32,
    );

    let q = alloc(&dev, dtype, (t * nh, d))?;
    let qp = ptr(&q)?;
    let eps = r.eps as f32;
    let name = format!("gattn_prep_{suffix}");
    let f = dev.get_or_load_custom_func(&name, MODULE, PTX)?;
    let mut b = f.builder();
    b.arg(&qkvp)
        .arg(&qwp)
        .arg(&kwp)
        .arg(&cp)
        .arg(&sp)
        .arg(&qp)
        .arg(&kcp)
        .arg(&vcp);
    b.arg(&nhi)
        .arg(&nkvi)
        .arg(&roti)
        .arg(&capi)
        .arg(&ci)
        .arg(&eps);
    go(
        &mut b,
        cfg((t as u32, (nh + nkv) as u32, 1), d as u32),
        &name,
    )?;

    let row_groups = (t * (nh / nkv)).div_ceil(ROWS_PER_WARP);
    let (kps, splits) = match keys_per_split {
        Some(k) if k > 0 => (k, live.div_ceil(k)),
        _ => split_plan(live, nkv, row_groups),
    };
    let nrows = t * nh;
    let acc = alloc_f32(&dev, splits * nrows * d)?;
    let ml = alloc_f32(&dev, splits * nrows * 2)?;
    let (accp, mlp) = (ptr(&acc)?, ptr(&ml)?);
    let (kpsi, splitsi) = (kps as i32, splits as i32);
    let scale = 1.0 / (d as f32).sqrt();
    let name = format!("gattn_split_{suffix}");
    let f = dev.get_or_load_custom_func(&name, MODULE, PTX)?;
    let mut b = f.builder();
    b.arg(&qp).arg(&kcp).arg(&vcp).arg(&accp).arg(&mlp);
    b.arg(&ti)
        .arg(&nhi)
        .arg(&nkvi)
        .arg(&capi)
        .arg(&ci)
        .arg(&kpsi)
        .arg(&splitsi)
        .arg(&scale);
    go(
        &mut b,
        cfg(
            (nkv as u32, splits.div_ceil(WARPS) as u32, row_groups as u32),
            (WARPS * 32) as u32,
        ),
        &name,
    )?;

    let out = alloc(&dev, dtype, (t, nh * d))?;
    let outp = ptr(&out)?;
    let name = format!("gattn_combine_{suffix}");
    let f = dev.get_or_load_custom_func(&name, MODULE, PTX)?;
    let mut b = f.builder();
    b.arg(&accp).arg(&mlp).arg(&qkvp).arg(&outp);
    b.arg(&ti).arg(&nhi).arg(&nkvi).arg(&splitsi);
    go(&mut b, cfg((nrows as u32, 1, 1), d as u32), &name)?;
    // The launches are stream-ordered; the scratch is freed (back to the pool) after them.
    drop((q, acc, ml));
    Ok(out)
}
