// The sparse-MoE block on the device (decode, chain and tree verification: at most
// MOE_MAX_ROWS rows per launch set; prefills: any number, routed by moe_route_rows/_tiles), with the math of layers/moe.rs: p = softmax_f32(router
// logits), the top k by p (ties to the lower expert), optionally renormalised to sum 1, and
// out[r] = sum over r's experts in ascending expert order of bf16(bf16(expert(x_r)) * bf16(w)),
// each addition rounded to bf16 (what the plain path's index_add does), plus the residual.
//
//   moe_route              one block: routing of every row and the grouping of (row, expert)
//                          pairs by expert, written to device memory (no host round trip);
//   moe_route_rows/_tiles  the same for any number of rows (prefills), tiles of <= 64 pairs;
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
// moe_route and the decode kernels open as programmatic dependents (`cuda::pdl`).
//
// A shared expert of the routed width (Qwen3.5/3.6 MoE: out = sigmoid(x g) shared(x) + the
// routed sum) can ride along at one row (decode): the router GEMV's rows are the E experts,
// then the shared gate (column E of the logits, row stride `stride`); moe_route appends to
// every row a pair of expert id E with weight sigmoid(logit E) after its top k (so k + 1 pairs
// a row, the shared one last in ascending order), and the rows kernels read expert E's
// weights from separate pointers. Five launches fewer per layer than the shared expert on
// its own (two GEMVs, the gate GEMV, sigmoid, scale, add).
//
// Routing metadata, u32 `meta` (P = rows * k pairs):
//   [0]              n_uniq, the number of experts used
//   [1, 1+P)         top-k experts of every row, highest probability first
//   [1+P, 1+2P)      the used experts, ascending (n_uniq of them)
//   [1+2P, 2+3P)     first pair of each used expert; entry n_uniq is P
//   [2+3P, 2+4P)     row of every pair (pairs grouped by expert, rows ascending within one)
//   [2+4P, 2+5P)     expert of every pair
//   [2+5P, 2+6P)     row r's k pairs in ascending expert order (at r * k)
// f32 `wts`: [0, P) the top-k weights (routing order), [P, 2P) the weights of row r's pairs in
// ascending expert order.

#include "gemv_impl.cuh"

#define MOE_MAX_E 512
#define MOE_MAX_E_SH (MOE_MAX_E + 32)  // room for the shared expert's id E
#define MOE_MAX_K 16
#define MOE_MAX_ROWS 64
#define ROUTE_WARPS 8

__device__ __forceinline__ float bf16r(float v) { return bf2f(f2bf(v)); }

// logits: [T, stride] (stride >= E + shared); shared: 1 appends the shared expert's pair (id E,
// weight sigmoid(logit E)) to every row, so rows hold kk = k + shared pairs (P = T * kk).
// Row r's routing by one warp: softmax over the E logits in f32 (e: the warp's [E] scratch),
// the top k by probability (ties to the lower expert), renormalised when norm; with shared, a
// last pair (id E, weight sigmoid(logit E)). Valid in lane 0: ids / ps [k + shared].
__device__ void route_row(const void* __restrict__ logits, int is_bf16, int r, int E, int k,
                          int norm, int stride, int shared, float* e, u32* ids, float* ps) {
    const int lane = threadIdx.x & 31;
    float mx = -INFINITY;
    for (int i = lane; i < E; i += 32) {
        const size_t at = (size_t)r * stride + i;
        const float l = is_bf16 ? bf2f(((const bf16_t*)logits)[at]) : ((const float*)logits)[at];
        e[i] = l;
        mx = fmaxf(mx, l);
    }
    mx = warp_max(mx);
    for (int i = lane; i < E; i += 32) e[i] = expf(e[i] - mx);
    __syncwarp();
    // One lane sums in ascending expert order, as the host does, so the weights are the
    // host's bit for bit.
    float sum = 0.f;
    if (lane == 0)
        for (int i = 0; i < E; ++i) sum += e[i];
    sum = __shfl_sync(0xffffffffu, sum, 0);
    for (int j = 0; j < k; ++j) {
        // Warp argmax: the highest value, ties to the lower expert (a stable sort's order);
        // taken experts are marked -1 (every probability is >= 0).
        float bv = -2.f;
        int bi = E;
        for (int i = lane; i < E; i += 32) {
            const float v = e[i];
            if (v > bv) bv = v, bi = i;
        }
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > bv || (ov == bv && oi < bi)) bv = ov, bi = oi;
        }
        ids[j] = (u32)bi;
        ps[j] = bv / sum;
        __syncwarp();
        if (lane == 0) e[bi] = -1.f;
        __syncwarp();
    }
    if (lane == 0) {
        if (norm) {
            float s = 0.f;
            for (int j = 0; j < k; ++j) s += ps[j];
            for (int j = 0; j < k; ++j) ps[j] /= s;
        }
        if (shared) {
            const size_t at = (size_t)r * stride + E;
            const float l = is_bf16 ? bf2f(((const bf16_t*)logits)[at]) : ((const float*)logits)[at];
            ids[k] = (u32)E;
            ps[k] = 1.f / (1.f + expf(-l));
        }
    }
}

// A row's kk pairs in ascending expert order (insertion sort; the shared one, id E, last).
__device__ __forceinline__ void sort_pairs(const u32* ids, const float* ps, int kk, u32* se,
                                           float* sw) {
    for (int j = 0; j < kk; ++j) {
        int at = j;
        while (at > 0 && se[at - 1] > ids[j]) {
            se[at] = se[at - 1];
            sw[at] = sw[at - 1];
            --at;
        }
        se[at] = ids[j];
        sw[at] = ps[j];
    }
}

extern "C" __global__ void __launch_bounds__(ROUTE_WARPS * 32)
    moe_route(const void* __restrict__ logits, int is_bf16, int T, int E, int k, int norm,
              u32* __restrict__ meta, float* __restrict__ wts, int stride, int shared) {
    pdl_launch_dependents();
    pdl_wait();
    __shared__ float ex[ROUTE_WARPS][MOE_MAX_E];
    __shared__ u32 sel[MOE_MAX_ROWS][MOE_MAX_E_SH / 32];
    __shared__ u32 cnt[MOE_MAX_E_SH], off[MOE_MAX_E_SH];
    __shared__ u32 sorted_e[MOE_MAX_ROWS * MOE_MAX_K];
    __shared__ float sorted_w[MOE_MAX_ROWS * MOE_MAX_K];
    const int kk = k + shared, Et = E + shared;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, P = T * kk,
              words = (Et + 31) / 32;
    for (int i = threadIdx.x; i < Et; i += blockDim.x) cnt[i] = 0;
    for (int i = threadIdx.x; i < T * words; i += blockDim.x) sel[i / words][i % words] = 0;
    __syncthreads();
    for (int r = warp; r < T; r += ROUTE_WARPS) {
        u32 ids[MOE_MAX_K];
        float ps[MOE_MAX_K];
        route_row(logits, is_bf16, r, E, k, norm, stride, shared, ex[warp], ids, ps);
        if (lane == 0) {
            for (int j = 0; j < kk; ++j) {
                meta[1 + r * kk + j] = ids[j];
                wts[r * kk + j] = ps[j];
                atomicAdd(&cnt[ids[j]], 1u);
                sel[r][ids[j] / 32] |= 1u << (ids[j] % 32);
            }
            sort_pairs(ids, ps, kk, sorted_e + r * kk, sorted_w + r * kk);
        }
        __syncwarp();
    }
    __syncthreads();
    u32* uniq = meta + 1 + P;
    u32* start = uniq + P;
    u32* pair_row = start + P + 1;
    u32* pair_exp = pair_row + P;
    u32* row_pair = pair_exp + P;
    if (warp == 0) {
        // Exclusive scans of the pair counts and of "used" over the experts: lane l owns the
        // contiguous experts [l * per, (l + 1) * per) below Et.
        const int per = (Et + 31) / 32, e0 = lane * per;
        u32 pairs = 0, used = 0;
        for (int i = 0; i < per && e0 + i < Et; ++i) {
            pairs += cnt[e0 + i];
            used += cnt[e0 + i] > 0;
        }
        u32 pi = pairs, ui = used;
        for (int o = 1; o < 32; o <<= 1) {
            const u32 a = __shfl_up_sync(0xffffffffu, pi, o), b = __shfl_up_sync(0xffffffffu, ui, o);
            if (lane >= o) pi += a, ui += b;
        }
        u32 at = pi - pairs, u = ui - used;
        for (int i = 0; i < per && e0 + i < Et; ++i) {
            const int x = e0 + i;
            off[x] = at;
            if (cnt[x] > 0) {
                uniq[u] = x;
                start[u] = at;
                ++u;
            }
            at += cnt[x];
        }
        if (lane == 31) {
            meta[0] = ui;
            start[ui] = (u32)P;
        }
    }
    __syncthreads();
    for (int q = threadIdx.x; q < P; q += blockDim.x) {
        const int r = q / kk;
        const u32 x = sorted_e[q];
        u32 pos = off[x];
        for (int rr = 0; rr < r; ++rr) pos += (sel[rr][x / 32] >> (x % 32)) & 1u;
        pair_row[pos] = (u32)r;
        pair_exp[pos] = x;
        row_pair[q] = pos;
        wts[P + q] = sorted_w[q];
    }
}

// Routing of any number of rows (prefills), in the layout above with one change: the "used
// experts" are tiles of at most MOE_MAX_ROWS pairs of one expert ([0] counts tiles, [1+P, ..)
// holds each tile's expert, [1+2P, ..) its first pair), so the tensor-core kernels read a
// popular expert once per 64 of its pairs. Two launches, after `counts` [E] is zeroed:
//   moe_route_rows   a warp per row: its top k ([1, 1+P), wts [0, P)), its pairs in ascending
//                    expert order (`sorted` [P], wts [P, 2P)), counts[e] += 1 per pair;
//   moe_route_tiles  a block per expert: its first pair and first tile (the counts before it),
//                    its tiles, and its pairs in row order (pair_row, pair_exp, row_pair).
extern "C" __global__ void __launch_bounds__(ROUTE_WARPS * 32)
    moe_route_rows(const void* __restrict__ logits, int is_bf16, int T, int E, int k, int norm,
                   u32* __restrict__ meta, float* __restrict__ wts, u32* __restrict__ sorted,
                   u32* __restrict__ counts) {
    __shared__ float ex[ROUTE_WARPS][MOE_MAX_E];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, P = T * k;
    const int r = blockIdx.x * ROUTE_WARPS + warp;
    if (r >= T) return;
    u32 ids[MOE_MAX_K], se[MOE_MAX_K];
    float ps[MOE_MAX_K], sw[MOE_MAX_K];
    route_row(logits, is_bf16, r, E, k, norm, E, 0, ex[warp], ids, ps);
    if (lane != 0) return;
    sort_pairs(ids, ps, k, se, sw);
    for (int j = 0; j < k; ++j) {
        meta[1 + r * k + j] = ids[j];
        wts[r * k + j] = ps[j];
        sorted[r * k + j] = se[j];
        wts[P + r * k + j] = sw[j];
        atomicAdd(&counts[se[j]], 1u);
    }
}

extern "C" __global__ void __launch_bounds__(256)
    moe_route_tiles(const u32* __restrict__ counts, const u32* __restrict__ sorted, int T,
                    int E, int k, u32* __restrict__ meta) {
    __shared__ u32 red[2][8];
    const int x = blockIdx.x, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, P = T * k;
    u32* uniq = meta + 1 + P;
    u32* start = uniq + P;
    u32* pair_row = start + P + 1;
    u32* pair_exp = pair_row + P;
    u32* row_pair = pair_exp + P;
    // Pairs and tiles of the experts before this one.
    u32 before = 0, tiles = 0;
    for (int i = tid; i < x; i += 256) {
        before += counts[i];
        tiles += (counts[i] + MOE_MAX_ROWS - 1) / MOE_MAX_ROWS;
    }
    for (int o = 16; o > 0; o >>= 1) {
        before += __shfl_xor_sync(0xffffffffu, before, o);
        tiles += __shfl_xor_sync(0xffffffffu, tiles, o);
    }
    if (lane == 0) red[0][warp] = before, red[1][warp] = tiles;
    __syncthreads();
    before = tiles = 0;
    for (int w = 0; w < 8; ++w) before += red[0][w], tiles += red[1][w];
    const u32 n = counts[x], nt = (n + MOE_MAX_ROWS - 1) / MOE_MAX_ROWS;
    for (u32 j = tid; j < nt; j += 256) {
        uniq[tiles + j] = (u32)x;
        start[tiles + j] = before + j * MOE_MAX_ROWS;
    }
    if (x == E - 1 && tid == 0) {
        meta[0] = tiles + nt;
        start[tiles + nt] = (u32)P;
    }
    // The expert's pairs in row order: 256 rows a round, a block-wide scan of the hits.
    u32 run = before;
    for (int base = 0; base < T && run < before + n; base += 256) {
        __syncthreads();  // red is reused below
        const int r = base + tid;
        int hit = -1;
        if (r < T)
            for (int j = 0; j < k; ++j)
                if (sorted[r * k + j] == (u32)x) hit = j;
        const u32 mask = __ballot_sync(0xffffffffu, hit >= 0);
        if (lane == 0) red[0][warp] = __popc(mask);
        __syncthreads();
        u32 off = 0, total = 0;
        for (int w = 0; w < 8; ++w) {
            off += w < warp ? red[0][w] : 0u;
            total += red[0][w];
        }
        if (hit >= 0) {
            const u32 pos = run + off + __popc(mask & ((1u << lane) - 1u));
            pair_row[pos] = (u32)r;
            pair_exp[pos] = (u32)x;
            row_pair[r * k + hit] = pos;
        }
        run += total;
    }
}

// act[p] = silu(x_r gate_e) * (x_r up_e) for pair p = blockIdx.y (row r, expert e), with x_r
// the RMSNorm of row r from its sums of squares when NORM. N = I, K = H. Expert E (when
// shared_w is given) is the shared expert, its [2I, H] rows at shared_w.
#define MOE_GATE_UP_ROWS(name, NORM)                                                            \
    extern "C" __global__ void __launch_bounds__(128, 8)                                         \
        name(const bf16_t* __restrict__ x, const bf16_t* __restrict__ w, bf16_t* __restrict__ act, \
             int N, int K, const u32* __restrict__ meta, int P, const bf16_t* __restrict__ nw,  \
             float eps, const float* __restrict__ ss_in, const bf16_t* __restrict__ shared_w,   \
             int E) {                                                                           \
        pdl_launch_dependents();                                                                \
        pdl_wait();                                                                             \
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
    if (n0 >= H) return;
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
        pdl_launch_dependents();                                                                \
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
