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
/// Shared memory of the two kernels (as laid out in gdn_chunk.cu): the solve's f32 tiles and a
/// tree's ancestor bits (two blocks an SM); the scan's two bf16 stages of [W | Q' | KT] and its
/// state and v_new tiles.
const SOLVE_SMEM: usize = 4 * (2 * 64 * 132 + 64 * 64 + 64 * 68 + 2 * 64) + 8 * 64;
const SCAN_SMEM: usize = 2 * (2 * (2 * 64 * 136 + 128 * 72) + 64 * 136 + 64 * 72);

/// The per-chunk buffers the solve writes and the scan reads, for `rows` = value heads x
/// chunks x 64 rows.
struct ChunkBuffers {
    u: Tensor,
    pu: Tensor,
    w: Tensor,
    qp: Tensor,
    kt: Tensor,
    gc: Tensor,
}

impl ChunkBuffers {
    fn new(dev: &CudaDevice, rows: usize) -> Result<Self> {
        let d = GDN_HEAD_DIM;
        Ok(Self {
            u: alloc_f32(dev, rows * d)?,
            pu: alloc_f32(dev, rows * d)?,
            w: alloc_bf16(dev, rows * d)?,
            qp: alloc_bf16(dev, rows * d)?,
            kt: alloc_bf16(dev, rows * d)?,
            gc: alloc_f32(dev, rows)?,
        })
    }
}

/// `gdn_prep`'s outputs as device addresses at a run's first token, and the run's length.
struct Run {
    q: u64,
    k: u64,
    v: u64,
    g: u64,
    beta: u64,
    n: usize,
}

impl Run {
    /// The `n` tokens from token `start` of `[q, k, v, g, beta]` (f32, `hk` key heads and `hv`
    /// value heads of 128).
    fn at(inputs: [&Tensor; 5], start: usize, n: usize, (hk, hv): (usize, usize)) -> Result<Self> {
        let d = GDN_HEAD_DIM;
        // Byte offset of token `start` in an input of `per_token` f32 a token.
        let at = |x: &Tensor, per_token: usize| -> Result<u64> {
            Ok(ptr(x)? + (start * per_token * 4) as u64)
        };
        let [q, k, v, g, beta] = inputs;
        Ok(Self {
            q: at(q, hk * d)?,
            k: at(k, hk * d)?,
            v: at(v, hv * d)?,
            g: at(g, hv)?,
            beta: at(beta, hv)?,
            n,
        })
    }
}

/// `gdn_chunk_solve` over `run` (`anc`: a tree's ancestor bits, 0 for a causal run).
fn solve(
    dev: &CudaDevice,
    run: &Run,
    buf: &ChunkBuffers,
    (hk, hv): (usize, usize),
    anc: u64,
) -> Result<()> {
    let f = function_with_smem(dev, (MODULE, PTX), "gdn_chunk_solve", SOLVE_SMEM)?;
    let stream = dev.cuda_stream();
    let (up, pup, wp) = (ptr(&buf.u)?, ptr(&buf.pu)?, ptr(&buf.w)?);
    let (qpp, ktp, gcp) = (ptr(&buf.qp)?, ptr(&buf.kt)?, ptr(&buf.gc)?);
    let (ni, hki, hvi) = (run.n as i32, hk as i32, hv as i32);
    let mut b = stream.launch_builder(&f);
    b.arg(&run.q)
        .arg(&run.k)
        .arg(&run.v)
        .arg(&run.g)
        .arg(&run.beta);
    b.arg(&up).arg(&pup).arg(&wp).arg(&qpp).arg(&ktp).arg(&gcp);
    b.arg(&ni).arg(&hki).arg(&hvi).arg(&anc);
    let cfg = LaunchConfig {
        grid_dim: (run.n.div_ceil(GDN_CHUNK) as u32, hv as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: SOLVE_SMEM as u32,
    };
    go(&mut b, cfg, "gdn_chunk_solve")
}

/// `gdn_chunk_scan` of `n` tokens from the state at `from`: outputs at `o`, the state after them
/// at `s_out`, every token's v_new at `vn_out` (each address 0 for none but `from` and `o`).
#[allow(clippy::too_many_arguments)]
fn scan(
    dev: &CudaDevice,
    buf: &ChunkBuffers,
    n: usize,
    hv: usize,
    from: u64,
    o: u64,
    s_out: u64,
    vn_out: u64,
) -> Result<()> {
    let f = function_with_smem(dev, (MODULE, PTX), "gdn_chunk_scan", SCAN_SMEM)?;
    let stream = dev.cuda_stream();
    let (up, pup, wp) = (ptr(&buf.u)?, ptr(&buf.pu)?, ptr(&buf.w)?);
    let (qpp, ktp, gcp) = (ptr(&buf.qp)?, ptr(&buf.kt)?, ptr(&buf.gc)?);
    let (ni, hvi) = (n as i32, hv as i32);
    let mut b = stream.launch_builder(&f);
    b.arg(&from).arg(&up).arg(&pup).arg(&wp).arg(&qpp).arg(&ktp);
    b.arg(&gcp)
        .arg(&o)
        .arg(&s_out)
        .arg(&ni)
        .arg(&hvi)
        .arg(&vn_out);
    let cfg = LaunchConfig {
        grid_dim: (hv as u32, (GDN_HEAD_DIM / SCAN_COLUMNS) as u32, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: SCAN_SMEM as u32,
    };
    go(&mut b, cfg, "gdn_chunk_scan")
}

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
    let buf = ChunkBuffers::new(dev, hv * t.min(SEGMENT).div_ceil(GDN_CHUNK) * GDN_CHUNK)?;
    let (ob, last) = (ptr(&o)?, ptr(&s_last)?);
    for start in (0..t).step_by(SEGMENT) {
        let n = (t - start).min(SEGMENT);
        let run = Run::at([q, k, v, g, beta], start, n, (hk, hv))?;
        solve(dev, &run, &buf, (hk, hv), 0)?;
        // The first segment starts from the cache's state; later ones from the state the
        // previous one left (in place: each block reads and writes only its own columns).
        let from = if start == 0 { ptr(s0)? } else { last };
        let o_at = ob + (start * hv * d * 4) as u64;
        scan(dev, &buf, n, hv, from, o_at, last, 0)?;
    }
    Ok((o, s_last))
}

/// The delta rule over a verify tree of `t <= 64` nodes from the committed state `s0` (inputs
/// as [`chunked_delta_rule`]'s; `anc`: i64 `[t]` ancestor bits, `cuda::tree_bits`, parents
/// before children): every node's raw output f32 `[t * hv * 128]` and the value it wrote (its
/// v_new) f32 `[t * hv * 128]`, from which the commit rebuilds the accepted path's state. One
/// chunk: two launches for any tree shape. Shapes are checked by the caller
/// (`gdn_tree_chunked`).
#[allow(clippy::too_many_arguments)]
pub(super) fn tree_delta_rule(
    dev: &CudaDevice,
    s0: &Tensor,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    g: &Tensor,
    beta: &Tensor,
    anc: &Tensor,
    (t, hk, hv): (usize, usize, usize),
) -> Result<(Tensor, Tensor)> {
    let d = GDN_HEAD_DIM;
    let o = alloc_f32(dev, t * hv * d)?;
    let vn = alloc_f32(dev, t * hv * d)?;
    let buf = ChunkBuffers::new(dev, hv * GDN_CHUNK)?;
    let run = Run::at([q, k, v, g, beta], 0, t, (hk, hv))?;
    solve(dev, &run, &buf, (hk, hv), ptr(anc)?)?;
    scan(dev, &buf, t, hv, ptr(s0)?, ptr(&o)?, 0, ptr(&vn)?)?;
    Ok((o, vn))
}
