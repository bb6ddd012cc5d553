// The Gated DeltaNet token mixer of a short causal chain (a decode step, t = 1, or a chain
// verify of up to GDN_MAX_T tokens) of one sequence, in two launches per layer:
//   gdn_chain       the short causal depthwise conv (kernel K <= 4) over [cached window; new
//                   rows] (read where they are: no joined copy) + SiLU, q/k L2 normalisation
//                   (q scaled by dk^-1/2), the decay g = -exp(A_log) * softplus(a + dt_bias)
//                   and beta = sigmoid(b), then the delta rule over the t tokens with the f32
//                   state in registers. One block per (value head, 32 value columns): the
//                   state's columns are independent given k, q, v, g and beta, so a block owns
//                   S[:, cols] (4 warps x 32 key rows per thread) and recomputes its head's
//                   q / k conv itself (a few KB from L2).
//                   Writes the raw outputs (f32) and the state after every token (or only the
//                   last), in the [Hv, dk, dv] layout the cache keeps; the last state may be
//                   written over the state read (each block reads, then writes, only its own
//                   columns);
//   gdn_gated_norm  RMSNorm(o) * weight * silu(z) per (token, value head), as HF
//                   Qwen3_5RMSNormGated (and the plain path) rounds it; and the conv window's
//                   rows the caller keeps (every row of [window; new rows], or the window after
//                   the last one, which may be written over the window read: one thread moves
//                   a channel's rows, oldest first).
// Both open as programmatic dependents (`cuda::pdl`).
// dk = dv = 128 (every published Qwen3.5 / 3.6 / Next shape); the wrapper checks.

#include "common.cuh"

#define GDN_DK 128
#define GDN_DV 128
#define GDN_COLS 32
#define GDN_MAX_T 16
#define GDN_MAX_K 4

__device__ __forceinline__ float silu_f(float x) { return x / (1.f + __expf(-x)); }

// win: bf16 [K-1, C] (the cached K-1 pre-conv rows), C = conv channels = 2 * hk * dk + hv * dv
// in the order [q | k | v]; the t new pre-conv rows are columns [0, C) of proj (bf16 rows of
// stride P), which holds b at column off_b + h and a at off_b + hv + h. taps: bf16 [K, C] (tap
// K-1 multiplies the current row). s0: f32 [hv, dk, dv] state before the chain. o: f32 [t, hv,
// dv]. s_out: f32 [all ? t : 1, hv, dk, dv] (may be s0 when not all).
extern "C" __global__ void __launch_bounds__(128) gdn_chain(
    const bf16_t* __restrict__ win, const bf16_t* __restrict__ proj,
    const bf16_t* __restrict__ taps, const float* __restrict__ neg_a,
    const float* __restrict__ dt_bias, const float* s0, float* __restrict__ o, float* s_out,
    int t, int all_states, int hk, int hv, int C, int P, int K, int off_b) {
    __shared__ float qs[GDN_MAX_T][GDN_DK];
    __shared__ float ks[GDN_MAX_T][GDN_DK];
    __shared__ float vs[GDN_MAX_T][GDN_COLS];
    __shared__ float decay[GDN_MAX_T], beta[GDN_MAX_T];
    __shared__ float red[2][4][GDN_COLS];
    const int h = blockIdx.x, cg = blockIdx.y;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int kh = h / (hv / hk);
    pdl_wait();
    pdl_launch_dependents();

    // Conv + SiLU of one channel for token i, rounded to bf16 as the plain path's u is; row r
    // of [window; new rows] is window row r below K - 1.
    auto conv = [&](int ch, int i) -> float {
        float acc = 0.f;
        for (int j = 0; j < K; ++j) {
            const int r = i + j;
            const bf16_t x =
                r < K - 1 ? win[(size_t)r * C + ch] : proj[(size_t)(r - K + 1) * P + ch];
            acc = fmaf(bf2f(x), bf2f(taps[(size_t)j * C + ch]), acc);
        }
        float u = bf2f(f2bf(acc));
        return bf2f(f2bf(silu_f(u)));
    };
    {
        const int qch = kh * GDN_DK + tid, kch = hk * GDN_DK + kh * GDN_DK + tid;
        for (int i = 0; i < t; ++i) {
            qs[i][tid] = conv(qch, i);
            ks[i][tid] = conv(kch, i);
        }
        const int vch = 2 * hk * GDN_DK + h * GDN_DV + cg * GDN_COLS + lane;
        for (int i = warp; i < t; i += 4) vs[i][lane] = conv(vch, i);
        if (tid < t) {
            const bf16_t* row = proj + (size_t)tid * P;
            float a = bf2f(row[off_b + hv + h]) + dt_bias[h];
            float sp = a >= 20.f ? a : logf(1.f + expf(a));
            decay[tid] = expf(sp * neg_a[h]);
            float b = bf2f(row[off_b + h]);
            beta[tid] = 1.f / (1.f + expf(-b));
        }
    }
    __syncthreads();
    // L2 normalisation of q and k per token (eps 1e-6 inside the root, as the plain path).
    const float qscale = rsqrtf((float)GDN_DK);
    for (int i = warp; i < t; i += 4) {
        float sq = 0.f, sk = 0.f;
        for (int c = lane; c < GDN_DK; c += 32) {
            sq += qs[i][c] * qs[i][c];
            sk += ks[i][c] * ks[i][c];
        }
        sq = warp_sum(sq);
        sk = warp_sum(sk);
        const float iq = 1.f / sqrtf(sq + 1e-6f), ik = 1.f / sqrtf(sk + 1e-6f);
        for (int c = lane; c < GDN_DK; c += 32) {
            qs[i][c] = qs[i][c] * iq * qscale;
            ks[i][c] = ks[i][c] * ik;
        }
    }
    __syncthreads();

    // This thread's slice of the state: key rows warp*32 .. +32 of column j.
    const int j = cg * GDN_COLS + lane;
    const size_t head = (size_t)h * GDN_DK * GDN_DV;
    float s[32];
#pragma unroll
    for (int r = 0; r < 32; ++r) s[r] = s0[head + (size_t)(warp * 32 + r) * GDN_DV + j];
    for (int i = 0; i < t; ++i) {
        const float d = decay[i];
        const float* k = &ks[i][warp * 32];
        const float* q = &qs[i][warp * 32];
        float part = 0.f;
#pragma unroll
        for (int r = 0; r < 32; ++r) {
            s[r] *= d;
            part = fmaf(k[r], s[r], part);
        }
        red[0][warp][lane] = part;
        __syncthreads();
        const float remembered = red[0][0][lane] + red[0][1][lane] + red[0][2][lane] + red[0][3][lane];
        const float delta = beta[i] * (vs[i][lane] - remembered);
        float out = 0.f;
#pragma unroll
        for (int r = 0; r < 32; ++r) {
            s[r] = fmaf(k[r], delta, s[r]);
            out = fmaf(q[r], s[r], out);
        }
        red[1][warp][lane] = out;
        __syncthreads();
        if (warp == 0)
            o[((size_t)i * hv + h) * GDN_DV + j] =
                red[1][0][lane] + red[1][1][lane] + red[1][2][lane] + red[1][3][lane];
        if (all_states || i == t - 1) {
            float* dst = s_out + (size_t)(all_states ? i : 0) * hv * GDN_DK * GDN_DV + head;
#pragma unroll
            for (int r = 0; r < 32; ++r) dst[(size_t)(warp * 32 + r) * GDN_DV + j] = s[r];
        }
    }
}

// y[i, h*dv + c] = bf16(bf16(rms(bf16(o)) * w) * silu(z)) for one (head h, token i) per block
// of dv = 128 threads; z sits in proj rows (stride P) at column z_off + h * dv. With win_out:
// rows [first, K-1+t) of [win; new rows] (the new rows in proj's columns [0, C)) into win_out
// (which may be win when first >= 1: row r is read before it is written, once per channel).
extern "C" __global__ void __launch_bounds__(128) gdn_gated_norm(
    const float* __restrict__ o, const bf16_t* __restrict__ proj, const bf16_t* __restrict__ w,
    bf16_t* __restrict__ y, int hv, int P, int z_off, float eps, const bf16_t* win,
    bf16_t* win_out, int first, int K, int C, int t) {
    __shared__ float red[32];
    const int h = blockIdx.x, i = blockIdx.y, c = threadIdx.x;
    pdl_wait();
    pdl_launch_dependents();
    if (win_out != nullptr) {
        const int threads = gridDim.x * gridDim.y * blockDim.x;
        const int rows = K - 1 + t - first;
        const int ch0 = (blockIdx.y * gridDim.x + blockIdx.x) * blockDim.x + c;
        for (int ch = ch0; ch < C; ch += threads)
            for (int r = 0; r < rows; ++r) {
                const int src = first + r;
                win_out[(size_t)r * C + ch] = src < K - 1 ? win[(size_t)src * C + ch]
                                                          : proj[(size_t)(src - K + 1) * P + ch];
            }
    }
    const float v = bf2f(f2bf(o[((size_t)i * hv + h) * GDN_DV + c]));
    const float ss = block_sum(v * v, red);
    const float r = rsqrtf(ss / (float)GDN_DV + eps);
    const float normed = bf2f(f2bf(v * r * bf2f(w[c])));
    const float z = bf2f(proj[(size_t)i * P + z_off + h * GDN_DV + c]);
    y[(size_t)i * hv * GDN_DV + h * GDN_DV + c] = f2bf(normed * silu_f(z));
}
