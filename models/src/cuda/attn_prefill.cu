// Attention in blocks of 64 query rows, FlashAttention-2 style (bf16 in, f32 accumulate,
// head_dim 128): causal prefill pieces in one pass (attn_prefill), and the split-K partials of
// verify forwards and draft blocks (attn_split_flash, causal or tree masks, merged by
// attn_combine in kernels.cu). Compiled to PTX by models/build.rs with nvcc when the `cuda`
// feature is on.
//
// Query rows are token * groups + g (g the q-head within its KV head), so one block of 4 warps
// x 16 rows holds consecutive tokens of every q-head of one KV head and each K/V tile it stages
// in shared memory serves all of them (the one-warp-per-16-rows kernel this replaced re-read
// every key chunk from L2 for each 16-row tile; measured slower by 1.2-1.8x, see
// deploy/bench/results/h200-2026-11-30b). K/V tiles of 64 keys arrive by cp.async, one tile
// ahead of the math: V[j] loads while S = Q K[j]^T runs, K[j + 1] while softmax and P V[j] run
// (the FlashAttention-2 schedule). The block's Q rows are staged in shared memory too and read
// per k-step rather than held in 32 registers per thread: that brings the kernel to 168
// registers, so three blocks (12 warps) share an SM without spills, which measured 1.37x faster
// than Q in registers at two blocks per SM (229 registers) on a 4096-token prefill. Fragments
// come from shared memory through ldmatrix (.trans for V) out of rows padded to 136 bf16, which
// keeps both the 16-byte cp.async writes and the ldmatrix row reads free of bank conflicts.
// Shared memory: K, V and Q, 64 rows each = 52,224 bytes, dynamic (over the 48 KB static limit;
// the launch raises the function's limit).
//
// One pass over the visible keys (no split, no combine launch): keys [0, c) are committed
// context, visible to every token; key c + j is new token j, visible to token i when j <= i.
// Key tiles past a block's last visible key are never loaded; warps whose rows see none of a
// tile skip its math. Numerics as the split form + attn_combine with one split: scores scaled
// in f32, P rounded to bf16 (cvt.rn.bf16x2: round to nearest even, as f2bf) before P V, row
// sums taken over the rounded P, out = bf16(O / l).

#include "common.cuh"

#define PCH 64     // keys per tile
#define PD 128     // head_dim
#define PPAD 136   // bf16 per shared row: 128 + 8 (272 bytes: 8 rows hit 8 distinct 16-byte bank groups)

__device__ __forceinline__ u32 smem_addr(const void* p) {
    return (u32)__cvta_generic_to_shared(p);
}

// 16-byte global -> shared copy; src_bytes 0 writes zeros (keys past the cache's live rows).
__device__ __forceinline__ void cp_async16(u32 dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                 "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() {
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
}

__device__ __forceinline__ void ldsm_x4(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}

// Stages keys [k0, k0 + PCH) of one KV head (rows >= L as zeros) into `dst` (PCH x PPAD).
template <int NW>
__device__ __forceinline__ void load_tile(bf16_t* dst, const bf16_t* __restrict__ src,
                                          const u32* __restrict__ pt, int k0, int L) {
    for (int e = threadIdx.x; e < PCH * (PD / 8); e += NW * 32) {
        int j = e / (PD / 8), p = e % (PD / 8);
        bool live = k0 + j < L;
        const bf16_t* s = src + kv_row(pt, live ? k0 + j : 0) * PD + 8 * p;
        cp_async16(smem_addr(dst + j * PPAD + 8 * p), s, live ? 16 : 0);
    }
}

// q [t, nh, d], kc/vc [nkv, cap, d] (rows through the page table pt; null: in order). Grid (nkv, ceil(t * groups / (16 NW)), nsplit), block
// 32 NW threads. Blocks run the last tiles (the most keys) first, for a short tail.
// SPLIT = false: one pass over every visible key (blockIdx.z = 0), out [t, nh * d] = bf16(O / l).
// SPLIT = true: split blockIdx.z walks key tiles [z cps, (z + 1) cps) (cps from the live
// length and gridDim.z, the most splits) and leaves unnormalised
// partials for attn_combine (kernels.cu), as attn_partial does: acc [nsplit, t nh, d],
// ml [nsplit, t nh, 2] (max, sum; max -inf where a row saw no key of the split). Splits that
// start past the live keys write nothing (the combine does not read them).
// tree_mask (null: causal): key c + j is visible to token i when bit j of row i is set; a tree
// may let a token see later ones (the drafter's block sees itself whole), so every live key
// tile is walked.
template <int NW, bool SPLIT>
__device__ __forceinline__ void flash_body(
    const bf16_t* __restrict__ q, const bf16_t* __restrict__ kc, const bf16_t* __restrict__ vc,
    const u32* __restrict__ cache_len, const u32* __restrict__ pt,
    const u64* __restrict__ tree_mask, int words, bf16_t* __restrict__ out,
    float* __restrict__ acc_out, float* __restrict__ ml_out, int t, int nh, int nkv, int cap,
    float scale, int pt_stride) {
    extern __shared__ __align__(16) bf16_t dyn_smem[];
    bf16_t* ks = dyn_smem;
    bf16_t* vs = dyn_smem + PCH * PPAD;
    bf16_t* qs = dyn_smem + 2 * PCH * PPAD;
    const int d = PD;
    // A batch of sequences of t tokens each: grid x = sequence x KV head.
    int kvh = blockIdx.x % nkv;
    {
        const size_t s = blockIdx.x / nkv;
        q += s * t * nh * PD;
        cache_len += s;
        if (pt) pt += s * pt_stride;
        if (tree_mask) tree_mask += s * t * words;
        if (SPLIT) {
            acc_out += s * gridDim.z * t * nh * PD;
            ml_out += s * gridDim.z * t * nh * 2;
        } else {
            out += s * t * nh * PD;
        }
    }
    int tile = gridDim.y - 1 - blockIdx.y;
    int groups = nh / nkv;
    int c = (int)(*cache_len);
    int L = c + t;
    int rows_total = t * groups;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tig = lane & 3;
    int rb = tile * 16 * NW;                // block's first row
    int r0 = rb + warp * 16;                // warp's first row
    // Keys the block needs: up to its last token's own key (causal), every live key (tree).
    int last_blk_tok = (min(rb + 16 * NW, rows_total) - 1) / groups;
    int ntiles = ((tree_mask ? L : c + last_blk_tok + 1) + PCH - 1) / PCH;
    // Split z walks chunks [z cps, (z + 1) cps) with cps = ceil(live chunks / gridDim.z), set
    // from the live length here so that one grid (one CUDA graph) fits every length.
    int cps = SPLIT ? chunks_per_split(L, PCH, (int)gridDim.z) : 0;
    int kt_begin = SPLIT ? blockIdx.z * cps : 0;
    int kt_end = SPLIT ? min(ntiles, kt_begin + cps) : ntiles;
    if (SPLIT && kt_begin * PCH >= L) return;
    bool warp_live = r0 < rows_total;
    int first_tok = warp_live ? r0 / groups : 0;
    int last_tok = warp_live ? (min(r0 + 16, rows_total) - 1) / groups : -1;
    int rowA = r0 + g, rowB = r0 + g + 8;
    bool liveA = rowA < rows_total, liveB = rowB < rows_total;
    int tokA = liveA ? rowA / groups : 0, tokB = liveB ? rowB / groups : 0;
    const bf16_t* kbase = kc + (size_t)kvh * cap * d;
    const bf16_t* vbase = vc + (size_t)kvh * cap * d;

    // The first K tile and the block's query rows (zeros past the last) in one group; nothing
    // when the split holds none of the block's visible keys (no copy may be left in flight).
    if (kt_begin < kt_end) load_tile<NW>(ks, kbase, pt, kt_begin * PCH, L);
    for (int e = threadIdx.x; kt_begin < kt_end && e < 16 * NW * (PD / 8); e += NW * 32) {
        int r = e / (PD / 8), p = e % (PD / 8), row = rb + r;
        bool live = row < rows_total;
        const bf16_t* src =
            q + (live ? ((size_t)(row / groups) * nh + kvh * groups + row % groups) * d + 8 * p : 0);
        cp_async16(smem_addr(qs + r * PPAD + 8 * p), src, live ? 16 : 0);
    }
    cp_async_commit();
    float o[16][4];
#pragma unroll
    for (int nt = 0; nt < 16; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.f;
    float mA = -INFINITY, mB = -INFINITY, lA = 0.f, lB = 0.f;

    // ldmatrix lane offsets. K (no trans): matrix m = lane / 8 covers keys +(m / 2) * 8,
    // dims +(m % 2) * 8 -> b0, b1 of key tiles 2np and 2np + 1. V (trans): matrix m covers keys
    // +(m % 2) * 8, dims +(m / 2) * 8 -> b0, b1 of dim tiles 2dp and 2dp + 1.
    int lm = lane >> 3, lr = lane & 7;
    u32 k_lane = smem_addr(ks + ((lm >> 1) * 8 + lr) * PPAD + (lm & 1) * 8);
    u32 v_lane = smem_addr(vs + ((lm & 1) * 8 + lr) * PPAD + (lm >> 1) * 8);
    // Q (no trans): matrix m covers rows +(m % 2) * 8, dims +(m / 2) * 8 -> a0..a3 of a k-step.
    u32 q_lane = smem_addr(qs + (warp * 16 + (lm & 1) * 8 + lr) * PPAD + (lm >> 1) * 8);

    for (int kt = kt_begin; kt < kt_end; ++kt) {
        int k0 = kt * PCH;
        cp_async_wait_all();
        __syncthreads();  // K[kt] landed; every warp is done with V[kt - 1]
        load_tile<NW>(vs, vbase, pt, k0, L);
        cp_async_commit();
        bool active = warp_live && (tree_mask || k0 <= c + last_tok);
        float s[8][4];
        if (active) {
#pragma unroll
            for (int nt = 0; nt < 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
            for (int kk = 0; kk < 8; ++kk) {
                u32 a0, a1, a2, a3;
                ldsm_x4(q_lane + kk * 16 * 2, a0, a1, a2, a3);
#pragma unroll
                for (int np = 0; np < 4; ++np) {
                    u32 b0, b1, b2, b3;
                    ldsm_x4(k_lane + (np * 16 * PPAD + kk * 16) * 2, b0, b1, b2, b3);
                    mma_bf16(s[2 * np], a0, a1, a2, a3, b0, b1);
                    mma_bf16(s[2 * np + 1], a0, a1, a2, a3, b2, b3);
                }
            }
        }
        cp_async_wait_all();
        __syncthreads();  // V[kt] landed; every warp is done with K[kt]
        if (kt + 1 < kt_end) {
            load_tile<NW>(ks, kbase, pt, k0 + PCH, L);
            cp_async_commit();
        }
        if (!active) continue;
        // Scale; mask only tiles that reach past the warp's first token's own key (causal) or
        // into the new keys (tree).
        bool masked = k0 + PCH - 1 > c + (tree_mask ? -1 : first_tok);
        float mxA = -INFINITY, mxB = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                int key = k0 + nt * 8 + tig * 2 + e;
                bool vA = liveA, vB = liveB;
                if (masked && tree_mask) {
                    int nj = key - c;
                    if (nj >= 0) {
                        vA = vA && nj < t &&
                             ((tree_mask[(size_t)tokA * words + (nj >> 6)] >> (nj & 63)) & 1ull);
                        vB = vB && nj < t &&
                             ((tree_mask[(size_t)tokB * words + (nj >> 6)] >> (nj & 63)) & 1ull);
                    }
                } else if (masked) {
                    vA = vA && key <= c + tokA;
                    vB = vB && key <= c + tokB;
                }
                s[nt][e] = vA ? s[nt][e] * scale : -INFINITY;
                s[nt][2 + e] = vB ? s[nt][2 + e] * scale : -INFINITY;
                mxA = fmaxf(mxA, s[nt][e]);
                mxB = fmaxf(mxB, s[nt][2 + e]);
            }
        }
        // P = exp(S - m) rounded to bf16, packed as the A fragments of P V.
        u32 pf[4][4];
        softmax_step<8>(s, mxA, mxB, o, mA, mB, lA, lB, pf);
        // O += P V: 4 k-steps of 16 keys x 8 pairs of 8-dim tiles.
#pragma unroll
        for (int j = 0; j < 4; ++j) {
#pragma unroll
            for (int dp = 0; dp < 8; ++dp) {
                u32 b0, b1, b2, b3;
                ldsm_x4_t(v_lane + (j * 16 * PPAD + dp * 16) * 2, b0, b1, b2, b3);
                mma_bf16(o[2 * dp], pf[j][0], pf[j][1], pf[j][2], pf[j][3], b0, b1);
                mma_bf16(o[2 * dp + 1], pf[j][0], pf[j][1], pf[j][2], pf[j][3], b2, b3);
            }
        }
    }
    if (SPLIT) {
        // Unnormalised rows A (o[.][0..1]) and B (o[.][2..3]) with their (max, sum).
        size_t nrows = (size_t)t * nh;
        size_t split = blockIdx.z;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            bool live = half ? liveB : liveA;
            if (!live) continue;
            int row = half ? rowB : rowA, tok = half ? tokB : tokA;
            size_t orow = (size_t)tok * nh + kvh * groups + row % groups;
            float2* ao = (float2*)(acc_out + (split * nrows + orow) * d);
#pragma unroll
            for (int nt = 0; nt < 16; ++nt)
                ao[nt * 4 + tig] = make_float2(o[nt][2 * half], o[nt][2 * half + 1]);
            if (tig == 0) {
                ml_out[(split * nrows + orow) * 2] = half ? mB : mA;
                ml_out[(split * nrows + orow) * 2 + 1] = half ? lB : lA;
            }
        }
        return;
    }
    // Rows A (o[.][0..1]) and B (o[.][2..3]), dims nt * 8 + tig * 2 + {0, 1}, as bf16 pairs.
    if (liveA) {
        float inv = 1.f / lA;
        u32* oa = (u32*)(out + ((size_t)tokA * nh + kvh * groups + rowA % groups) * d);
#pragma unroll
        for (int nt = 0; nt < 16; ++nt)
            oa[nt * 4 + tig] = (u32)f2bf(o[nt][0] * inv) | ((u32)f2bf(o[nt][1] * inv) << 16);
    }
    if (liveB) {
        float inv = 1.f / lB;
        u32* ob = (u32*)(out + ((size_t)tokB * nh + kvh * groups + rowB % groups) * d);
#pragma unroll
        for (int nt = 0; nt < 16; ++nt)
            ob[nt * 4 + tig] = (u32)f2bf(o[nt][2] * inv) | ((u32)f2bf(o[nt][3] * inv) << 16);
    }
}

// Four warps (64 query rows) per block, at most 168 registers so three blocks fit an SM. On the
// H200 (check::attention_timings) this was the fastest or within 10% of the fastest in every
// case against 8 warps at one block per SM, 6 warps (96 rows) at two, and four blocks of 4 warps
// (128 registers, spilling).
extern "C" __global__ void __launch_bounds__(128, 3) attn_prefill(
    const bf16_t* __restrict__ q, const bf16_t* __restrict__ kc, const bf16_t* __restrict__ vc,
    const u32* __restrict__ cache_len, const u32* __restrict__ pt, bf16_t* __restrict__ out, int t,
    int nh, int nkv, int cap, float scale, int pt_stride) {
    flash_body<4, false>(q, kc, vc, cache_len, pt, nullptr, 0, out, nullptr, nullptr, t, nh, nkv,
                         cap, scale, pt_stride);
}

// Split-K partials of the same blocks (see flash_body) for verification forwards and draft
// blocks: a few dozen query rows over a long cache need the keys spread over many blocks.
extern "C" __global__ void __launch_bounds__(128, 3) attn_split_flash(
    const bf16_t* __restrict__ q, const bf16_t* __restrict__ kc, const bf16_t* __restrict__ vc,
    const u32* __restrict__ cache_len, const u32* __restrict__ pt,
    const u64* __restrict__ tree_mask, int words, float* __restrict__ acc_out,
    float* __restrict__ ml_out, int t, int nh, int nkv, int cap, float scale, int pt_stride) {
    flash_body<4, true>(q, kc, vc, cache_len, pt, tree_mask, words, nullptr, acc_out, ml_out, t, nh,
                        nkv, cap, scale, pt_stride);
}

// The same split partials from blocks of 8 warps (128 query rows): each staged K/V tile then
// serves twice the rows, which halves the K/V bytes a short piece over a long context pulls
// through L2 (a 64-token piece of Qwen3-8B holds 256 rows per KV head: 4 blocks of 4 warps
// re-read every key tile 4 times, 2 blocks of 8 twice), at one block (8 warps, 214
// registers) per SM. A measured variant (check_scale), not on any forward's path: on the H200
// it won 1-9% past 16K committed rows and lost up to 1.8x at 1K-8K.
extern "C" __global__ void __launch_bounds__(256, 1) attn_split_flash8(
    const bf16_t* __restrict__ q, const bf16_t* __restrict__ kc, const bf16_t* __restrict__ vc,
    const u32* __restrict__ cache_len, const u32* __restrict__ pt,
    const u64* __restrict__ tree_mask, int words, float* __restrict__ acc_out,
    float* __restrict__ ml_out, int t, int nh, int nkv, int cap, float scale, int pt_stride) {
    flash_body<8, true>(q, kc, vc, cache_len, pt, tree_mask, words, nullptr, acc_out, ml_out, t, nh,
                        nkv, cap, scale, pt_stride);
}
