// The Gated DeltaNet delta rule over a long run of tokens (a prefill) in its chunked form, on
// the tensor cores: what gdn_scan (gdn_split.cu) does one token at a time, 64 tokens at a time.
// The math is the CPU reference's (`qwen3_5::delta_rule::chunked`, HF's
// torch_chunk_gated_delta_rule). Per value head h and chunk c of 64 tokens, with G the
// log-decays summed inside the chunk (G_i = g_1 + .. + g_i):
//   A[i][j] = beta_i e^(G_i - G_j) (k_i . k_j) for j < i      (strictly lower)
//   P[i][j] = e^(G_i - G_j) (q_i . k_j)        for j <= i     (lower)
//   [U | W] = (I + A)^-1 [beta v | beta e^G k]                 (forward substitution)
// and across chunks, from the state S entering the chunk ([dk, dv]):
//   v_new = U - W S,  o = q e^G S + P v_new,  S' = e^(G_last) S + (k e^(G_last - G))^T v_new.
// With Q' = q e^G - P W and PU = P U (both independent of S), o = Q' S + PU, so the sequential
// kernel reads W, Q', U, PU and the decayed keys per chunk and does three products per chunk.
//   gdn_chunk_solve  one block per (chunk, value head), all chunks at once, two blocks an SM:
//                    G, A and P (TF32 mma), the solve (f32), Q' and PU (TF32 mma). Writes U
//                    and PU f32 [hv, nc, 64, 128], W and Q' bf16 [hv, nc, 64, 128], the
//                    decayed keys transposed, KT bf16 [hv, nc, 128, 64], G f32 [hv, nc, 64].
//   gdn_chunk_scan   one block per (value head, 64 value columns), the chunks in order: the
//                    state's 64 columns in f32 registers (C fragments), its bf16 copy in shared
//                    memory as the products' operand (bf16 mma, f32 sums: the rounding the
//                    flash-linear-attention kernels make); the next chunk's W, Q' and KT
//                    copied in (cp.async) while the current one is computed.
// The sequential kernel's loads were what bounded the first (all-f32) form: a block waited on
// 96 KB of synchronous loads per chunk, 192 blocks in two waves of one per SM.
// A verify tree of up to 64 nodes (`anc`: one u64 of ancestor bits a node, itself included;
// parents before children) is one chunk of the same form with the causal mask replaced by the
// ancestor mask: G_i sums the log-decays along the node's root path, A keeps the strict
// ancestors, P the ancestors and the node itself, and the forward substitution still runs in
// index order (A is zero off the ancestors); the scan then writes every node's v_new (the
// value it wrote, which the commit rebuilds the accepted path's state from) and no state. The
// CPU reference of that form is `qwen3_5::delta_rule::tree` (its tests: the node-by-node
// recurrence); tools/emulate_gdn_chunk.py emulates both modes lane by lane.
// Every exponent is <= 0 (g <= 0), so nothing overflows. Rows past t (the last chunk's tail)
// are zero: they write nothing into the state and their outputs are not written.

#include "common.cuh"

#define GC_D 128    // key and value head size
#define GC_C 64     // chunk length
#define GC_BV 64    // value columns per scan block
#define GC_LD 132   // row stride of the solve's f32 [64][128] tiles: 4 mod 32 words
#define GC_LDP 68   // [64][64] P read as A: 4 mod 32
#define GC_LDH 136  // bf16 [.][128] scan tiles (W, Q', the state transposed): 68 words, 4 mod 32
#define GC_LDT 72   // bf16 [.][64] scan tiles (KT, v_new transposed): 36 words, 4 mod 32

__device__ __forceinline__ u32 gc_tf32(float x) {
    u32 r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}

// c += a b, one m16n8k8 TF32 product (f32 accumulators).
__device__ __forceinline__ void gc_mma(float* c, const u32 (&a)[4], const u32 (&b)[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// TF32 fragments (lane = 4 g + t): A (16 x 8) rows g, g + 8, columns t, t + 4; B (8 x 8) rows
// t, t + 4, column g; C (16 x 8) rows g, g + 8, columns 2t, 2t + 1.
// A element (m, k) at x[m * ld + k].
__device__ __forceinline__ void gc_a(u32 (&a)[4], const float* x, int ld, int m0, int k0,
                                     int g, int t) {
    a[0] = gc_tf32(x[(m0 + g) * ld + k0 + t]);
    a[1] = gc_tf32(x[(m0 + g + 8) * ld + k0 + t]);
    a[2] = gc_tf32(x[(m0 + g) * ld + k0 + t + 4]);
    a[3] = gc_tf32(x[(m0 + g + 8) * ld + k0 + t + 4]);
}
// B element (k, n) at x[k * ld + n].
__device__ __forceinline__ void gc_b(u32 (&b)[2], const float* x, int ld, int k0, int n0,
                                     int g, int t) {
    b[0] = gc_tf32(x[(k0 + t) * ld + n0 + g]);
    b[1] = gc_tf32(x[(k0 + t + 4) * ld + n0 + g]);
}
// B element (k, n) at x[n * ld + k] (the rows of a matrix whose transpose is the operand).
__device__ __forceinline__ void gc_b_t(u32 (&b)[2], const float* x, int ld, int k0, int n0,
                                       int g, int t) {
    b[0] = gc_tf32(x[(n0 + g) * ld + k0 + t]);
    b[1] = gc_tf32(x[(n0 + g) * ld + k0 + t + 4]);
}

// bf16 m16n8k16 fragments, both from k-contiguous rows (element (m, k) of A at x[m * ld + k],
// element (k, n) of B at x[n * ld + k]): A rows g, g + 8, columns 2t, 2t + 1 and 2t + 8,
// 2t + 9; B rows 2t, 2t + 1 and 2t + 8, 2t + 9, column g. One 32-bit load per pair.
__device__ __forceinline__ u32 gc_pair(const bf16_t* x, int at) {
    return *reinterpret_cast<const u32*>(x + at);
}
__device__ __forceinline__ void gc_mma16(float* c, const bf16_t* a, int lda, int m0,
                                         const bf16_t* b, int ldb, int n0, int k0, int g, int t) {
    mma_bf16(c, gc_pair(a, (m0 + g) * lda + k0 + 2 * t), gc_pair(a, (m0 + g + 8) * lda + k0 + 2 * t),
             gc_pair(a, (m0 + g) * lda + k0 + 2 * t + 8), gc_pair(a, (m0 + g + 8) * lda + k0 + 2 * t + 8),
             gc_pair(b, (n0 + g) * ldb + k0 + 2 * t), gc_pair(b, (n0 + g) * ldb + k0 + 2 * t + 8));
}

__device__ __forceinline__ void gc_cp16(void* dst, const void* src) {
    const u32 s = (u32)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(src));
}
__device__ __forceinline__ void gc_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void gc_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// q, k: f32 [t, hk, 128] (q already scaled by dk^-1/2); v: f32 [t, hv * 128]; g, beta: f32
// [t, hv] (gdn_prep's outputs). Writes U, PU: f32 [hv, nc, 64, 128]; W, Qp: bf16
// [hv, nc, 64, 128]; KT: bf16 [hv, nc, 128, 64] (k e^(G_last - G), transposed); Gc: f32
// [hv, nc, 64]. anc (nullable): a tree's ancestor bits, u64 [t] (then t <= 64, nc = 1); null for
// a causal run. Grid (nc, hv), 256 threads, dynamic shared memory gdn_chunk_solve_smem bytes.
extern "C" __global__ void __launch_bounds__(256, 2) gdn_chunk_solve(
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
    const float* __restrict__ g, const float* __restrict__ beta, float* __restrict__ U,
    float* __restrict__ PU, bf16_t* __restrict__ W, bf16_t* __restrict__ Qp,
    bf16_t* __restrict__ KT, float* __restrict__ Gc, int t, int hk, int hv,
    const u64* __restrict__ anc) {
    extern __shared__ float gc_smem[];
    float* ks = gc_smem;               // [64][GC_LD]: the keys, then W
    float* qs = ks + GC_C * GC_LD;     // [64][GC_LD]: the queries, then U
    float* as = qs + GC_C * GC_LD;     // [64][64]: A
    float* ps = as + GC_C * GC_C;      // [64][GC_LDP]: P
    float* gs = ps + GC_C * GC_LDP;    // [64]: G
    float* bs = gs + GC_C;             // [64]: beta
    u64* ancs = reinterpret_cast<u64*>(bs + GC_C);  // [64]: a tree's ancestor bits
    const int c = blockIdx.x, h = blockIdx.y, nc = gridDim.x, tid = threadIdx.x;
    const int warp = tid >> 5, lane = tid & 31, fg = lane >> 2, ft = lane & 3;
    const int kh = h / (hv / hk), row0 = c * GC_C;
    const int n = min(GC_C, t - row0);
    const size_t blk = ((size_t)h * nc + c) * GC_C;
    for (int idx = tid; idx < GC_C * GC_D / 4; idx += 256) {
        const int i = idx / (GC_D / 4), d = 4 * (idx % (GC_D / 4));
        if (i < n) {
            const size_t at = ((size_t)(row0 + i) * hk + kh) * GC_D + d;
            gc_cp16(ks + i * GC_LD + d, k + at);
            gc_cp16(qs + i * GC_LD + d, q + at);
        } else {
            const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
            *reinterpret_cast<float4*>(ks + i * GC_LD + d) = zero;
            *reinterpret_cast<float4*>(qs + i * GC_LD + d) = zero;
        }
    }
    gc_commit();
    if (warp == 0) {
        const int i0 = 2 * lane, i1 = 2 * lane + 1;
        const float g0 = i0 < n ? g[(size_t)(row0 + i0) * hv + h] : 0.f;
        const float g1 = i1 < n ? g[(size_t)(row0 + i1) * hv + h] : 0.f;
        if (anc) {
            // G along each node's root path: its ancestors' log-decays (and its own), root
            // first; the raw ones staged in A's tile (written only after the next barrier).
            const u64 a0 = i0 < n ? anc[i0] : 0ull, a1 = i1 < n ? anc[i1] : 0ull;
            ancs[i0] = a0;
            ancs[i1] = a1;
            as[i0] = g0;
            as[i1] = g1;
            __syncwarp();
            float s0 = 0.f, s1 = 0.f;
            for (u64 m = a0; m; m &= m - 1) s0 += as[__ffsll((long long)m) - 1];
            for (u64 m = a1; m; m &= m - 1) s1 += as[__ffsll((long long)m) - 1];
            __syncwarp();
            gs[i0] = s0;
            gs[i1] = s1;
        } else {
            // G: an inclusive prefix sum over the chunk, two tokens a lane.
            float pair = g0 + g1, run = pair;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const float y = __shfl_up_sync(0xffffffffu, run, o);
                if (lane >= o) run += y;
            }
            const float before = run - pair;
            gs[i0] = before + g0;
            gs[i1] = before + g0 + g1;
        }
        bs[i0] = i0 < n ? beta[(size_t)(row0 + i0) * hv + h] : 0.f;
        bs[i1] = i1 < n ? beta[(size_t)(row0 + i1) * hv + h] : 0.f;
    }
    gc_wait<0>();
    __syncthreads();
    // A (warps 0-3) and P (warps 4-7): warp w's 16 rows (w % 4) by all 64 columns.
    {
        const float* lhs = warp < 4 ? ks : qs;
        const int m0 = (warp & 3) * 16;
        float acc[8][4];
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
#pragma unroll 4
        for (int k0 = 0; k0 < GC_D; k0 += 8) {
            u32 a[4];
            gc_a(a, lhs, GC_LD, m0, k0, fg, ft);
#pragma unroll
            for (int nt = 0; nt < 8; ++nt) {
                u32 b[2];
                gc_b_t(b, ks, GC_LD, k0, nt * 8, fg, ft);
                gc_mma(acc[nt], a, b);
            }
        }
#pragma unroll
        for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int i = m0 + fg + (e >> 1) * 8, j = nt * 8 + 2 * ft + (e & 1);
                const float dec = __expf(gs[i] - gs[j]);
                // Visible: j up to i (causal), or j an ancestor of i or i itself (a tree).
                const bool seen = anc ? ((ancs[i] >> j) & 1ull) != 0 : j <= i;
                if (warp < 4)
                    as[i * GC_C + j] = seen && j != i ? bs[i] * dec * acc[nt][e] : 0.f;
                else
                    ps[i * GC_LDP + j] = seen ? dec * acc[nt][e] : 0.f;
            }
        }
    }
    __syncthreads();
    // The solve, one column of [beta v | beta e^G k] a thread (warps 0-3 U's, 4-7 W's), by
    // forward substitution in registers. x starts as the right-hand side (finite), so the
    // four-wide products may run past j = i - 1: A is zero there.
    {
        const bool is_u = warp < 4;
        const int d = tid & (GC_D - 1);
        float x[GC_C];
        if (is_u) {
#pragma unroll
            for (int i = 0; i < GC_C; ++i)
                x[i] = i < n ? bs[i] * v[((size_t)(row0 + i) * hv + h) * GC_D + d] : 0.f;
        } else {
            // This thread's key column, also written decayed to the chunk end (KT's row d).
            const float glast = gs[GC_C - 1];
            bf16_t* kt = KT + (((size_t)h * nc + c) * GC_D + d) * GC_C;
#pragma unroll
            for (int i = 0; i < GC_C; i += 2) {
                const float k0v = ks[i * GC_LD + d], k1v = ks[(i + 1) * GC_LD + d];
                x[i] = bs[i] * __expf(gs[i]) * k0v;
                x[i + 1] = bs[i + 1] * __expf(gs[i + 1]) * k1v;
                *reinterpret_cast<u32*>(kt + i) =
                    pack2(k0v * __expf(glast - gs[i]), k1v * __expf(glast - gs[i + 1]));
            }
        }
#pragma unroll
        for (int i = 1; i < GC_C; ++i) {
            float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma unroll
            for (int j = 0; j < i; j += 4) {
                const float4 a = *reinterpret_cast<const float4*>(as + i * GC_C + j);
                s0 = fmaf(a.x, x[j], s0);
                s1 = fmaf(a.y, x[j + 1], s1);
                s2 = fmaf(a.z, x[j + 2], s2);
                s3 = fmaf(a.w, x[j + 3], s3);
            }
            x[i] -= (s0 + s1) + (s2 + s3);
        }
        // U into the queries' tile (read only before the last barrier), W into this thread's
        // own key column (read only by this thread since that barrier).
        float* xs = is_u ? qs : ks;
#pragma unroll
        for (int i = 0; i < GC_C; ++i) {
            xs[i * GC_LD + d] = x[i];
            if (is_u)
                U[(blk + i) * GC_D + d] = x[i];
            else
                W[(blk + i) * GC_D + d] = f2bf(x[i]);
        }
    }
    if (tid < GC_C) Gc[blk + tid] = gs[tid];
    __syncthreads();
    // P U (warps 0-3) and P W (warps 4-7): warp w's 16 rows (w % 4) by 128 columns; PU as is,
    // Q' = q e^G - P W (the queries read again from global memory: their tile now holds U).
    {
        const int m0 = (warp & 3) * 16;
        const bool is_u = warp < 4;
        const float* rhs = is_u ? qs : ks;
        float acc[16][4];
#pragma unroll
        for (int nt = 0; nt < 16; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
#pragma unroll 2
        for (int k0 = 0; k0 < GC_C; k0 += 8) {
            u32 a[4];
            gc_a(a, ps, GC_LDP, m0, k0, fg, ft);
#pragma unroll
            for (int nt = 0; nt < 16; ++nt) {
                u32 b[2];
                gc_b(b, rhs, GC_LD, k0, nt * 8, fg, ft);
                gc_mma(acc[nt], a, b);
            }
        }
#pragma unroll
        for (int nt = 0; nt < 16; ++nt) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int i = m0 + fg + r * 8, j = nt * 8 + 2 * ft;
                const size_t at = (blk + i) * GC_D + j;
                if (is_u) {
                    *reinterpret_cast<float2*>(PU + at) = make_float2(acc[nt][2 * r], acc[nt][2 * r + 1]);
                } else {
                    float2 qv = make_float2(0.f, 0.f);
                    if (i < n)
                        qv = *reinterpret_cast<const float2*>(q + ((size_t)(row0 + i) * hk + kh) * GC_D + j);
                    const float e = __expf(gs[i]);
                    *reinterpret_cast<u32*>(Qp + at) =
                        pack2(qv.x * e - acc[nt][2 * r], qv.y * e - acc[nt][2 * r + 1]);
                }
            }
        }
    }
}

// s0: f32 [hv, 128, 128] state before the run; U, PU, W, Qp, KT, Gc as gdn_chunk_solve writes
// them. o: f32 [t, hv, 128]; s_out (nullable): f32 [hv, 128, 128], the state after the last
// token; it may be s0 (each block reads its own columns of s0 at the start and writes the same
// columns of s_out at the end). vn_out (nullable): f32 [t, hv, 128], every token's v_new (a
// tree's writes; with s_out null the last chunk's state update is skipped). Grid (hv, 128 / 64),
// 256 threads, dynamic shared memory gdn_chunk_scan_smem bytes.
extern "C" __global__ void __launch_bounds__(256) gdn_chunk_scan(
    const float* s0, const float* __restrict__ U, const float* __restrict__ PU,
    const bf16_t* __restrict__ W, const bf16_t* __restrict__ Qp, const bf16_t* __restrict__ KT,
    const float* __restrict__ Gc, float* __restrict__ o, float* s_out, int t, int hv,
    float* __restrict__ vn_out) {
    extern __shared__ float gc_smem[];
    // Two stages of [W | Q' | KT] (bf16), then the state transposed and v_new transposed.
    bf16_t* stage0 = reinterpret_cast<bf16_t*>(gc_smem);
    const int stage_len = 2 * GC_C * GC_LDH + GC_D * GC_LDT;
    bf16_t* st_t = stage0 + 2 * stage_len;   // [64 value columns][GC_LDH]: S^T, bf16
    bf16_t* vn_t = st_t + GC_BV * GC_LDH;    // [64 value columns][GC_LDT]: v_new^T, bf16
    const int h = blockIdx.x, col0 = blockIdx.y * GC_BV, tid = threadIdx.x;
    const int warp = tid >> 5, lane = tid & 31, fg = lane >> 2, ft = lane & 3;
    const int nc = (t + GC_C - 1) / GC_C;
    const size_t head = (size_t)h * GC_D * GC_D;
    // Chunk c's W, Q' and KT into stage (c & 1): 16-byte copies, 12 a thread.
    auto fetch = [&](int c) {
        bf16_t* sw = stage0 + (c & 1) * stage_len;
        bf16_t* sq = sw + GC_C * GC_LDH;
        bf16_t* sk = sq + GC_C * GC_LDH;
        const size_t blk = ((size_t)h * nc + c) * GC_C;
        for (int idx = tid; idx < GC_C * GC_D / 8; idx += 256) {
            const int i = idx / (GC_D / 8), d = 8 * (idx % (GC_D / 8));
            gc_cp16(sw + i * GC_LDH + d, W + (blk + i) * GC_D + d);
            gc_cp16(sq + i * GC_LDH + d, Qp + (blk + i) * GC_D + d);
        }
        const bf16_t* kt = KT + ((size_t)h * nc + c) * GC_D * GC_C;
        for (int idx = tid; idx < GC_D * GC_C / 8; idx += 256) {
            const int r = idx / (GC_C / 8), i = 8 * (idx % (GC_C / 8));
            gc_cp16(sk + r * GC_LDT + i, kt + r * GC_C + i);
        }
        gc_commit();
    };
    fetch(0);
    // The state's rows 16 warp .. 16 warp + 15 by the block's 64 columns, as C fragments:
    // st[nt][e] is row 16 warp + fg + 8 (e >> 1), column 8 nt + 2 ft + (e & 1).
    float st[8][4];
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int r = 16 * warp + fg + 8 * (e >> 1), cc = 8 * nt + 2 * ft + (e & 1);
            st[nt][e] = s0[head + (size_t)r * GC_D + col0 + cc];
            st_t[cc * GC_LDH + r] = f2bf(st[nt][e]);
        }
    // Phase 1's tile of warp w: rows 16 (w % 4), columns 32 (w / 4) of the block's 64.
    const int m0 = 16 * (warp & 3), n0 = 32 * (warp >> 2);
    for (int c = 0; c < nc; ++c) {
        const int row0 = c * GC_C, n = min(GC_C, t - row0);
        const size_t blk = ((size_t)h * nc + c) * GC_C;
        if (c + 1 < nc) fetch(c + 1);
        // This thread's U and PU elements (f32, read straight into registers).
        float2 uu[4][2], pu[4][2];
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const size_t at = (blk + m0 + fg + 8 * r) * GC_D + col0 + n0 + 8 * nt + 2 * ft;
                uu[nt][r] = *reinterpret_cast<const float2*>(U + at);
                pu[nt][r] = *reinterpret_cast<const float2*>(PU + at);
            }
        const float glast = Gc[blk + GC_C - 1];
        if (c + 1 < nc) gc_wait<1>(); else gc_wait<0>();
        __syncthreads();
        const bf16_t* sw = stage0 + (c & 1) * stage_len;
        const bf16_t* sq = sw + GC_C * GC_LDH;
        const bf16_t* sk = sq + GC_C * GC_LDH;
        // v_new = U - W S and o = PU + Q' S.
        {
            float av[4][4], ao[4][4];
#pragma unroll
            for (int nt = 0; nt < 4; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) av[nt][e] = ao[nt][e] = 0.f;
#pragma unroll
            for (int k0 = 0; k0 < GC_D; k0 += 16) {
#pragma unroll
                for (int nt = 0; nt < 4; ++nt) {
                    gc_mma16(av[nt], sw, GC_LDH, m0, st_t, GC_LDH, n0 + 8 * nt, k0, fg, ft);
                    gc_mma16(ao[nt], sq, GC_LDH, m0, st_t, GC_LDH, n0 + 8 * nt, k0, fg, ft);
                }
            }
#pragma unroll
            for (int nt = 0; nt < 4; ++nt)
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const int i = m0 + fg + 8 * r, j = n0 + 8 * nt + 2 * ft;
                    const float2 vn = make_float2(uu[nt][r].x - av[nt][2 * r],
                                                  uu[nt][r].y - av[nt][2 * r + 1]);
                    vn_t[j * GC_LDT + i] = f2bf(vn.x);
                    vn_t[(j + 1) * GC_LDT + i] = f2bf(vn.y);
                    if (i < n) {
                        const size_t at = ((size_t)(row0 + i) * hv + h) * GC_D + col0 + j;
                        *reinterpret_cast<float2*>(o + at) =
                            make_float2(pu[nt][r].x + ao[nt][2 * r], pu[nt][r].y + ao[nt][2 * r + 1]);
                        if (vn_out) *reinterpret_cast<float2*>(vn_out + at) = vn;
                    }
                }
        }
        __syncthreads();
        if (!s_out && c + 1 == nc) break;  // no state wanted after the last chunk
        // S' = e^(G_last) S + KT v_new: warp w's 16 state rows by the 64 columns.
        {
            const float dec = __expf(glast);
#pragma unroll
            for (int nt = 0; nt < 8; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) st[nt][e] *= dec;
#pragma unroll
            for (int k0 = 0; k0 < GC_C; k0 += 16)
#pragma unroll
                for (int nt = 0; nt < 8; ++nt)
                    gc_mma16(st[nt], sk, GC_LDT, 16 * warp, vn_t, GC_LDT, 8 * nt, k0, fg, ft);
#pragma unroll
            for (int nt = 0; nt < 8; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int r = 16 * warp + fg + 8 * (e >> 1), cc = 8 * nt + 2 * ft + (e & 1);
                    st_t[cc * GC_LDH + r] = f2bf(st[nt][e]);
                }
        }
        __syncthreads();
    }
    if (s_out) {
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = 16 * warp + fg + 8 * (e >> 1), cc = 8 * nt + 2 * ft + (e & 1);
                s_out[head + (size_t)r * GC_D + col0 + cc] = st[nt][e];
            }
    }
}
