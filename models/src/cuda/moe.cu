// The sparse-MoE block's experts on the device (decode, chain and tree verification: at most
// MOE_MAX_ROWS rows per launch set; prefills: any number), routed by moe_route.cu's kernels
// (metadata layout: moe.cuh), with the math of layers/moe.rs: out[r] = sum over r's experts in
// ascending expert order of bf16(bf16(expert(x_r)) * bf16(w)), each addition rounded to bf16
// (what the plain path's index_add does), plus the residual.
//   moe_gate_up_rows*      one row per pair on CUDA cores (decode): grid (column tiles, pairs),
//                          silu(gate) * up of the pair's expert, the input norm applied as x
//                          streams in (the skinny GEMM's rows_impl);
//   moe_down_rows_sp*      decode: every block owns 8 output columns of one row and walks the
//                          row's k experts in ascending order, so the weighted combine and the
//                          residual add happen in registers: no per-pair outputs;
//   moe_gate_up_mma_m*     2..64 rows on tensor cores: grid (column tiles, used experts); a
//   moe_down_mma_m*        block reads its expert's weights once for all the rows routed to it
//                          (gathered, mma_impl's GATHER), writing per-pair outputs;
//   moe_combine            the weighted sum of each row's pairs (+ residual, + the row sums of
//                          squares the next RMSNorm reads).
// Only the selected experts' weights are read. The expert weights are stacked: gate_up
// [E, 2I, H] (gate rows then up rows per expert), down [E, H, I].
// The decode kernels launch as programmatic dependents (`cuda::pdl`), the next kernel
// triggered once their weights have streamed.
//
// A shared expert of the routed width (Qwen3.5/3.6 MoE: out = sigmoid(x g) shared(x) + the
// routed sum) can ride along at one row (decode): the router GEMV's rows are the E experts,
// then the shared gate (column E of the logits, row stride `stride`); moe_route appends to
// every row a pair of expert id E with weight sigmoid(logit E) after its top k (so k + 1 pairs
// a row, the shared one last in ascending order), and the rows kernels read expert E's
// weights from separate pointers. Five launches fewer per layer than the shared expert on
// its own (two GEMVs, the gate GEMV, sigmoid, scale, add).
//
#include "moe.cuh"

// act[p] = silu(x_r gate_e) * (x_r up_e) for pair p = blockIdx.y (row r, expert e), with x_r
// the RMSNorm of row r from its sums of squares when NORM. N = I, K = H. Expert E (when
// shared_w is given) is the shared expert, its [2I, H] rows at shared_w.
#define MOE_GATE_UP_ROWS(name, NORM)                                                            \
    extern "C" __global__ void __launch_bounds__(128, 8)                                         \
        name(const bf16_t* __restrict__ x, const bf16_t* __restrict__ w, bf16_t* __restrict__ act, \
             int N, int K, const u32* __restrict__ meta, int P, const bf16_t* __restrict__ nw,  \
             float eps, const float* __restrict__ ss_in, const bf16_t* __restrict__ shared_w,   \
             int E) {                                                                           \
        pdl_wait(); /* the pair's row and expert; rows_impl triggers the next kernel */        \
        const int p = blockIdx.y;                                                               \
        const u32 r = meta[2 + 3 * P + p], e = meta[2 + 4 * P + p];                             \
        const bf16_t* we =                                                                      \
            shared_w != nullptr && e == (u32)E ? shared_w : w + (size_t)e * 2 * N * K;          \
        rows_impl<2, 2, EPI_SILU, NORM, 1>(x + (size_t)r * K, we,                               \
                                           act + (size_t)p * N, N, K, nullptr, nw, eps,         \
                                           NORM ? ss_in + r : nullptr, nullptr, nullptr,        \
                                           nullptr, nullptr, 0);                                \
    }
MOE_GATE_UP_ROWS(moe_gate_up_rows, NORM_NONE)
MOE_GATE_UP_ROWS(moe_gate_up_rows_norm, NORM_SS)

// y[r, n] = resid[r, n] + the combine of row r's experts' down projections, for the 8 columns
// of this block (2 per warp) and row r = blockIdx.y; act [P, I] (I = 256 SP), w [E, H, I]. Two
// experts' weights are in flight at a time; each expert's product is rounded, weighted and
// added as the plain path does, in ascending expert order.
// Expert E (when shared_w is given) is the shared expert, its [H, I] at shared_w.
template <int SP>
__device__ void down_rows(const bf16_t* __restrict__ act, const bf16_t* __restrict__ w,
                          bf16_t* __restrict__ y, const bf16_t* __restrict__ resid, int H, int k,
                          const u32* __restrict__ meta, const float* __restrict__ wts, int P,
                          const bf16_t* __restrict__ shared_w, int E) {
    constexpr int I = 256 * SP;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int n0 = (blockIdx.x * 4 + warp) * 2, r = blockIdx.y;
    if (n0 >= H) return;  // (an exited block counts as triggered)
    const u32* row_pair = meta + 2 + 5 * P + r * k;
    const u32* pair_exp = meta + 2 + 4 * P;
    const float* row_w = wts + P + r * k;
    float out0 = 0.f, out1 = 0.f;
    for (int j = 0; j < k; j += 2) {
        const bool two = j + 1 < k;
        uint4 wv[2][2][SP], xv[2][SP];
#pragma unroll
        for (int s = 0; s < 2; ++s) {
            if (s == 1 && !two) break;
            const u32 p = row_pair[j + s], e = pair_exp[p];
            const bf16_t* we =
                shared_w != nullptr && e == (u32)E ? shared_w : w + (size_t)e * H * I;
            const uint4* w0 = (const uint4*)(we + (size_t)n0 * I) + lane;
            const uint4* xa = (const uint4*)(act + (size_t)p * I) + lane;
#pragma unroll
            for (int q = 0; q < SP; ++q) {
                wv[s][0][q] = ld_stream(w0 + q * 32);
                wv[s][1][q] = ld_stream(w0 + I / 8 + q * 32);
                xv[s][q] = __ldg(xa + q * 32);
            }
        }
#pragma unroll
        for (int s = 0; s < 2; ++s) {
            if (s == 1 && !two) break;
            float a0 = 0.f, a1 = 0.f;
#pragma unroll
            for (int q = 0; q < SP; ++q) {
                a0 += dot8(wv[s][0][q], xv[s][q]);
                a1 += dot8(wv[s][1][q], xv[s][q]);
            }
            a0 = warp_sum(a0);
            a1 = warp_sum(a1);
            const float wb = bf16r(row_w[j + s]);
            out0 = bf16r(out0 + bf16r(bf16r(a0) * wb));
            out1 = bf16r(out1 + bf16r(bf16r(a1) * wb));
        }
    }
    pdl_launch_dependents();  // past the weight stream: the next kernel may launch
    if (lane != 0) return;
    const size_t at = (size_t)r * H + n0;
    if (resid != nullptr) {
        const u32 rv = *(const u32*)(resid + at);
        out0 = lo(rv) + out0;
        out1 = hi(rv) + out1;
    }
    *(u32*)(y + at) = (u32)f2bf(out0) | ((u32)f2bf(out1) << 16);
}
#define MOE_DOWN_ROWS(SP)                                                                       \
    extern "C" __global__ void __launch_bounds__(128) moe_down_rows_sp##SP(                     \
        const bf16_t* act, const bf16_t* w, bf16_t* y, const bf16_t* resid, int H, int k,       \
        const u32* meta, const float* wts, int P, const bf16_t* shared_w, int E) {              \
        pdl_wait();                                                                             \
        down_rows<SP>(act, w, y, resid, H, k, meta, wts, P, shared_w, E);                       \
    }
MOE_DOWN_ROWS(1)
MOE_DOWN_ROWS(2)
MOE_DOWN_ROWS(3)
MOE_DOWN_ROWS(4)

// Tensor-core kernels: block y serves used expert u = blockIdx.y (none past n_uniq), its
// M = start[u + 1] - start[u] pairs; the skinny GEMM's mma_impl over them.
//   gate_up: x = the rows' normed inputs gathered through pair_row, y = act[start[u]..];
//   down:    x = act[start[u]..] (consecutive), y = per-pair outputs [P, H].
#define MOE_MMA(MT)                                                                             \
    extern "C" __global__ void __launch_bounds__(128) moe_gate_up_mma_m##MT(                    \
        const bf16_t* x, const bf16_t* w, bf16_t* act, int N, int K, int ks, const u32* meta,   \
        int P) {                                                                                \
        const u32 u = blockIdx.y;                                                               \
        if (u >= meta[0]) return;                                                               \
        const u32 e = meta[1 + P + u], p0 = meta[1 + 2 * P + u];                                \
        const int M = (int)(meta[1 + 2 * P + u + 1] - p0);                                      \
        mma_impl<1, EPI_SILU, MT, true>(x, w + (size_t)e * 2 * N * K, act + (size_t)p0 * N, M,  \
                                        N, K, ks, nullptr, nullptr, nullptr, nullptr,           \
                                        meta + 2 + 3 * P + p0);                                 \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(128) moe_down_mma_m##MT(                       \
        const bf16_t* act, const bf16_t* w, bf16_t* out, int N, int K, int ks, const u32* meta, \
        int P) {                                                                                \
        const u32 u = blockIdx.y;                                                               \
        if (u >= meta[0]) return;                                                               \
        const u32 e = meta[1 + P + u], p0 = meta[1 + 2 * P + u];                                \
        const int M = (int)(meta[1 + 2 * P + u + 1] - p0);                                      \
        mma_impl<1, EPI_STORE, MT>(act + (size_t)p0 * K, w + (size_t)e * N * K,                 \
                                   out + (size_t)p0 * N, M, N, K, ks, nullptr, nullptr,         \
                                   nullptr, nullptr);                                           \
    }
MOE_MMA(1)
MOE_MMA(2)
MOE_MMA(3)
MOE_MMA(4)

// y[r] = resid[r] + the combine of row r's pair outputs (one block per row, 8 columns per
// thread and step); ss[r] = sum of y[r]^2 when ss is given (for the next RMSNorm).
extern "C" __global__ void moe_combine(const bf16_t* __restrict__ pair_out,
                                       const bf16_t* __restrict__ resid, bf16_t* __restrict__ y,
                                       float* __restrict__ ss, int H, int k,
                                       const u32* __restrict__ meta, const float* __restrict__ wts,
                                       int P) {
    __shared__ float red[32];
    const int r = blockIdx.x;
    const u32* row_pair = meta + 2 + 5 * P + r * k;
    const float* row_w = wts + P + r * k;
    float sq = 0.f;
    for (int c = threadIdx.x; c < H / 8; c += blockDim.x) {
        float acc[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[i] = 0.f;
        for (int j = 0; j < k; ++j) {
            const float wb = bf16r(row_w[j]);
            const uint4 v = __ldg((const uint4*)(pair_out + (size_t)row_pair[j] * H) + c);
            const u32 vv[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                acc[2 * i] = bf16r(acc[2 * i] + bf16r(lo(vv[i]) * wb));
                acc[2 * i + 1] = bf16r(acc[2 * i + 1] + bf16r(hi(vv[i]) * wb));
            }
        }
        u32 o[4];
        const size_t at = (size_t)r * H + (size_t)c * 8;
        if (resid != nullptr) {
            const uint4 rv = __ldg((const uint4*)(resid + at));
            const u32 rr[4] = {rv.x, rv.y, rv.z, rv.w};
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                acc[2 * i] = bf16r(lo(rr[i]) + acc[2 * i]);
                acc[2 * i + 1] = bf16r(hi(rr[i]) + acc[2 * i + 1]);
            }
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            o[i] = (u32)f2bf(acc[2 * i]) | ((u32)f2bf(acc[2 * i + 1]) << 16);
            sq += acc[2 * i] * acc[2 * i] + acc[2 * i + 1] * acc[2 * i + 1];
        }
        *(uint4*)(y + at) = make_uint4(o[0], o[1], o[2], o[3]);
    }
    if (ss == nullptr) return;
    sq = block_sum(sq, red);
    if (threadIdx.x == 0) ss[r] = sq;
}

// out[q] = x[pair_row[q]] for the P pairs of a wide routing (rows of H bf16, H % 8 == 0): the
// grouped GEMMs' gathered inputs (moe_grouped.rs), 16 bytes a thread, a row a block-stride.
extern "C" __global__ void __launch_bounds__(256)
    moe_gather_rows(const bf16_t* __restrict__ x, const u32* __restrict__ pair_row,
                    bf16_t* __restrict__ out, int P, int H) {
    const int per_row = H / 8;
    const size_t n = (size_t)P * per_row;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        const size_t q = i / per_row, c = i % per_row;
        const uint4 v = __ldg((const uint4*)(x + (size_t)pair_row[q] * H) + c);
        *((uint4*)(out + q * H) + c) = v;
    }
}
