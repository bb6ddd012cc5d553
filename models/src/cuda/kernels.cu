// Fused kernels for batch-1 decode and speculative verification (bf16 only).
// Compiled to PTX by models/build.rs with nvcc when the `cuda` feature is on.
// bf16 values travel as raw 16-bit words so no CUDA header is needed.

#include "common.cuh"

// Per-head RMSNorm (q, k), RoPE (q, k; rotate-half layout) and the cache write (k, v) of one
// GEMM output row block holding `nq` q heads (nh, or 0 for rows that only provide K/V) and then
// the K and V heads: qkv [t, (nq + 2 nkv) * d]. Grid (nq + 2 nkv, t), block d threads.
// Row i's K/V go to cache row (*cache_len + i); q goes to q_out [t, nh, d].
// cos/sin: f32 tables [max_pos, d/2], rounded to bf16 as the plain path does.
__device__ __forceinline__ void norm_rope_cache(
    const bf16_t* __restrict__ qkv, const bf16_t* __restrict__ qw, const bf16_t* __restrict__ kw,
    const float* __restrict__ cos_t, const float* __restrict__ sin_t,
    const u32* __restrict__ positions, const u32* __restrict__ cache_len,
    const u32* __restrict__ pt, bf16_t* __restrict__ kc, bf16_t* __restrict__ vc,
    bf16_t* __restrict__ q_out, int nq, int nh, int nkv, int d, int cap, float eps, int t_per,
    int pt_stride) {
    __shared__ float red[32];
    __shared__ float normed[256];
    int head = blockIdx.x + nh - nq, tok = blockIdx.y, i = threadIdx.x;
    int width = (nq + 2 * nkv) * d;
    float x = bf2f(qkv[(size_t)tok * width + (size_t)blockIdx.x * d + i]);
    // A batch of sequences of t_per tokens each (one sequence: t_per = its tokens).
    const int seq = tok / t_per;
    size_t row =
        kv_row(pt ? pt + (size_t)seq * pt_stride : nullptr, (int)cache_len[seq] + tok % t_per);
    if (head >= nh + nkv) {  // V: copy into the cache
        int kvh = head - nh - nkv;
        vc[((size_t)kvh * cap + row) * d + i] = f2bf(x);
        return;
    }
    const bf16_t* w = head < nh ? qw : kw;
    float ss = block_sum(x * x, red);
    float inv = rsqrtf(ss / (float)d + eps);
    // The plain path rounds the normed value to bf16 before RoPE.
    normed[i] = bf2f(f2bf(x * inv * bf2f(w[i])));
    __syncthreads();
    int half = d / 2;
    int p = (int)positions[tok];
    int f = i < half ? i : i - half;
    float c = bf2f(f2bf(cos_t[(size_t)p * half + f]));
    float s = bf2f(f2bf(sin_t[(size_t)p * half + f]));
    float y = i < half ? normed[i] * c - normed[i + half] * s : normed[i] * c + normed[i - half] * s;
    bf16_t out = f2bf(y);
    if (head < nh) {
        q_out[((size_t)tok * nh + head) * d + i] = out;
    } else {
        kc[((size_t)(head - nh) * cap + row) * d + i] = out;
    }
}

extern "C" __global__ void qk_norm_rope_cache(
    const bf16_t* __restrict__ qkv, const bf16_t* __restrict__ qw, const bf16_t* __restrict__ kw,
    const float* __restrict__ cos_t, const float* __restrict__ sin_t,
    const u32* __restrict__ positions, const u32* __restrict__ cache_len,
    const u32* __restrict__ pt, bf16_t* __restrict__ kc, bf16_t* __restrict__ vc,
    bf16_t* __restrict__ q_out, int nh, int nkv, int d, int cap, float eps, int t_per,
    int pt_stride) {
    norm_rope_cache(qkv, qw, kw, cos_t, sin_t, positions, cache_len, pt, kc, vc, q_out, nh, nh,
                    nkv, d, cap, eps, t_per, pt_stride);
}

// The same for rows without q heads (the drafter's context rows only provide K/V).
extern "C" __global__ void kv_norm_rope_cache(
    const bf16_t* __restrict__ kv, const bf16_t* __restrict__ kw, const float* __restrict__ cos_t,
    const float* __restrict__ sin_t, const u32* __restrict__ positions,
    const u32* __restrict__ cache_len, const u32* __restrict__ pt, bf16_t* __restrict__ kc,
    bf16_t* __restrict__ vc, int nh, int nkv, int d, int cap, float eps, int t_per,
    int pt_stride) {
    norm_rope_cache(kv, nullptr, kw, cos_t, sin_t, positions, cache_len, pt, kc, vc, nullptr, 0,
                    nh, nkv, d, cap, eps, t_per, pt_stride);
}

// Split-K attention over the cache for t new tokens, one KV head per blockIdx.x, one chunk of
// CH keys per blockIdx.y, one tile of ROWS query rows (row = token * groups + g) per blockIdx.z.
// Keys [0, c) are committed (visible to all); key c + j is new token j, visible to token i when
// j <= i (causal, tree_mask == null) or bit j of tree_mask[i * words + j / 64] is set.
// Writes unnormalised partials: acc [nsplit, t * nh, d], ml [nsplit, t * nh, 2] (max, sum).
#define CH 64
#define ROWS 16
#define DMAX 128
extern "C" __global__ void attn_partial(
    const bf16_t* __restrict__ q, const bf16_t* __restrict__ kc, const bf16_t* __restrict__ vc,
    const u32* __restrict__ cache_len, const u32* __restrict__ pt,
    const u64* __restrict__ tree_mask, int words, float* __restrict__ acc_out,
    float* __restrict__ ml_out, int t, int nh, int nkv, int cap, float scale) {
    __shared__ u32 ks[CH][DMAX / 2 + 1];  // K chunk as bf16 pairs, padded against bank conflicts
    __shared__ u32 vs[CH][DMAX / 2];
    __shared__ float qs[ROWS][DMAX];
    const int d = DMAX;
    int kvh = blockIdx.x, split = blockIdx.y, tile = blockIdx.z;
    int groups = nh / nkv;
    int c = (int)(*cache_len);
    int L = c + t;
    int k0 = split * CH;
    int rows_total = t * groups;
    int r0 = tile * ROWS;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    size_t nrows = (size_t)t * nh;
    if (k0 >= L) return;  // past the end: the combine kernel ignores this split
    int kend = min(k0 + CH, L);
    // Causal: no row of this tile sees any key of the chunk past its last token (a tree mask
    // may show later tokens: the draft block sees itself whole).
    int last_tok = min(r0 + ROWS, rows_total) - 1;
    last_tok = last_tok / groups;
    bool empty = !tree_mask && k0 > c + last_tok;
    if (!empty) {
        for (int e = threadIdx.x; e < CH * (d / 2); e += blockDim.x) {
            int j = e / (d / 2), p = e % (d / 2);
            u32 kv = 0, vv = 0;
            if (k0 + j < kend) {
                size_t off = ((size_t)kvh * cap + kv_row(pt, k0 + j)) * d + 2 * p;
                kv = *(const u32*)(kc + off);
                vv = *(const u32*)(vc + off);
            }
            ks[j][p] = kv;
            vs[j][p] = vv;
        }
        for (int e = threadIdx.x; e < ROWS * d; e += blockDim.x) {
            int r = e / d, dd = e % d;
            int row = r0 + r;
            float v = 0.f;
            if (row < rows_total) {
                int tok = row / groups, g = row % groups;
                v = bf2f(q[((size_t)tok * nh + kvh * groups + g) * d + dd]) * scale;
            }
            qs[r][dd] = v;
        }
    }
    __syncthreads();
    // Each warp owns RW consecutive rows of the tile and scores them together, so every K
    // and V element read from shared memory feeds RW rows.
    const int RW = 4;
    int rbase = warp * RW;
    if (rbase >= ROWS) return;
    int tok[RW];
    bool live[RW];
    float m[RW], l[RW], a[RW][4];
#pragma unroll
    for (int i = 0; i < RW; ++i) {
        int row = r0 + rbase + i;
        live[i] = row < rows_total;
        tok[i] = live[i] ? row / groups : 0;
        m[i] = -INFINITY;
        l[i] = 0.f;
        a[i][0] = a[i][1] = a[i][2] = a[i][3] = 0.f;
    }
    if (!empty) {
        for (int kb = 0; kb < CH; kb += 32) {
            int j = kb + lane;
            int key = k0 + j;
            float s[RW];
            bool vis[RW];
#pragma unroll
            for (int i = 0; i < RW; ++i) {
                bool v = live[i] && key < kend;
                if (v && key >= c) {
                    int nj = key - c;
                    v = tree_mask ? ((tree_mask[(size_t)tok[i] * words + (nj >> 6)] >> (nj & 63)) & 1ull) != 0
                                  : nj <= tok[i];
                }
                vis[i] = v;
                s[i] = 0.f;
            }
#pragma unroll 8
            for (int p = 0; p < d / 2; ++p) {
                u32 kk = ks[j][p];
                float k0f = __uint_as_float(kk << 16), k1f = __uint_as_float(kk & 0xffff0000u);
#pragma unroll
                for (int i = 0; i < RW; ++i) {
                    float2 qv = *(const float2*)&qs[rbase + i][2 * p];
                    s[i] += qv.x * k0f + qv.y * k1f;
                }
            }
            float pexp[RW];
#pragma unroll
            for (int i = 0; i < RW; ++i) {
                float si = vis[i] ? s[i] : -INFINITY;
                float m_new = fmaxf(m[i], warp_max(si));
                if (m_new == -INFINITY) {  // nothing visible yet for this row (warp-uniform)
                    pexp[i] = 0.f;
                    continue;
                }
                pexp[i] = vis[i] ? __expf(si - m_new) : 0.f;
                float corr = __expf(m[i] - m_new);
                l[i] = l[i] * corr + warp_sum(pexp[i]);
                a[i][0] *= corr; a[i][1] *= corr; a[i][2] *= corr; a[i][3] *= corr;
                m[i] = m_new;
            }
#pragma unroll 4
            for (int jj = 0; jj < 32; ++jj) {
                u32 v01 = vs[kb + jj][2 * lane], v23 = vs[kb + jj][2 * lane + 1];
                float v0 = __uint_as_float(v01 << 16), v1 = __uint_as_float(v01 & 0xffff0000u);
                float v2 = __uint_as_float(v23 << 16), v3 = __uint_as_float(v23 & 0xffff0000u);
#pragma unroll
                for (int i = 0; i < RW; ++i) {
                    float pj = __shfl_sync(0xffffffffu, pexp[i], jj);
                    a[i][0] += pj * v0; a[i][1] += pj * v1; a[i][2] += pj * v2; a[i][3] += pj * v3;
                }
            }
        }
    }
#pragma unroll
    for (int i = 0; i < RW; ++i) {
        if (!live[i]) continue;
        int row = r0 + rbase + i;
        int g = row % groups;
        size_t orow = (size_t)tok[i] * nh + kvh * groups + g;
        float* ao = acc_out + ((size_t)split * nrows + orow) * d + 4 * lane;
        ao[0] = a[i][0]; ao[1] = a[i][1]; ao[2] = a[i][2]; ao[3] = a[i][3];
        if (lane == 0) {
            ml_out[((size_t)split * nrows + orow) * 2] = m[i];
            ml_out[((size_t)split * nrows + orow) * 2 + 1] = l[i];
        }
    }
}

// Merges the splits of attn_partial: out [t, nh * d] bf16. Grid (t * nh), block d threads.
// The splits' (max, sum) pairs are read by all threads at once into shared memory (up to
// COMBINE_SMEM splits; more take the same loop reading them one by one), so the merge costs
// one round of loads instead of two dependent loads per split; the sums are added in split
// order either way, so results do not depend on the path.
#define COMBINE_SMEM 1024
extern "C" __global__ void attn_combine(
    const float* __restrict__ acc, const float* __restrict__ ml, const u32* __restrict__ cache_len,
    bf16_t* __restrict__ out, int t, int nh, int d, int nsplit, int cps) {
    __shared__ float wsh[COMBINE_SMEM];
    __shared__ float lsh[COMBINE_SMEM];
    __shared__ float red[32];
    size_t nrows = (size_t)t * nh;
    // A batch of sequences of t tokens each: block x is sequence x row.
    const size_t seq = blockIdx.x / nrows;
    size_t orow = blockIdx.x % nrows;
    acc += seq * nsplit * nrows * d;
    ml += seq * nsplit * nrows * 2;
    out += seq * nrows * d;
    int L = (int)cache_len[seq] + t;
    // cps 0: chunks per split set from the live length, as attn_split_flash sets them.
    if (cps == 0) cps = chunks_per_split(L, CH, nsplit);
    int used = min(nsplit, (L + CH * cps - 1) / (CH * cps));
    if (used <= COMBINE_SMEM) {
        float mx = -INFINITY;
        for (int s = threadIdx.x; s < used; s += blockDim.x) {
            float m = ml[(s * nrows + orow) * 2];
            wsh[s] = m;
            lsh[s] = ml[(s * nrows + orow) * 2 + 1];
            mx = fmaxf(mx, m);
        }
        // Block max (order-free), then each split's weight; -inf marks a split with no keys.
        mx = warp_max(mx);
        if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = mx;
        __syncthreads();
        float M = -INFINITY;
        for (int w = 0; w < (int)(blockDim.x >> 5); ++w) M = fmaxf(M, red[w]);
        for (int s = threadIdx.x; s < used; s += blockDim.x)
            wsh[s] = wsh[s] == -INFINITY ? -INFINITY : __expf(wsh[s] - M);
        __syncthreads();
        // Eight splits' partials loaded at once, then added in split order (the loop
        // with one dependent load per split was latency bound: 12 us for 16 tokens, ncu).
        float num = 0.f, den = 0.f;
        for (int s0 = 0; s0 < used; s0 += 8) {
            float a[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const int s = s0 + j;
                a[j] = s < used && wsh[s] != -INFINITY ? acc[(s * nrows + orow) * d + threadIdx.x] : 0.f;
            }
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const int s = s0 + j;
                if (s >= used) break;
                const float w = wsh[s];
                if (w == -INFINITY) continue;
                den += w * lsh[s];
                num += w * a[j];
            }
        }
        out[orow * d + threadIdx.x] = f2bf(num / den);
        return;
    }
    float M = -INFINITY;
    for (int s = 0; s < used; ++s) M = fmaxf(M, ml[(s * nrows + orow) * 2]);
    float num = 0.f, den = 0.f;
    for (int s = 0; s < used; ++s) {
        float m = ml[(s * nrows + orow) * 2];
        if (m == -INFINITY) continue;
        float w = __expf(m - M);
        den += w * ml[(s * nrows + orow) * 2 + 1];
        num += w * acc[(s * nrows + orow) * d + threadIdx.x];
    }
    out[orow * d + threadIdx.x] = f2bf(num / den);
}

// out[r, j] = silu(gu[r, j]) * gu[r, i + j] for gu [rows, 2i]; out [rows, i].
// Rounds silu to bf16 before the product, as the plain path does.
extern "C" __global__ void silu_mul(const bf16_t* __restrict__ gu, bf16_t* __restrict__ out,
                                    int rows, int inter) {
    size_t n = (size_t)rows * inter;
    for (size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x; e < n;
         e += (size_t)gridDim.x * blockDim.x) {
        size_t r = e / inter, j = e % inter;
        float g = bf2f(gu[r * 2 * inter + j]);
        float u = bf2f(gu[r * 2 * inter + inter + j]);
        float sg = bf2f(f2bf(g / (1.f + __expf(-g))));
        out[e] = f2bf(sg * u);
    }
}

// add_rmsnorm for rows of hidden % 8 == 0, at most 8 ADD_VEC * blockDim.x long, 16-byte
// aligned: each thread loads its 16-byte pieces of x and delta at once and keeps the sums in
// registers for the second pass, where the scalar loop below makes every thread walk the row
// twice with one dependent 2-byte load pair per step (ncu, 16 rows of 4096 on the H200: 16.7
// us). Same rounding; the sum of squares is added in a different order.
#define ADD_VEC 4
__device__ __forceinline__ u32 add2(u32 a, u32 b) { return pack2(lo(a) + lo(b), hi(a) + hi(b)); }
__device__ __forceinline__ float sq2(u32 v) { return lo(v) * lo(v) + hi(v) * hi(v); }
extern "C" __global__ void __launch_bounds__(256) add_rmsnorm_vec(
    const bf16_t* __restrict__ x, const bf16_t* __restrict__ delta, const bf16_t* __restrict__ w,
    bf16_t* __restrict__ x_out, bf16_t* __restrict__ h_out, int hidden, float eps) {
    __shared__ float red[32];
    const int nv = hidden / 8;
    const size_t base = (size_t)blockIdx.x * nv;
    const uint4* xv = (const uint4*)x + base;
    const uint4* dv = (const uint4*)delta + base;
    uint4 sv[ADD_VEC];
    float ss = 0.f;
#pragma unroll
    for (int j = 0; j < ADD_VEC; ++j) {
        const int i = threadIdx.x + j * blockDim.x;
        if (i < nv) {
            const uint4 a = xv[i], b = dv[i];
            sv[j] = make_uint4(add2(a.x, b.x), add2(a.y, b.y), add2(a.z, b.z), add2(a.w, b.w));
            ss += sq2(sv[j].x) + sq2(sv[j].y) + sq2(sv[j].z) + sq2(sv[j].w);
        }
    }
    ss = block_sum(ss, red);
    const float inv = rsqrtf(ss / (float)hidden + eps);
#pragma unroll
    for (int j = 0; j < ADD_VEC; ++j) {
        const int i = threadIdx.x + j * blockDim.x;
        if (i < nv) {
            ((uint4*)x_out)[base + i] = sv[j];
            ((uint4*)h_out)[base + i] = norm8(sv[j], ((const uint4*)w)[i], inv);
        }
    }
}

// x_out = bf16(x + delta); h_out = rmsnorm(x_out) * w. One block per row.
extern "C" __global__ void add_rmsnorm(const bf16_t* __restrict__ x, const bf16_t* __restrict__ delta,
                                       const bf16_t* __restrict__ w, bf16_t* __restrict__ x_out,
                                       bf16_t* __restrict__ h_out, int hidden, float eps) {
    __shared__ float red[32];
    size_t base = (size_t)blockIdx.x * hidden;
    float ss = 0.f;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        float v = bf2f(f2bf(bf2f(x[base + i]) + bf2f(delta[base + i])));
        ss += v * v;
    }
    ss = block_sum(ss, red);
    float inv = rsqrtf(ss / (float)hidden + eps);
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        bf16_t s = f2bf(bf2f(x[base + i]) + bf2f(delta[base + i]));
        x_out[base + i] = s;
        h_out[base + i] = f2bf(bf2f(s) * inv * bf2f(w[i]));
    }
}
