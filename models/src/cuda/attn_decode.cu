// One attention kernel per layer for forwards of few rows (decode, small verifies, trees):
// q/k RMSNorm + RoPE straight from the raw qkv GEMM output, the new tokens' K/V into the cache,
// split-K flash-decoding over the cache on tensor cores, and the merge of the splits by the
// last block to finish — what qk_norm_rope_cache + attn_split_flash (attn_prefill.cu) +
// attn_combine (kernels.cu) do in three launches. Compiled to PTX by models/build.rs.
//
// Grid (KV head, key split, sequence x row tile), 4 warps per block; the sequences of a batch
// (t new tokens each) read their rows through their page tables. A block owns TR = 16 RT query rows
// (row = token * groups + g) and `cps` chunks of CH keys from key split * cps * CH; its warps
// split the rows into RT tiles of 16 and each chunk's keys into KS = 4 / RT parts, so a
// decode block (one tile) has four warps on 16 keys each. Chunks stream through shared memory
// with cp.async, double buffered when a block has several; the key rows of the new tokens
// (>= cache_len) are computed from qkv instead of read from the cache, which the z = 0 block
// of each split writes in the same launch (no block reads those cache rows).

#include "common.cuh"

#define CH 64     // keys per chunk (cuda::CHUNK)
#define D 128     // head dim
#define KPAD 136  // bf16 per shared K/V/q row: 128 + 8, so fragment reads avoid bank conflicts
#define NW 4      // warps per block

#include "norm_rope.cuh"

__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
    u32 s = (u32)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(src));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

struct Args {
    const bf16_t* qkv;
    const bf16_t* qw;
    const bf16_t* kw;
    const float* cos_t;
    const float* sin_t;
    const u32* positions;
    const u32* cache_len;
    const u32* pt;  // page tables [seqs, pt_stride] (null: one sequence, rows in order)
    bf16_t* kc;
    bf16_t* vc;
    const u64* tree_mask;
    float* acc;
    float* ml;
    u32* counter;
    bf16_t* out;
    int words, t, nh, nkv, cap, cps;
    int pt_stride, tiles;  // page-table entries per sequence; row tiles per sequence
    float scale, eps;
};

// A batch of sequences with t new tokens each runs in one launch, grid z = sequence x row
// tile: the block's sequence's inputs and outputs, as a one-sequence launch sees them.
__device__ __forceinline__ Args for_sequence(Args a, int s) {
    const size_t rows = (size_t)a.t * a.nh;
    const size_t splits = gridDim.y;
    a.qkv += (size_t)s * a.t * (a.nh + 2 * a.nkv) * D;
    a.positions += (size_t)s * a.t;
    a.cache_len += s;
    if (a.pt) a.pt += (size_t)s * a.pt_stride;
    if (a.tree_mask) a.tree_mask += (size_t)s * a.t * a.words;
    a.acc += (size_t)s * splits * rows * D;
    a.ml += (size_t)s * splits * rows * 2;
    a.out += (size_t)s * rows * D;
    return a;
}

// The block's first batches: q rows [0, nq) of the block (norm + RoPE into qs) and the new
// keys [kfirst, kfirst + nk) of its first chunk (k-norm + RoPE and V into kb/vb at row
// key - k0, and into the cache when to_cache), each warp taking every NW-th job, four per
// batch, q rows first. The same routine writes the keys of later chunks (nq = 0) and, with
// kb null, the cache rows of chunks the block does not load.
__device__ __forceinline__ void heads(const Args& a, int kvh, int r0, int nq, bf16_t* qs,
                                      int kfirst, int nk, int c, int k0, bf16_t* kb, bf16_t* vb,
                                      bool to_cache) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int width = (a.nh + 2 * a.nkv) * D;
    const int groups = a.nh / a.nkv;
    const int myq = nq > warp ? (nq - warp + NW - 1) / NW : 0;
    const int myk = nk > warp ? (nk - warp + NW - 1) / NW : 0;
    for (int j0 = 0; j0 < myq + myk; j0 += 4) {
        Batch h;
        int dst[4];  // q row of the block, or key
#pragma unroll
        for (int b = 0; b < 4; ++b) {
            int j = j0 + b;
            h.src[b] = nullptr;
            h.vsrc[b] = nullptr;
            h.w[b] = a.qw;
            h.tok[b] = 0;
            dst[b] = 0;
            if (j < myq) {
                int r = warp + NW * j, row = r0 + r;
                h.tok[b] = row / groups;
                h.src[b] = a.qkv + (size_t)h.tok[b] * width + (size_t)(kvh * groups + row % groups) * D;
                dst[b] = r;
            } else if (j < myq + myk) {
                int key = kfirst + warp + NW * (j - myq);
                h.tok[b] = key - c;
                h.src[b] = a.qkv + (size_t)h.tok[b] * width + (size_t)(a.nh + kvh) * D;
                h.vsrc[b] = h.src[b] + (size_t)a.nkv * D;  // V head kvh: nkv heads after K head kvh
                h.w[b] = a.kw;
                dst[b] = key;
            }
        }
        bf16_t out[4][4], vout[4][4];
        norm_rope4(h, a.positions, a.cos_t, a.sin_t, a.eps, lane, out, vout);
#pragma unroll
        for (int b = 0; b < 4; ++b) {
            if (!h.src[b]) continue;
            if (!h.vsrc[b]) {
#pragma unroll
                for (int i = 0; i < 4; ++i) qs[dst[b] * KPAD + lane + 32 * i] = out[b][i];
                continue;
            }
            int key = dst[b];
            size_t off = ((size_t)kvh * a.cap + kv_row(a.pt, key)) * D;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                if (kb) {
                    kb[(key - k0) * KPAD + lane + 32 * i] = out[b][i];
                    vb[(key - k0) * KPAD + lane + 32 * i] = vout[b][i];
                }
                if (to_cache) {
                    a.kc[off + lane + 32 * i] = out[b][i];
                    a.vc[off + lane + 32 * i] = vout[b][i];
                }
            }
        }
    }
}

// Committed keys of the chunk from key k0 into shared buffers kb/vb by cp.async; keys past
// the live ones zeroed (their probabilities are 0, and 0 * garbage could be NaN). The new
// keys' rows are left to heads().
__device__ __forceinline__ void load_committed(const Args& a, int kvh, int k0, int c, int L,
                                               bf16_t* kb, bf16_t* vb) {
    for (int e = threadIdx.x; e < CH * (D / 8); e += NW * 32) {
        int j = e >> 4, p = e & 15, key = k0 + j;
        if (key < c) {
            size_t off = ((size_t)kvh * a.cap + kv_row(a.pt, key)) * D + 8 * p;
            cp_async16(kb + j * KPAD + 8 * p, a.kc + off);
            cp_async16(vb + j * KPAD + 8 * p, a.vc + off);
        } else if (key >= L) {
            *(uint4*)(kb + j * KPAD + 8 * p) = make_uint4(0, 0, 0, 0);
            *(uint4*)(vb + j * KPAD + 8 * p) = make_uint4(0, 0, 0, 0);
        }
    }
}

// ONE: a single shared K/V buffer even when a block walks several chunks (each chunk loaded
// after the previous one is consumed): half the shared memory, so more blocks per SM.
template <int RT, bool ONE>
__device__ __forceinline__ void attn_decode_impl(const Args& a) {
    constexpr int KS = NW / RT;  // warps sharing a row tile
    constexpr int KW = CH / KS;  // keys of a chunk per warp
    constexpr int NT = KW / 8;   // 8-key tiles per warp
    constexpr int TR = 16 * RT;  // query rows per block
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ u32 is_last;
    __shared__ float rowD[TR];
    const int stages = (ONE || a.cps == 1) ? 1 : 2;
    bf16_t* kvbuf = (bf16_t*)smem;  // stages x {K, V} x CH x KPAD
    bf16_t* qs = kvbuf + stages * 2 * CH * KPAD;  // TR x KPAD
    const int kvh = blockIdx.x, split = blockIdx.y, z = blockIdx.z % a.tiles;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, tig = lane & 3;
    const int groups = a.nh / a.nkv;
    const int c = (int)(*a.cache_len);
    const int L = c + a.t;
    // cps 0: chunks per split from the live length, the grid's splits being the most, so one
    // launch (one CUDA graph) is right for every length and cache capacity.
    const int cps = a.cps > 0 ? a.cps : chunks_per_split(L, CH, (int)gridDim.y);
    const int kbeg = split * cps * CH;
    const int rows_total = a.t * groups;
    const int r0 = z * TR;
    const size_t nrows = (size_t)a.t * a.nh;
    u32* cnt = a.counter + (size_t)kvh * gridDim.z + blockIdx.z;

    if (kbeg < L) {
        // Chunks with a visible key for some row of the block (causal: none past the block's
        // last token; a tree mask may show later tokens, so all live chunks).
        const int last_tok = (min(r0 + TR, rows_total) - 1) / groups;
        int nch = 0;
        while (nch < cps && kbeg + nch * CH < L &&
               (a.tree_mask || kbeg + nch * CH <= c + last_tok))
            ++nch;
        // Committed keys of the first chunk in flight, then the q rows and the chunk's new
        // keys in the same batches, dead q rows zeroed. The z = 0 block of each split writes
        // the new keys into the cache: those of the chunks it loads as it loads them, the
        // rest (past its rows' last token) separately.
        const bool to_cache = z == 0;
        if (nch > 0) load_committed(a, kvh, kbeg, c, L, kvbuf, kvbuf + CH * KPAD);
        cp_async_commit();
        const int nq = min(TR, rows_total - r0);
        const int kfirst = max(kbeg, c);
        const int nk0 = nch > 0 ? max(0, min(kbeg + CH, L) - kfirst) : 0;
        heads(a, kvh, r0, nq, qs, kfirst, nk0, c, kbeg, kvbuf, kvbuf + CH * KPAD, to_cache);
        if (to_cache) {
            int from = max(kbeg + nch * CH, c), to = min(kbeg + cps * CH, L);
            heads(a, kvh, 0, 0, nullptr, from, max(0, to - from), c, 0, nullptr, nullptr, true);
        }
        for (int e = nq * D + tid; e < TR * D; e += NW * 32) qs[(e / D) * KPAD + e % D] = 0;
        __syncthreads();
        const int tr = warp % RT, kofs = (warp / RT) * KW;
        const int t0 = r0 + tr * 16;  // first row of this warp's tile
        const int rowA = t0 + g, rowB = t0 + g + 8;
        const bool liveA = rowA < rows_total, liveB = rowB < rows_total;
        const bool dead = t0 >= rows_total;
        const int tokA = liveA ? rowA / groups : 0, tokB = liveB ? rowB / groups : 0;
        const int wlast = dead ? -1 : (min(t0 + 16, rows_total) - 1) / groups;
        u32 qf[8][4];
        {
            const u32* qa = (const u32*)(qs + (tr * 16 + g) * KPAD);
            const u32* qb = (const u32*)(qs + (tr * 16 + g + 8) * KPAD);
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
        for (int sc = 0; sc < nch; ++sc) {
            if (stages == 1 && sc > 0) {
                // The previous chunk's buffer is free (barrier at the loop's end).
                int k1 = kbeg + sc * CH, kf = max(k1, c);
                load_committed(a, kvh, k1, c, L, kvbuf, kvbuf + CH * KPAD);
                heads(a, kvh, 0, 0, nullptr, kf, max(0, min(k1 + CH, L) - kf), c, k1, kvbuf,
                      kvbuf + CH * KPAD, to_cache);
                cp_async_commit();
                cp_async_wait<0>();
            } else if (stages == 2 && sc + 1 < nch) {
                bf16_t* nb = kvbuf + ((sc + 1) & 1) * 2 * CH * KPAD;
                int k1 = kbeg + (sc + 1) * CH, kf = max(k1, c);
                load_committed(a, kvh, k1, c, L, nb, nb + CH * KPAD);
                heads(a, kvh, 0, 0, nullptr, kf, max(0, min(k1 + CH, L) - kf), c, k1, nb,
                      nb + CH * KPAD, to_cache);
                cp_async_commit();
                cp_async_wait<1>();
            } else {
                cp_async_wait<0>();
            }
            __syncthreads();
            const int k0 = kbeg + sc * CH + kofs;  // this warp's first key
            if (!dead && k0 < L && k0 <= c + wlast) {
                const bf16_t* kb = kvbuf + (stages == 2 ? (sc & 1) : 0) * 2 * CH * KPAD + kofs * KPAD;
                const bf16_t* vb = kb + CH * KPAD;
                float s[NT][4];
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
                    const u32* krow = (const u32*)(kb + (nt * 8 + g) * KPAD);
#pragma unroll
                    for (int kk = 0; kk < 8; ++kk)
                        mma_bf16(s[nt], qf[kk][0], qf[kk][1], qf[kk][2], qf[kk][3],
                                 krow[kk * 8 + tig], krow[kk * 8 + tig + 4]);
                }
                float mxA = -INFINITY, mxB = -INFINITY;
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
                    for (int e = 0; e < 2; ++e) {
                        int key = k0 + nt * 8 + tig * 2 + e;
                        bool vA = liveA && key < L, vB = liveB && key < L;
                        if (key >= c) {
                            int nj = key - c;
                            if (a.tree_mask) {
                                vA = vA && ((a.tree_mask[(size_t)tokA * a.words + (nj >> 6)] >> (nj & 63)) & 1ull);
                                vB = vB && ((a.tree_mask[(size_t)tokB * a.words + (nj >> 6)] >> (nj & 63)) & 1ull);
                            } else {
                                vA = vA && nj <= tokA;
                                vB = vB && nj <= tokB;
                            }
                        }
                        s[nt][e] = vA ? s[nt][e] * a.scale : -INFINITY;
                        s[nt][2 + e] = vB ? s[nt][2 + e] * a.scale : -INFINITY;
                        mxA = fmaxf(mxA, s[nt][e]);
                        mxB = fmaxf(mxB, s[nt][2 + e]);
                    }
                }
                // P = exp(S - m) as bf16 A fragments of P V (k-step j = key tiles 2j, 2j + 1).
                u32 pf[NT / 2][4];
                softmax_step<NT>(s, mxA, mxB, o, mA, mB, lA, lB, pf);
#pragma unroll
                for (int nt = 0; nt < 16; ++nt) {
                    int dim = nt * 8 + g;
#pragma unroll
                    for (int j = 0; j < NT / 2; ++j) {
                        int key = j * 16 + tig * 2;
                        u32 b0 = (u32)vb[key * KPAD + dim] | ((u32)vb[(key + 1) * KPAD + dim] << 16);
                        u32 b1 = (u32)vb[(key + 8) * KPAD + dim] | ((u32)vb[(key + 9) * KPAD + dim] << 16);
                        mma_bf16(o[nt], pf[j][0], pf[j][1], pf[j][2], pf[j][3], b0, b1);
                    }
                }
            }
            __syncthreads();  // the next load overwrites this buffer
        }
        // The block's partial: the KS warps of each row tile merged in a fixed order through
        // shared memory (the K/V buffers are free now), then one row of acc/ml per query row.
        float* ob = (float*)smem;          // [NW][16][D]
        float* mlb = ob + NW * 16 * D;     // [NW][16][2]
#pragma unroll
        for (int nt = 0; nt < 16; ++nt) {
            int dim = nt * 8 + tig * 2;
            ob[(warp * 16 + g) * D + dim] = o[nt][0];
            ob[(warp * 16 + g) * D + dim + 1] = o[nt][1];
            ob[(warp * 16 + g + 8) * D + dim] = o[nt][2];
            ob[(warp * 16 + g + 8) * D + dim + 1] = o[nt][3];
        }
        if (tig == 0) {
            mlb[(warp * 16 + g) * 2] = mA;
            mlb[(warp * 16 + g) * 2 + 1] = lA;
            mlb[(warp * 16 + g + 8) * 2] = mB;
            mlb[(warp * 16 + g + 8) * 2 + 1] = lB;
        }
        __syncthreads();
        for (int e = tid; e < TR * D; e += NW * 32) {
            int r = e / D, dim = e % D, rt = r / 16, rr = r % 16;
            int row = r0 + r;
            if (row >= rows_total) continue;
            float M = -INFINITY;
#pragma unroll
            for (int k = 0; k < KS; ++k) M = fmaxf(M, mlb[((k * RT + rt) * 16 + rr) * 2]);
            float num = 0.f, den = 0.f;
#pragma unroll
            for (int k = 0; k < KS; ++k) {
                int wr = (k * RT + rt) * 16 + rr;
                float m = mlb[wr * 2];
                if (m == -INFINITY) continue;
                float w = __expf(m - M);
                den += w * mlb[wr * 2 + 1];
                num += w * ob[wr * D + dim];
            }
            int tok = row / groups, gq = row % groups;
            size_t orow = (size_t)tok * a.nh + kvh * groups + gq;
            a.acc[((size_t)split * nrows + orow) * D + dim] = num;
            if (dim == 0) {
                a.ml[((size_t)split * nrows + orow) * 2] = M;
                a.ml[((size_t)split * nrows + orow) * 2 + 1] = den;
            }
        }
    }
    // Every block of the (KV head, row tile) counts itself; the last one merges the splits.
    __threadfence();
    __syncthreads();
    if (tid == 0) is_last = atomicAdd(cnt, 1u) == gridDim.y - 1;
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    const int span = CH * cps;
    const int used = min((int)gridDim.y, (L + span - 1) / span);
    // Every split's (max, sum) of the block's rows into shared memory (the host keeps
    // 2 used TR floats within the K/V buffers), then per row the global max, the weights
    // exp(m - M) in place and the denominator.
    float* wts = (float*)smem;         // [used][TR]
    float* sums = wts + used * TR;     // [used][TR]
    for (int e = tid; e < used * TR; e += NW * 32) {
        int s = e / TR, row = r0 + e % TR;
        float2 v = make_float2(-INFINITY, 0.f);
        if (row < rows_total) {
            size_t orow = (size_t)(row / groups) * a.nh + kvh * groups + row % groups;
            v = __ldcg((const float2*)(a.ml + ((size_t)s * nrows + orow) * 2));
        }
        wts[e] = v.x;
        sums[e] = v.y;
    }
    __syncthreads();
    for (int r = warp; r < TR; r += NW) {
        if (r0 + r >= rows_total) continue;
        float M = -INFINITY;
        for (int s = lane; s < used; s += 32) M = fmaxf(M, wts[s * TR + r]);
        M = warp_max(M);
        float den = 0.f;
        for (int s = lane; s < used; s += 32) {
            float m = wts[s * TR + r];
            float w = m == -INFINITY ? 0.f : __expf(m - M);
            den += w * sums[s * TR + r];
            wts[s * TR + r] = w;
        }
        den = warp_sum(den);
        if (lane == 0) rowD[r] = den;
    }
    __syncthreads();
    // Weighted sum of the partials, splits in order; independent loads, several in flight.
    for (int e = tid; e < TR * (D / 4); e += NW * 32) {
        int r = e / (D / 4), q4 = e % (D / 4);
        int row = r0 + r;
        if (row >= rows_total) continue;
        size_t orow = (size_t)(row / groups) * a.nh + kvh * groups + row % groups;
        const float4* src = (const float4*)(a.acc + orow * D) + q4;
        const size_t stride = nrows * (D / 4);  // float4 per split
        float4 num = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll 8
        for (int s = 0; s < used; ++s) {
            float w = wts[s * TR + r];
            float4 v = __ldcg(src + (size_t)s * stride);
            num.x += w * v.x; num.y += w * v.y; num.z += w * v.z; num.w += w * v.w;
        }
        float den = rowD[r];
        uint2 packed;
        packed.x = (u32)f2bf(num.x / den) | ((u32)f2bf(num.y / den) << 16);
        packed.y = (u32)f2bf(num.z / den) | ((u32)f2bf(num.w / den) << 16);
        *(uint2*)(a.out + orow * D + 4 * q4) = packed;
    }
    if (tid == 0) *cnt = 0u;  // re-armed for the next launch
}

// Every variant opens as a programmatic dependent (`cuda::pdl`).
#define ATTN_DECODE(NAME, RT, MINB, ONE)                                                        \
    extern "C" __global__ void __launch_bounds__(NW * 32, MINB) NAME(Args a) {                  \
        pdl_wait();                                                                             \
        pdl_launch_dependents();                                                                \
        attn_decode_impl<RT, ONE>(for_sequence(a, blockIdx.z / a.tiles));                       \
    }
ATTN_DECODE(attn_decode_rt1, 1, 1, false)
ATTN_DECODE(attn_decode_rt2, 2, 1, false)
ATTN_DECODE(attn_decode_rt4, 4, 1, false)
// Batched decode (one row tile per block): the register file caps the blocks per SM (255
// registers x 128 threads: 2 blocks, 8 warps), hence variants held to 3 blocks (168
// registers, two stages: 3 x 74 KB shared) and to 4 (128 registers, one stage: 4 x 39 KB).
ATTN_DECODE(attn_decode_rt1_b3, 1, 3, false)
ATTN_DECODE(attn_decode_rt1_b4s1, 1, 4, true)
