//! Launch wrappers of gdn_chunk.cu: the Gated DeltaNet delta rule of a prefill in its chunked
//! form on the tensor cores, in place of `gdn_scan`'s token-by-token recurrence (which leaves
//! most of the GPU idle: one block per value head and 16 value columns, each walking every
//! token). Takes what `gdn_prep` writes; shapes are checked by the caller (`gdn_split`).

use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::CudaDevice;
use candle_core::{Result, Tensor};

use super::gdn::GDN_HEAD_DIM;
use super::launch::{alloc_bf16, alloc_f32, function_with_smem, go, ptr};

pub(super) const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/gdn_chunk.ptx"));
pub(super) const MODULE: &str = "dflash_gdn_chunk";

/// Tokens a chunk of the kernels' form holds (`GC_C`).
pub const GDN_CHUNK: usize = 64;
/// Fewest tokens for which a prefill takes the chunked kernels: below a few chunks the
/// token-by-token scan's one launch is as fast.
pub const GDN_CHUNKED_MIN_T: usize = 4 * GDN_CHUNK;
/// Most tokens one launch pair takes; longer runs go segment by segment with the state carried
/// (bounds the per-chunk buffers: 2 f32 and 3 bf16 of hv x 4096 x 128, 300 MB at 48 value
/// heads).
const SEGMENT: usize = 4096;
/// Value columns per scan block (`GC_BV`).
const SCAN_COLUMNS: usize = 64;
/// Shared memory of the two kernels (as laid out in gdn_chunk.cu): the solve's f32 tiles (two
/// blocks an SM); the scan's two bf16 stages of [W | Q' | KT] and its state and v_new tiles.
const SOLVE_SMEM: usize = 4 * (2 * 64 * 132 + 64 * 64 + 64 * 68 + 2 * 64);
const SCAN_SMEM: usize = 2 * (2 * (2 * 64 * 136 + 128 * 72) + 64 * 136 + 64 * 72);

/// The delta rule over `t` tokens from the state `s0` (f32 `[hv, 128, 128]`) given `gdn_prep`'s
/// f32 outputs (`q`, `k` `[t, hk, 128]`, `v` `[t, hv * 128]`, `g`, `beta` `[t, hv]`): the raw
/// outputs f32 `[t * hv * 128]` and the state after the last token (f32 `[hv * 128 * 128]`).
/// Two launches per segment of up to 4096 tokens.
#[allow(clippy::too_many_arguments)]
pub(super) fn chunked_delta_rule(
    dev: &CudaDevice,
    s0: &Tensor,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    beta: &Tensor,
    (t, hk, hv): (usize, usize, usize),
) -> Result<(Tensor, Tensor)> {
    let d = GDN_HEAD_DIM;
    let o = alloc_f32(dev, t * hv * d)?;
    let s_last = alloc_f32(dev, hv * d * d)?;
    let seg_chunks = t.min(SEGMENT).div_ceil(GDN_CHUNK);
    let rows = hv * seg_chunks * GDN_CHUNK;
    let (u, pu) = (alloc_f32(dev, rows * d)?, alloc_f32(dev, rows * d)?);
    let (w, qp, kt) = (
        alloc_bf16(dev, rows * d)?,
        alloc_bf16(dev, rows * d)?,
        alloc_bf16(dev, rows * d)?,
    );
    let gc = alloc_f32(dev, rows)?;
    let solve = function_with_smem(dev, (MODULE, PTX), "gdn_chunk_solve", SOLVE_SMEM)?;
    let scan = function_with_smem(dev, (MODULE, PTX), "gdn_chunk_scan", SCAN_SMEM)?;
    let (up, pup, gcp) = (ptr(&u)?, ptr(&pu)?, ptr(&gc)?);
    let (wp, qpp, ktp) = (ptr(&w)?, ptr(&qp)?, ptr(&kt)?);
    let (qb, kb, vb, gb, bb, ob) = (ptr(q)?, ptr(k)?, ptr(v)?, ptr(g)?, ptr(beta)?, ptr(&o)?);
    let last = ptr(&s_last)?;
    let (hki, hvi) = (hk as i32, hv as i32);
    let stream = dev.cuda_stream();
    for start in (0..t).step_by(SEGMENT) {
        let n = (t - start).min(SEGMENT);
        let nc = n.div_ceil(GDN_CHUNK);
        let ni = n as i32;
        // Byte offsets of the segment's first token in each input and in the output.
        let at = |base: u64, per_token: usize| base + (start * per_token * 4) as u64;
        let (qs, ks) = (at(qb, hk * d), at(kb, hk * d));
        let (vs, gs, bs, os) = (at(vb, hv * d), at(gb, hv), at(bb, hv), at(ob, hv * d));
        let mut b = stream.launch_builder(&solve);
        b.arg(&qs).arg(&ks).arg(&vs).arg(&gs).arg(&bs);
        b.arg(&up).arg(&pup).arg(&wp).arg(&qpp).arg(&ktp).arg(&gcp);
        b.arg(&ni).arg(&hki).arg(&hvi);
        let cfg = LaunchConfig {
            grid_dim: (nc as u32, hv as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: SOLVE_SMEM as u32,
        };
        go(&mut b, cfg, "gdn_chunk_solve")?;
        // The first segment starts from the cache's state; later ones from the state the
        // previous one left (in place: each block reads and writes only its own columns).
        let from = if start == 0 { ptr(s0)? } else { last };
        let mut b = stream.launch_builder(&scan);
        b.arg(&from).arg(&up).arg(&pup).arg(&wp).arg(&qpp).arg(&ktp);
        b.arg(&gcp).arg(&os).arg(&last).arg(&ni).arg(&hvi);
        let cfg = LaunchConfig {
            grid_dim: (hv as u32, (d / SCAN_COLUMNS) as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: SCAN_SMEM as u32,
        };
        go(&mut b, cfg, "gdn_chunk_scan")?;
    }
    Ok((o, s_last))
}
