// The Gated DeltaNet delta rule over a long run of tokens (a prefill) in its chunked form, on
// the tensor cores (TF32 inputs, f32 accumulation, the state kept in f32): what gdn_scan
// (gdn_split.cu) does one token at a time, 64 tokens at a time. The math is the CPU reference's
// (`qwen3_5::delta_rule::chunked`, HF's torch_chunk_gated_delta_rule). Per value head h and
// chunk c of 64 tokens, with G the log-decays summed inside the chunk (G_i = g_1 + .. + g_i):
//   A[i][j] = beta_i e^(G_i - G_j) (k_i . k_j) for j < i      (strictly lower)
//   P[i][j] = e^(G_i - G_j) (q_i . k_j)        for j <= i     (lower)
//   [U | W] = (I + A)^-1 [beta v | beta e^G k]                 (forward substitution)
// and across chunks, from the state S entering the chunk ([dk, dv]):
//   v_new = U - W S,  o = q e^G S + P v_new,  S' = e^(G_last) S + (k e^(G_last - G))^T v_new.
// With Q' = q e^G - P W and PU = P U (both independent of S), o = Q' S + PU, so the sequential
// kernel reads W, Q', U, PU and the keys per chunk and does three products per chunk.
//   gdn_chunk_solve  one block per (chunk, value head), all chunks at once: G, A, P, the solve,
//                    Q' and PU. Writes U, W, Q', PU f32 [hv, nc, 64, 128] and G [hv, nc, 64].
//   gdn_chunk_scan   one block per (value head, 32 value columns), the chunks in order: the
//                    state's 32 columns in registers (f32) and in shared memory (the products'
//                    operand), o written per chunk, the last state at the end.
// Every exponent is <= 0 (g <= 0), so nothing overflows. Rows past t (the last chunk's tail)
// are zero: they write nothing into the state and their outputs are not written.

#include "common.cuh"

#define GC_D 128    // key and value head size
#define GC_C 64     // chunk length
#define GC_BV 32    // value columns per scan block
#define GC_LD 132   // row stride of [64][128] operands read as A (m, k) or B^T: 4 mod 32
#define GC_LDX 264  // [64][256] read as B (k, n): 8 mod 32
#define GC_LDK 136  // [64][128] keys read transposed as A: 8 mod 32
#define GC_LDS 40   // [.][32] state / new values read as B (k, n): 8 mod 32
#define GC_LDP 68   // [64][64] P read as A: 4 mod 32

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

// Fragments (lane = 4 g + t): A (16 x 8) rows g, g + 8, columns t, t + 4; B (8 x 8) rows t,
// t + 4, column g; C (16 x 8) rows g, g + 8, columns 2t, 2t + 1.
// A element (m, k) at x[m * ld + k].
__device__ __forceinline__ void gc_a(u32 (&a)[4], const float* x, int ld, int m0, int k0,
                                     int g, int t) {
    a[0] = gc_tf32(x[(m0 + g) * ld + k0 + t]);
    a[1] = gc_tf32(x[(m0 + g + 8) * ld + k0 + t]);
    a[2] = gc_tf32(x[(m0 + g) * ld + k0 + t + 4]);
    a[3] = gc_tf32(x[(m0 + g + 8) * ld + k0 + t + 4]);
}
// A element (m, k) at x[k * ld + m] (a transposed operand).
__device__ __forceinline__ void gc_a_t(u32 (&a)[4], const float* x, int ld, int m0, int k0,
                                       int g, int t) {
    a[0] = gc_tf32(x[(k0 + t) * ld + m0 + g]);
    a[1] = gc_tf32(x[(k0 + t) * ld + m0 + g + 8]);
    a[2] = gc_tf32(x[(k0 + t + 4) * ld + m0 + g]);
    a[3] = gc_tf32(x[(k0 + t + 4) * ld + m0 + g + 8]);
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

// q, k: f32 [t, hk, 128] (q already scaled by dk^-1/2); v: f32 [t, hv * 128]; g, beta: f32
// [t, hv] (gdn_prep's outputs). Writes U, W, Qp, PU: f32 [hv, nc, 64, 128]; Gc: f32
// [hv, nc, 64]. Grid (nc, hv), 256 threads, dynamic shared memory gdn_chunk_solve_smem bytes.
extern "C" __global__ void __launch_bounds__(256) gdn_chunk_solve(
    const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
    const float* __restrict__ g, const float* __restrict__ beta, float* __restrict__ U,
    float* __restrict__ W, float* __restrict__ Qp, float* __restrict__ PU,
    float* __restrict__ Gc, int t, int hk, int hv) {
    extern __shared__ float gc_smem[];
    float* ks = gc_smem;                // [64][GC_LD]
    float* qs = ks + GC_C * GC_LD;      // [64][GC_LD]
    float* xs = qs + GC_C * GC_LD;      // [64][GC_LDX]: U | W
    float* as = xs + GC_C * GC_LDX;     // [64][64]: A
    float* ps = as + GC_C * GC_C;       // [64][GC_LDP]: P
    float* gs = ps + GC_C * GC_LDP;     // [64]: G
    float* bs = gs + GC_C;              // [64]: beta
    const int c = blockIdx.x, h = blockIdx.y, nc = gridDim.x, tid = threadIdx.x;
    const int warp = tid >> 5, lane = tid & 31, fg = lane >> 2, ft = lane & 3;
    const int kh = h / (hv / hk), row0 = c * GC_C;
    const int n = min(GC_C, t - row0);
    for (int idx = tid; idx < GC_C * GC_D / 4; idx += 256) {
        const int i = idx / (GC_D / 4), d = 4 * (idx % (GC_D / 4));
        const bool in = i < n;
        const size_t at = ((size_t)(row0 + i) * hk + kh) * GC_D + d;
        const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
        *reinterpret_cast<float4*>(ks + i * GC_LD + d) = in ? *reinterpret_cast<const float4*>(k + at) : zero;
        *reinterpret_cast<float4*>(qs + i * GC_LD + d) = in ? *reinterpret_cast<const float4*>(q + at) : zero;
    }
    if (warp == 0) {
        // G: an inclusive prefix sum over the chunk, two tokens a lane.
        const int i0 = 2 * lane, i1 = 2 * lane + 1;
        const float g0 = i0 < n ? g[(size_t)(row0 + i0) * hv + h] : 0.f;
        const float g1 = i1 < n ? g[(size_t)(row0 + i1) * hv + h] : 0.f;
        float pair = g0 + g1, run = pair;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const float y = __shfl_up_sync(0xffffffffu, run, o);
            if (lane >= o) run += y;
        }
        const float before = run - pair;
        gs[i0] = before + g0;
        gs[i1] = before + g0 + g1;
        bs[i0] = i0 < n ? beta[(size_t)(row0 + i0) * hv + h] : 0.f;
        bs[i1] = i1 < n ? beta[(size_t)(row0 + i1) * hv + h] : 0.f;
    }
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
                if (warp < 4)
                    as[i * GC_C + j] = j < i ? bs[i] * dec * acc[nt][e] : 0.f;
                else
                    ps[i * GC_LDP + j] = j <= i ? dec * acc[nt][e] : 0.f;
            }
        }
    }
    __syncthreads();
    // The solve, one column of [beta v | beta e^G k] a thread, by forward substitution with
    // the column in registers (4 partial sums per row for the FMA pipeline).
    {
        const int col = tid;
        float x[GC_C];
#pragma unroll
        for (int i = 0; i < GC_C; ++i) {
            float b;
            if (col < GC_D)
                b = i < n ? bs[i] * v[((size_t)(row0 + i) * hv + h) * GC_D + col] : 0.f;
            else
                b = bs[i] * __expf(gs[i]) * ks[i * GC_LD + col - GC_D];
            float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma unroll
            for (int j = 0; j + 3 < i; j += 4) {
                s0 = fmaf(as[i * GC_C + j], x[j], s0);
                s1 = fmaf(as[i * GC_C + j + 1], x[j + 1], s1);
                s2 = fmaf(as[i * GC_C + j + 2], x[j + 2], s2);
                s3 = fmaf(as[i * GC_C + j + 3], x[j + 3], s3);
            }
#pragma unroll
            for (int j = i & ~3; j < i; ++j) s0 = fmaf(as[i * GC_C + j], x[j], s0);
            x[i] = b - ((s0 + s1) + (s2 + s3));
        }
        float* dst = (col < GC_D ? U : W) + (((size_t)h * nc + c) * GC_C) * GC_D + (col & (GC_D - 1));
#pragma unroll
        for (int i = 0; i < GC_C; ++i) {
            xs[i * GC_LDX + col] = x[i];
            dst[(size_t)i * GC_D] = x[i];
        }
    }
    if (tid < GC_C) Gc[((size_t)h * nc + c) * GC_C + tid] = gs[tid];
    __syncthreads();
    // P [U | W]: warp w's 16 rows (w % 4) by 128 columns (U's for w < 4, W's after); PU as
    // is, Q' = q e^G - P W.
    {
        const int m0 = (warp & 3) * 16, half = warp >> 2;
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
                gc_b(b, xs, GC_LDX, k0, half * GC_D + nt * 8, fg, ft);
                gc_mma(acc[nt], a, b);
            }
        }
        float* dst = (half == 0 ? PU : Qp) + (((size_t)h * nc + c) * GC_C) * GC_D;
#pragma unroll
        for (int nt = 0; nt < 16; ++nt) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int i = m0 + fg + r * 8, j = nt * 8 + 2 * ft;
                float2 o;
                if (half == 0) {
                    o = make_float2(acc[nt][2 * r], acc[nt][2 * r + 1]);
                } else {
                    const float e = __expf(gs[i]);
                    o = make_float2(qs[i * GC_LD + j] * e - acc[nt][2 * r],
                                    qs[i * GC_LD + j + 1] * e - acc[nt][2 * r + 1]);
                }
                *reinterpret_cast<float2*>(dst + (size_t)i * GC_D + j) = o;
            }
        }
    }
}

// s0: f32 [hv, 128, 128] state before the run; k: f32 [t, hk, 128]; U, W, Qp, PU, Gc as
// gdn_chunk_solve writes them. o: f32 [t, hv, 128]; s_out (nullable): f32 [hv, 128, 128], the
// state after the last token; it may be s0 (each block reads its own columns of s0 at the start
// and writes the same columns of s_out at the end). Grid (hv, 128 / 32), 128 threads, dynamic shared memory
// gdn_chunk_scan_smem bytes.
extern "C" __global__ void __launch_bounds__(128) gdn_chunk_scan(
    const float* s0, const float* __restrict__ k, const float* __restrict__ U,
    const float* __restrict__ W, const float* __restrict__ Qp, const float* __restrict__ PU,
    const float* __restrict__ Gc, float* __restrict__ o, float* s_out, int t,
    int hk, int hv) {
    extern __shared__ float gc_smem[];
    float* ws = gc_smem;               // [64][GC_LD]: W
    float* qs = ws + GC_C * GC_LD;     // [64][GC_LD]: Q'
    float* kd = qs + GC_C * GC_LD;     // [64][GC_LDK]: k e^(G_last - G)
    float* ss = kd + GC_C * GC_LDK;    // [128][GC_LDS]: the state's columns
    float* vn = ss + GC_D * GC_LDS;    // [64][GC_LDS]: v_new's columns
    const int h = blockIdx.x, col0 = blockIdx.y * GC_BV, tid = threadIdx.x;
    const int warp = tid >> 5, lane = tid & 31, fg = lane >> 2, ft = lane & 3;
    const int kh = h / (hv / hk), nc = (t + GC_C - 1) / GC_C;
    const size_t head = (size_t)h * GC_D * GC_D;
    // The state's rows 32 warp .. 32 warp + 31 by the block's 32 columns, as C fragments:
    // st[mt][nt][e] is row 32 warp + 16 mt + fg + 8 (e >> 1), column 8 nt + 2 ft + (e & 1).
    float st[2][4][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int nt = 0; nt < 4; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = 32 * warp + 16 * mt + fg + 8 * (e >> 1), cc = 8 * nt + 2 * ft + (e & 1);
                st[mt][nt][e] = s0[head + (size_t)r * GC_D + col0 + cc];
                ss[r * GC_LDS + cc] = st[mt][nt][e];
            }
    for (int c = 0; c < nc; ++c) {
        const int row0 = c * GC_C, n = min(GC_C, t - row0);
        const size_t blk = ((size_t)h * nc + c) * GC_C;
        const float* gc = Gc + blk;
        const float glast = gc[GC_C - 1];
        for (int idx = tid; idx < GC_C * GC_D / 4; idx += 128) {
            const int i = idx / (GC_D / 4), d = 4 * (idx % (GC_D / 4));
            *reinterpret_cast<float4*>(ws + i * GC_LD + d) =
                *reinterpret_cast<const float4*>(W + (blk + i) * GC_D + d);
            *reinterpret_cast<float4*>(qs + i * GC_LD + d) =
                *reinterpret_cast<const float4*>(Qp + (blk + i) * GC_D + d);
            float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
            if (i < n) {
                x = *reinterpret_cast<const float4*>(k + ((size_t)(row0 + i) * hk + kh) * GC_D + d);
                const float e = __expf(glast - gc[i]);
                x.x *= e; x.y *= e; x.z *= e; x.w *= e;
            }
            *reinterpret_cast<float4*>(kd + i * GC_LDK + d) = x;
        }
        __syncthreads();
        // v_new = U - W S and o = PU + Q' S: warp w's 16 rows by the 32 columns.
        {
            const int m0 = 16 * warp;
            float av[4][4], ao[4][4];
#pragma unroll
            for (int nt = 0; nt < 4; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) av[nt][e] = ao[nt][e] = 0.f;
#pragma unroll 4
            for (int k0 = 0; k0 < GC_D; k0 += 8) {
                u32 aw[4], aq[4];
                gc_a(aw, ws, GC_LD, m0, k0, fg, ft);
                gc_a(aq, qs, GC_LD, m0, k0, fg, ft);
#pragma unroll
                for (int nt = 0; nt < 4; ++nt) {
                    u32 b[2];
                    gc_b(b, ss, GC_LDS, k0, nt * 8, fg, ft);
                    gc_mma(av[nt], aw, b);
                    gc_mma(ao[nt], aq, b);
                }
            }
#pragma unroll
            for (int nt = 0; nt < 4; ++nt)
#pragma unroll
                for (int r = 0; r < 2; ++r) {
                    const int i = m0 + fg + 8 * r, j = 8 * nt + 2 * ft;
                    const size_t at = (blk + i) * GC_D + col0 + j;
                    const float2 u = *reinterpret_cast<const float2*>(U + at);
                    const float2 pu = *reinterpret_cast<const float2*>(PU + at);
                    vn[i * GC_LDS + j] = u.x - av[nt][2 * r];
                    vn[i * GC_LDS + j + 1] = u.y - av[nt][2 * r + 1];
                    if (i < n)
                        *reinterpret_cast<float2*>(o + ((size_t)(row0 + i) * hv + h) * GC_D + col0 + j) =
                            make_float2(pu.x + ao[nt][2 * r], pu.y + ao[nt][2 * r + 1]);
                }
        }
        __syncthreads();
        // S' = e^(G_last) S + kd^T v_new: warp w's 32 state rows.
        {
            const float dec = __expf(glast);
#pragma unroll
            for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                for (int nt = 0; nt < 4; ++nt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) st[mt][nt][e] *= dec;
#pragma unroll
            for (int k0 = 0; k0 < GC_C; k0 += 8) {
                u32 b[4][2];
#pragma unroll
                for (int nt = 0; nt < 4; ++nt) gc_b(b[nt], vn, GC_LDS, k0, nt * 8, fg, ft);
#pragma unroll
                for (int mt = 0; mt < 2; ++mt) {
                    u32 a[4];
                    gc_a_t(a, kd, GC_LDK, 32 * warp + 16 * mt, k0, fg, ft);
#pragma unroll
                    for (int nt = 0; nt < 4; ++nt) gc_mma(st[mt][nt], a, b[nt]);
                }
            }
#pragma unroll
            for (int mt = 0; mt < 2; ++mt)
#pragma unroll
                for (int nt = 0; nt < 4; ++nt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int r = 32 * warp + 16 * mt + fg + 8 * (e >> 1);
                        ss[r * GC_LDS + 8 * nt + 2 * ft + (e & 1)] = st[mt][nt][e];
                    }
        }
        __syncthreads();
    }
    if (s_out) {
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int nt = 0; nt < 4; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int r = 32 * warp + 16 * mt + fg + 8 * (e >> 1), cc = 8 * nt + 2 * ft + (e & 1);
                    s_out[head + (size_t)r * GC_D + col0 + cc] = st[mt][nt][e];
                }
    }
}
