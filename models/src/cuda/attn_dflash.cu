// DFlash training attention (training/attn_dflash.rs), forward and backward: block b's B
// queries (slots k = 0..B-1 of the block anchored at a_b) attend to the context rows strictly
// before the anchor, [0, a_b) of their sequence, and to their own block's B keys
// (bidirectional; in a sliding layer of window W the context is cut to j >= a_b + k + 1 - W
// and the block is causal, as dflash/train.rs's training_mask). Nothing of score size exists:
// one warp per query row streams the visible keys with an online softmax in f32, and the
// row's log-sum-exp is saved; the backward recomputes the probabilities from it
// (training/attn_dflash_ref.rs is the CPU reference of all three kernels).
//
// Layouts (contiguous rows of D): q [H, R, D], kb/vb rows of KV head h at (h * bs + r) (R =
// blocks * B block rows), kc/vc rows at (h * cs + c) (every sequence's context rows, one
// after another): separate [KV, R, D] / [KV, C, D] tensors (bs = R, cs = C) or one
// [KV, C + R, D] tensor per K and V, context rows first (cs = bs = C + R, kb = kc + C * D).
// blocks u32 [nblocks, 2] = (context offset of the block's sequence, anchor a_b); out and
// dout [R, H * D] in the inputs' dtype, lse and delta f32 [H, R]. D = 32 * PER.
//
// Backward, two passes and no atomics: dflash_bwd_dq is query-major like the forward (dq,
// and delta = rowsum(dout * out) for the second pass); dflash_bwd_dkv is key-major, one warp
// per (key row, KV head) looping over the query rows (and heads of the group) that see the
// key, so dk and dv are written once each. seqs u32 [nseq, 3] = (context offset, first block,
// end block) and ctx_seq u32 [C] (the sequence of each context row) let a context key find
// its sequence's blocks, which are consecutive.

#include "common.cuh"

__device__ __forceinline__ float ld(const float* p, size_t i) { return p[i]; }
__device__ __forceinline__ float ld(const bf16_t* p, size_t i) { return bf2f(p[i]); }
__device__ __forceinline__ void st(float* p, size_t i, float v) { p[i] = v; }
__device__ __forceinline__ void st(bf16_t* p, size_t i, float v) { p[i] = f2bf(v); }

__device__ __forceinline__ void warp_sum2(float& a, float& b) {
    for (int o = 16; o > 0; o >>= 1) {
        a += __shfl_xor_sync(0xffffffffu, a, o);
        b += __shfl_xor_sync(0xffffffffu, b, o);
    }
}

// Calls f(key row pointer offset into kc/vc or kb/vb, is_block) for every key query (b, k)
// sees, context first.
template <typename F>
__device__ __forceinline__ void for_visible(int b, int k, u32 ctx_off, int a, int kvh, int cs,
                                            int bs, int B, int window, int D, F f) {
    int lo = 0;
    if (window > 0) lo = max(0, a + k + 1 - window);
    for (int j = lo; j < a; j++) f(((size_t)kvh * cs + ctx_off + j) * D, false);
    const int last = window > 0 ? k : B - 1;
    for (int j = 0; j <= last; j++) f(((size_t)kvh * bs + b * B + j) * D, true);
}

template <typename T, int PER>
__device__ void dflash_fwd(const T* __restrict__ q, const T* __restrict__ kc,
                           const T* __restrict__ vc, const T* __restrict__ kb,
                           const T* __restrict__ vb, const u32* __restrict__ blocks,
                           T* __restrict__ out, float* __restrict__ lse, int H, int KV, int R,
                           int cs, int bs, int B, int window, float scale) {
    constexpr int D = 32 * PER;
    const int b = blockIdx.x, h = blockIdx.y, k = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (k >= B) return;
    const int kvh = h / (H / KV);
    const int row = b * B + k;
    const u32 ctx_off = blocks[2 * b];
    const int a = (int)blocks[2 * b + 1];
    float qv[PER], acc[PER];
    const T* qr = q + ((size_t)h * R + row) * D;
#pragma unroll
    for (int e = 0; e < PER; e++) {
        qv[e] = ld(qr, lane + 32 * e) * scale;
        acc[e] = 0.f;
    }
    float m = -INFINITY, l = 0.f;
    for_visible(b, k, ctx_off, a, kvh, cs, bs, B, window, D, [&](size_t r, bool blk) {
        const T* kr = (blk ? kb : kc) + r;
        const T* vr = (blk ? vb : vc) + r;
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
    });
    const float inv = 1.f / l;
    T* orow = out + (size_t)row * H * D + (size_t)h * D;
#pragma unroll
    for (int e = 0; e < PER; e++) st(orow, lane + 32 * e, acc[e] * inv);
    if (lane == 0) lse[(size_t)h * R + row] = m + logf(l);
}

// Grid (nblocks, H), B warps: dq [H, R, D] and delta [H, R].
template <typename T, int PER>
__device__ void dflash_bwd_dq(const T* __restrict__ q, const T* __restrict__ kc,
                              const T* __restrict__ vc, const T* __restrict__ kb,
                              const T* __restrict__ vb, const u32* __restrict__ blocks,
                              const T* __restrict__ out, const T* __restrict__ dout,
                              const float* __restrict__ lse, T* __restrict__ dq,
                              float* __restrict__ delta, int H, int KV, int R, int cs, int bs,
                              int B, int window, float scale) {
    constexpr int D = 32 * PER;
    const int b = blockIdx.x, h = blockIdx.y, k = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (k >= B) return;
    const int kvh = h / (H / KV);
    const int row = b * B + k;
    const u32 ctx_off = blocks[2 * b];
    const int a = (int)blocks[2 * b + 1];
    const size_t qi = ((size_t)h * R + row) * D, oi = (size_t)row * H * D + (size_t)h * D;
    float qv[PER], dov[PER], acc[PER], dl = 0.f;
#pragma unroll
    for (int e = 0; e < PER; e++) {
        qv[e] = ld(q, qi + lane + 32 * e) * scale;
        dov[e] = ld(dout, oi + lane + 32 * e);
        dl += dov[e] * ld(out, oi + lane + 32 * e);
        acc[e] = 0.f;
    }
    dl = warp_sum(dl);
    const float L = lse[(size_t)h * R + row];
    for_visible(b, k, ctx_off, a, kvh, cs, bs, B, window, D, [&](size_t r, bool blk) {
        const T* kr = (blk ? kb : kc) + r;
        const T* vr = (blk ? vb : vc) + r;
        float kk[PER], s = 0.f, dp = 0.f;
#pragma unroll
        for (int e = 0; e < PER; e++) {
            kk[e] = ld(kr, lane + 32 * e);
            s += qv[e] * kk[e];
            dp += dov[e] * ld(vr, lane + 32 * e);
        }
        warp_sum2(s, dp);
        const float ds = expf(s - L) * (dp - dl);
#pragma unroll
        for (int e = 0; e < PER; e++) acc[e] += ds * kk[e];
    });
#pragma unroll
    for (int e = 0; e < PER; e++) st(dq, qi + lane + 32 * e, acc[e] * scale);
    if (lane == 0) delta[(size_t)h * R + row] = dl;
}

#define DKV_WARPS 8

// Grid (ceil((C + R - w0) / DKV_WARPS), KV), DKV_WARPS warps: warp w (from w0) is key row w of
// the context (w < C) or block row w - C, for KV head blockIdx.y; dk/dv laid out as kc/vc and
// kb/vb. w0 = C when the tensor-core kernel (attn_dflash_tc.cu) takes the context rows.
template <typename T, int PER>
__device__ void dflash_bwd_dkv(const T* __restrict__ q, const T* __restrict__ kc,
                               const T* __restrict__ vc, const T* __restrict__ kb,
                               const T* __restrict__ vb, const u32* __restrict__ blocks,
                               const u32* __restrict__ seqs, const u32* __restrict__ ctx_seq,
                               const T* __restrict__ dout, const float* __restrict__ lse,
                               const float* __restrict__ delta, T* __restrict__ dkc,
                               T* __restrict__ dvc, T* __restrict__ dkb, T* __restrict__ dvb,
                               int H, int KV, int R, int C, int cs, int bs, int B, int window,
                               float scale, int w0) {
    constexpr int D = 32 * PER;
    const int w = w0 + blockIdx.x * DKV_WARPS + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    const int kvh = blockIdx.y;
    if (w >= C + R) return;
    const int G = H / KV;
    const bool is_ctx = w < C;
    const size_t ki = is_ctx ? ((size_t)kvh * cs + w) * D : ((size_t)kvh * bs + (w - C)) * D;
    const T* kp = is_ctx ? kc : kb;
    const T* vp = is_ctx ? vc : vb;
    float kk[PER], vv[PER], dk[PER], dv[PER];
#pragma unroll
    for (int e = 0; e < PER; e++) {
        kk[e] = ld(kp, ki + lane + 32 * e) * scale;
        vv[e] = ld(vp, ki + lane + 32 * e);
        dk[e] = 0.f;
        dv[e] = 0.f;
    }
    auto visit = [&](int row) {
        for (int g = 0; g < G; g++) {
            const int h = kvh * G + g;
            const T* qr = q + ((size_t)h * R + row) * D;
            const T* dor = dout + (size_t)row * H * D + (size_t)h * D;
            float qq[PER], dd[PER], s = 0.f, dp = 0.f;
#pragma unroll
            for (int e = 0; e < PER; e++) {
                qq[e] = ld(qr, lane + 32 * e);
                dd[e] = ld(dor, lane + 32 * e);
                s += qq[e] * kk[e];
                dp += dd[e] * vv[e];
            }
            warp_sum2(s, dp);
            const size_t li = (size_t)h * R + row;
            const float p = expf(s - lse[li]);
            const float ds = p * (dp - delta[li]);
#pragma unroll
            for (int e = 0; e < PER; e++) {
                dk[e] += ds * qq[e];
                dv[e] += p * dd[e];
            }
        }
    };
    if (is_ctx) {
        const u32 sq = ctx_seq[w];
        if (sq != 0xffffffffu) {
            const int off = (int)seqs[3 * sq], blo = (int)seqs[3 * sq + 1],
                      bhi = (int)seqs[3 * sq + 2];
            const int j = w - off;
            for (int b = blo; b < bhi; b++) {
                const int a = (int)blocks[2 * b + 1];
                if (j >= a) continue;
                // Sliding: slot k sees j iff j >= a + k + 1 - W, i.e. k <= j + W - 1 - a.
                const int kmax = window > 0 ? min(B - 1, j + window - 1 - a) : B - 1;
                for (int k = 0; k <= kmax; k++) visit(b * B + k);
            }
        }
    } else {
        const int r = w - C, b = r / B, j = r % B;
        for (int k = window > 0 ? j : 0; k < B; k++) visit(b * B + k);
    }
    T* dkp = is_ctx ? dkc : dkb;
    T* dvp = is_ctx ? dvc : dvb;
#pragma unroll
    for (int e = 0; e < PER; e++) {
        st(dkp, ki + lane + 32 * e, dk[e] * scale);
        st(dvp, ki + lane + 32 * e, dv[e]);
    }
}

#define DFLASH(T, PER, SUF)                                                                    \
    extern "C" __global__ void dflash_attn_fwd_##SUF(                                          \
        const T* q, const T* kc, const T* vc, const T* kb, const T* vb, const u32* blocks,     \
        T* out, float* lse, int H, int KV, int R, int cs, int bs, int B, int window,           \
        float scale) {                                                                         \
        dflash_fwd<T, PER>(q, kc, vc, kb, vb, blocks, out, lse, H, KV, R, cs, bs, B, window,   \
                           scale);                                                             \
    }                                                                                          \
    extern "C" __global__ void dflash_attn_bwd_dq_##SUF(                                       \
        const T* q, const T* kc, const T* vc, const T* kb, const T* vb, const u32* blocks,     \
        const T* out, const T* dout, const float* lse, T* dq, float* delta, int H, int KV,     \
        int R, int cs, int bs, int B, int window, float scale) {                               \
        dflash_bwd_dq<T, PER>(q, kc, vc, kb, vb, blocks, out, dout, lse, dq, delta, H, KV, R,  \
                              cs, bs, B, window, scale);                                       \
    }                                                                                          \
    extern "C" __global__ void dflash_attn_bwd_dkv_##SUF(                                      \
        const T* q, const T* kc, const T* vc, const T* kb, const T* vb, const u32* blocks,     \
        const u32* seqs, const u32* ctx_seq, const T* dout, const float* lse,                  \
        const float* delta, T* dkc, T* dvc, T* dkb, T* dvb, int H, int KV, int R, int C,       \
        int cs, int bs, int B, int window, float scale, int w0) {                              \
        dflash_bwd_dkv<T, PER>(q, kc, vc, kb, vb, blocks, seqs, ctx_seq, dout, lse, delta,     \
                               dkc, dvc, dkb, dvb, H, KV, R, C, cs, bs, B, window, scale, w0); \
    }

DFLASH(bf16_t, 2, bf16_d64)
DFLASH(bf16_t, 4, bf16_d128)
DFLASH(float, 2, f32_d64)
DFLASH(float, 4, f32_d128)
