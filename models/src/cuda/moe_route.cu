// The sparse-MoE block's routing on the device (moe.cu runs the experts it selects), with the
// math of layers/moe.rs: p = softmax_f32(router logits), the top k by p (ties to the lower
// expert), optionally renormalised to sum 1; the (row, expert) pairs grouped by expert in the
// metadata layout of moe.cuh, written to device memory (no host round trip):
//   moe_route              one block: every row of up to MOE_MAX_ROWS (decode, verification);
//   moe_router_route*      one row (decode): the router GEMV and the routing in one launch;
//   moe_route_rows/_tiles  any number of rows (prefills), tiles of <= 64 pairs.
// A shared expert (Qwen3.5/3.6 MoE) rides along as one more pair a row: see moe.cu.
// moe_route opens as a programmatic dependent (`cuda::pdl`).

#include "moe.cuh"

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
    pdl_wait();
    pdl_launch_dependents();
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

// One row's routing by warps 0 and 1 of the calling block, moe_route's math and layout bit
// for bit (P = kk pairs): warp 0 holds the E probabilities in registers and takes the top k
// with two warp reductions a pick (__reduce_max_sync over the probabilities' bits, then
// __reduce_min_sync over the expert ids holding that maximum: the lower expert on ties), while
// warp 1's lane 0 adds them up in ascending expert order (route_row's sum, the host's order).
__device__ void route_one(const bf16_t* logits, int E, int k, int norm, int shared,
                          u32* __restrict__ meta, float* __restrict__ wts) {
    constexpr int J = MOE_MAX_E / 32;
    __shared__ __align__(16) float ex[MOE_MAX_E];
    __shared__ float total;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, nj = E / 32;
    if (warp > 1) return;
    u32 key[J];
    if (warp == 0) {
        float v[J], mx = -INFINITY;
#pragma unroll
        for (int j = 0; j < J; ++j) {
            v[j] = j < nj ? bf2f(__ldcg(logits + j * 32 + lane)) : -INFINITY;
            mx = fmaxf(mx, v[j]);
        }
        mx = warp_max(mx);
#pragma unroll
        for (int j = 0; j < J; ++j) {
            if (j < nj) {
                const float p = expf(v[j] - mx);
                ex[j * 32 + lane] = p;
                key[j] = __float_as_uint(p) + 1u;  // p >= 0: its bits order as p does; 0 = taken
            } else {
                key[j] = 0u;
            }
        }
    }
    asm volatile("bar.sync 1, 64;\n" ::: "memory");
    if (warp == 1) {
        if (lane == 0) {
            float sum = 0.f;
            for (int i = 0; i < E; i += 4) {
                const float4 q = *(const float4*)(ex + i);
                sum += q.x;
                sum += q.y;
                sum += q.z;
                sum += q.w;
            }
            total = sum;
        }
        asm volatile("bar.sync 1, 64;\n" ::: "memory");
        return;
    }
    // Pick r lands in lane r's (id, p): nothing indexed at run time, so no local memory.
    u32 id = 0u, kb = 0u;
    float p = 0.f;
    int jb = 0;
#pragma unroll
    for (int j = 0; j < J; ++j)
        if (key[j] > kb) kb = key[j], jb = j;
    for (int r = 0; r < k; ++r) {
        const u32 g = __reduce_max_sync(0xffffffffu, kb);
        const u32 gi = __reduce_min_sync(0xffffffffu, kb == g ? (u32)(jb * 32 + lane) : 0xffffffffu);
        if (lane == r) id = gi, p = __uint_as_float(g - 1u);
        if ((int)(gi & 31u) == lane) {
            kb = 0u;
            jb = 0;
#pragma unroll
            for (int j = 0; j < J; ++j) {
                if (j == (int)(gi >> 5)) key[j] = 0u;
                if (key[j] > kb) kb = key[j], jb = j;
            }
        }
    }
    asm volatile("bar.sync 1, 64;\n" ::: "memory");
    // route_row's arithmetic: p / sum, then the renormalisation by the top k's sum taken in
    // pick order.
    p = p / total;
    if (norm) {
        float s = 0.f;
        for (int j = 0; j < k; ++j) s += __shfl_sync(0xffffffffu, p, j);
        p /= s;
    }
    const int kk = k + shared, P = kk;
    if (shared && lane == k) id = (u32)E, p = 1.f / (1.f + expf(-bf2f(__ldcg(logits + E))));
    // Lane q writes pair q (routing order) and, at its rank among the row's experts, its
    // place in ascending expert order (the ids are distinct; the shared one, E, ranks last).
    int rank = 0;
    for (int j = 0; j < kk; ++j) rank += __shfl_sync(0xffffffffu, id, j) < id;
    if (lane == 0) meta[0] = (u32)kk, meta[1 + 2 * P + kk] = (u32)P;
    if (lane < kk) {
        meta[1 + lane] = id;
        wts[lane] = p;
        meta[1 + P + rank] = id;             // the used experts, ascending
        meta[1 + 2 * P + lane] = (u32)lane;  // each one's first pair
        meta[2 + 3 * P + lane] = 0u;         // pair_row
        meta[2 + 4 * P + rank] = id;         // pair_exp
        meta[2 + 5 * P + lane] = (u32)lane;  // row_pair
        wts[P + rank] = p;
    }
}

// One row (decode): the router GEMV (gemv_rows2_store / _norm's rows_impl, so the logits are
// theirs bit for bit) and the routing in one launch: the last block to finish routes the row
// (route_one: moe_route's result) and re-arms `counter`, so a decode layer's MoE block has no
// routing launch of its own. N router rows (E, or E + the shared gate and padding), 8 a block.
template <int NORM>
__device__ void router_route(const bf16_t* x, const bf16_t* w, bf16_t* logits, int N, int K,
                             const bf16_t* nw, float eps, int E, int k, int norm, int shared,
                             u32* meta, float* wts, u32* counter) {
    rows_impl<2, 4, EPI_STORE, NORM, 1>(x, w, logits, N, K, nullptr, nw, eps, nullptr, nullptr,
                                        nullptr, nullptr, nullptr, 0);
    __shared__ u32 is_last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) is_last = atomicAdd(counter, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    if (threadIdx.x == 0) *counter = 0u;
    route_one(logits, E, k, norm, shared, meta, wts);
}
#define MOE_ROUTER_ROUTE(name, NORM)                                                            \
    extern "C" __global__ void __launch_bounds__(128)                                           \
        name(const bf16_t* x, const bf16_t* w, bf16_t* logits, int N, int K, const bf16_t* nw,   \
             float eps, int E, int k, int norm, int shared, u32* meta, float* wts,               \
             u32* counter) {                                                                     \
        router_route<NORM>(x, w, logits, N, K, nw, eps, E, k, norm, shared, meta, wts, counter); \
    }
MOE_ROUTER_ROUTE(moe_router_route, NORM_NONE)
MOE_ROUTER_ROUTE(moe_router_route_norm, NORM_SELF)

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
