// DFlash training attention on tensor cores (bf16 in, f32 accumulate, mma.sync m16n8k16;
// head_dim 64 or 128, block size 16, at most 8 q-heads per KV head): the forward, dq and the
// context keys' dk/dv of attn_dflash.cu (whose header gives the visibility, the layouts and
// the two-pass no-atomics scheme; its scalar kernels stay the f32 path and take the block keys'
// dk/dv here, a small share: each is seen by its own block's 16 queries only).
//
// Forward and dq: one CTA per (block, KV head), one warp per q-head of the group, each warp's
// 16 rows the block's 16 queries. K/V tiles of 64 keys are staged in shared memory by cp.async
// and shared by the group's warps: the context [max(0, a + 1 - W), a) of the block's sequence
// in tiles, then the block's own 16 keys as a last tile (rows 16..63 zero and masked).
// Per-element masks as attn_dflash.cu: context key j visible to slot k iff j < a and (full, or
// j >= a + k + 1 - W); block key j iff full or j <= k.
// Numerics: scores and softmax in f32; P (forward) and dS (dq, dk) are rounded to bf16 as the
// A operands of their products; the forward's row sum l is taken over the unrounded P so the
// saved lse is the exact log-sum-exp of the f32 scores the backward recomputes.
//
// dk/dv of context keys: one CTA per (64 context rows, KV head), 4 warps of 16 keys; the rows
// are walked as runs of one sequence (ctx_seq), and for each run every block of that sequence
// that can see one of its rows is visited: its G heads' Q and dO rows (16 each), lse and
// delta are staged, and each warp accumulates dV += P^T dO and dK += dS^T Q in registers
// (S^T = K Q^T and dP^T = V dO^T recomputed), written once at the end: deterministic.

#include "common.cuh"

#define TCH 64  // keys per tile

__device__ __forceinline__ u32 tsm(const void* p) { return (u32)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void tcp16(u32 dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
                 "r"(src_bytes));
}
__device__ __forceinline__ void tcommit_wait() {
    asm volatile("cp.async.commit_group;\n" ::);
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
}
__device__ __forceinline__ void tldsm(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}
__device__ __forceinline__ void tldsm_t(u32 addr, u32& r0, u32& r1, u32& r2, u32& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}

// Copies `n` rows of D bf16 (row i from src + i * D, or zeros where !live(i)) into dst rows
// of PAD; `rows` rows in all (zeros past n). All threads of the CTA take part.
template <int D, int PAD, typename Live>
__device__ __forceinline__ void stage_rows(bf16_t* dst, const bf16_t* __restrict__ src, int rows,
                                           Live live) {
    for (int e = threadIdx.x; e < rows * (D / 8); e += blockDim.x) {
        int i = e / (D / 8), p = e % (D / 8);
        bool ok = live(i);
        tcp16(tsm(dst + i * PAD + 8 * p), ok ? src + (size_t)i * D + 8 * p : src, ok ? 16 : 0);
    }
}

// S[16 x 64] += A[16 x D] (lanes' ldmatrix address a_lane) times B^T for B [64 x D] stored row
// per key (b_lane: the non-trans B addressing of attn_prefill.cu).
template <int D, int PAD>
__device__ __forceinline__ void mm_abt64(float (&s)[8][4], u32 a_lane, u32 b_lane) {
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
        u32 a0, a1, a2, a3;
        tldsm(a_lane + kk * 16 * 2, a0, a1, a2, a3);
#pragma unroll
        for (int np = 0; np < 4; ++np) {
            u32 b0, b1, b2, b3;
            tldsm(b_lane + (np * 16 * PAD + kk * 16) * 2, b0, b1, b2, b3);
            mma_bf16(s[2 * np], a0, a1, a2, a3, b0, b1);
            mma_bf16(s[2 * np + 1], a0, a1, a2, a3, b2, b3);
        }
    }
}

// O[16 x D] += P[16 x 64] (bf16 A fragments pf) times V [64 x D] (row per key; bt_lane: the
// trans addressing).
template <int D, int PAD>
__device__ __forceinline__ void mm_pv64(float (&o)[D / 8][4], const u32 (&pf)[4][4], u32 bt_lane) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
        for (int dp = 0; dp < D / 16; ++dp) {
            u32 b0, b1, b2, b3;
            tldsm_t(bt_lane + (j * 16 * PAD + dp * 16) * 2, b0, b1, b2, b3);
            mma_bf16(o[2 * dp], pf[j][0], pf[j][1], pf[j][2], pf[j][3], b0, b1);
            mma_bf16(o[2 * dp + 1], pf[j][0], pf[j][1], pf[j][2], pf[j][3], b2, b3);
        }
    }
}

// Whether key column c (0..63) of tile `t` is visible to slot k. Tiles 0..nctx-1 are context
// tiles starting at key j0 = lo + 64 t; tile nctx is the block's own keys.
__device__ __forceinline__ bool tc_visible(bool blk, int j, int k, int a, int window) {
    if (blk) return j < 16 && (window == 0 || j <= k);
    return j < a && (window == 0 || j >= a + k + 1 - window);
}

// Stages tile t's K and V (context or block keys) into ks / vs.
template <int D, int PAD>
__device__ __forceinline__ void stage_kv(bf16_t* ks, bf16_t* vs, const bf16_t* kc,
                                         const bf16_t* vc, const bf16_t* kb, const bf16_t* vb,
                                         bool blk, int j0, int a, size_t ctx_row0,
                                         size_t blk_row0) {
    if (blk) {
        auto live = [&](int i) { return i < 16; };
        stage_rows<D, PAD>(ks, kb + blk_row0 * D, TCH, live);
        stage_rows<D, PAD>(vs, vb + blk_row0 * D, TCH, live);
    } else {
        auto live = [&](int i) { return j0 + i < a; };
        stage_rows<D, PAD>(ks, kc + (ctx_row0 + j0) * D, TCH, live);
        stage_rows<D, PAD>(vs, vc + (ctx_row0 + j0) * D, TCH, live);
    }
}

// Grid (nblocks, KV), 32 G threads. out [R, H D] bf16, lse [H, R].
template <int D>
__device__ void tc_fwd(const bf16_t* __restrict__ q, const bf16_t* __restrict__ kc,
                       const bf16_t* __restrict__ vc, const bf16_t* __restrict__ kb,
                       const bf16_t* __restrict__ vb, const u32* __restrict__ blocks,
                       bf16_t* __restrict__ out, float* __restrict__ lse, int H, int KV, int R,
                       int cs, int bs, int window, float scale) {
    constexpr int PAD = D + 8, ODT = D / 8;
    extern __shared__ __align__(16) bf16_t tc_smem[];
    const int G = H / KV;
    bf16_t* ks = tc_smem;
    bf16_t* vs = ks + TCH * PAD;
    bf16_t* qs = vs + TCH * PAD;  // G x 16 rows
    const int b = blockIdx.x, kvh = blockIdx.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tig = lane & 3;
    const int h = kvh * G + warp;
    const u32 ctx_off = blocks[2 * b];
    const int a = (int)blocks[2 * b + 1];
    const int lo = window > 0 ? max(0, a + 1 - window) : 0;
    const int nctx = (a - lo + TCH - 1) / TCH;
    const size_t ctx_row0 = (size_t)kvh * cs + ctx_off, blk_row0 = (size_t)kvh * bs + b * 16;
    for (int w = 0; w < G; ++w)
        stage_rows<D, PAD>(qs + w * 16 * PAD, q + ((size_t)(kvh * G + w) * R + b * 16) * D, 16,
                           [](int) { return true; });
    int lm = lane >> 3, lr = lane & 7;
    u32 k_lane = tsm(ks + ((lm >> 1) * 8 + lr) * PAD + (lm & 1) * 8);
    u32 v_lane = tsm(vs + ((lm & 1) * 8 + lr) * PAD + (lm >> 1) * 8);
    u32 q_lane = tsm(qs + (warp * 16 + (lm & 1) * 8 + lr) * PAD + (lm >> 1) * 8);
    float o[ODT][4];
#pragma unroll
    for (int nt = 0; nt < ODT; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.f;
    float mA = -INFINITY, mB = -INFINITY, lA = 0.f, lB = 0.f;
    for (int t = 0; t <= nctx; ++t) {
        const bool blk = t == nctx;
        const int j0 = lo + t * TCH;
        __syncthreads();  // every warp is done with the previous tile
        stage_kv<D, PAD>(ks, vs, kc, vc, kb, vb, blk, j0, a, ctx_row0, blk_row0);
        tcommit_wait();
        __syncthreads();
        float s[8][4];
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
        mm_abt64<D, PAD>(s, q_lane, k_lane);
        float mxA = -INFINITY, mxB = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                int c = nt * 8 + tig * 2 + e, j = blk ? c : j0 + c;
                s[nt][e] = tc_visible(blk, j, g, a, window) ? s[nt][e] * scale : -INFINITY;
                s[nt][2 + e] =
                    tc_visible(blk, j, g + 8, a, window) ? s[nt][2 + e] * scale : -INFINITY;
                mxA = fmaxf(mxA, s[nt][e]);
                mxB = fmaxf(mxB, s[nt][2 + e]);
            }
        }
        mxA = fmaxf(mxA, __shfl_xor_sync(0xffffffffu, mxA, 1));
        mxA = fmaxf(mxA, __shfl_xor_sync(0xffffffffu, mxA, 2));
        mxB = fmaxf(mxB, __shfl_xor_sync(0xffffffffu, mxB, 1));
        mxB = fmaxf(mxB, __shfl_xor_sync(0xffffffffu, mxB, 2));
        float nA = fmaxf(mA, mxA), nB = fmaxf(mB, mxB);
        float cA = nA == -INFINITY ? 1.f : __expf(mA - nA);
        float cB = nB == -INFINITY ? 1.f : __expf(mB - nB);
#pragma unroll
        for (int nt = 0; nt < ODT; ++nt) {
            o[nt][0] *= cA; o[nt][1] *= cA; o[nt][2] *= cB; o[nt][3] *= cB;
        }
        mA = nA;
        mB = nB;
        float sumA = 0.f, sumB = 0.f;
        u32 pf[4][4];
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
            float p0 = mA == -INFINITY ? 0.f : __expf(s[nt][0] - mA);
            float p1 = mA == -INFINITY ? 0.f : __expf(s[nt][1] - mA);
            float p2 = mB == -INFINITY ? 0.f : __expf(s[nt][2] - mB);
            float p3 = mB == -INFINITY ? 0.f : __expf(s[nt][3] - mB);
            sumA += p0 + p1;
            sumB += p2 + p3;
            u32 pa = pack2(p0, p1), pb = pack2(p2, p3);
            int jj = nt >> 1;
            if ((nt & 1) == 0) { pf[jj][0] = pa; pf[jj][1] = pb; }
            else { pf[jj][2] = pa; pf[jj][3] = pb; }
        }
        sumA += __shfl_xor_sync(0xffffffffu, sumA, 1);
        sumA += __shfl_xor_sync(0xffffffffu, sumA, 2);
        sumB += __shfl_xor_sync(0xffffffffu, sumB, 1);
        sumB += __shfl_xor_sync(0xffffffffu, sumB, 2);
        lA = lA * cA + sumA;
        lB = lB * cB + sumB;
        mm_pv64<D, PAD>(o, pf, v_lane);
    }
    const int rowA = b * 16 + g, rowB = rowA + 8;
    float invA = 1.f / lA, invB = 1.f / lB;
    u32* oa = (u32*)(out + (size_t)rowA * H * D + (size_t)h * D);
    u32* ob = (u32*)(out + (size_t)rowB * H * D + (size_t)h * D);
#pragma unroll
    for (int nt = 0; nt < ODT; ++nt) {
        oa[nt * 4 + tig] = (u32)f2bf(o[nt][0] * invA) | ((u32)f2bf(o[nt][1] * invA) << 16);
        ob[nt * 4 + tig] = (u32)f2bf(o[nt][2] * invB) | ((u32)f2bf(o[nt][3] * invB) << 16);
    }
    if (tig == 0) {
        lse[(size_t)h * R + rowA] = mA + logf(lA);
        lse[(size_t)h * R + rowB] = mB + logf(lB);
    }
}

// Grid (nblocks, KV), 32 G threads: dq [H, R, D] bf16 and delta [H, R] = rowsum(dout * out).
template <int D>
__device__ void tc_bwd_dq(const bf16_t* __restrict__ q, const bf16_t* __restrict__ kc,
                          const bf16_t* __restrict__ vc, const bf16_t* __restrict__ kb,
                          const bf16_t* __restrict__ vb, const u32* __restrict__ blocks,
                          const bf16_t* __restrict__ out, const bf16_t* __restrict__ dout,
                          const float* __restrict__ lse, bf16_t* __restrict__ dq,
                          float* __restrict__ delta, int H, int KV, int R, int cs, int bs,
                          int window, float scale) {
    constexpr int PAD = D + 8, ODT = D / 8;
    extern __shared__ __align__(16) bf16_t tc_smem[];
    const int G = H / KV;
    bf16_t* ks = tc_smem;
    bf16_t* vs = ks + TCH * PAD;
    bf16_t* qs = vs + TCH * PAD;     // G x 16 rows
    bf16_t* dos = qs + G * 16 * PAD;  // G x 16 rows
    const int b = blockIdx.x, kvh = blockIdx.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tig = lane & 3;
    const int h = kvh * G + warp;
    const u32 ctx_off = blocks[2 * b];
    const int a = (int)blocks[2 * b + 1];
    const int lo = window > 0 ? max(0, a + 1 - window) : 0;
    const int nctx = (a - lo + TCH - 1) / TCH;
    const size_t ctx_row0 = (size_t)kvh * cs + ctx_off, blk_row0 = (size_t)kvh * bs + b * 16;
    for (int w = 0; w < G; ++w) {
        stage_rows<D, PAD>(qs + w * 16 * PAD, q + ((size_t)(kvh * G + w) * R + b * 16) * D, 16,
                           [](int) { return true; });
    }
    // dout rows of head h are strided by H D: stage them row by row.
    for (int e = threadIdx.x; e < G * 16 * (D / 8); e += blockDim.x) {
        int w = e / (16 * (D / 8)), i = (e / (D / 8)) % 16, p = e % (D / 8);
        const bf16_t* src = dout + (size_t)(b * 16 + i) * H * D + (size_t)(kvh * G + w) * D + 8 * p;
        tcp16(tsm(dos + (w * 16 + i) * PAD + 8 * p), src, 16);
    }
    // delta of the warp's 16 rows: lane pairs (row, half) sum D / 2 products each.
    float dl_row;
    {
        const int i = lane >> 1, half = lane & 1;
        const size_t oi = (size_t)(b * 16 + i) * H * D + (size_t)h * D + half * (D / 2);
        float acc = 0.f;
        for (int c = 0; c < D / 2; ++c) acc += bf2f(dout[oi + c]) * bf2f(out[oi + c]);
        acc += __shfl_xor_sync(0xffffffffu, acc, 1);
        dl_row = acc;  // row lane >> 1
        if (half == 0) delta[(size_t)h * R + b * 16 + i] = acc;
    }
    const float dA = __shfl_sync(0xffffffffu, dl_row, 2 * g);
    const float dB = __shfl_sync(0xffffffffu, dl_row, 2 * (g + 8));
    const float LA = lse[(size_t)h * R + b * 16 + g], LB = lse[(size_t)h * R + b * 16 + g + 8];
    int lm = lane >> 3, lr = lane & 7;
    u32 kn_lane = tsm(ks + ((lm >> 1) * 8 + lr) * PAD + (lm & 1) * 8);
    u32 vn_lane = tsm(vs + ((lm >> 1) * 8 + lr) * PAD + (lm & 1) * 8);
    u32 kt_lane = tsm(ks + ((lm & 1) * 8 + lr) * PAD + (lm >> 1) * 8);
    u32 q_lane = tsm(qs + (warp * 16 + (lm & 1) * 8 + lr) * PAD + (lm >> 1) * 8);
    u32 do_lane = tsm(dos + (warp * 16 + (lm & 1) * 8 + lr) * PAD + (lm >> 1) * 8);
    float acc[ODT][4];
#pragma unroll
    for (int nt = 0; nt < ODT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
    for (int t = 0; t <= nctx; ++t) {
        const bool blk = t == nctx;
        const int j0 = lo + t * TCH;
        __syncthreads();
        stage_kv<D, PAD>(ks, vs, kc, vc, kb, vb, blk, j0, a, ctx_row0, blk_row0);
        tcommit_wait();
        __syncthreads();
        float s[8][4], dp[8][4];
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
            s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
            dp[nt][0] = dp[nt][1] = dp[nt][2] = dp[nt][3] = 0.f;
        }
        mm_abt64<D, PAD>(s, q_lane, kn_lane);
        mm_abt64<D, PAD>(dp, do_lane, vn_lane);
        u32 pf[4][4];
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
            float ds[4];
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                int c = nt * 8 + tig * 2 + e, j = blk ? c : j0 + c;
                float pA = tc_visible(blk, j, g, a, window) ? __expf(s[nt][e] * scale - LA) : 0.f;
                float pB =
                    tc_visible(blk, j, g + 8, a, window) ? __expf(s[nt][2 + e] * scale - LB) : 0.f;
                ds[e] = pA * (dp[nt][e] - dA);
                ds[2 + e] = pB * (dp[nt][2 + e] - dB);
            }
            u32 pa = pack2(ds[0], ds[1]), pb = pack2(ds[2], ds[3]);
            int jj = nt >> 1;
            if ((nt & 1) == 0) { pf[jj][0] = pa; pf[jj][1] = pb; }
            else { pf[jj][2] = pa; pf[jj][3] = pb; }
        }
        mm_pv64<D, PAD>(acc, pf, kt_lane);
    }
    const int rowA = b * 16 + g, rowB = rowA + 8;
    u32* qa = (u32*)(dq + ((size_t)h * R + rowA) * D);
    u32* qb = (u32*)(dq + ((size_t)h * R + rowB) * D);
#pragma unroll
    for (int nt = 0; nt < ODT; ++nt) {
        qa[nt * 4 + tig] =
            (u32)f2bf(acc[nt][0] * scale) | ((u32)f2bf(acc[nt][1] * scale) << 16);
        qb[nt * 4 + tig] =
            (u32)f2bf(acc[nt][2] * scale) | ((u32)f2bf(acc[nt][3] * scale) << 16);
    }
}

// Stages block b's G heads' Q and dO rows (cp.async, not committed) and its lse and delta
// (plain loads) into one buffer of the context dk/dv kernel. All threads take part.
template <int D, int PAD>
__device__ __forceinline__ void stage_block(bf16_t* qs, bf16_t* dos, float* ls, float* dls,
                                            const bf16_t* __restrict__ q,
                                            const bf16_t* __restrict__ dout,
                                            const float* __restrict__ lse,
                                            const float* __restrict__ delta, int b, int kvh,
                                            int G, int H, int R) {
    for (int e = threadIdx.x; e < G * 16 * (D / 8); e += blockDim.x) {
        int w = e / (16 * (D / 8)), i = (e / (D / 8)) % 16, p = e % (D / 8);
        const int hh = kvh * G + w;
        tcp16(tsm(qs + (w * 16 + i) * PAD + 8 * p), q + ((size_t)hh * R + b * 16 + i) * D + 8 * p,
              16);
        tcp16(tsm(dos + (w * 16 + i) * PAD + 8 * p),
              dout + (size_t)(b * 16 + i) * H * D + (size_t)hh * D + 8 * p, 16);
    }
    for (int e = threadIdx.x; e < G * 16; e += blockDim.x) {
        const size_t li = (size_t)(kvh * G + e / 16) * R + b * 16 + e % 16;
        ls[e] = lse[li];
        dls[e] = delta[li];
    }
}

// One visible block's contribution to the warp's 16 context keys (anchor a; the block's rows
// staged in qs / dos / ls / dls): dV += P^T dO and dK += dS^T Q over the group's G heads.
template <int D, int PAD>
__device__ __forceinline__ void dkv_visit(const bf16_t* qs, const bf16_t* dos, const float* ls,
                                          const float* dls, int G, int a, u32 ka_lane,
                                          u32 va_lane, bool inA, bool inB, int jA, int jB,
                                          int window, float scale, float (*dk)[4],
                                          float (*dv)[4]) {
    const int lane = threadIdx.x & 31, tig = lane & 3, lm = lane >> 3, lr = lane & 7;
    for (int w = 0; w < G; ++w) {
        u32 qn_lane = tsm(qs + (w * 16 + (lm >> 1) * 8 + lr) * PAD + (lm & 1) * 8);
        u32 don_lane = tsm(dos + (w * 16 + (lm >> 1) * 8 + lr) * PAD + (lm & 1) * 8);
        u32 qt_lane = tsm(qs + (w * 16 + (lm & 1) * 8 + lr) * PAD + (lm >> 1) * 8);
        u32 dot_lane = tsm(dos + (w * 16 + (lm & 1) * 8 + lr) * PAD + (lm >> 1) * 8);
        // S^T = K Q^T and dP^T = V dO^T: [16 keys x 16 queries].
        float st[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
        float dpt[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
        for (int kk = 0; kk < D / 16; ++kk) {
            u32 a0, a1, a2, a3, b0, b1, b2, b3;
            tldsm(ka_lane + kk * 16 * 2, a0, a1, a2, a3);
            tldsm(qn_lane + kk * 16 * 2, b0, b1, b2, b3);
            mma_bf16(st[0], a0, a1, a2, a3, b0, b1);
            mma_bf16(st[1], a0, a1, a2, a3, b2, b3);
            tldsm(va_lane + kk * 16 * 2, a0, a1, a2, a3);
            tldsm(don_lane + kk * 16 * 2, b0, b1, b2, b3);
            mma_bf16(dpt[0], a0, a1, a2, a3, b0, b1);
            mma_bf16(dpt[1], a0, a1, a2, a3, b2, b3);
        }
        float p[2][4], ds[2][4];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int k = nt * 8 + tig * 2 + e;  // query slot
                const float L = ls[w * 16 + k], dl = dls[w * 16 + k];
                const bool vA = inA && jA < a && (window == 0 || jA >= a + k + 1 - window);
                const bool vB = inB && jB < a && (window == 0 || jB >= a + k + 1 - window);
                p[nt][e] = vA ? __expf(st[nt][e] * scale - L) : 0.f;
                p[nt][2 + e] = vB ? __expf(st[nt][2 + e] * scale - L) : 0.f;
                ds[nt][e] = p[nt][e] * (dpt[nt][e] - dl);
                ds[nt][2 + e] = p[nt][2 + e] * (dpt[nt][2 + e] - dl);
            }
        }
        // A fragments over the 16 queries (one k-step).
        const u32 pa0 = pack2(p[0][0], p[0][1]), pa1 = pack2(p[0][2], p[0][3]),
                  pa2 = pack2(p[1][0], p[1][1]), pa3 = pack2(p[1][2], p[1][3]);
        const u32 sa0 = pack2(ds[0][0], ds[0][1]), sa1 = pack2(ds[0][2], ds[0][3]),
                  sa2 = pack2(ds[1][0], ds[1][1]), sa3 = pack2(ds[1][2], ds[1][3]);
#pragma unroll
        for (int dp = 0; dp < D / 16; ++dp) {
            u32 b0, b1, b2, b3;
            tldsm_t(dot_lane + dp * 16 * 2, b0, b1, b2, b3);
            mma_bf16(dv[2 * dp], pa0, pa1, pa2, pa3, b0, b1);
            mma_bf16(dv[2 * dp + 1], pa0, pa1, pa2, pa3, b2, b3);
            tldsm_t(qt_lane + dp * 16 * 2, b0, b1, b2, b3);
            mma_bf16(dk[2 * dp], sa0, sa1, sa2, sa3, b0, b1);
            mma_bf16(dk[2 * dp + 1], sa0, sa1, sa2, sa3, b2, b3);
        }
    }
}

// Grid (ceil(C / 64), KV), 128 threads: dk, dv of context rows (laid out as kc / vc).
// seqs u32 [nseq, 3] = (context offset, first block, end block), ctx_seq u32 [C].
// PIPE: two buffers of the visited blocks' rows, the next block's copies in flight while the
// current one is computed (without, each visit waits for its own copies: latency-bound, ~3 ms
// a layer at the 8B recipe's shape against 0.77 for the forward, session 21's profile).
// Both forms visit the same blocks in the same order: the same sums, bit for bit.
template <int D, bool PIPE>
__device__ void tc_bwd_dkv_ctx(const bf16_t* __restrict__ q, const bf16_t* __restrict__ kc,
                               const bf16_t* __restrict__ vc, const u32* __restrict__ blocks,
                               const u32* __restrict__ seqs, const u32* __restrict__ ctx_seq,
                               const bf16_t* __restrict__ dout, const float* __restrict__ lse,
                               const float* __restrict__ delta, bf16_t* __restrict__ dkc,
                               bf16_t* __restrict__ dvc, int H, int KV, int R, int C, int cs,
                               int window, float scale) {
    constexpr int PAD = D + 8, ODT = D / 8, NBUF = PIPE ? 2 : 1;
    extern __shared__ __align__(16) bf16_t tc_smem[];
    const int G = H / KV;
    bf16_t* ks = tc_smem;
    bf16_t* vs = ks + TCH * PAD;
    bf16_t* qs = vs + TCH * PAD;                 // NBUF x G x 16 rows
    bf16_t* dos = qs + NBUF * G * 16 * PAD;      // NBUF x G x 16 rows
    float* ls = (float*)(dos + NBUF * G * 16 * PAD);  // NBUF x G x 16 lse
    float* dls = ls + NBUF * G * 16;                  // NBUF x G x 16 delta
    u32* row_seq = (u32*)(dls + NBUF * G * 16);       // 64
    const int r0 = blockIdx.x * TCH, kvh = blockIdx.y;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tig = lane & 3;
    const size_t krow0 = (size_t)kvh * cs + r0;
    {
        auto live = [&](int i) { return r0 + i < C; };
        stage_rows<D, PAD>(ks, kc + krow0 * D, TCH, live);
        stage_rows<D, PAD>(vs, vc + krow0 * D, TCH, live);
    }
    for (int i = threadIdx.x; i < TCH; i += blockDim.x)
        row_seq[i] = r0 + i < C ? ctx_seq[r0 + i] : 0xffffffffu;
    tcommit_wait();
    __syncthreads();
    int lm = lane >> 3, lr = lane & 7;
    // A operands: the warp's 16 key rows of K and V (non-trans A addressing).
    u32 ka_lane = tsm(ks + (warp * 16 + (lm & 1) * 8 + lr) * PAD + (lm >> 1) * 8);
    u32 va_lane = tsm(vs + (warp * 16 + (lm & 1) * 8 + lr) * PAD + (lm >> 1) * 8);
    float dk[ODT][4], dv[ODT][4];
#pragma unroll
    for (int nt = 0; nt < ODT; ++nt) {
        dk[nt][0] = dk[nt][1] = dk[nt][2] = dk[nt][3] = 0.f;
        dv[nt][0] = dv[nt][1] = dv[nt][2] = dv[nt][3] = 0.f;
    }
    const int kA = warp * 16 + g, kB = kA + 8;  // the lane's key rows within the tile
    const int rows16 = G * 16;
    int run = 0;
    while (run < TCH) {
        const u32 sq = row_seq[run];
        int end = run + 1;
        while (end < TCH && row_seq[end] == sq) ++end;
        if (sq != 0xffffffffu) {
            const int off = (int)seqs[3 * sq], blo = (int)seqs[3 * sq + 1],
                      bhi = (int)seqs[3 * sq + 2];
            const int jmin = r0 + run - off, jmax = r0 + end - 1 - off;
            const bool inA = kA >= run && kA < end, inB = kB >= run && kB < end;
            const int jA = r0 + kA - off, jB = r0 + kB - off;
            // The next block at or after b that sees a row of this run (bhi: none).
            auto next_visible = [&](int b) {
                for (; b < bhi; ++b) {
                    const int a = (int)blocks[2 * b + 1];
                    if (a <= jmin) continue;
                    if (window > 0 && jmax < a + 1 - window) continue;
                    return b;
                }
                return bhi;
            };
            if constexpr (PIPE) {
                int b = next_visible(blo), cur = 0;
                if (b < bhi)
                    stage_block<D, PAD>(qs, dos, ls, dls, q, dout, lse, delta, b, kvh, G, H, R);
                asm volatile("cp.async.commit_group;\n" ::);
                while (b < bhi) {
                    const int nb = next_visible(b + 1), nx = cur ^ 1;
                    if (nb < bhi)
                        stage_block<D, PAD>(qs + nx * rows16 * PAD, dos + nx * rows16 * PAD,
                                            ls + nx * rows16, dls + nx * rows16, q, dout, lse,
                                            delta, nb, kvh, G, H, R);
                    asm volatile("cp.async.commit_group;\n" ::);
                    // The current block's copies (the group before the one just committed).
                    asm volatile("cp.async.wait_group 1;\n" ::: "memory");
                    __syncthreads();
                    dkv_visit<D, PAD>(qs + cur * rows16 * PAD, dos + cur * rows16 * PAD,
                                      ls + cur * rows16, dls + cur * rows16, G,
                                      (int)blocks[2 * b + 1], ka_lane, va_lane, inA, inB, jA, jB,
                                      window, scale, dk, dv);
                    __syncthreads();  // every warp is done with `cur` before it is restaged
                    b = nb;
                    cur = nx;
                }
                asm volatile("cp.async.wait_group 0;\n" ::: "memory");
            } else {
                for (int b = next_visible(blo); b < bhi; b = next_visible(b + 1)) {
                    __syncthreads();  // every warp is done with the previous block's rows
                    stage_block<D, PAD>(qs, dos, ls, dls, q, dout, lse, delta, b, kvh, G, H, R);
                    tcommit_wait();
                    __syncthreads();
                    dkv_visit<D, PAD>(qs, dos, ls, dls, G, (int)blocks[2 * b + 1], ka_lane,
                                      va_lane, inA, inB, jA, jB, window, scale, dk, dv);
                }
            }
        }
        run = end;
    }
    // Rows kA (c[0..1]) and kB (c[2..3]) of the tile, when they are context rows.
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const int kr = half ? kB : kA;
        if (r0 + kr >= C) continue;
        u32* pk = (u32*)(dkc + (krow0 + kr) * D);
        u32* pv = (u32*)(dvc + (krow0 + kr) * D);
#pragma unroll
        for (int nt = 0; nt < ODT; ++nt) {
            pk[nt * 4 + tig] = (u32)f2bf(dk[nt][2 * half] * scale) |
                               ((u32)f2bf(dk[nt][2 * half + 1] * scale) << 16);
            pv[nt * 4 + tig] =
                (u32)f2bf(dv[nt][2 * half]) | ((u32)f2bf(dv[nt][2 * half + 1]) << 16);
        }
    }
}

#define DFLASH_TC(D)                                                                           \
    extern "C" __global__ void dflash_tc_fwd_d##D(                                             \
        const bf16_t* q, const bf16_t* kc, const bf16_t* vc, const bf16_t* kb,                 \
        const bf16_t* vb, const u32* blocks, bf16_t* out, float* lse, int H, int KV, int R,    \
        int cs, int bs, int window, float scale) {                                             \
        tc_fwd<D>(q, kc, vc, kb, vb, blocks, out, lse, H, KV, R, cs, bs, window, scale);       \
    }                                                                                          \
    extern "C" __global__ void dflash_tc_bwd_dq_d##D(                                          \
        const bf16_t* q, const bf16_t* kc, const bf16_t* vc, const bf16_t* kb,                 \
        const bf16_t* vb, const u32* blocks, const bf16_t* out, const bf16_t* dout,            \
        const float* lse, bf16_t* dq, float* delta, int H, int KV, int R, int cs, int bs,      \
        int window, float scale) {                                                             \
        tc_bwd_dq<D>(q, kc, vc, kb, vb, blocks, out, dout, lse, dq, delta, H, KV, R, cs, bs,   \
                     window, scale);                                                           \
    }                                                                                          \
    extern "C" __global__ void dflash_tc_bwd_dkv_ctx_d##D(                                     \
        const bf16_t* q, const bf16_t* kc, const bf16_t* vc, const u32* blocks,                \
        const u32* seqs, const u32* ctx_seq, const bf16_t* dout, const float* lse,             \
        const float* delta, bf16_t* dkc, bf16_t* dvc, int H, int KV, int R, int C, int cs,     \
        int window, float scale) {                                                             \
        tc_bwd_dkv_ctx<D, false>(q, kc, vc, blocks, seqs, ctx_seq, dout, lse, delta, dkc, dvc, \
                                 H, KV, R, C, cs, window, scale);                              \
    }                                                                                          \
    extern "C" __global__ void dflash_tc_bwd_dkv_ctx_pipe_d##D(                                \
        const bf16_t* q, const bf16_t* kc, const bf16_t* vc, const u32* blocks,                \
        const u32* seqs, const u32* ctx_seq, const bf16_t* dout, const float* lse,             \
        const float* delta, bf16_t* dkc, bf16_t* dvc, int H, int KV, int R, int C, int cs,     \
        int window, float scale) {                                                             \
        tc_bwd_dkv_ctx<D, true>(q, kc, vc, blocks, seqs, ctx_seq, dout, lse, delta, dkc, dvc,  \
                                H, KV, R, C, cs, window, scale);                               \
    }

DFLASH_TC(64)
DFLASH_TC(128)
