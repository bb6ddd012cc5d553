//! Launch wrapper of gattn.cu: the hybrid's gated full attention (head dim 256, partial RoPE,
//! zero-centred q/k norms, sigmoid output gate) for one sequence's causal chain or verify tree
//! of new tokens in three launches, from the stacked q|gate|k|v projection to the o_proj input. Shapes are
//! checked here because the kernels trust them.

use candle_core::cuda_backend::CudaDevice;
use candle_core::{bail, DType, Result, Tensor};

use super::launch::{alloc_bf16, alloc_f32, cfg, cuda, ptr, KernelArgs};

pub(super) const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/gattn.ptx"));
pub(super) const MODULE: &str = "dflash_gattn";

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
    /// For a CUDA graph: the committed length read from this u32 `[1]` device tensor at each
    /// launch instead of `cache_len` (then only a bound for the checks), over a fixed split.
    pub graph: Option<GraphSplit<'a>>,
    /// A verify tree's ancestor bits (i64 `[t]`, [`super::tree_bits`] of at most 64 nodes):
    /// each new row sees the committed rows and its ancestors; None: a causal chain.
    pub tree: Option<&'a Tensor>,
    /// `(query heads, KV heads)`.
    pub heads: (usize, usize),
    pub rotary_dim: usize,
    pub eps: f64,
}

/// A graph's fixed split: the device-side committed length and `keys_per_split` keys per
/// split over as many splits as cover the whole cache (splits past the live keys are empty
/// and the merge skips them, so the result equals the eager launch with the same keys per
/// split at every length).
#[derive(Clone, Copy)]
pub struct GraphSplit<'a> {
    pub cache_len: &'a Tensor,
    pub keys_per_split: usize,
}

/// Keys per split the eager plan picks for `live` keys and `t` new tokens of `heads`
/// (query, KV): a graph replay equals the eager forward bit for bit only while this is the
/// graph's [`GraphSplit::keys_per_split`].
pub fn planned_keys_per_split(live: usize, t: usize, (nh, nkv): (usize, usize)) -> usize {
    let row_groups = (t * (nh / nkv.max(1))).div_ceil(ROWS_PER_WARP);
    split_plan(live, nkv, row_groups).0
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
/// of the `t` new tokens, each seeing the committed rows and the new rows up to itself (of a
/// tree: its ancestors and itself), with
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
    if let Some(g) = &r.graph {
        if g.cache_len.dtype() != DType::U32
            || g.cache_len.elem_count() != 1
            || g.keys_per_split == 0
        {
            bail!("gated_attention_chain: a graph's cache length is one u32 and keys per split > 0")
        }
    }
    if let Some(bits) = r.tree {
        if bits.dtype() != DType::I64 || bits.dims1()? != t || t > 64 {
            bail!(
                "gated_attention_chain: a tree's ancestor bits are i64 [t] for t <= 64 new rows, got {:?} {:?} for {t}",
                bits.dtype(),
                bits.shape()
            )
        }
    }
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

    let c_dev = match &r.graph {
        Some(g) => ptr(g.cache_len)?,
        None => 0u64,
    };
    let anc = r.tree.map(ptr).transpose()?.unwrap_or(0);
    let q = alloc(&dev, dtype, (t * nh, d))?;
    let qp = ptr(&q)?;
    let eps = r.eps as f32;
    let name = format!("gattn_prep_{suffix}");
    let f = dev.get_or_load_custom_func(&name, MODULE, PTX)?;
    let mut b = KernelArgs::new();
    b.arg(&qkvp)
        .arg(&qwp)
        .arg(&kwp)
        .arg(&cp)
        .arg(&sp)
        .arg(&qp)
        .arg(&kcp);
    b.arg(&vcp)
        .arg(&nhi)
        .arg(&nkvi)
        .arg(&roti)
        .arg(&capi)
        .arg(&ci);
    b.arg(&c_dev).arg(&eps);
    let grid = (t as u32, (nh + nkv) as u32, 1);
    b.launch(&dev, &f, cfg(grid, d as u32), &name)?;

    let row_groups = (t * (nh / nkv)).div_ceil(ROWS_PER_WARP);
    // A graph covers the whole cache: its replays may see any length up to the capacity.
    let (kps, splits) = match (&r.graph, keys_per_split) {
        (Some(g), _) => (g.keys_per_split, cap.div_ceil(g.keys_per_split)),
        (None, Some(k)) if k > 0 => (k, live.div_ceil(k)),
        _ => split_plan(live, nkv, row_groups),
    };
    let nrows = t * nh;
    let acc = alloc_f32(&dev, splits * nrows * d)?;
    let ml = alloc_f32(&dev, splits * nrows * 2)?;
    let (accp, mlp) = (ptr(&acc)?, ptr(&ml)?);
    let (kpsi, splitsi) = (kps as i32, splits as i32);
    let scale = 1.0 / (d as f32).sqrt();
    let name = match super::gattn_split2() {
        true => format!("gattn_split2_{suffix}"),
        false => format!("gattn_split_{suffix}"),
    };
    let f = dev.get_or_load_custom_func(&name, MODULE, PTX)?;
    let mut b = KernelArgs::new();
    b.arg(&qp)
        .arg(&kcp)
        .arg(&vcp)
        .arg(&accp)
        .arg(&mlp)
        .arg(&ti)
        .arg(&nhi);
    b.arg(&nkvi)
        .arg(&capi)
        .arg(&ci)
        .arg(&c_dev)
        .arg(&kpsi)
        .arg(&splitsi);
    b.arg(&scale).arg(&anc);
    let grid = (nkv as u32, splits.div_ceil(WARPS) as u32, row_groups as u32);
    b.launch(&dev, &f, cfg(grid, (WARPS * 32) as u32), &name)?;

    let out = alloc(&dev, dtype, (t, nh * d))?;
    let outp = ptr(&out)?;
    let name = format!("gattn_combine_{suffix}");
    let f = dev.get_or_load_custom_func(&name, MODULE, PTX)?;
    let mut b = KernelArgs::new();
    b.arg(&accp).arg(&mlp).arg(&qkvp).arg(&outp);
    b.arg(&ti).arg(&nhi).arg(&nkvi).arg(&splitsi);
    b.arg(&ci).arg(&c_dev).arg(&kpsi);
    b.launch(&dev, &f, cfg((nrows as u32, 1, 1), d as u32), &name)?;
    // The launches are stream-ordered; the scratch is freed (back to the pool) after them.
    drop((q, acc, ml));
    Ok(out)
}
