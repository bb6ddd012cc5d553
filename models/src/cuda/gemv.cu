// The skinny GEMM kernels (see gemv_impl.cuh for how they work; the MoE expert kernels in
// moe.cu share the implementation), instantiated with their launch bounds.

#include "gemv_impl.cuh"

#define GEMV_ARGS                                                                             \
    const bf16_t *x, const bf16_t *w, bf16_t *y, int M, int N, int K, int ks,                 \
        const bf16_t *resid, const bf16_t *nw, float eps, const float *ss_in, float *ss_out,  \
        float *part, u32 *counter, const char *pf, u64 pf_bytes
// MINB 0: no minimum-blocks bound (a bound of 1 is not the same: with it ptxas spends up to
// 50% more registers on these kernels).
#define ROWS_KERNEL(name, R, U, EPI, NORM, MINB, KS)                                          \
    extern "C" __global__ void __launch_bounds__(128, MINB) name(GEMV_ARGS) {                 \
        rows_impl<R, U, EPI, NORM, KS>(x, w, y, N, K, resid, nw, eps, ss_in, ss_out, part,    \
                                       counter, pf, pf_bytes);                                \
    }
#define MMA_KERNEL(name, U, EPI, MT)                                                          \
    extern "C" __global__ void __launch_bounds__(128) name(GEMV_ARGS) {                       \
        mma_impl<U, EPI, MT>(x, w, y, M, N, K, ks, resid, ss_out, part, counter);             \
    }

// Measured (H200): 2 rows per warp with 4 loads in flight per row beat 4 rows x 2 on every
// projection, and beat 8 in flight (batched or refilled one by one) on q/k/v, o and down;
// 1 span in flight per tensor-core warp beat 2. The SiLU kernels are held to 40 registers (12
// blocks per SM, no spills): Qwen3-8B's gate/up (1536 blocks) then runs in one wave instead of
// 1.16 (10 blocks per SM at 48 registers), whose partial second wave streamed at a fraction of
// the bandwidth: 56.5 -> 51.5 us per layer, decode 5.00 -> 4.81 ms. The residual kernels
// (o_proj, down: 512 blocks, under 4 per SM) split K over 2 warps, so twice the warps stream
// the same bytes: decode 4.75 -> 4.65 ms; a 2-way split of q/k/v gained nothing, 4 ways on
// the residual kernels lost (deploy/bench/results/h200-2026-11-30-decode).
ROWS_KERNEL(gemv_rows2_store, 2, 4, EPI_STORE, NORM_NONE, 0, 1)
ROWS_KERNEL(gemv_rows2_store_norm, 2, 4, EPI_STORE, NORM_SELF, 0, 1)
ROWS_KERNEL(gemv_rows2_resid, 2, 4, EPI_RESID, NORM_NONE, 0, 2)
ROWS_KERNEL(gemv_rows2_silu, 2, 2, EPI_SILU, NORM_NONE, 12, 1)
ROWS_KERNEL(gemv_rows2_silu_norm, 2, 2, EPI_SILU, NORM_SS, 12, 1)
MMA_KERNEL(gemv_mma_store, 1, EPI_STORE, 1)
MMA_KERNEL(gemv_mma_resid, 1, EPI_RESID, 1)
MMA_KERNEL(gemv_mma_silu, 1, EPI_SILU, 1)
// 17..64 rows: 2, 3 or 4 m16 tiles per warp over the same weight fragments.
MMA_KERNEL(gemv_mma_store_m2, 1, EPI_STORE, 2)
MMA_KERNEL(gemv_mma_resid_m2, 1, EPI_RESID, 2)
MMA_KERNEL(gemv_mma_silu_m2, 1, EPI_SILU, 2)
MMA_KERNEL(gemv_mma_store_m3, 1, EPI_STORE, 3)
MMA_KERNEL(gemv_mma_resid_m3, 1, EPI_RESID, 3)
MMA_KERNEL(gemv_mma_silu_m3, 1, EPI_SILU, 3)
MMA_KERNEL(gemv_mma_store_m4, 1, EPI_STORE, 4)
MMA_KERNEL(gemv_mma_resid_m4, 1, EPI_RESID, 4)
MMA_KERNEL(gemv_mma_silu_m4, 1, EPI_SILU, 4)

// ss[m] = sum_k x[m, k]^2 (the first norm of a forward). One block per row.
extern "C" __global__ void row_sumsq(const bf16_t* __restrict__ x, float* __restrict__ ss, int K) {
    __shared__ float red[32];
    const bf16_t* row = x + (size_t)blockIdx.x * K;
    float s = 0.f;
    for (int i = threadIdx.x; i < K; i += blockDim.x) {
        float v = bf2f(row[i]);
        s += v * v;
    }
    s = block_sum(s, red);
    if (threadIdx.x == 0) ss[blockIdx.x] = s;
}

// h = RMSNorm(x) * nw from precomputed row sums of squares; grid (ceil(K / 1024), M), 128
// threads, 8 elements each.
extern "C" __global__ void rms_apply(const bf16_t* __restrict__ x, const float* __restrict__ ss,
                                     const bf16_t* __restrict__ nw, bf16_t* __restrict__ h, int K,
                                     float eps) {
    const int r = blockIdx.y, c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= K / 8) return;
    const float inv = rsqrtf(ss[r] / (float)K + eps);
    const uint4 xv = ((const uint4*)(x + (size_t)r * K))[c];
    ((uint4*)(h + (size_t)r * K))[c] = norm8(xv, ((const uint4*)nw)[c], inv);
}
