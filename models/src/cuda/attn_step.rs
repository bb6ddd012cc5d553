//! Launch wrapper of attn_step.cu: the attention of a batched one-token decode step (B
//! sequences, one new token each, through their page tables), a kernel built for it rather
//! than the general fused one (`attn_decode.cu`): every (sequence, KV head) streams its K/V
//! once for all its query heads through warp-private cp.async rings. Same inputs, outputs and
//! cache writes as [`super::fused_attention`]'s batched launch (the q/k rows bit-identical,
//! the attention up to the f32 summation order and where the splits fall).

use std::sync::Mutex;

use candle_core::cuda_backend::cudarc::driver::sys::{
    CUdevice_attribute_enum, CUfunction_attribute_enum,
};
use candle_core::cuda_backend::cudarc::driver::{DeviceRepr, LaunchConfig};
use candle_core::cuda_backend::{CudaDevice, DeviceId};
use candle_core::{bail, Result, Tensor};

use super::attn_plan::{step_shared_bytes, step_splits};
use super::attn_scratch::{scratch, COUNTERS};
use super::kernels::QkvRows;
use super::launch::{alloc_bf16, cuda, opt_ptr, page_stride, ptr, KernelArgs};

pub(super) const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/attn_step.ptx"));
pub(super) const MODULE: &str = "dflash_attn_step";

/// Most query heads per KV head the kernel takes (the rows of one m16 tile).
pub const STEP_MAX_GROUPS: usize = 16;

/// Whether [`step_attention`] takes a launch of `t` new tokens per sequence for `seqs`
/// sequences with `nh` / `nkv` heads and no tree (one sequence: only when
/// [`super::step_attn_one`] sends it).
pub(crate) fn step_fits(seqs: usize, t: usize, nh: usize, nkv: usize, tree: bool) -> bool {
    seqs > 0 && t == 1 && !tree && nkv > 0 && nh.is_multiple_of(nkv) && nh / nkv <= STEP_MAX_GROUPS
}

/// The kernel's parameter block (`StepArgs` in attn_step.cu, same field order).
#[repr(C)]
#[derive(Clone, Copy)]
struct StepArgs {
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
    acc: u64,
    ml: u64,
    counter: u64,
    out: u64,
    nh: i32,
    nkv: i32,
    cap: i32,
    pt_stride: i32,
    scale: f32,
    eps: f32,
}

// SAFETY: plain old data with the C layout the kernel declares.
unsafe impl DeviceRepr for StepArgs {}

/// SMs per device.
static SMS: Mutex<Vec<(DeviceId, usize)>> = Mutex::new(Vec::new());

fn kernel_name(stages: usize) -> Result<&'static str> {
    match stages {
        2 => Ok("attn_step_s2"),
        3 => Ok("attn_step_s3"),
        s => bail!("step_attention: {s} stages per warp (2 or 3)"),
    }
}

/// Loads the `stages` kernel with its dynamic shared memory allowed (always the same value,
/// so graphs captured earlier keep launching with theirs): its name and shared bytes.
fn prepare(dev: &CudaDevice, stages: usize) -> Result<(&'static str, usize)> {
    let name = kernel_name(stages)?;
    let smem = step_shared_bytes(stages);
    let f = dev.get_or_load_custom_func(name, MODULE, PTX)?;
    f.set_attribute(
        CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        smem as i32,
    )
    .map_err(|e| candle_core::Error::Msg(format!("{name}: shared memory {smem}: {e}")))?;
    Ok((name, smem))
}

/// The device's SM count.
fn sms(dev: &CudaDevice) -> Result<usize> {
    let err = |e: String| candle_core::Error::Msg(format!("step_attention: {e}"));
    let mut all = SMS
        .lock()
        .map_err(|_| err("SM count lock poisoned".into()))?;
    if let Some(&(_, n)) = all.iter().find(|s| s.0 == dev.id()) {
        return Ok(n);
    }
    let n = dev
        .cuda_stream()
        .context()
        .attribute(CUdevice_attribute_enum::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .map_err(|e| err(e.to_string()))?
        .max(1) as usize;
    all.push((dev.id(), n));
    Ok(n)
}

/// The attention of a batched one-token step (see the module doc): `rows` of `seqs` sequences
/// with one row each, their page tables in `rows.pages` (one sequence may have none); `stages` 2 or 3 cp.async
/// stages per warp; `blocks` the blocks to aim at (0: see [`step_splits`]). Returns `[seqs, nh * d]`.
pub(crate) fn step_attention(rows: &QkvRows<'_>, stages: usize, blocks: usize) -> Result<Tensor> {
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
    let (total, cap) = rows.check("step_attention", true)?;
    let seqs = rows.seqs();
    if !step_fits(seqs, total / seqs, nh, nkv, false) || total != seqs {
        bail!("step_attention: {total} rows of {seqs} sequences, heads {nh}/{nkv}: not a batched one-token step")
    }
    let pt_stride = page_stride(pages, seqs, "step_attention")?;
    let dev = cuda(qkv)?;
    let nsplit = step_splits(seqs * nkv, sms(&dev)?, blocks);
    let acc_floats = seqs * nsplit * nh * d;
    let (acc, counter) = scratch(&dev, qkv, acc_floats + seqs * nsplit * nh * 2)?;
    if seqs * nkv > COUNTERS {
        bail!("step_attention: {seqs} sequences x {nkv} KV heads exceed the merge counters")
    }
    let out = alloc_bf16(&dev, (total, nh * d))?;
    let args = StepArgs {
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
        acc,
        ml: acc + (acc_floats * 4) as u64,
        counter,
        out: ptr(&out)?,
        nh: nh as i32,
        nkv: nkv as i32,
        cap: cap as i32,
        pt_stride: pt_stride as i32,
        scale: 1.0 / (d as f32).sqrt(),
        eps: eps as f32,
    };
    let (name, smem) = prepare(&dev, stages)?;
    let f = dev.get_or_load_custom_func(name, MODULE, PTX)?;
    let cfg = LaunchConfig {
        grid_dim: (nkv as u32, nsplit as u32, seqs as u32),
        block_dim: (128, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    let mut b = KernelArgs::new();
    b.arg(&args);
    b.launch(&dev, &f, cfg, name)?;
    Ok(out)
}
