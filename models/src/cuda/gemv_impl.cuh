// Skinny GEMMs for decode, verification and draft blocks: y[m, n] = sum_k x[m, k] * w[n, k]
// for M <= 64 rows (x [M, K], w nn.Linear layout [N, K], bf16 in and out, f32 accumulation).
// Batch-1 steps are bound by streaming the weights, so the kernels are built around the loads:
//   gemv_rows_*  M = 1 on CUDA cores: each warp instruction reads 512 contiguous bytes of one
//                weight row (R rows per warp, U instructions per row in flight), x from L1;
//   gemv_mma_*   M <= 64 on tensor cores (mma.m16n8k16): each warp owns 8 weight rows, reads
//                them with the same row-contiguous loads and re-reads them from shared memory
//                in the fragment layout; the K order inside each 32-wide chunk is permuted
//                identically for x and w so one 16-byte read feeds two mma fragments; KS warps
//                of a block split K when N is small.
// Epilogues fused into both:
//   STORE  y = bf16(acc);
//   SILU   w holds gate rows [0, N) then up rows [N, 2N); y = bf16(silu(gate)) * bf16(up),
//          rounded as silu_mul does;
//   RESID  y = bf16(resid + bf16(acc)) (the residual stream) and ss[m] = sum_n y[m, n]^2 for
//          the next RMSNorm: blocks leave per-row partial sums, the last block to finish adds
//          them in a fixed order (deterministic) and re-arms the counter;
// After its own loads, every block of an M = 1 kernel can start pulling a share of the next
// product's leading weight bytes into L2 (l2_prefetch), so the next kernel's first loads hit L2;
// and before the M = 1 kernel, NORM: its input is RMSNorm(x) = bf16(x * rsqrt(ss / K + eps) * nw),
// computed while x streams in (rounded as add_rmsnorm rounds it), so a decode layer needs no
// separate norm launches; rms_apply does the same for the tensor-core kernel's inputs.

#pragma once
#include "common.cuh"

enum { EPI_STORE = 0, EPI_RESID = 1, EPI_SILU = 2 };
// The input norm of the one-row kernels: none, from the row sums of squares ss_in, or summed
// by each block from x itself.
enum { NORM_NONE = 0, NORM_SS = 1, NORM_SELF = 2 };

__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

// Starts pulling this warp's share of bytes [0, bytes) of `pf` (the next product's weights)
// into L2 and returns at once (bulk prefetch, sm_90; a hint, with no completion to wait for).
// Called by warps that are done with their own loads, so the copies fill the memory system's
// slack at the end of a kernel and in the launch gap. 16-byte units, in 32-bit math: a 64-bit
// division here costs the kernel registers (and so resident blocks).
__device__ __forceinline__ void l2_prefetch(const char* pf, u64 bytes) {
    if (pf == nullptr || bytes < 16 || (threadIdx.x & 31) != 0) return;
    const u32 units = (u32)(bytes >> 4), warps = gridDim.x * (blockDim.x >> 5);
    const u32 per_warp = (units + warps - 1) / warps;
    const u32 b0 = (blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * per_warp;
    const u32 b1 = min(units, b0 + per_warp);
    for (u32 u = b0; u < b1; u += 2048) {  // at most 32 KB per instruction
        const u32 n = min(b1 - u, 2048u) << 4;
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(pf + ((u64)u << 4)), "r"(n)
                     : "memory");
    }
}

__device__ __forceinline__ float dot8(uint4 a, uint4 b) {
    float s = lo(a.x) * lo(b.x);
    s = fmaf(hi(a.x), hi(b.x), s);
    s = fmaf(lo(a.y), lo(b.y), s);
    s = fmaf(hi(a.y), hi(b.y), s);
    s = fmaf(lo(a.z), lo(b.z), s);
    s = fmaf(hi(a.z), hi(b.z), s);
    s = fmaf(lo(a.w), lo(b.w), s);
    s = fmaf(hi(a.w), hi(b.w), s);
    return s;
}


// y, after the residual add, for one output pair; returns its sum of squares.
__device__ __forceinline__ float store_pair(int epi, bf16_t* y, const bf16_t* resid, size_t at,
                                            float v0, float v1, float u0, float u1) {
    bf16_t o0, o1;
    float sq = 0.f;
    if (epi == EPI_STORE) {
        o0 = f2bf(v0);
        o1 = f2bf(v1);
    } else if (epi == EPI_RESID) {
        u32 rv = *(const u32*)(resid + at);
        o0 = f2bf(lo(rv) + bf2f(f2bf(v0)));
        o1 = f2bf(hi(rv) + bf2f(f2bf(v1)));
        sq = bf2f(o0) * bf2f(o0) + bf2f(o1) * bf2f(o1);
    } else {
        float g0 = bf2f(f2bf(v0)), g1 = bf2f(f2bf(v1));
        float b0 = bf2f(f2bf(u0)), b1 = bf2f(f2bf(u1));
        o0 = f2bf(bf2f(f2bf(g0 / (1.f + __expf(-g0)))) * b0);
        o1 = f2bf(bf2f(f2bf(g1 / (1.f + __expf(-g1)))) * b1);
    }
    *(u32*)(y + at) = (u32)o0 | ((u32)o1 << 16);
    return sq;
}

// Sum of squares of the K-wide bf16 row x, the same value in every block (a fixed order per
// thread, then block_sum); called by every thread of the block.
__device__ __forceinline__ float row_sumsq_block(const bf16_t* __restrict__ x, int K) {
    __shared__ float red[32];
    float s = 0.f;
    for (int i = threadIdx.x; i < K / 8; i += blockDim.x) {
        uint4 v = __ldg((const uint4*)x + i);
        s += dot8(v, v);
    }
    return block_sum(s, red);
}

// RESID tail, called by every thread of every block once `blocksum[r]` (shared) holds the
// block's sum of y[r, :]^2 over its columns: partials per block, then the last block adds them
// in block order into ss_out and re-arms the counter.
__device__ void resid_tail(const float* blocksum, int M, float* part, float* ss_out, u32* counter) {
    __shared__ u32 is_last;
    if ((int)threadIdx.x < M) {
        part[(size_t)blockIdx.x * M + threadIdx.x] = blocksum[threadIdx.x];
        __threadfence();
    }
    __syncthreads();
    if (threadIdx.x == 0) is_last = atomicAdd(counter, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nwarps = blockDim.x >> 5;
    for (int r = warp; r < M; r += nwarps) {
        float s = 0.f;
        for (int b = lane; b < (int)gridDim.x; b += 32) s += __ldcg(part + (size_t)b * M + r);
        s = warp_sum(s);
        if (lane == 0) ss_out[r] = s;
    }
    if (threadIdx.x == 0) *counter = 0u;
}

// ---- M = 1 on CUDA cores ----------------------------------------------------------------
// Block of 4 warps; KS consecutive warps own R consecutive output columns (SILU: R gate and R
// up rows) and split their K range in KS contiguous parts, added in part order (so the sums do
// not depend on timing).
template <int R, int U, int EPI, int NORM, int KS>
__device__ void rows_impl(const bf16_t* __restrict__ x, const bf16_t* __restrict__ w,
                          bf16_t* __restrict__ y, int N, int K, const bf16_t* __restrict__ resid,
                          const bf16_t* __restrict__ nw, float eps, const float* ss_in,
                          float* ss_out, float* part, u32* counter, const char* pf, u64 pf_bytes) {
    constexpr int RW = EPI == EPI_SILU ? 2 * R : R;
    __shared__ float wsum[4];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int grp = warp / KS, split = warp % KS;
    const int n0 = (blockIdx.x * (4 / KS) + grp) * R;
    const bool active = n0 < N;
    // Launched as a dependent (`cuda::pdl`): wait for the kernel before (x, the sums of
    // squares, the residual, the counter are its or earlier ones') before reading them. The
    // next kernel may launch once every block here is past its loads (pdl_launch_dependents
    // below): its launch hides in this one's tail, its blocks take no slot a wave of this one
    // still needs, and it comes after this kernel's own wait. Both return at once without PDL.
    // (Measured, H100, session 28: loading the first weight spans before the wait and the input
    // norm made every decode 1-3% slower; pulling a warp's weight rows into L2 before the wait,
    // with the trigger at the kernel's start, the 27B's 13%, session 26.)
    float acc[RW];
#pragma unroll
    for (int r = 0; r < RW; ++r) acc[r] = 0.f;
    const uint4* wrow[RW];
#pragma unroll
    for (int r = 0; r < RW; ++r)
        wrow[r] = (const uint4*)(w + (size_t)((r < R ? 0 : N) + (active ? n0 : 0) + (r % R)) * K) + lane;
    const int spans = K >> 8;  // 256 elements per warp instruction
    const int per = (spans + KS - 1) / KS, it0 = split * per;
    const int iters = active ? min(spans, it0 + per) : it0;
    const uint4* xv = (const uint4*)x + lane;
    const uint4* nv = (const uint4*)nw + lane;
    auto load = [&](uint4 (&wv)[U][RW], int it) {
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int r = 0; r < RW; ++r)
                wv[u][r] = it + u < iters ? ld_stream(wrow[r] + (it + u) * 32) : make_uint4(0, 0, 0, 0);
    };
    auto consume = [&](const uint4 (&wv)[U][RW], int it, float inv) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            if (it + u >= iters) break;
            uint4 xx = __ldg(xv + (it + u) * 32);
            if (NORM) xx = norm8(xx, __ldg(nv + (it + u) * 32), inv);
#pragma unroll
            for (int r = 0; r < RW; ++r) acc[r] += dot8(wv[u][r], xx);
        }
    };
    pdl_wait();
    // NORM_SELF: every block sums x's squares itself (x is one 8-16 KB row, in L2), so the
    // kernel that wrote x needs no cross-block reduction at its end. (Not in the SiLU kernels:
    // at their 40-register bound the extra block reduction spills.)
    const float inv_self = NORM == NORM_SELF ? rsqrtf(row_sumsq_block(x, K) / (float)K + eps) : 0.f;
    if (active) {
        const float inv = NORM == NORM_SS ? rsqrtf(ss_in[0] / (float)K + eps) : inv_self;
        for (int it = it0; it < iters; it += U) {
            uint4 wv[U][RW];
            load(wv, it);
            consume(wv, it, inv);
        }
    }
    pdl_launch_dependents();
    if (active) {
#pragma unroll
        for (int r = 0; r < RW; ++r) acc[r] = warp_sum(acc[r]);
    }
    if (KS > 1) {
        __shared__ float red[4][RW];
        if (lane == 0)
#pragma unroll
            for (int r = 0; r < RW; ++r) red[warp][r] = acc[r];
        __syncthreads();
        if (split == 0)
            for (int k = 1; k < KS; ++k)
#pragma unroll
                for (int r = 0; r < RW; ++r) acc[r] += red[warp + k][r];
    }
    l2_prefetch(pf, pf_bytes);
    float sq = 0.f;
    if (active && lane == 0 && split == 0) {
#pragma unroll
        for (int r = 0; r < R; r += 2)
            sq += store_pair(EPI, y, resid, n0 + r, acc[r], acc[r + 1],
                             EPI == EPI_SILU ? acc[R + r] : 0.f, EPI == EPI_SILU ? acc[R + r + 1] : 0.f);
    }
    if (EPI != EPI_RESID || ss_out == nullptr) return;
    if (lane == 0) wsum[warp] = sq;
    __syncthreads();
    __shared__ float blocksum[1];
    if (threadIdx.x == 0) blocksum[0] = wsum[0] + wsum[1] + wsum[2] + wsum[3];
    __syncthreads();
    resid_tail(blocksum, 1, part, ss_out, counter);
}

// ---- M <= 64 on tensor cores -------------------------------------------------------------
// A warp owns 8 weight rows (SILU: 8 gate + 8 up) and walks its K range in 256-wide spans:
// each span of a row is one row-contiguous 512-byte warp load (as the M = 1 kernel reads),
// staged through the warp's own shared memory (row stride 576 bytes: conflict-free both ways)
// and re-read in the mma fragment layout; U spans per row in flight. MT m16 tiles of x (M <=
// 16 MT rows) share every weight fragment read from shared memory, so the weights are still
// read once whatever the row count; each row's sum runs in the same order for every MT (the
// m16 tiles are independent), so a row's result does not depend on how many rows come with it.
// GATHER: row r of x is row xrows[r] of the buffer (the MoE kernels' rows routed to one
// expert, moe.cu); otherwise rows are consecutive.
template <int U, int EPI, int MT, bool GATHER = false>
__device__ void mma_impl(const bf16_t* __restrict__ x, const bf16_t* __restrict__ w,
                         bf16_t* __restrict__ y, int M, int N, int K, int ks,
                         const bf16_t* __restrict__ resid, float* ss_out, float* part,
                         u32* counter, const u32* __restrict__ xrows = nullptr) {
    // Buffer row of x's row r (r < M).
    auto xrow = [&](int r) -> size_t { return GATHER ? (size_t)__ldg(xrows + r) : (size_t)r; };
    constexpr int NTW = EPI == EPI_SILU ? 2 : 1;  // 8-row weight tiles per warp
    constexpr int ROWS = 8 * NTW, STRIDE = 36;    // uint4 per staged row
    constexpr int MR = 16 * MT;                   // most x rows
    // The K-split reduction reuses the staging buffer: MT NTW 4 x 32 floats per warp.
    static_assert(MT * NTW * 4 * 32 * 4 <= ROWS * STRIDE * 16, "reduction fits the stage");
    __shared__ uint4 stage[4][ROWS * STRIDE];
    __shared__ float rowsum[4][MR];
    __shared__ float blocksum[MR];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tig = lane & 3;
    const int groups = 4 / ks, grp = warp / ks, split = warp % ks;
    const int n0 = (blockIdx.x * groups + grp) * 8;  // this warp's first output column
    const bool active = n0 < N;
    const int spans = K >> 8, per = (spans + ks - 1) / ks;
    const int s_begin = split * per, s_end = min(spans, s_begin + per);
    const uint4* wrow[ROWS];
#pragma unroll
    for (int i = 0; i < ROWS; ++i)
        wrow[i] = (const uint4*)(w + (size_t)((i < 8 ? 0 : N) + (active ? n0 : 0) + (i & 7)) * K) + lane;
    float c[MT][NTW][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int j = 0; j < NTW; ++j) c[mt][j][0] = c[mt][j][1] = c[mt][j][2] = c[mt][j][3] = 0.f;
    const uint4 zero = make_uint4(0, 0, 0, 0);
    uint4* st = stage[warp];
    if (active) {
        for (int sp0 = s_begin; sp0 < s_end; sp0 += U) {
            uint4 wv[U][ROWS];
#pragma unroll
            for (int u = 0; u < U; ++u)
#pragma unroll
                for (int i = 0; i < ROWS; ++i)
                    wv[u][i] = sp0 + u < s_end ? ld_stream(wrow[i] + (sp0 + u) * 32) : zero;
#pragma unroll
            for (int u = 0; u < U; ++u) {
                if (sp0 + u >= s_end) break;
                __syncwarp();
#pragma unroll
                for (int i = 0; i < ROWS; ++i) st[i * STRIDE + lane] = wv[u][i];
                __syncwarp();
                if (MT == 1) {
                    // All x fragments of the span first, so their L1 latencies overlap.
                    const bool lo_row = g < M, hi_row = g + 8 < M;
                    const size_t r0 = GATHER ? (lo_row ? xrow(g) : 0) : (size_t)g;
                    const size_t r1 = GATHER ? (hi_row ? xrow(g + 8) : 0) : (size_t)(g + 8);
                    const uint4* x0 = (const uint4*)(x + r0 * K) + tig;
                    const uint4* x1 = (const uint4*)(x + r1 * K) + tig;
                    uint4 xa[8], xb[8];
#pragma unroll
                    for (int cc = 0; cc < 8; ++cc) {
                        const int ch = (sp0 + u) * 8 + cc;
                        xa[cc] = lo_row ? __ldg(x0 + ch * 4) : zero;
                        xb[cc] = hi_row ? __ldg(x1 + ch * 4) : zero;
                    }
#pragma unroll
                    for (int cc = 0; cc < 8; ++cc) {
#pragma unroll
                        for (int j = 0; j < NTW; ++j) {
                            uint4 b = st[(j * 8 + g) * STRIDE + cc * 4 + tig];
                            mma_bf16(c[0][j], xa[cc].x, xb[cc].x, xa[cc].y, xb[cc].y, b.x, b.y);
                            mma_bf16(c[0][j], xa[cc].z, xb[cc].z, xa[cc].w, xb[cc].w, b.z, b.w);
                        }
                    }
                } else {
                    // Two 32-wide chunks of every m16 tile at a time (registers bound it).
#pragma unroll
                    for (int c2 = 0; c2 < 8; c2 += 2) {
                        uint4 xa[MT][2], xb[MT][2];
#pragma unroll
                        for (int mt = 0; mt < MT; ++mt) {
                            const int ra = 16 * mt + g, rb = ra + 8;
#pragma unroll
                            for (int h = 0; h < 2; ++h) {
                                const int ch = (sp0 + u) * 8 + c2 + h;
                                xa[mt][h] = ra < M ? __ldg((const uint4*)(x + xrow(ra) * K) + tig + ch * 4) : zero;
                                xb[mt][h] = rb < M ? __ldg((const uint4*)(x + xrow(rb) * K) + tig + ch * 4) : zero;
                            }
                        }
#pragma unroll
                        for (int h = 0; h < 2; ++h) {
#pragma unroll
                            for (int j = 0; j < NTW; ++j) {
                                uint4 b = st[(j * 8 + g) * STRIDE + (c2 + h) * 4 + tig];
#pragma unroll
                                for (int mt = 0; mt < MT; ++mt) {
                                    const uint4 a0 = xa[mt][h], a1 = xb[mt][h];
                                    mma_bf16(c[mt][j], a0.x, a1.x, a0.y, a1.y, b.x, b.y);
                                    mma_bf16(c[mt][j], a0.z, a1.z, a0.w, a1.w, b.z, b.w);
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    // The K splits of one tile meet in shared memory (the staging buffers, every warp done
    // with them); split 0 adds them in split order.
    if (ks > 1) {
        __syncthreads();
        float* red = (float*)stage[warp];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int j = 0; j < NTW; ++j)
#pragma unroll
                for (int e = 0; e < 4; ++e) red[((mt * NTW + j) * 4 + e) * 32 + lane] = c[mt][j][e];
        __syncthreads();
        if (split == 0) {
            for (int s = 1; s < ks; ++s) {
                const float* other = (const float*)stage[warp + s];
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int j = 0; j < NTW; ++j)
#pragma unroll
                        for (int e = 0; e < 4; ++e)
                            c[mt][j][e] += other[((mt * NTW + j) * 4 + e) * 32 + lane];
            }
        }
    }
    const bool writer = active && split == 0;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            int row = 16 * mt + g + 8 * half;
            float sq = 0.f;
            if (writer && row < M)
                sq = store_pair(EPI, y, resid, (size_t)row * N + n0 + tig * 2, c[mt][0][2 * half],
                                c[mt][0][2 * half + 1], c[mt][NTW - 1][2 * half],
                                c[mt][NTW - 1][2 * half + 1]);
            if (EPI == EPI_RESID) {
                sq += __shfl_xor_sync(0xffffffffu, sq, 1);
                sq += __shfl_xor_sync(0xffffffffu, sq, 2);
                if (split == 0 && tig == 0) rowsum[grp][row] = sq;
            }
        }
    }
    if (EPI != EPI_RESID) return;
    __syncthreads();
    if ((int)threadIdx.x < M) {
        float s = 0.f;
        for (int q = 0; q < groups; ++q) s += rowsum[q][threadIdx.x];
        blocksum[threadIdx.x] = s;
    }
    __syncthreads();
    resid_tail(blocksum, M, part, ss_out, counter);
}

