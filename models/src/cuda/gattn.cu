// The hybrid's gated full attention (qwen3_5/gated_attention.rs) for one sequence's short causal
// chain (decode steps and chain verifies of up to 16 tokens) or verify tree (up to 64 nodes,
// their ancestor bits masking the new rows) in three launches, instead of the
// plain path's ~30 candle ops: gattn_prep (q/k zero-centred RMSNorm + partial RoPE, the new
// K/V into the cache), gattn_split (split-K attention over the cache, GQA, causal among the
// new rows) and gattn_combine (merge of the splits times the sigmoid output gate: the o_proj
// input). Head dim 256 and its 16-token chains are not the dense kernels' shapes
// (attn_decode.cu: head dim 128 in registers and shared memory), and the arithmetic here is
// small next to the layer's projections, so these run on CUDA cores, which also gives an f32
// instance for the tight per-layer check. Compiled to PTX by models/build.rs.
//
// qkv row layout (the stacked projection): per q head, GD query dims then GD gate dims, then
// nkv K heads, then nkv V heads. The cache is [nkv, cap, GD] per K and V (contiguous
// buffers: the fused path takes no page tables); the new rows go to rows c .. c + t. With a
// non-null c_dev the committed length c is read from device memory instead (a CUDA graph's
// replays: one capture serves every cache length, the split count fixed for the capacity and
// the splits past the live keys empty).

#include "common.cuh"

#define GD 256  // head dim (one thread per dim in prep and combine)
#define RPW 8   // query rows per warp in gattn_split
#define DPL 8   // dims per lane: GD / 32
#define SNW 8   // warps per gattn_split block (consecutive key splits of the same rows)

__device__ __forceinline__ float ld(float x) { return x; }
__device__ __forceinline__ float ld(bf16_t x) { return bf2f(x); }
__device__ __forceinline__ void st(float* p, float x) { *p = x; }
__device__ __forceinline__ void st(bf16_t* p, float x) { *p = f2bf(x); }
// Dims 8 lane .. 8 lane + 7 of a row: one 16-byte load per lane for bf16, two for f32.
__device__ __forceinline__ void load8(const bf16_t* __restrict__ p, float (&v)[8]) {
    const uint4 u = __ldg((const uint4*)p);
    const u32 w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        v[2 * i] = lo(w[i]);
        v[2 * i + 1] = hi(w[i]);
    }
}
__device__ __forceinline__ void load8(const float* __restrict__ p, float (&v)[8]) {
    const float4 a = __ldg((const float4*)p), b = __ldg((const float4*)p + 1);
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
    v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}
// x as the element type would hold it (the plain path rounds there).
__device__ __forceinline__ float rnd(float x, float) { return x; }
__device__ __forceinline__ float rnd(float x, bf16_t) { return bf2f(f2bf(x)); }

// Whether new token tok may see key `key` (below its causal bound c + tok + 1, checked by the
// caller) of c committed ones: always for a causal chain (anc null), else a committed key or a
// new token among its ancestors (anc: one u64 per new token, bit j = new token j is tok or
// an ancestor of it; at most 64 new tokens; cuda::tree_bits).
__device__ __forceinline__ bool tree_sees(const u64* __restrict__ anc, int tok, int key, int c) {
    return anc == nullptr || key < c || ((__ldg(anc + tok) >> (key - c)) & 1ull);
}

// Grid (t, nh + nkv), GD threads: block (tok, h) normalises q head h (h < nh) or K head
// h - nh of token tok, applies RoPE to its first r dims (rotate-half within them, as HF's
// partial rotary), and writes q to q_out [t, nh, GD] or K (and the V head) to the cache.
// The normed value is rounded to the element type before RoPE, as the plain rms_norm output.
template <typename T>
__device__ __forceinline__ void prep_impl(const T* __restrict__ qkv, const T* __restrict__ qw,
                                          const T* __restrict__ kw, const T* __restrict__ cos_t,
                                          const T* __restrict__ sin_t, T* q_out, T* kc, T* vc,
                                          int nh, int nkv, int r, int cap, int c,
                                          const u32* __restrict__ c_dev, float eps) {
    if (c_dev) c = *c_dev;
    __shared__ float red[32];
    __shared__ float nv[GD];
    const int tok = blockIdx.x, h = blockIdx.y, dim = threadIdx.x;
    const size_t width = (size_t)(2 * nh + 2 * nkv) * GD;
    const T* row = qkv + (size_t)tok * width;
    const bool is_q = h < nh;
    const int kvh = h - nh;
    const T* src = is_q ? row + (size_t)h * 2 * GD : row + (size_t)(2 * nh + kvh) * GD;
    const float x = ld(src[dim]);
    const float ss = block_sum(x * x, red);
    const float inv = rsqrtf(ss / (float)GD + eps);
    const float n = rnd(x * inv * ld((is_q ? qw : kw)[dim]), T());
    nv[dim] = n;
    __syncthreads();
    float y = n;
    const int half = r / 2;
    if (dim < r) {
        const float cs = ld(cos_t[(size_t)tok * half + dim % half]);
        const float sn = ld(sin_t[(size_t)tok * half + dim % half]);
        y = dim < half ? n * cs - nv[dim + half] * sn : n * cs + nv[dim - half] * sn;
    }
    if (is_q) {
        st(q_out + ((size_t)tok * nh + h) * GD + dim, y);
    } else {
        const size_t off = ((size_t)kvh * cap + c + tok) * GD + dim;
        st(kc + off, y);
        vc[off] = row[(size_t)(2 * nh + nkv + kvh) * GD + dim];
    }
}

// Split s's partial (max, sum, unnormalised output) of each of the warp's RPW rows (row group
// z of KV head kvh) into ml / acc [split][tok * nh + head]; lane l holds dims 8 l .. 8 l + 7.
__device__ __forceinline__ void put_partials(const float (&o)[RPW][DPL], const float (&m)[RPW],
                                             const float (&l)[RPW], float* acc, float* ml, int t,
                                             int nh, int groups, int kvh, int s, int z) {
    const int lane = threadIdx.x & 31, rows = t * groups;
    const size_t nrows = (size_t)t * nh;
#pragma unroll
    for (int i = 0; i < RPW; ++i) {
        const int row = z * RPW + i;
        if (row >= rows) continue;
        const size_t orow = (size_t)(row / groups) * nh + kvh * groups + row % groups;
        const size_t at = (size_t)s * nrows + orow;
#pragma unroll
        for (int e = 0; e < DPL; ++e) acc[at * GD + DPL * lane + e] = o[i][e];
        if (lane == 0) {
            ml[at * 2] = m[i];
            ml[at * 2 + 1] = l[i];
        }
    }
}

// Grid (nkv, ceil(splits / SNW), row groups), SNW warps: warp w of block (kvh, y, z) owns key
// split s = y * SNW + w (keys [s * kps, (s + 1) * kps) of the L = c + t live ones) and the
// RPW query rows z * RPW .. of KV head kvh (row = tok * groups + g, q head kvh * groups + g).
// Lane l holds dims 8 l .. 8 l + 7 of its rows' q and of each key's K and V row (16-byte
// loads; the warp reads a 256-dim row in one go); per key an online
// softmax step per row. The partial (max, sum, unnormalised output) of each row goes to
// ml / acc [split][tok * nh + head] for gattn_combine; an empty split writes (-inf, 0, 0).
template <typename T>
__device__ __forceinline__ void split_impl(const T* __restrict__ q, const T* __restrict__ kc,
                                           const T* __restrict__ vc, float* acc, float* ml,
                                           int t, int nh, int nkv, int cap, int c,
                                           const u32* __restrict__ c_dev, int kps, int splits,
                                           float scale, const u64* __restrict__ anc) {
    if (c_dev) c = *c_dev;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int kvh = blockIdx.x, s = blockIdx.y * SNW + warp, z = blockIdx.z;
    if (s >= splits) return;
    const int groups = nh / nkv;
    const int rows = t * groups;
    const int L = c + t;
    // A split past every live key (a graph's splits cover the capacity) writes nothing: the
    // combine reads only the splits that hold live keys.
    if (s * kps >= L) return;
    float qv[RPW][DPL], o[RPW][DPL], m[RPW], l[RPW];
    int lim[RPW];  // keys visible to the row: [0, lim)
#pragma unroll
    for (int i = 0; i < RPW; ++i) {
        const int row = z * RPW + i;
        const bool live = row < rows;
        const int tok = live ? row / groups : 0;
        const int head = kvh * groups + (live ? row % groups : 0);
        lim[i] = live ? c + tok + 1 : 0;
        m[i] = -INFINITY;
        l[i] = 0.f;
        load8(q + ((size_t)tok * nh + head) * GD + DPL * lane, qv[i]);
#pragma unroll
        for (int e = 0; e < DPL; ++e) {
            qv[i][e] = live ? qv[i][e] * scale : 0.f;
            o[i][e] = 0.f;
        }
    }
    const int k0 = s * kps, k1 = min(L, k0 + kps);
    const T* kb = kc + (size_t)kvh * cap * GD + DPL * lane;
    const T* vb = vc + (size_t)kvh * cap * GD + DPL * lane;
#pragma unroll 4
    for (int key = k0; key < k1; ++key) {
        float kv[DPL], vv[DPL];
        load8(kb + (size_t)key * GD, kv);
        load8(vb + (size_t)key * GD, vv);
#pragma unroll
        for (int i = 0; i < RPW; ++i) {
            float part = 0.f;
#pragma unroll
            for (int e = 0; e < DPL; ++e) part = fmaf(qv[i][e], kv[e], part);
            const float sc = warp_sum(part);
            if (key < lim[i] && tree_sees(anc, (z * RPW + i) / groups, key, c)) {
                const float mn = fmaxf(m[i], sc);
                const float alpha = __expf(m[i] - mn);  // 0 while m is -inf
                const float p = __expf(sc - mn);
                l[i] = l[i] * alpha + p;
#pragma unroll
                for (int e = 0; e < DPL; ++e) o[i][e] = fmaf(o[i][e], alpha, p * vv[e]);
                m[i] = mn;
            }
        }
    }
    put_partials(o, m, l, acc, ml, t, nh, groups, kvh, s, z);
}

// gattn_split2: split_impl's grid, splits and partials (the same gattn_combine reads them), a
// second form of the work inside a warp (`cuda::set_gattn_split2`). The block stages its
// rows' q (scaled, f32) in shared memory once. A warp walks its keys 32
// at a time: lane j scores key j against every row (its K row read whole, q broadcast from
// shared memory: no cross-lane sums), one online-softmax step per row for the 32 keys (warp
// max and sum), the probabilities staged in shared memory, then lane l accumulates dims
// 8 l .. 8 l + 7 of the rows' outputs over the 32 V rows. (The first form took a warp-wide
// sum per key and row: ~540 instructions a key, 45 us for a 35B-A3B decode step at a 1K
// context on an H100, the SMs 11% active; session 27's ncu.) The partial (max, sum,
// unnormalised output) of each row goes to ml / acc [split][tok * nh + head] for gattn_combine;
// a split without a key a row may see leaves it (-inf, 0, 0); a split past every live key
// writes nothing (the combine reads only the splits that hold live keys).
template <typename T>
__device__ __forceinline__ void split2_impl(const T* __restrict__ q, const T* __restrict__ kc,
                                           const T* __restrict__ vc, float* acc, float* ml,
                                           int t, int nh, int nkv, int cap, int c,
                                           const u32* __restrict__ c_dev, int kps, int splits,
                                           float scale, const u64* __restrict__ anc) {
    __shared__ __align__(16) float qs[RPW][GD];
    __shared__ float pb[SNW][RPW][32];
    if (c_dev) c = *c_dev;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int kvh = blockIdx.x, s = blockIdx.y * SNW + warp, z = blockIdx.z;
    const int groups = nh / nkv;
    const int rows = t * groups;
    const int L = c + t;
    for (int x = threadIdx.x; x < RPW * GD; x += blockDim.x) {
        const int i = x / GD, dim = x % GD, row = z * RPW + i;
        float v = 0.f;
        if (row < rows) {
            const int head = kvh * groups + row % groups;
            v = ld(q[((size_t)(row / groups) * nh + head) * GD + dim]) * scale;
        }
        qs[i][dim] = v;
    }
    __syncthreads();
    if (s >= splits || s * kps >= L) return;
    float o[RPW][DPL], m[RPW], l[RPW];
    int lim[RPW];  // keys visible to the row: [0, lim)
#pragma unroll
    for (int i = 0; i < RPW; ++i) {
        const int row = z * RPW + i;
        lim[i] = row < rows ? c + row / groups + 1 : 0;
        m[i] = -INFINITY;
        l[i] = 0.f;
#pragma unroll
        for (int e = 0; e < DPL; ++e) o[i][e] = 0.f;
    }
    const int k0 = s * kps, k1 = min(L, k0 + kps);
    const T* kbase = kc + (size_t)kvh * cap * GD;
    const T* vbase = vc + (size_t)kvh * cap * GD + DPL * lane;
    for (int c0 = k0; c0 < k1; c0 += 32) {
        const int key = c0 + lane;
        const bool valid = key < k1;
        // Scores of lane's key against every row.
        float sc[RPW];
#pragma unroll
        for (int i = 0; i < RPW; ++i) sc[i] = 0.f;
        if (valid) {
            const T* kr = kbase + (size_t)key * GD;
#pragma unroll 4
            for (int d = 0; d < GD; d += DPL) {
                float kv[DPL];
                load8(kr + d, kv);
#pragma unroll
                for (int i = 0; i < RPW; ++i) {
                    const float4 a = *(const float4*)&qs[i][d];
                    const float4 b = *(const float4*)&qs[i][d + 4];
                    float acc8 = sc[i];
                    acc8 = fmaf(a.x, kv[0], acc8);
                    acc8 = fmaf(a.y, kv[1], acc8);
                    acc8 = fmaf(a.z, kv[2], acc8);
                    acc8 = fmaf(a.w, kv[3], acc8);
                    acc8 = fmaf(b.x, kv[4], acc8);
                    acc8 = fmaf(b.y, kv[5], acc8);
                    acc8 = fmaf(b.z, kv[6], acc8);
                    acc8 = fmaf(b.w, kv[7], acc8);
                    sc[i] = acc8;
                }
            }
        }
        // One online-softmax step per row for these 32 keys.
#pragma unroll
        for (int i = 0; i < RPW; ++i) {
            const bool sees = valid && key < lim[i] && tree_sees(anc, (z * RPW + i) / groups, key, c);
            const float x = sees ? sc[i] : -INFINITY;
            const float mn = fmaxf(m[i], warp_max(x));
            float p = 0.f, alpha = 1.f;
            if (mn != -INFINITY) {
                alpha = __expf(m[i] - mn);  // 0 while m is -inf
                p = __expf(x - mn);          // 0 for a key the row may not see
            }
            l[i] = l[i] * alpha + warp_sum(p);
            m[i] = mn;
            pb[warp][i][lane] = p;
#pragma unroll
            for (int e = 0; e < DPL; ++e) o[i][e] *= alpha;
        }
        __syncwarp();
        const int n = min(32, k1 - c0);
        for (int j = 0; j < n; ++j) {
            float vv[DPL];
            load8(vbase + (size_t)(c0 + j) * GD, vv);
#pragma unroll
            for (int i = 0; i < RPW; ++i) {
                const float p = pb[warp][i][j];
#pragma unroll
                for (int e = 0; e < DPL; ++e) o[i][e] = fmaf(p, vv[e], o[i][e]);
            }
        }
        __syncwarp();
    }
    put_partials(o, m, l, acc, ml, t, nh, groups, kvh, s, z);
}

// Grid (t * nh), GD threads: row tok * nh + h merged over the splits (weights exp(m_s - M)),
// rounded to the element type as the plain attention output, times sigmoid(gate) (rounded
// too, as the plain sigmoid), into out [t, nh * GD]: the o_proj input. Only the splits holding
// live keys (the first ceil((c + t) / kps); c from c_dev when set) are read: the later ones of
// a graph's capacity-wide split wrote nothing (and would only have added nothing).
template <typename T>
__device__ __forceinline__ void combine_impl(const float* __restrict__ acc,
                                             const float* __restrict__ ml,
                                             const T* __restrict__ qkv, T* out, int t, int nh,
                                             int nkv, int splits, int c,
                                             const u32* __restrict__ c_dev, int kps) {
    if (c_dev) c = *c_dev;
    splits = min(splits, (c + t + kps - 1) / kps);
    const int orow = blockIdx.x, dim = threadIdx.x;
    const int tok = orow / nh, h = orow % nh;
    const size_t nrows = (size_t)t * nh;
    float mx = -INFINITY;
    for (int s = 0; s < splits; ++s) mx = fmaxf(mx, ml[((size_t)s * nrows + orow) * 2]);
    float num = 0.f, den = 0.f;
    for (int s = 0; s < splits; ++s) {
        const size_t at = (size_t)s * nrows + orow;
        const float ms = ml[at * 2];
        if (ms == -INFINITY) continue;
        const float w = __expf(ms - mx);
        den += w * ml[at * 2 + 1];
        num += w * acc[at * GD + dim];
    }
    const float a = rnd(num / den, T());
    const size_t width = (size_t)(2 * nh + 2 * nkv) * GD;
    const float g = ld(qkv[(size_t)tok * width + (size_t)h * 2 * GD + GD + dim]);
    const float sg = rnd(1.f / (1.f + __expf(-g)), T());
    st(out + (size_t)orow * GD + dim, a * sg);
}

// All four launch as programmatic dependents (`cuda::pdl`).
#define GATTN(SUF, T)                                                                          \
    extern "C" __global__ void __launch_bounds__(GD) gattn_prep_##SUF(                         \
        const T* qkv, const T* qw, const T* kw, const T* cos_t, const T* sin_t, T* q_out,      \
        T* kc, T* vc, int nh, int nkv, int r, int cap, int c, const u32* c_dev, float eps) {   \
        pdl_wait();                                                                            \
        pdl_launch_dependents();                                                               \
        prep_impl<T>(qkv, qw, kw, cos_t, sin_t, q_out, kc, vc, nh, nkv, r, cap, c, c_dev, eps); \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(SNW * 32) gattn_split_##SUF(                  \
        const T* q, const T* kc, const T* vc, float* acc, float* ml, int t, int nh, int nkv,   \
        int cap, int c, const u32* c_dev, int kps, int splits, float scale, const u64* anc) {    \
        pdl_wait();                                                                            \
        pdl_launch_dependents();                                                               \
        split_impl<T>(q, kc, vc, acc, ml, t, nh, nkv, cap, c, c_dev, kps, splits, scale, anc);      \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(SNW * 32) gattn_split2_##SUF(                 \
        const T* q, const T* kc, const T* vc, float* acc, float* ml, int t, int nh, int nkv,   \
        int cap, int c, const u32* c_dev, int kps, int splits, float scale, const u64* anc) {    \
        pdl_wait();                                                                            \
        pdl_launch_dependents();                                                               \
        split2_impl<T>(q, kc, vc, acc, ml, t, nh, nkv, cap, c, c_dev, kps, splits, scale, anc);     \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(GD) gattn_combine_##SUF(                      \
        const float* acc, const float* ml, const T* qkv, T* out, int t, int nh, int nkv,       \
        int splits, int c, const u32* c_dev, int kps) {                                        \
        pdl_wait();                                                                            \
        pdl_launch_dependents();                                                               \
        combine_impl<T>(acc, ml, qkv, out, t, nh, nkv, splits, c, c_dev, kps);                 \
    }
GATTN(bf16, bf16_t)
GATTN(f32, float)
