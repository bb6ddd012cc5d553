// DFlash training attention, forward (training/attn_dflash.rs): block b's B queries (slots
// k = 0..B-1 of the block anchored at a_b) attend to the context rows strictly before the
// anchor, [0, a_b) of their sequence, and to their own block's B keys (bidirectional; in a
// sliding layer of window W the context is cut to j >= a_b + k + 1 - W and the block is
// causal, as dflash/train.rs's training_mask). Nothing of score size exists: one warp per
// query row streams the visible keys with an online softmax in f32, and the row's log-sum-exp
// is saved for the backward (which recomputes the scores).
//
// Layouts (contiguous): q [H, R, D], kb/vb [KV, R, D] (R = blocks * B block rows),
// kc/vc [KV, C, D] (every sequence's context rows, one after another), blocks u32
// [nblocks, 2] = (context offset of the block's sequence, anchor a_b); out [R, H * D] in the
// inputs' dtype, lse f32 [H, R]. Grid (nblocks, H), B warps per block, D = 32 * PER.

#include "common.cuh"

__device__ __forceinline__ float ld(const float* p, size_t i) { return p[i]; }
__device__ __forceinline__ float ld(const bf16_t* p, size_t i) { return bf2f(p[i]); }
__device__ __forceinline__ void st(float* p, size_t i, float v) { p[i] = v; }
__device__ __forceinline__ void st(bf16_t* p, size_t i, float v) { p[i] = f2bf(v); }

template <typename T, int PER>
__device__ void dflash_fwd(const T* __restrict__ q, const T* __restrict__ kc,
                           const T* __restrict__ vc, const T* __restrict__ kb,
                           const T* __restrict__ vb, const u32* __restrict__ blocks,
                           T* __restrict__ out, float* __restrict__ lse, int H, int KV, int R,
                           int C, int B, int window, float scale) {
    constexpr int D = 32 * PER;
    const int b = blockIdx.x, h = blockIdx.y, k = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (k >= B) return;
    const int kvh = h / (H / KV);
    const int row = b * B + k;
    const u32 ctx_off = blocks[2 * b], a = blocks[2 * b + 1];
    float qv[PER], acc[PER];
    const T* qr = q + ((size_t)h * R + row) * D;
#pragma unroll
    for (int e = 0; e < PER; e++) {
        qv[e] = ld(qr, lane + 32 * e) * scale;
        acc[e] = 0.f;
    }
    float m = -INFINITY, l = 0.f;
    auto visit = [&](const T* kr, const T* vr) {
        float s = 0.f;
#pragma unroll
        for (int e = 0; e < PER; e++) s += qv[e] * ld(kr, lane + 32 * e);
        s = warp_sum(s);
        float mn = fmaxf(m, s);
        float corr = m == -INFINITY ? 0.f : expf(m - mn);
        float p = expf(s - mn);
        l = l * corr + p;
#pragma unroll
        for (int e = 0; e < PER; e++) acc[e] = acc[e] * corr + p * ld(vr, lane + 32 * e);
        m = mn;
    };
    int lo = 0;
    if (window > 0) lo = max(0, (int)a + k + 1 - window);
    for (int j = lo; j < (int)a; j++) {
        size_t r = ((size_t)kvh * C + ctx_off + j) * D;
        visit(kc + r, vc + r);
    }
    const int last = window > 0 ? k : B - 1;
    for (int j = 0; j <= last; j++) {
        size_t r = ((size_t)kvh * R + b * B + j) * D;
        visit(kb + r, vb + r);
    }
    const float inv = 1.f / l;
    T* orow = out + (size_t)row * H * D + (size_t)h * D;
#pragma unroll
    for (int e = 0; e < PER; e++) st(orow, lane + 32 * e, acc[e] * inv);
    if (lane == 0) lse[(size_t)h * R + row] = m + logf(l);
}

#define DFLASH_FWD(NAME, T, PER)                                                               \
    extern "C" __global__ void NAME(const T* q, const T* kc, const T* vc, const T* kb,         \
                                    const T* vb, const u32* blocks, T* out, float* lse, int H, \
                                    int KV, int R, int C, int B, int window, float scale) {    \
        dflash_fwd<T, PER>(q, kc, vc, kb, vb, blocks, out, lse, H, KV, R, C, B, window,        \
                           scale);                                                             \
    }

DFLASH_FWD(dflash_attn_fwd_bf16_d64, bf16_t, 2)
DFLASH_FWD(dflash_attn_fwd_bf16_d128, bf16_t, 4)
DFLASH_FWD(dflash_attn_fwd_f32_d64, float, 2)
DFLASH_FWD(dflash_attn_fwd_f32_d128, float, 4)
