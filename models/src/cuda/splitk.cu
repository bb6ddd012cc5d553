// Split-K skinny GEMM for batched decode steps: y[m, n] = sum_k x[m, k] * w[n, k] for M <= 64
// rows (x [M, K], w nn.Linear layout [N, K], bf16 in and out, f32 accumulation), N % 64 == 0,
// K % 32 == 0. The 17..64-row kernels of gemv.cu lose to cuBLAS because each warp re-reads x
// through L1 for every 8 weight rows; here one block of 4 warps owns 64 output columns and a
// slice of K, stages both the x tile (M x 32, shared by all warps) and the weight tile (64 or
// 128 rows x 32) in shared memory with cp.async (STAGES deep, so several tiles of weights are
// in flight per block), reads fragments with ldmatrix and multiplies with mma.m16n8k16.
// K is split over gridDim.y blocks so that even a 4096-column output fills the machine; the
// splits leave f32 partials and the last block of a column tile to arrive (a counter per
// tile, re-armed by that block) adds them in split order 0, 1, ... (deterministic: the order
// never depends on which block arrives last) and applies the epilogue:
//   STORE  y = bf16(acc);
//   RESID  y = bf16(resid + bf16(acc)) (rounded as gemv_mma's residual epilogue);
//   SILU   w holds gate rows [0, N) then up rows [N, 2N) (y is [M, N]); each block stages 64
//          gate and the matching 64 up rows; y = bf16(bf16(silu(bf16(g))) * bf16(u)), rounded
//          as the cuBLAS product followed by silu_mul.

#include "common.cuh"

enum { SK_STORE = 0, SK_RESID = 1, SK_SILU = 2 };

#define SK_BN 64       // output columns per block
#define SK_BK 32       // K per pipeline stage
#define SK_LD 40       // shared row stride in bf16: 80 bytes put the 8 rows of an ldmatrix
                       // in distinct 16-byte bank groups
#define SK_THREADS 128

__device__ __forceinline__ u32 smem_addr(const void* p) {
    return (u32)__cvta_generic_to_shared(p);
}

// 16 bytes global -> shared, bypassing L1; `bytes` 0 fills zeros (x rows past M).
__device__ __forceinline__ void cp16(u32 dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
__device__ __forceinline__ void ldm4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}

// Shared weight row of n8 tile j of `warp`: for SILU tiles 0, 1 are gate rows and 2, 3 the up
// rows of the same output columns (64 rows further).
__device__ __forceinline__ int sk_wrow(int j, int warp) {
    return (j >> 1) * SK_BN + warp * 16 + (j & 1) * 8;
}

template <int MT, int EPI, int STAGES>
__device__ __forceinline__ void splitk_body(const bf16_t* __restrict__ x,
                                            const bf16_t* __restrict__ w,
                                            const bf16_t* __restrict__ resid,
                                            bf16_t* __restrict__ y, float* __restrict__ part,
                                            u32* __restrict__ counters, int M, int N, int K,
                                            int chunks_per_split) {
    constexpr int WROWS = EPI == SK_SILU ? 2 * SK_BN : SK_BN;
    constexpr int NT = WROWS / 32;  // n8 tiles per warp
    __shared__ __align__(128) bf16_t xs[STAGES][MT * 16][SK_LD];
    __shared__ __align__(128) bf16_t ws[STAGES][WROWS][SK_LD];
    __shared__ u32 is_last;
    const int tile = blockIdx.x, split = blockIdx.y, splits = gridDim.y;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int c0 = split * chunks_per_split;
    const int nch = min(chunks_per_split, K / SK_BK - c0);

    auto load = [&](int c, int s) {
        const int k0 = c * SK_BK;
#pragma unroll
        for (int i = tid; i < WROWS * 4; i += SK_THREADS) {
            const int r = i >> 2, q = i & 3;
            const size_t g = EPI == SK_SILU && r >= SK_BN ? (size_t)N + tile * SK_BN + (r - SK_BN)
                                                          : (size_t)tile * SK_BN + r;
            cp16(smem_addr(&ws[s][r][q * 8]), w + g * K + k0 + q * 8, 16);
        }
#pragma unroll
        for (int i = tid; i < MT * 16 * 4; i += SK_THREADS) {
            const int r = i >> 2, q = i & 3;
            const bool live = r < M;
            cp16(smem_addr(&xs[s][r][q * 8]), x + (size_t)(live ? r : 0) * K + k0 + q * 8,
                 live ? 16 : 0);
        }
    };

    float acc[MT][NT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[mt][j][e] = 0.f;

#pragma unroll
    for (int i = 0; i < STAGES - 1; ++i) {
        if (i < nch) load(c0 + i, i);
        cp_commit();
    }
    for (int i = 0; i < nch; ++i) {
        cp_wait<STAGES - 2>();
        __syncthreads();
        const int s = i % STAGES;
#pragma unroll
        for (int kk = 0; kk < SK_BK; kk += 16) {
            u32 a[MT][4];
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
                ldm4(smem_addr(&xs[s][mt * 16 + (lane & 15)][kk + (lane >> 4) * 8]), a[mt][0],
                     a[mt][1], a[mt][2], a[mt][3]);
#pragma unroll
            for (int jp = 0; jp < NT / 2; ++jp) {
                // Matrices (tile 2jp, k 0-7), (2jp, k 8-15), (2jp+1, k 0-7), (2jp+1, k 8-15).
                const int mi = lane >> 3;
                const int row = sk_wrow(2 * jp + (mi >> 1), warp) + (lane & 7);
                u32 b0, b1, b2, b3;
                ldm4(smem_addr(&ws[s][row][kk + (mi & 1) * 8]), b0, b1, b2, b3);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    mma_bf16(acc[mt][2 * jp], a[mt][0], a[mt][1], a[mt][2], a[mt][3], b0, b1);
                    mma_bf16(acc[mt][2 * jp + 1], a[mt][0], a[mt][1], a[mt][2], a[mt][3], b2, b3);
                }
            }
        }
        const int next = i + STAGES - 1;
        if (next < nch) load(c0 + next, next % STAGES);
        cp_commit();
    }
    cp_wait<0>();

    if (splits > 1) {
        // Partials [split][tile][MT * 16][WROWS]; rows past M are neither written nor read.
        const size_t tile_elems = (size_t)MT * 16 * WROWS;
        float* mine = part + ((size_t)split * gridDim.x + tile) * tile_elems;
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int j = 0; j < NT; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int row = mt * 16 + (lane >> 2) + (e >> 1) * 8;
                    const int col = sk_wrow(j, warp) + (lane & 3) * 2 + (e & 1);
                    if (row < M) mine[row * WROWS + col] = acc[mt][j][e];
                }
        __threadfence();
        __syncthreads();
        if (tid == 0) is_last = atomicAdd(&counters[tile], 1u) == (u32)(splits - 1);
        __syncthreads();
        if (!is_last) return;
        __threadfence();
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int j = 0; j < NT; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int row = mt * 16 + (lane >> 2) + (e >> 1) * 8;
                    const int col = sk_wrow(j, warp) + (lane & 3) * 2 + (e & 1);
                    float v = 0.f;
                    if (row < M)
                        for (int sp = 0; sp < splits; ++sp)
                            v += __ldcg(part + ((size_t)sp * gridDim.x + tile) * tile_elems +
                                        row * WROWS + col);
                    acc[mt][j][e] = v;
                }
        if (tid == 0) counters[tile] = 0;
    }

#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int row = mt * 16 + (lane >> 2) + (e >> 1) * 8;
                if (row >= M) continue;
                const int col = tile * SK_BN + warp * 16 + j * 8 + (lane & 3) * 2 + (e & 1);
                const size_t o = (size_t)row * N + col;
                const float g = acc[mt][j][e];
                bf16_t r;
                if (EPI == SK_STORE) {
                    r = f2bf(g);
                } else if (EPI == SK_RESID) {
                    r = f2bf(bf2f(resid[o]) + bf2f(f2bf(g)));
                } else {
                    const float gb = bf2f(f2bf(g));
                    const float u = bf2f(f2bf(acc[mt][j + (NT > 2 ? 2 : 0)][e]));
                    const float sg = bf2f(f2bf(gb / (1.f + __expf(-gb))));
                    r = f2bf(sg * u);
                }
                y[o] = r;
            }
}

#define SK_KERNEL(NAME, MT, EPI, STAGES)                                                        \
    extern "C" __global__ void __launch_bounds__(SK_THREADS)                                     \
        NAME(const bf16_t* __restrict__ x, const bf16_t* __restrict__ w,                        \
             const bf16_t* __restrict__ resid, bf16_t* __restrict__ y, float* __restrict__ part, \
             u32* __restrict__ counters, int M, int N, int K, int chunks_per_split) {           \
        splitk_body<MT, EPI, STAGES>(x, w, resid, y, part, counters, M, N, K,                  \
                                     chunks_per_split);                                         \
    }

// 4 stages of 64 weight rows (40 KB of shared memory at 4 m16 tiles), 3 of 128 for SILU (45 KB):
// static shared memory stays under 48 KB.
SK_KERNEL(splitk_store_m1, 1, SK_STORE, 4)
SK_KERNEL(splitk_store_m2, 2, SK_STORE, 4)
SK_KERNEL(splitk_store_m3, 3, SK_STORE, 4)
SK_KERNEL(splitk_store_m4, 4, SK_STORE, 4)
SK_KERNEL(splitk_resid_m1, 1, SK_RESID, 4)
SK_KERNEL(splitk_resid_m2, 2, SK_RESID, 4)
SK_KERNEL(splitk_resid_m3, 3, SK_RESID, 4)
SK_KERNEL(splitk_resid_m4, 4, SK_RESID, 4)
SK_KERNEL(splitk_silu_m1, 1, SK_SILU, 3)
SK_KERNEL(splitk_silu_m2, 2, SK_SILU, 3)
SK_KERNEL(splitk_silu_m3, 3, SK_SILU, 3)
SK_KERNEL(splitk_silu_m4, 4, SK_SILU, 3)
