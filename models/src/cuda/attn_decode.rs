//! Launch wrapper of attn_decode.cu: a layer's whole attention for forwards of few rows in
//! one kernel — q/k norm + RoPE from the raw qkv GEMM output, the new K/V into the cache,
//! split-K attention and the merge of the splits — instead of `qk_norm_rope_cache` followed
//! by [`super::attention`] (three launches). Same results up to the f32 summation order of the
//! attention partials (the q/k rows themselves are bit-identical).

use std::sync::Mutex;

use candle_core::cuda_backend::cudarc::driver::sys::CUfunction_attribute_enum;
use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig};
use candle_core::{bail, DType, Result, Tensor};

use super::attn_plan::{
    attn_plan, one_stage_shared_bytes, runtime_plan, CHUNK_KEYS, MAX_SHARED_BYTES,
};
use super::attn_scratch::{scratch, COUNTERS};
use super::attn_step::{step_attention, step_fits};
use super::kernels::{QkvRows, CHUNK};
use super::launch::{alloc_bf16, cuda, opt_ptr, page_stride, ptr, KernelArgs};

const _: () = assert!(CHUNK_KEYS == CHUNK);

pub(super) const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/attn_decode.ptx"));
pub(super) const MODULE: &str = "dflash_attn_decode";

/// Most new tokens of one sequence the fused kernel takes.
pub const FUSED_ATTN_MAX_TOKENS: usize = 64;

/// Whether the layer stack runs the attention of `t` new tokens through [`fused_attention`]:
/// decode steps (one token; up to 16 query heads per KV head, one row tile). Measured on the
/// H200, Qwen3-8B heads, one layer's attention in a CUDA graph (`kernel_checks.attention_us_*`
/// of `dflash-serve bench`): one token over 1K / 8K keys 12.6 / 23.0 us fused against 14.2 /
/// 50.1 us for `qk_norm_rope_cache` + [`super::attention`]; but 4 tokens 24.2 against 15.0 us,
/// 16 tokens 41-80 against 18.4 us, 64 tokens 96-175 against 44.7 us (the merging block
/// walks its rows' partials one row at a time), so wider forwards keep the two launches.
pub fn fused_attention_fits(t: usize, nh: usize, nkv: usize) -> bool {
    t == 1 && nkv > 0 && nh / nkv <= 16
}

/// Blocks a one-sequence step launch aims at (`DFLASH_STEP_ONE_BLOCKS`, read once; 0, the
/// default: one per SM, [`super::attn_plan::step_splits`]'s choice). A measurement knob: fewer
/// splits make each block stream more keys and the merge read fewer partials. Measured (H100,
/// session 27, Qwen3-8B heads, the launch alone at 1K / 8K context): 0 (132) 9.9 / 17.2 us,
/// 32 blocks 12.5 / 38.2, 64 10.1 / 23.5, 256 10.7 / 17.1.
fn step_one_blocks() -> usize {
    static BLOCKS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *BLOCKS.get_or_init(|| {
        std::env::var("DFLASH_STEP_ONE_BLOCKS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    })
}

/// Blocks a batched launch aims at (see `fused_attention_rt`). 512 rather than 1024: fewer
/// splits per sequence, so each block streams more chunks through its double buffer and the
/// merge reads fewer partials. Measured on the H200 (h200-2026-12-03-decode-attn, Qwen3-8B
/// heads, the launch alone): B 16 / 32 / 64 at 640 positions 46.4 / 69.5 / 98.1 us at 1024
/// against 38.6 / 52.3 / 79.6 at 512 (2048: slower still), 4096 positions 123 / 201 / 353
/// against 106 / 181 / 335.
pub const BATCH_SPLIT_BLOCKS: usize = 512;

/// The kernel of a batched decode launch (several sequences, one row tile, chunks per split
/// set on the device): the register file caps `attn_decode_rt1` at 2 blocks (8 warps) per SM;
/// the variants hold it to 3 (two stages) or 4 (one shared stage) blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BatchKernel {
    /// `attn_decode_rt1`: 255 registers, two stages.
    Base,
    /// `attn_decode_rt1_b3`: 168 registers, two stages.
    Blocks3,
    /// `attn_decode_rt1_b4s1`: 128 registers, one stage.
    Blocks4OneStage,
    /// `attn_step_s3` (attn_step.cu, one-token steps without a tree only: others keep
    /// `Base`): the step kernel, 3 cp.async stages per warp; the target blocks 0: one split
    /// per (sequence, KV head) unless the batch leaves SMs idle (`attn_plan::step_splits`).
    Step3,
    /// `attn_step_s2`: 2 stages per warp, 3 blocks per SM.
    Step2,
}

/// The default batched decode launch: the step kernel (attn_step.cu, 3 stages) filling the
/// device once. Measured on the H200 (h200-2026-12-06-s16-decattn, Qwen3-8B heads, the
/// launch alone in a CUDA graph): B 16 / 32 / 64 at 640 positions 19.2 / 30.1 / 55.3 us
/// against 39.0 / 52.2 / 79.7 for `Base` at 512 blocks, 4096 positions 75 / 141 / 272 against
/// 106 / 181 / 336, 8192 positions 143 / 272 / 533 against 181 / 332 / 651; the decode graph
/// steps at 640 positions 0.713 / 0.707 / 0.707 of the memory roofline against 0.608 / 0.591
/// / 0.586. Launches it does not take (a tree, several tokens, one sequence) keep `Base` at
/// [`BATCH_SPLIT_BLOCKS`].
pub const DEFAULT_BATCH_LAUNCH: (BatchKernel, usize) = (BatchKernel::Step3, 0);

/// The batched decode launch's kernel and the blocks it aims at (a measurement knob of
/// `gpu_check --scale`: graphs keep the launch they captured, so compare them on models of
/// their own graph caches).
static BATCH_LAUNCH: Mutex<(BatchKernel, usize)> = Mutex::new(DEFAULT_BATCH_LAUNCH);

/// Sets the batched decode launch's kernel and target block count (see [`BatchKernel`]; 0
/// blocks: the step kernels' own choice, one block for the others).
pub fn set_batch_launch(kernel: BatchKernel, blocks: usize) -> Result<()> {
    let mut l = BATCH_LAUNCH
        .lock()
        .map_err(|_| candle_core::Error::Msg("fused_attention: launch lock poisoned".into()))?;
    let blocks = match kernel {
        BatchKernel::Step3 | BatchKernel::Step2 => blocks,
        _ => blocks.max(1),
    };
    *l = (kernel, blocks);
    Ok(())
}

fn batch_launch() -> Result<(BatchKernel, usize)> {
    BATCH_LAUNCH
        .lock()
        .map(|l| *l)
        .map_err(|_| candle_core::Error::Msg("fused_attention: launch lock poisoned".into()))
}

/// The kernel's parameter block (`Args` in attn_decode.cu, same field order).
#[repr(C)]
#[derive(Clone, Copy)]
struct Args {
    qkv: u64,
    qw: u64,
    kw: u64,
    cos: u64,
    sin: u64,
    positions: u64,
    cache_len: u64,
    pt: u64,
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
    pt_stride: i32,
    tiles: i32,
    scale: f32,
    eps: f32,
}

// SAFETY: plain old data with the C layout the kernel declares.
unsafe impl DeviceRepr for Args {}

/// Attention of the `t` rows of `rows.qkv` (the raw GEMM output) over its cache: q/k RMSNorm
/// and RoPE as `qk_norm_rope_cache` rounds them, the new K/V written at cache rows
/// `cache_len[0] ..`, committed rows visible to every token and new token j visible
/// to token i when `j <= i` (`tree` None) or bit j of `tree[i * words + j / 64]` is set.
/// `split`: `(splits, key chunks per split)` covering the live keys (see
/// [`super::split_plan`]). Returns `[t, nh * d]`. A batch (`rows.cache_len` of `seqs` > 1
/// lengths, `rows.pages` their page tables) runs `t / seqs` rows of each sequence in the same
/// launch, the rows of sequence s being `[s t / seqs, (s + 1) t / seqs)`.
pub fn fused_attention(
    rows: &QkvRows<'_>,
    tree: Option<&Tensor>,
    split: Option<(usize, usize)>,
) -> Result<Tensor> {
    fused_attention_rt(None, rows, tree, split)
}

/// [`fused_attention`] with the 16-row tiles per block forced to `rt` (1, 2 or 4; None: by
/// the row count), for the checks and timings.
pub(crate) fn fused_attention_rt(
    rt: Option<usize>,
    rows: &QkvRows<'_>,
    tree: Option<&Tensor>,
    split: Option<(usize, usize)>,
) -> Result<Tensor> {
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
    let (total, cap) = rows.check("fused_attention", true)?;
    let new_rows = rows;
    let seqs = rows.seqs();
    let t = total / seqs;
    let pt_stride = page_stride(pages, seqs, "fused_attention")?;
    let dev = cuda(qkv)?;
    if nh % nkv != 0 {
        bail!("fused_attention: {nh} q heads are not a multiple of {nkv} KV heads")
    }
    if t == 0 || t > FUSED_ATTN_MAX_TOKENS {
        bail!("fused_attention: {t} tokens, takes 1 to {FUSED_ATTN_MAX_TOKENS}")
    }
    let words = t.div_ceil(64);
    let tree_mask = match tree {
        Some(m) => {
            if m.dims2()? != (total, words) || m.dtype() != DType::I64 {
                bail!(
                    "fused_attention: tree mask must be i64 [{total}, {words}], got {:?}",
                    m.shape()
                )
            }
            ptr(m)?
        }
        None => 0u64,
    };
    let rows = t * (nh / nkv);
    let plan = match split {
        Some(split) => attn_plan(rows, split, rt),
        None => runtime_plan(rows, rt),
    }
    .map_err(|e| candle_core::Error::Msg(format!("fused_attention: {e}")))?;
    let (rt, tiles, cps) = (plan.rt, plan.tiles, plan.cps);
    // A batch fills the GPU with its sequences: fewer splits each (every block of a split
    // past the live keys still takes part in the merge's count), about `blocks` blocks in
    // all. The kernel sets the chunks per split from each sequence's length.
    let batched = seqs > 1 && cps == 0;
    let (kernel, blocks) = if batched {
        batch_launch()?
    } else {
        (BatchKernel::Base, BATCH_SPLIT_BLOCKS)
    };
    let stages = match kernel {
        BatchKernel::Step3 => Some(3),
        BatchKernel::Step2 => Some(2),
        // One sequence's decode token: the step kernel too when switched on, with the batched
        // default's three stages (DEFAULT_BATCH_LAUNCH).
        _ if seqs == 1 && cps == 0 && super::step_attn_one() => Some(3),
        _ => None,
    };
    if let Some(stages) = stages {
        if step_fits(seqs, t, nh, nkv, tree.is_some()) {
            // One sequence: the step kernel's own split count (a block per SM), or the blocks
            // `DFLASH_STEP_ONE_BLOCKS` asks for (a measurement knob).
            let blocks = if batched { blocks } else { step_one_blocks() };
            return step_attention(new_rows, stages, blocks);
        }
    }
    let (kernel, blocks) = match stages {
        Some(_) => (BatchKernel::Base, BATCH_SPLIT_BLOCKS),
        None => (kernel, blocks),
    };
    let nsplit = if batched {
        (blocks / (nkv * tiles * seqs)).clamp(1, plan.nsplit)
    } else {
        plan.nsplit
    };
    let (name, shared_bytes) = match (kernel, rt) {
        (BatchKernel::Blocks3, 1) => ("attn_decode_rt1_b3".to_string(), plan.shared_bytes),
        (BatchKernel::Blocks4OneStage, 1) => (
            "attn_decode_rt1_b4s1".to_string(),
            one_stage_shared_bytes(rt),
        ),
        _ => (format!("attn_decode_rt{rt}"), plan.shared_bytes),
    };
    if nkv * tiles * seqs > COUNTERS {
        bail!("fused_attention: {nkv} KV heads x {seqs} sequences x {tiles} row tiles exceed {COUNTERS} counters")
    }
    let acc_floats = seqs * nsplit * t * nh * d;
    let (acc, counter) = scratch(&dev, qkv, acc_floats + seqs * nsplit * t * nh * 2)?;
    let ml = acc + (acc_floats * 4) as u64;
    let out = alloc_bf16(&dev, (total, nh * d))?;
    let args = Args {
        qkv: ptr(qkv)?,
        qw: ptr(q_norm)?,
        kw: ptr(k_norm)?,
        cos: ptr(cos)?,
        sin: ptr(sin)?,
        positions: ptr(positions)?,
        cache_len: ptr(cache_len)?,
        pt: opt_ptr(pages)?,
        kc: ptr(kc)?,
        vc: ptr(vc)?,
        tree_mask,
        acc,
        ml,
        counter,
        out: ptr(&out)?,
        words: words as i32,
        t: t as i32,
        nh: nh as i32,
        nkv: nkv as i32,
        cap: cap as i32,
        cps: cps as i32,
        pt_stride: pt_stride as i32,
        tiles: tiles as i32,
        scale: 1.0 / (d as f32).sqrt(),
        eps: eps as f32,
    };
    let f = dev.get_or_load_custom_func(&name, MODULE, PTX)?;
    // Always the same value, so graphs captured earlier keep launching with theirs.
    f.set_attribute(
        CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        MAX_SHARED_BYTES as i32,
    )
    .map_err(|e| {
        candle_core::Error::Msg(format!("{name}: shared memory {MAX_SHARED_BYTES}: {e}"))
    })?;
    let cfg = LaunchConfig {
        grid_dim: (nkv as u32, nsplit as u32, (tiles * seqs) as u32),
        block_dim: (128, 1, 1),
        shared_mem_bytes: shared_bytes as u32,
    };
    let mut b = KernelArgs::new();
    b.arg(&args);
    b.launch(&dev, &f, cfg, &name)?;
    Ok(out)
}
