//! Launch wrappers of attn_dflash_tc.cu: the DFlash training attention forward, dq and the
//! context keys' dk/dv on tensor cores (bf16, head_dim 64 or 128, block size 16, at most 8
//! q-heads per KV head). `attn_dflash.rs` takes them where [`applies`] holds; the scalar
//! kernels of attn_dflash.cu stay the f32 path, the other shapes' path and the block keys'
//! dk/dv.

use candle_core::cuda_backend::cudarc::driver::{CudaFunction, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::CudaDevice;
use candle_core::{DType, Result};

use super::attn_dflash_dims::Dims;
use super::launch::{function_with_smem, go};

pub(super) const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/attn_dflash_tc.ptx"));
pub(super) const MODULE: &str = "dflash_attn_dflash_tc";
/// Keys per staged tile (TCH in the .cu).
const TILE: usize = 64;
const MAX_GROUP: usize = 8;

/// Whether a launch of these dims takes the tensor-core kernels (switched by
/// [`super::set_dflash_tensor_cores`]).
pub(super) fn applies(dtype: DType, x: &Dims) -> bool {
    super::dflash_tensor_cores()
        && dtype == DType::BF16
        && (x.d == 64 || x.d == 128)
        && x.block == 16
        && x.kv > 0
        && x.h.is_multiple_of(x.kv)
        && x.h / x.kv <= MAX_GROUP
}

fn function(dev: &CudaDevice, name: &str, smem: usize) -> Result<CudaFunction> {
    function_with_smem(dev, (MODULE, PTX), name, smem)
}

/// Bytes of `rows` staged rows of head_dim `d` (padded by 8 bf16).
fn rows_bytes(rows: usize, d: usize) -> usize {
    rows * (d + 8) * 2
}

/// Pointers: q, kc, vc, kb, vb, blocks, out, lse.
pub(super) fn launch_fwd(dev: &CudaDevice, x: &Dims, p: [u64; 8]) -> Result<()> {
    let g = x.h / x.kv;
    let name = format!("dflash_tc_fwd_d{}", x.d);
    let smem = rows_bytes(2 * TILE + 16 * g, x.d);
    let f = function(dev, &name, smem)?;
    let [hi, kvi, ri, _, csi, bsi, _, wi] = x.ints();
    let scale = x.scale();
    let stream = dev.cuda_stream();
    let mut b = stream.launch_builder(&f);
    for v in &p {
        b.arg(v);
    }
    for v in [&hi, &kvi, &ri, &csi, &bsi, &wi] {
        b.arg(v);
    }
    b.arg(&scale);
    let cfg = LaunchConfig {
        grid_dim: ((x.r / 16) as u32, x.kv as u32, 1),
        block_dim: ((32 * g) as u32, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    go(&mut b, cfg, &name)
}

/// Pointers: q, kc, vc, kb, vb, blocks, out, dout, lse, dq, delta.
pub(super) fn launch_bwd_dq(dev: &CudaDevice, x: &Dims, p: [u64; 11]) -> Result<()> {
    let g = x.h / x.kv;
    let name = format!("dflash_tc_bwd_dq_d{}", x.d);
    let smem = rows_bytes(2 * TILE + 32 * g, x.d);
    let f = function(dev, &name, smem)?;
    let [hi, kvi, ri, _, csi, bsi, _, wi] = x.ints();
    let scale = x.scale();
    let stream = dev.cuda_stream();
    let mut b = stream.launch_builder(&f);
    for v in &p {
        b.arg(v);
    }
    for v in [&hi, &kvi, &ri, &csi, &bsi, &wi] {
        b.arg(v);
    }
    b.arg(&scale);
    let cfg = LaunchConfig {
        grid_dim: ((x.r / 16) as u32, x.kv as u32, 1),
        block_dim: ((32 * g) as u32, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    go(&mut b, cfg, &name)
}

/// Pointers: q, kc, vc, blocks, seqs, ctx_seq, dout, lse, delta, dkc, dvc (the context rows of
/// the packed dk / dv). Nothing to do without context rows.
pub(super) fn launch_bwd_dkv_ctx(dev: &CudaDevice, x: &Dims, p: [u64; 11]) -> Result<()> {
    if x.c == 0 {
        return Ok(());
    }
    let g = x.h / x.kv;
    // The pipelined form holds two buffers of the visited block's rows.
    let (name, bufs) = if super::dflash_dkv_pipelined() {
        (format!("dflash_tc_bwd_dkv_ctx_pipe_d{}", x.d), 2)
    } else {
        (format!("dflash_tc_bwd_dkv_ctx_d{}", x.d), 1)
    };
    // K, V tiles, the group's Q and dO rows, their lse and delta, and the rows' sequences.
    let smem = rows_bytes(2 * TILE + bufs * 32 * g, x.d) + bufs * 2 * 16 * g * 4 + TILE * 4;
    let f = function(dev, &name, smem)?;
    let [hi, kvi, ri, ci, csi, _, _, wi] = x.ints();
    let scale = x.scale();
    let stream = dev.cuda_stream();
    let mut b = stream.launch_builder(&f);
    for v in &p {
        b.arg(v);
    }
    for v in [&hi, &kvi, &ri, &ci, &csi, &wi] {
        b.arg(v);
    }
    b.arg(&scale);
    let cfg = LaunchConfig {
        grid_dim: (x.c.div_ceil(TILE) as u32, x.kv as u32, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: smem as u32,
    };
    go(&mut b, cfg, &name)
}
