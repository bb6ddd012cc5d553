// Per-head q/k RMSNorm + RoPE of up to four heads per warp, bit for bit as
// qk_norm_rope_cache (kernels.cu) rounds them: shared by the fused decode attention
// (attn_decode.cu) and the batched one-token step attention (attn_step.cu), so every path
// writes the same K rows into the cache.
#pragma once

#include "common.cuh"

#ifndef D
#define D 128  // head dim
#endif

// Up to 4 heads a warp normalises in one batch: head b is the row src[b] (null: none) of
// token tok[b], RMSNorm weights w[b]; vsrc[b] (null: none) is a V row loaded along with it.
struct Batch {
    const bf16_t* src[4];
    const bf16_t* w[4];
    const bf16_t* vsrc[4];
    int tok[4];
};

// RMSNorm + RoPE of a batch, lane owning dims lane + 32 i: the same roundings as
// qk_norm_rope_cache (normed value to bf16 before RoPE, cos/sin to bf16), and the same
// summation order as its block_sum (warp i sums dims 32i.., then (s0 + s2) + (s1 + s3)), so
// the values agree bit for bit. RoPE pairs dim i with i + 64: the same lane. Every load of
// the batch is issued before any arithmetic, so their latencies overlap.
__device__ __forceinline__ void norm_rope4(const Batch& h, const u32* __restrict__ positions,
                                           const float* __restrict__ cos_t,
                                           const float* __restrict__ sin_t, float eps, int lane,
                                           bf16_t out[4][4], bf16_t vout[4][4]) {
    const int half = D / 2;
    float x[4][4], wv[4][4], cs[4][4];
    int p[4];
#pragma unroll
    for (int b = 0; b < 4; ++b) {
        p[b] = 0;
        if (h.src[b]) {
            p[b] = (int)positions[h.tok[b]];
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                x[b][i] = bf2f(h.src[b][lane + 32 * i]);
                wv[b][i] = bf2f(h.w[b][lane + 32 * i]);
            }
        }
        if (h.vsrc[b]) {
#pragma unroll
            for (int i = 0; i < 4; ++i) vout[b][i] = h.vsrc[b][lane + 32 * i];
        }
    }
#pragma unroll
    for (int b = 0; b < 4; ++b) {
        if (h.src[b]) {
            size_t o = (size_t)p[b] * half + lane;
            cs[b][0] = bf2f(f2bf(cos_t[o]));
            cs[b][1] = bf2f(f2bf(sin_t[o]));
            cs[b][2] = bf2f(f2bf(cos_t[o + 32]));
            cs[b][3] = bf2f(f2bf(sin_t[o + 32]));
        }
    }
#pragma unroll
    for (int b = 0; b < 4; ++b) {
        if (!h.src[b]) continue;
        float sq[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) sq[i] = warp_sum(x[b][i] * x[b][i]);
        float ss = (sq[0] + sq[2]) + (sq[1] + sq[3]);
        float inv = rsqrtf(ss / (float)D + eps);
        float n[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) n[i] = bf2f(f2bf(x[b][i] * inv * wv[b][i]));
        float c0 = cs[b][0], s0 = cs[b][1], c1 = cs[b][2], s1 = cs[b][3];
        out[b][0] = f2bf(n[0] * c0 - n[2] * s0);
        out[b][1] = f2bf(n[1] * c1 - n[3] * s1);
        out[b][2] = f2bf(n[2] * c0 + n[0] * s0);
        out[b][3] = f2bf(n[3] * c1 + n[1] * s1);
    }
}
