// Cache-less causal attention over a batch of packed sequences of different lengths (bf16 in,
// f32 accumulate, head_dim 64, 128 or 256), for the trainer's target forward: it needs the
// hidden states of every token of every sequence and never decodes after, so no K/V cache is
// written and one launch covers the whole batch (the plain path ran one materialised f32
// attention per sequence and layer against a freshly allocated cache). Head dim 256 is the
// Qwen3.5/3.6 hybrids' gated attention: their prefill from an empty cache takes this kernel
// too (the new rows are every key; the cache write stays the caller's). Compiled to PTX by
// models/build.rs.
//
// The schedule is attn_prefill.cu's (FlashAttention-2 on mma.sync m16n8k16): blocks of 4 warps
// x 16 query rows, rows token * groups + g so one staged K/V tile serves every q-head of its KV
// head, K/V tiles of 64 keys by cp.async one tile ahead of the math, fragments through ldmatrix
// out of rows padded by 8 bf16 (conflict-free for both widths), P rounded to bf16 before P V
// and the row sums taken over the rounded P. What differs: the head dim is a template
// parameter; inputs are the projections' own head-major layouts q [nh, total, D] and k, v
// [nkv, total, D] (no transpose, no cache); and each block's sequence and tile come from a
// host-built table (`tiles`: pairs (sequence, tile within it), longest tiles first for a short
// tail), with `offsets` [seqs + 1] the sequences' first rows.

#include "common.cuh"

#define VCH 64  // keys per tile

__device__ __forceinline__ u32 vsmem(const void* p) { return (u32)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void vcp16(u32 dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                 "r"(src_bytes));
}
__device__ __forceinline__ void vcommit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void vwait() { asm volatile("cp.async.wait_group 0;\n" ::: "memory"); }
__device__ __forceinline__ void vldsm(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}
__device__ __forceinline__ void vldsm_t(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}

// Stages keys [k0, k0 + VCH) of one sequence's rows `src` (row stride D; rows >= L as zeros).
template <int D, int PAD>
__device__ __forceinline__ void vload_tile(bf16_t* dst, const bf16_t* __restrict__ src, int k0,
                                           int L) {
    for (int e = threadIdx.x; e < VCH * (D / 8); e += 128) {
        int j = e / (D / 8), p = e % (D / 8);
        bool live = k0 + j < L;
        const bf16_t* s = src + (size_t)(live ? k0 + j : 0) * D + 8 * p;
        vcp16(vsmem(dst + j * PAD + 8 * p), s, live ? 16 : 0);
    }
}

template <int D>
__device__ __forceinline__ void varlen_body(const bf16_t* __restrict__ q,
                                            const bf16_t* __restrict__ k,
                                            const bf16_t* __restrict__ v,
                                            const u32* __restrict__ offsets,
                                            const u32* __restrict__ tiles, bf16_t* __restrict__ out,
                                            int total, int nh, int nkv, float scale) {
    constexpr int PAD = D + 8;
    constexpr int ODT = D / 8;  // 8-dim output tiles per row
    extern __shared__ __align__(16) bf16_t vdyn_smem[];
    bf16_t* ks = vdyn_smem;
    bf16_t* vs = vdyn_smem + VCH * PAD;
    bf16_t* qs = vdyn_smem + 2 * VCH * PAD;
    const int kvh = blockIdx.x;
    const int seq = (int)tiles[2 * blockIdx.y], tile = (int)tiles[2 * blockIdx.y + 1];
    const int start = (int)offsets[seq];
    const int L = (int)offsets[seq + 1] - start;
    const int groups = nh / nkv;
    const int rows_total = L * groups;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tig = lane & 3;
    int rb = tile * 64, r0 = rb + warp * 16;
    if (rb >= rows_total) return;
    int last_blk_tok = (min(rb + 64, rows_total) - 1) / groups;
    int ntiles = (last_blk_tok + VCH) / VCH;
    bool warp_live = r0 < rows_total;
    int first_tok = warp_live ? r0 / groups : 0;
    int last_tok = warp_live ? (min(r0 + 16, rows_total) - 1) / groups : -1;
    int rowA = r0 + g, rowB = r0 + g + 8;
    bool liveA = rowA < rows_total, liveB = rowB < rows_total;
    int tokA = liveA ? rowA / groups : 0, tokB = liveB ? rowB / groups : 0;
    const bf16_t* kbase = k + ((size_t)kvh * total + start) * D;
    const bf16_t* vbase = v + ((size_t)kvh * total + start) * D;

    vload_tile<D, PAD>(ks, kbase, 0, L);
    for (int e = threadIdx.x; e < 64 * (D / 8); e += 128) {
        int r = e / (D / 8), p = e % (D / 8), row = rb + r;
        bool live = row < rows_total;
        int head = kvh * groups + (live ? row % groups : 0);
        const bf16_t* src =
            q + (live ? ((size_t)head * total + start + row / groups) * D + 8 * p : 0);
        vcp16(vsmem(qs + r * PAD + 8 * p), src, live ? 16 : 0);
    }
    vcommit();
    float o[ODT][4];
#pragma unroll
    for (int nt = 0; nt < ODT; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.f;
    float mA = -INFINITY, mB = -INFINITY, lA = 0.f, lB = 0.f;

    int lm = lane >> 3, lr = lane & 7;
    u32 k_lane = vsmem(ks + ((lm >> 1) * 8 + lr) * PAD + (lm & 1) * 8);
    u32 v_lane = vsmem(vs + ((lm & 1) * 8 + lr) * PAD + (lm >> 1) * 8);
    u32 q_lane = vsmem(qs + (warp * 16 + (lm & 1) * 8 + lr) * PAD + (lm >> 1) * 8);

    for (int kt = 0; kt < ntiles; ++kt) {
        int k0 = kt * VCH;
        vwait();
        __syncthreads();  // K[kt] landed; every warp is done with V[kt - 1]
        vload_tile<D, PAD>(vs, vbase, k0, L);
        vcommit();
        bool active = warp_live && k0 <= last_tok;
        float s[8][4];
        if (active) {
#pragma unroll
            for (int nt = 0; nt < 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < D / 16; ++kk) {
                u32 a0, a1, a2, a3;
                vldsm(q_lane + kk * 16 * 2, a0, a1, a2, a3);
#pragma unroll
                for (int np = 0; np < 4; ++np) {
                    u32 b0, b1, b2, b3;
                    vldsm(k_lane + (np * 16 * PAD + kk * 16) * 2, b0, b1, b2, b3);
                    mma_bf16(s[2 * np], a0, a1, a2, a3, b0, b1);
                    mma_bf16(s[2 * np + 1], a0, a1, a2, a3, b2, b3);
                }
            }
        }
        vwait();
        __syncthreads();  // V[kt] landed; every warp is done with K[kt]
        if (kt + 1 < ntiles) {
            vload_tile<D, PAD>(ks, kbase, k0 + VCH, L);
            vcommit();
        }
        if (!active) continue;
        bool masked = k0 + VCH - 1 > first_tok;
        float mxA = -INFINITY, mxB = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                int key = k0 + nt * 8 + tig * 2 + e;
                bool vA = liveA && (!masked || key <= tokA);
                bool vB = liveB && (!masked || key <= tokB);
                s[nt][e] = vA ? s[nt][e] * scale : -INFINITY;
                s[nt][2 + e] = vB ? s[nt][2 + e] * scale : -INFINITY;
                mxA = fmaxf(mxA, s[nt][e]);
                mxB = fmaxf(mxB, s[nt][2 + e]);
            }
        }
        u32 pf[4][4];
        softmax_step<8, ODT>(s, mxA, mxB, o, mA, mB, lA, lB, pf);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
#pragma unroll
            for (int dp = 0; dp < D / 16; ++dp) {
                u32 b0, b1, b2, b3;
                vldsm_t(v_lane + (j * 16 * PAD + dp * 16) * 2, b0, b1, b2, b3);
                mma_bf16(o[2 * dp], pf[j][0], pf[j][1], pf[j][2], pf[j][3], b0, b1);
                mma_bf16(o[2 * dp + 1], pf[j][0], pf[j][1], pf[j][2], pf[j][3], b2, b3);
            }
        }
    }
    // out [total, nh * D]: rows A (o[.][0..1]) and B (o[.][2..3]) as bf16 pairs.
    if (liveA) {
        float inv = 1.f / lA;
        u32* oa = (u32*)(out + ((size_t)(start + tokA) * nh + kvh * groups + rowA % groups) * D);
#pragma unroll
        for (int nt = 0; nt < ODT; ++nt)
            oa[nt * 4 + tig] = (u32)f2bf(o[nt][0] * inv) | ((u32)f2bf(o[nt][1] * inv) << 16);
    }
    if (liveB) {
        float inv = 1.f / lB;
        u32* ob = (u32*)(out + ((size_t)(start + tokB) * nh + kvh * groups + rowB % groups) * D);
#pragma unroll
        for (int nt = 0; nt < ODT; ++nt)
            ob[nt * 4 + tig] = (u32)f2bf(o[nt][2] * inv) | ((u32)f2bf(o[nt][3] * inv) << 16);
    }
}

// Grid (nkv, tiles), 128 threads; dynamic shared memory 192 * (D + 8) * 2 bytes.
extern "C" __global__ void __launch_bounds__(128, 3) attn_varlen_causal_d64(
    const bf16_t* __restrict__ q, const bf16_t* __restrict__ k, const bf16_t* __restrict__ v,
    const u32* __restrict__ offsets, const u32* __restrict__ tiles, bf16_t* __restrict__ out,
    int total, int nh, int nkv, float scale) {
    varlen_body<64>(q, k, v, offsets, tiles, out, total, nh, nkv, scale);
}

extern "C" __global__ void __launch_bounds__(128, 3) attn_varlen_causal_d128(
    const bf16_t* __restrict__ q, const bf16_t* __restrict__ k, const bf16_t* __restrict__ v,
    const u32* __restrict__ offsets, const u32* __restrict__ tiles, bf16_t* __restrict__ out,
    int total, int nh, int nkv, float scale) {
    varlen_body<128>(q, k, v, offsets, tiles, out, total, nh, nkv, scale);
}

// Head dim 256: 128 f32 output accumulators per thread, so one block per SM by the bound (the
// register file then fits two, and the 101 KB of tiles twice in shared memory).
extern "C" __global__ void __launch_bounds__(128, 1) attn_varlen_causal_d256(
    const bf16_t* __restrict__ q, const bf16_t* __restrict__ k, const bf16_t* __restrict__ v,
    const u32* __restrict__ offsets, const u32* __restrict__ tiles, bf16_t* __restrict__ out,
    int total, int nh, int nkv, float scale) {
    varlen_body<256>(q, k, v, offsets, tiles, out, total, nh, nkv, scale);
}
