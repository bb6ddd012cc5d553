// The attention of a batched one-token decode step (one new query token per sequence, B
// sequences through their page tables), specialised for it: what attn_decode.cu's batched
// launch does (q/k RMSNorm + RoPE from the raw qkv GEMM output, the new K/V row into the
// cache, split-K flash-decoding over the cache, the last block of a (sequence, KV head)
// merging the splits), with the key stream built for bandwidth. Compiled to PTX by
// models/build.rs.
//
// Grid (KV head, key split, sequence), 4 warps per block. The G = nh / nkv query heads of the
// block's KV head are the rows of one m16 tile (G <= 16), so every K/V byte is read once for
// all of them. A split is a run of 16-key tiles; warp w takes tiles w, w + 4, ... of it, each
// through its OWN ring of S shared-memory stages filled by cp.async (16-byte pieces, no block
// barrier in the loop: a warp waits only for its own loads), S - 1 tiles in flight per warp
// while it computes one. K fragments come by ldmatrix, V fragments by ldmatrix.trans (rows of
// 272 bytes: conflict-free), S = Q K^T and O += P V on tensor cores, f32 online softmax
// (softmax_step, as the other flash kernels round P). Splits per sequence are fixed by the
// host from B alone; the tiles per split are set on the device from the live length, so one
// CUDA graph fits every length. The new token's K/V row (position cache_len) is computed by
// the block whose split holds it, written to the cache and into its tile in shared memory
// (no block reads that cache row).

#include "common.cuh"

#define D 128     // head dim
#define TK 16     // keys per warp tile
#define RPAD 136  // bf16 per shared row: 128 + 8 (272 bytes), ldmatrix rows on distinct banks
#define NWS 4     // warps per block
#define MAXG 16   // query heads per KV head (rows of the m16 tile)

#include "norm_rope.cuh"

struct StepArgs {
    const bf16_t* qkv;  // [seqs, (nh + 2 nkv) D]
    const bf16_t* qw;
    const bf16_t* kw;
    const float* cos_t;
    const float* sin_t;
    const u32* positions;  // [seqs]
    const u32* cache_len;  // [seqs]
    const u32* pt;         // [seqs, pt_stride]
    bf16_t* kc;            // [nkv, cap, D]
    bf16_t* vc;
    float* acc;    // [seqs, splits, nh, D] partials
    float* ml;     // [seqs, splits, nh, 2] (max, sum)
    u32* counter;  // [seqs, nkv], zero at rest
    bf16_t* out;   // [seqs, nh D]
    int nh, nkv, cap, pt_stride;
    float scale, eps;
};

__device__ __forceinline__ u32 smem_addr(const void* p) {
    return (u32)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ void cp16(u32 dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void wait_groups() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
__device__ __forceinline__ void ldsm4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}
__device__ __forceinline__ void ldsm4t(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}

// The page-table window of a warp: lane i holds the page of logical page base + i.
struct Pages {
    const u32* pt;  // the sequence's table (null: rows in order)
    int n;          // its entries
    int base;
    u32 mine;
    __device__ __forceinline__ void load(int first, int lane) {
        base = first;
        mine = pt && first + lane < n ? __ldg(pt + first + lane) : 0u;
    }
    // Buffer row of the first key of logical page p (p >= base, warp-uniform).
    __device__ __forceinline__ size_t row(int p, int lane) {
        if (!pt) return (size_t)p * KV_PAGE;
        if (p - base >= 32) load(p, lane);
        return (size_t)__shfl_sync(0xffffffffu, mine, p - base) * KV_PAGE;
    }
};

template <int S>
__device__ __forceinline__ void attn_step_impl(const StepArgs& a) {
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ u32 is_last;
    __shared__ float rowD[MAXG];
    const int kvh = blockIdx.x, split = blockIdx.y, seq = blockIdx.z;
    const int nsplit = gridDim.y;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, tig = lane & 3;
    const int G = a.nh / a.nkv;
    const int width = (a.nh + 2 * a.nkv) * D;
    const bf16_t* qkv = a.qkv + (size_t)seq * width;
    // The page-table window from page 0 is loaded with the length (one round trip for both;
    // a split starting 32 pages on reloads it).
    Pages pg;
    pg.pt = a.pt ? a.pt + (size_t)seq * a.pt_stride : nullptr;
    pg.n = a.pt_stride;
    pg.load(0, lane);
    const int c = (int)a.cache_len[seq];
    const int L = c + 1;
    const int ntiles = (L + TK - 1) / TK;
    const int tps = (ntiles + nsplit - 1) / nsplit;  // tiles per split
    const int t0 = split * tps, t1 = min(ntiles, t0 + tps);
    const int used = (ntiles + tps - 1) / tps;  // splits holding keys
    const size_t hrow = (size_t)kvh * a.cap;    // the KV head's first buffer row
    const size_t nrows = (size_t)a.nh;
    // Stages: warp-private rings of S x {K, V} x TK rows, then the q rows and the new K/V.
    bf16_t* ring = (bf16_t*)smem + (size_t)warp * S * 2 * TK * RPAD;
    bf16_t* qs = (bf16_t*)smem + (size_t)NWS * S * 2 * TK * RPAD;  // MAXG x RPAD
    bf16_t* knew = qs + MAXG * RPAD;                                 // K row, then V row
    bf16_t* vnew = knew + RPAD;
    u32* cnt = a.counter + (size_t)seq * a.nkv + kvh;

    if (t0 < t1) {
        const int nw = max(0, (t1 - t0 - warp + NWS - 1) / NWS);  // this warp's tiles
        // Committed keys of the warp's i-th tile into stage `st`: piece e = lane + 32 j of
        // 16 keys x 16 sixteen-byte pieces, K and V alike. Keys >= c are left to the fix-up.
        auto issue = [&](int i, int st) {
            const int k0 = (t0 + warp + NWS * i) * TK;
            const size_t base = (hrow + pg.row(k0 / KV_PAGE, lane) + k0 % KV_PAGE) * D;
            const u32 kb = smem_addr(ring + st * 2 * TK * RPAD), vb = kb + TK * RPAD * 2;
#pragma unroll
            for (int j = 0; j < TK * 16 / 32; ++j) {
                const int e = lane + 32 * j, r = e >> 4, p = e & 15;
                if (k0 + r < c) {
                    const size_t off = base + (size_t)r * D + 8 * p;
                    cp16(kb + (r * RPAD + 8 * p) * 2, a.kc + off);
                    cp16(vb + (r * RPAD + 8 * p) * 2, a.vc + off);
                }
            }
        };
        // The first tiles' loads go out before the q rows are built, hiding their latency.
#pragma unroll
        for (int i = 0; i < S - 1; ++i) {
            if (i < nw) issue(i, i);
            commit();
        }
        // Launched as a dependent (`cuda::pdl`): the page table, the length and the committed
        // keys are older than the kernel before this one (the q/k/v projection, whose trigger
        // follows its own wait), so their loads above go out before waiting for it; qkv is its.
        pdl_wait();
        // q heads (jobs 0..G-1) and, in the block holding key c, the new K/V row (job G):
        // warp w takes jobs w, w + 4, ..., four per norm_rope4 batch.
        const bool holds_new = c / TK >= t0 && c / TK < t1;
        const int jobs = G + (holds_new ? 1 : 0);
        for (int j0 = warp; j0 < jobs; j0 += 4 * NWS) {
            Batch h;
#pragma unroll
            for (int b = 0; b < 4; ++b) {
                const int j = j0 + NWS * b;
                h.src[b] = nullptr;
                h.vsrc[b] = nullptr;
                h.w[b] = a.qw;
                h.tok[b] = seq;
                if (j < G) {
                    h.src[b] = qkv + (size_t)(kvh * G + j) * D;
                } else if (j < jobs) {
                    h.src[b] = qkv + (size_t)(a.nh + kvh) * D;
                    h.vsrc[b] = h.src[b] + (size_t)a.nkv * D;
                    h.w[b] = a.kw;
                }
            }
            bf16_t o4[4][4], v4[4][4];
            norm_rope4(h, a.positions, a.cos_t, a.sin_t, a.eps, lane, o4, v4);
#pragma unroll
            for (int b = 0; b < 4; ++b) {
                const int j = j0 + NWS * b;
                if (!h.src[b]) continue;
                if (!h.vsrc[b]) {
#pragma unroll
                    for (int i = 0; i < 4; ++i) qs[j * RPAD + lane + 32 * i] = o4[b][i];
                    continue;
                }
                const size_t off = (hrow + kv_row(pg.pt, c)) * D;
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    knew[lane + 32 * i] = o4[b][i];
                    vnew[lane + 32 * i] = v4[b][i];
                    a.kc[off + lane + 32 * i] = o4[b][i];
                    a.vc[off + lane + 32 * i] = v4[b][i];
                }
            }
        }
        for (int e = G * D + tid; e < MAXG * D; e += NWS * 32) qs[(e / D) * RPAD + e % D] = 0;
        __syncthreads();
        u32 qf[8][4];
        {
            const u32* qa = (const u32*)(qs + g * RPAD);
            const u32* qb = (const u32*)(qs + (g + 8) * RPAD);
#pragma unroll
            for (int kk = 0; kk < 8; ++kk) {
                qf[kk][0] = qa[kk * 8 + tig];
                qf[kk][1] = qb[kk * 8 + tig];
                qf[kk][2] = qa[kk * 8 + tig + 4];
                qf[kk][3] = qb[kk * 8 + tig + 4];
            }
        }
        float o[16][4];
#pragma unroll
        for (int nt = 0; nt < 16; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.f;
        float mA = -INFINITY, mB = -INFINITY, lA = 0.f, lB = 0.f;
        // ldmatrix row addresses (bytes within a stage): K x4 = keys 0-7 / 8-15 x dims +0 / +8
        // of a 16-dim step (b0, b1 of key tiles 0 and 1); V x4.trans = keys 0-7 / 8-15 x dims
        // +0 / +8 (b0, b1 of dim tiles 2n and 2n + 1).
        const u32 kofs = (((lane & 7) + ((lane >> 4) << 3)) * RPAD + ((lane >> 3) & 1) * 8) * 2;
        const u32 vofs = (((lane & 7) + (((lane >> 3) & 1) << 3)) * RPAD + (lane >> 4) * 8) * 2;
        for (int i = 0; i < nw; ++i) {
            if (i + S - 1 < nw) issue(i + S - 1, (i + S - 1) % S);
            commit();
            wait_groups<S - 1>();
            bf16_t* kt = ring + (i % S) * 2 * TK * RPAD;
            bf16_t* vt = kt + TK * RPAD;
            const int k0 = (t0 + warp + NWS * i) * TK;
            if (k0 + TK > c) {
                // The tile of key c: its row from the new K/V, rows past it zeroed (their
                // probabilities are 0, and 0 * stale bits could be NaN).
                for (int e = lane; e < TK * 16; e += 32) {
                    const int r = e >> 4, p = e & 15;
                    if (k0 + r < c) continue;
                    uint4 kv = make_uint4(0, 0, 0, 0), vv = kv;
                    if (k0 + r == c) {
                        kv = *(const uint4*)(knew + 8 * p);
                        vv = *(const uint4*)(vnew + 8 * p);
                    }
                    *(uint4*)(kt + r * RPAD + 8 * p) = kv;
                    *(uint4*)(vt + r * RPAD + 8 * p) = vv;
                }
            }
            __syncwarp();
            const u32 kb = smem_addr(kt), vb = smem_addr(vt);
            float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
            for (int kk = 0; kk < 8; ++kk) {
                u32 b0, b1, b2, b3;
                ldsm4(kb + kofs + kk * 32, b0, b1, b2, b3);
                mma_bf16(s[0], qf[kk][0], qf[kk][1], qf[kk][2], qf[kk][3], b0, b1);
                mma_bf16(s[1], qf[kk][0], qf[kk][1], qf[kk][2], qf[kk][3], b2, b3);
            }
            float mxA = -INFINITY, mxB = -INFINITY;
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const bool live = k0 + nt * 8 + tig * 2 + e < L;
                    s[nt][e] = live ? s[nt][e] * a.scale : -INFINITY;
                    s[nt][2 + e] = live ? s[nt][2 + e] * a.scale : -INFINITY;
                    mxA = fmaxf(mxA, s[nt][e]);
                    mxB = fmaxf(mxB, s[nt][2 + e]);
                }
            }
            u32 pf[1][4];
            softmax_step<2>(s, mxA, mxB, o, mA, mB, lA, lB, pf);
#pragma unroll
            for (int n2 = 0; n2 < 8; ++n2) {
                u32 b0, b1, b2, b3;
                ldsm4t(vb + vofs + n2 * 32, b0, b1, b2, b3);
                mma_bf16(o[2 * n2], pf[0][0], pf[0][1], pf[0][2], pf[0][3], b0, b1);
                mma_bf16(o[2 * n2 + 1], pf[0][0], pf[0][1], pf[0][2], pf[0][3], b2, b3);
            }
            __syncwarp();  // the stage is refilled next
        }
        wait_groups<0>();
        pdl_launch_dependents();  // past the key stream: the next kernel may launch
        // The block's partial: the warps merged in a fixed order through shared memory (the
        // rings are free now), one row of acc/ml (or of the output) per query head.
        __syncthreads();
        float* ob = (float*)smem;             // [NWS][G][D]
        float* mlb = ob + NWS * MAXG * D;     // [NWS][G][2]
#pragma unroll
        for (int nt = 0; nt < 16; ++nt) {
            const int dim = nt * 8 + tig * 2;
            if (g < G) {
                ob[(warp * G + g) * D + dim] = o[nt][0];
                ob[(warp * G + g) * D + dim + 1] = o[nt][1];
            }
            if (g + 8 < G) {
                ob[(warp * G + g + 8) * D + dim] = o[nt][2];
                ob[(warp * G + g + 8) * D + dim + 1] = o[nt][3];
            }
        }
        if (tig == 0) {
            if (g < G) {
                mlb[(warp * G + g) * 2] = mA;
                mlb[(warp * G + g) * 2 + 1] = lA;
            }
            if (g + 8 < G) {
                mlb[(warp * G + g + 8) * 2] = mB;
                mlb[(warp * G + g + 8) * 2 + 1] = lB;
            }
        }
        __syncthreads();
        for (int e = tid; e < G * D; e += NWS * 32) {
            const int r = e / D, dim = e % D;
            float M = -INFINITY;
#pragma unroll
            for (int k = 0; k < NWS; ++k) M = fmaxf(M, mlb[(k * G + r) * 2]);
            float num = 0.f, den = 0.f;
#pragma unroll
            for (int k = 0; k < NWS; ++k) {
                const float m = mlb[(k * G + r) * 2];
                if (m == -INFINITY) continue;
                const float w = __expf(m - M);
                den += w * mlb[(k * G + r) * 2 + 1];
                num += w * ob[(k * G + r) * D + dim];
            }
            const size_t orow = (size_t)seq * nrows + kvh * G + r;
            if (nsplit == 1) {
                a.out[orow * D + dim] = f2bf(num / den);
                continue;
            }
            const size_t prow = ((size_t)seq * nsplit + split) * nrows + kvh * G + r;
            a.acc[prow * D + dim] = num;
            if (dim == 0) {
                a.ml[prow * 2] = M;
                a.ml[prow * 2 + 1] = den;
            }
        }
    } else {
        pdl_wait();  // a block with no keys still counts itself in the counter below
        pdl_launch_dependents();
    }
    if (nsplit == 1) return;
    // Every split of the (sequence, KV head) counts itself; the last one merges.
    __threadfence();
    __syncthreads();
    if (tid == 0) is_last = atomicAdd(cnt, 1u) == (u32)nsplit - 1;
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    float* wts = (float*)smem;          // [used][G]
    float* sums = wts + used * MAXG;    // [used][G]
    for (int e = tid; e < used * G; e += NWS * 32) {
        const int sp = e / G, r = e % G;
        const size_t prow = ((size_t)seq * nsplit + sp) * nrows + kvh * G + r;
        const float2 v = __ldcg((const float2*)(a.ml + prow * 2));
        wts[sp * MAXG + r] = v.x;
        sums[sp * MAXG + r] = v.y;
    }
    __syncthreads();
    for (int r = warp; r < G; r += NWS) {
        float M = -INFINITY;
        for (int sp = lane; sp < used; sp += 32) M = fmaxf(M, wts[sp * MAXG + r]);
        M = warp_max(M);
        float den = 0.f;
        for (int sp = lane; sp < used; sp += 32) {
            const float m = wts[sp * MAXG + r];
            const float w = m == -INFINITY ? 0.f : __expf(m - M);
            den += w * sums[sp * MAXG + r];
            wts[sp * MAXG + r] = w;
        }
        den = warp_sum(den);
        if (lane == 0) rowD[r] = den;
    }
    __syncthreads();
    // Weighted sum of the partials, splits in order; independent loads, 16 in flight (one
    // sequence takes up to 33 splits: at 8 a batch its merge was five L2 round trips a row).
    for (int e = tid; e < G * (D / 4); e += NWS * 32) {
        const int r = e / (D / 4), q4 = e % (D / 4);
        const size_t orow = (size_t)seq * nrows + kvh * G + r;
        const float4* src =
            (const float4*)(a.acc + ((size_t)seq * nsplit * nrows + kvh * G + r) * D) + q4;
        const size_t stride = nrows * (D / 4);  // float4 per split
        float4 num = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 16
        for (int sp = 0; sp < used; ++sp) {
            const float w = wts[sp * MAXG + r];
            const float4 v = __ldcg(src + (size_t)sp * stride);
            num.x += w * v.x; num.y += w * v.y; num.z += w * v.z; num.w += w * v.w;
        }
        const float den = rowD[r];
        uint2 packed;
        packed.x = (u32)f2bf(num.x / den) | ((u32)f2bf(num.y / den) << 16);
        packed.y = (u32)f2bf(num.z / den) | ((u32)f2bf(num.w / den) << 16);
        *(uint2*)(a.out + orow * D + 4 * q4) = packed;
    }
    if (tid == 0) *cnt = 0u;  // re-armed for the next launch
}

// S stages per warp: 3 (104 KB of rings, 2 blocks per SM) or 2 (70 KB, 3 blocks per SM).
// Both launch as programmatic dependents (`cuda::pdl`; the waits are in attn_step_impl).
extern "C" __global__ void __launch_bounds__(NWS * 32, 2) attn_step_s3(StepArgs a) {
    attn_step_impl<3>(a);
}
extern "C" __global__ void __launch_bounds__(NWS * 32, 3) attn_step_s2(StepArgs a) {
    attn_step_impl<2>(a);
}
