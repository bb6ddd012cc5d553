//! The experts of a wide routing (prefills: hundreds of rows and more) as two cuBLAS grouped
//! GEMMs (`cublasGemmGroupedBatchedEx`, one launch per projection for every used expert, bf16
//! in and out, f32 accumulation): the skinny tensor-core kernels of moe.cu re-read an expert's
//! weights for every tile of 64 of its pairs and every 32 output columns re-read the tile's
//! inputs, which at a 4K-token prefill of the Qwen3-Coder-30B-A3B shape (256 pairs an expert)
//! made the MoE block ~5 ms a layer, slower than HF transformers' grouped GEMM (H100, session
//! 29: its 4K prefill 0.166 s against the tiles' 0.282 s; with these GEMMs 0.146 s).
//!
//! The group sizes are the per-expert pair counts, which cuBLAS takes on the host: one small
//! device-to-host copy (a synchronisation) per block, so this path runs only outside CUDA graph
//! capture and for blocks wider than any captured step ([`GROUPED_MIN_ROWS`]).
//! The math is moe.cu's: pairs grouped by expert (the routing's pair order), `silu(gate) * up`
//! rounded as the plain path rounds it ([`super::silu_mul`]), each pair's down product, then
//! moe_combine's weighted sum in ascending expert order.

use candle_core::cuda_backend::cudarc::cublas::sys as cb;
use candle_core::{bail, DType, Result, Tensor};

use super::launch::{alloc_bf16, cuda, ptr};

/// Rows of a block from which the grouped GEMMs replace the tiled kernels: above the widest
/// sparse-MoE step a CUDA graph captures (`decoder_stack::MOE_GRAPH_MAX_ROWS`, 512, asserted
/// there), so a batched step computes the same way whether it replays a graph or runs its
/// eager warm-up; prefills of more rows take the grouped GEMMs (the counts' copy is noise).
pub const GROUPED_MIN_ROWS: usize = 513;

/// `out[q] = a[q] @ w[e(q)]ᵀ` for the pairs `q` of `a: [P, K]` grouped by expert (expert `e`'s
/// `counts[e]` pairs consecutive, in expert order), `w: [E, N, K]` (nn.Linear rows per expert):
/// `[P, N]` bf16. One cuBLAS launch for every expert with pairs.
pub(super) fn grouped_linear(a: &Tensor, w: &Tensor, counts: &[u32]) -> Result<Tensor> {
    let dev = cuda(a)?;
    let (p, k) = a.dims2()?;
    let (e, n, k2) = w.dims3()?;
    let pairs: usize = counts.iter().map(|&c| c as usize).sum();
    if k2 != k || counts.len() != e || pairs != p {
        bail!(
            "moe grouped gemm: a {:?}, w {:?} against {} expert counts summing to {pairs}",
            a.shape(),
            w.shape(),
            counts.len(),
        )
    }
    if !a.is_contiguous()
        || !w.is_contiguous()
        || a.dtype() != DType::BF16
        || w.dtype() != DType::BF16
    {
        bail!("moe grouped gemm: a and w must be contiguous bf16")
    }
    let out = alloc_bf16(&dev, (p, n))?;
    let (ap, wp, op) = (ptr(a)?, ptr(w)?, ptr(&out)?);
    // One group per used expert (its own row count); the pointer arrays live on the device.
    let (mut a_ptrs, mut w_ptrs, mut o_ptrs, mut rows) = (vec![], vec![], vec![], vec![]);
    let mut start = 0u64;
    for (x, &c) in counts.iter().enumerate() {
        if c > 0 {
            w_ptrs.push((wp + (x * n * k * 2) as u64) as i64);
            a_ptrs.push((ap + start * (k * 2) as u64) as i64);
            o_ptrs.push((op + start * (n * 2) as u64) as i64);
            rows.push(c as i32);
        }
        start += c as u64;
    }
    let groups = rows.len();
    if groups == 0 {
        return Ok(out);
    }
    let mut all = w_ptrs;
    all.extend(a_ptrs);
    all.extend(o_ptrs);
    let ptrs = Tensor::from_vec(all, 3 * groups, a.device())?;
    let pp = ptr(&ptrs)?;
    // Row-major out [rows, N] = a [rows, K] @ w_eᵀ is column-major out' [N, rows] = w_e' [K,
    // N]ᵀ a' [K, rows]: transa = T, transb = N, m = N, n = rows, k = K.
    let g = groups;
    let transa = vec![cb::cublasOperation_t::CUBLAS_OP_T; g];
    let transb = vec![cb::cublasOperation_t::CUBLAS_OP_N; g];
    let (ms, ks) = (vec![n as i32; g], vec![k as i32; g]);
    let (ldc, ones) = (vec![n as i32; g], vec![1i32; g]);
    let (alpha, beta) = (vec![1f32; g], vec![0f32; g]);
    let blas = dev.cublas_handle();
    // SAFETY: every pointer array holds `g` entries; the device pointer arrays hold `g`
    // device addresses each, inside `a`, `w` and `out` (checked shapes above), alive until the
    // launch is stream-ordered before their frees; the host arrays outlive the call, which
    // reads them before it returns.
    let status = unsafe {
        cb::cublasGemmGroupedBatchedEx(
            *blas.handle(),
            transa.as_ptr(),
            transb.as_ptr(),
            ms.as_ptr(),
            rows.as_ptr(),
            ks.as_ptr(),
            alpha.as_ptr().cast(),
            pp as usize as *const *const std::ffi::c_void,
            cb::cudaDataType_t::CUDA_R_16BF,
            ks.as_ptr(),
            (pp as usize + g * 8) as *const *const std::ffi::c_void,
            cb::cudaDataType_t::CUDA_R_16BF,
            ks.as_ptr(),
            beta.as_ptr().cast(),
            (pp as usize + 2 * g * 8) as *const *mut std::ffi::c_void,
            cb::cudaDataType_t::CUDA_R_16BF,
            ldc.as_ptr(),
            g as i32,
            ones.as_ptr(),
            cb::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        )
    };
    if status != cb::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        bail!("moe grouped gemm: cublasGemmGroupedBatchedEx returned {status:?} ({g} experts, N {n}, K {k})")
    }
    // The pointer array is freed stream-ordered after the launch.
    drop(ptrs);
    Ok(out)
}

/// The per-pair down outputs `[P, H]` of a wide routing's experts on `xg: [P, H]` (the normed
/// rows gathered per pair, pairs in the routing's order): grouped gate/up, silu·up, grouped
/// down. `counts` are the routing's per-expert pair counts.
pub(super) fn grouped_pair_outputs(
    xg: &Tensor,
    gate_up: &Tensor,
    down: &Tensor,
    counts: &[u32],
) -> Result<Tensor> {
    // Phase marks for the benches' prefill profile (`super::phases`; no-ops unless open).
    let mark = |label| super::phases::mark(xg.device(), label);
    mark("mlp.gate_up");
    let gu = grouped_linear(xg, gate_up, counts)?;
    mark("mlp.silu");
    let act = super::silu_mul(&gu)?;
    mark("mlp.down");
    let out = grouped_linear(&act, down, counts)?;
    mark("mlp.combine");
    Ok(out)
}
