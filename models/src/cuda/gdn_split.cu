// The Gated DeltaNet token mixer of a short causal chain split into a prologue and a scan, so
// that the chain's work is spread over twice the warps `gdn_chain` (gdn.cu) uses (1536 against
// 768 at the 27B shape):
//   gdn_prep   the causal depthwise conv (kernel K <= 4) over [cached window; new rows] + SiLU
//              for every channel and token once (gdn_chain recomputes its head's q / k conv in
//              every column block), the q / k L2 normalisation (q scaled by dk^-1/2), and per
//              (token, value head) the log-decay g = -exp(A_log) * softplus(a + dt_bias) and
//              beta = sigmoid(b). One block per (token, 128 channels), plus one for the gates.
//   gdn_scan   the delta rule over the t tokens with the f32 state in registers: one block per
//              (value head, 16 value columns), a warp holds 4 columns x 8 slices of 16 key rows
//              (lane = slice * 4 + column), so both reductions over the key rows are three warp
//              shuffles and no __syncthreads (gdn_chain: one block per 32 columns, 32 rows a
//              thread, two block barriers per token). It writes the raw outputs and, as the
//              caller asks, the state after every token, after the last, or none, and the value
//              each token wrote into the state (u_i in S_i = e^{g_i} S_{i-1} + k_i u_i^T), from
//              which the commit rebuilds the state of any row (gdn_state_along).
//   gdn_state_along  that rebuild: S_m from S_0 and m rows' (k, u, g), with the scan's own
//              operations in its order (s *= e^g, then s = fma(k, u, s)), so a state rebuilt
//              from the scan's writes is the scan's state bit for bit.
// The gated RMSNorm stays gdn.cu's gdn_gated_norm. dk = dv = 128 for prep / scan (the wrapper
// checks); gdn_state_along takes any head sizes.

#include "common.cuh"

#define GS_D 128
#define GS_MAX_T 16
#define GS_COLS 16
#define GS_SLICE 16
#define GS_PAD 17  // per-slice stride in shared memory: 8 slices land in 8 different banks

__device__ __forceinline__ float gs_silu(float x) { return x / (1.f + __expf(-x)); }

// One token of the delta rule on a thread's GS_SLICE key rows of one value column (the warp's
// 8 slices meet in the shuffles): decay the state, `delta = beta (v - S^T k)`, write
// `S += k delta`, return `S^T q`. The one arithmetic of gdn_scan and gdn_scan_tree.
__device__ __forceinline__ float gs_token(float* s, const float* kr, const float* qr, float d,
                                          float bt, float vc, float* delta_out) {
    float p0 = 0.f, p1 = 0.f;
#pragma unroll
    for (int r = 0; r < GS_SLICE; r += 2) {
        s[r] *= d;
        s[r + 1] *= d;
        p0 = fmaf(kr[r], s[r], p0);
        p1 = fmaf(kr[r + 1], s[r + 1], p1);
    }
    float part = p0 + p1;
    part += __shfl_xor_sync(0xffffffffu, part, 4);
    part += __shfl_xor_sync(0xffffffffu, part, 8);
    part += __shfl_xor_sync(0xffffffffu, part, 16);
    const float delta = bt * (vc - part);
    float o0 = 0.f, o1 = 0.f;
#pragma unroll
    for (int r = 0; r < GS_SLICE; r += 2) {
        s[r] = fmaf(kr[r], delta, s[r]);
        s[r + 1] = fmaf(kr[r + 1], delta, s[r + 1]);
        o0 = fmaf(qr[r], s[r], o0);
        o1 = fmaf(qr[r + 1], s[r + 1], o1);
    }
    float out = o0 + o1;
    out += __shfl_xor_sync(0xffffffffu, out, 4);
    out += __shfl_xor_sync(0xffffffffu, out, 8);
    out += __shfl_xor_sync(0xffffffffu, out, 16);
    *delta_out = delta;
    return out;
}

// win: bf16 [K-1, C], the cached pre-conv rows; proj: bf16 rows of stride P, q|k|v in columns
// [0, C), b at off_b + h, a at off_b + hv + h; taps: bf16 [K, C] (tap K-1 multiplies the
// current row). Outputs: q, k f32 [t, hk, 128]; v f32 [t, hv * 128]; g, beta f32 [t, hv].
// rows (nullable): u32 [t, K], the rows of [win; new rows] token i's conv reads, oldest first
// (a tree token's ancestors, `Forest::conv_taps`); null: a chain's rows i .. i + K - 1.
// Grid (C / 128 + 1, t), 128 threads; the last block column computes the gates.
extern "C" __global__ void __launch_bounds__(128) gdn_prep(
    const bf16_t* __restrict__ win, const bf16_t* __restrict__ proj,
    const bf16_t* __restrict__ taps, const unsigned* __restrict__ rows,
    const float* __restrict__ neg_a, const float* __restrict__ dt_bias, float* __restrict__ q,
    float* __restrict__ k, float* __restrict__ v, float* __restrict__ g,
    float* __restrict__ beta, int hk, int hv, int C, int P, int K, int off_b) {
    __shared__ float red[32];
    const int blk = blockIdx.x, i = blockIdx.y, tid = threadIdx.x;
    const int nblk = C / GS_D;
    if (blk == nblk) {
        const bf16_t* row = proj + (size_t)i * P;
        for (int h = tid; h < hv; h += blockDim.x) {
            const float a = bf2f(row[off_b + hv + h]) + dt_bias[h];
            const float sp = a >= 20.f ? a : logf(1.f + expf(a));
            g[(size_t)i * hv + h] = sp * neg_a[h];
            const float b = bf2f(row[off_b + h]);
            beta[(size_t)i * hv + h] = 1.f / (1.f + expf(-b));
        }
        return;
    }
    const int ch = blk * GS_D + tid;
    // Token i's conv reads rows i .. i + K - 1 of [win; new rows]; rounded as the plain path's
    // u (bf16 conv output, bf16 SiLU) and as gdn_chain does.
    float acc = 0.f;
    for (int j = 0; j < K; ++j) {
        const int r = rows ? (int)rows[(size_t)i * K + j] : i + j;
        const float x = r < K - 1 ? bf2f(win[(size_t)r * C + ch])
                                  : bf2f(proj[(size_t)(r - (K - 1)) * P + ch]);
        acc = fmaf(x, bf2f(taps[(size_t)j * C + ch]), acc);
    }
    const float u = bf2f(f2bf(gs_silu(bf2f(f2bf(acc)))));
    if (blk >= 2 * hk) {
        v[(size_t)i * (C - 2 * hk * GS_D) + (blk - 2 * hk) * GS_D + tid] = u;
        return;
    }
    // The block is one q (blk < hk) or k head: L2 normalisation, eps 1e-6 inside the root.
    const float ss = block_sum(u * u, red);
    const float inv = 1.f / sqrtf(ss + 1e-6f);
    if (blk < hk)
        q[((size_t)i * hk + blk) * GS_D + tid] = u * inv * rsqrtf((float)GS_D);
    else
        k[((size_t)i * hk + blk - hk) * GS_D + tid] = u * inv;
}

// s0: f32 [hv, 128, 128] state before the chain; q, k, v, g, beta as gdn_prep writes them.
// o: f32 [t, hv, 128]; u (nullable): f32 [t, hv, 128]; s_out (nullable): f32
// [states == 2 ? t : 1, hv, 128, 128], the state after every token (states 2) or the last
// (states 1). Any t (a prefill too): tokens go through shared memory GS_MAX_T at a time.
// Grid (hv, 128 / 16), 128 threads.
extern "C" __global__ void __launch_bounds__(128) gdn_scan(
    const float* __restrict__ s0, const float* __restrict__ q, const float* __restrict__ k,
    const float* __restrict__ v, const float* __restrict__ g, const float* __restrict__ beta,
    float* __restrict__ o, float* __restrict__ u, float* __restrict__ s_out, int t, int states,
    int hk, int hv) {
    __shared__ float qs[GS_MAX_T][8 * GS_PAD];
    __shared__ float ks[GS_MAX_T][8 * GS_PAD];
    __shared__ float vs[GS_MAX_T][GS_COLS];
    __shared__ float dec[GS_MAX_T], bet[GS_MAX_T];
    const int h = blockIdx.x, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int kh = h / (hv / hk);
    const int col0 = blockIdx.y * GS_COLS;
    const int c = warp * 4 + (lane & 3), slice = lane >> 2;
    const int j = col0 + c, row0 = slice * GS_SLICE;
    const size_t head = (size_t)h * GS_D * GS_D;
    float s[GS_SLICE];
#pragma unroll
    for (int r = 0; r < GS_SLICE; ++r) s[r] = s0[head + (size_t)(row0 + r) * GS_D + j];
    // Tiles of GS_MAX_T tokens staged in shared memory; the state stays in registers across
    // them (a chain of up to GS_MAX_T tokens is one tile, as before the tiling).
    for (int base = 0; base < t; base += GS_MAX_T) {
        const int n = min(GS_MAX_T, t - base);
        if (base > 0) __syncthreads();  // every warp is done with the previous tile
        for (int idx = tid; idx < n * GS_D; idx += 128) {
            const int i = idx / GS_D, r = idx % GS_D;
            const int at = (r / GS_SLICE) * GS_PAD + r % GS_SLICE;
            qs[i][at] = q[((size_t)(base + i) * hk + kh) * GS_D + r];
            ks[i][at] = k[((size_t)(base + i) * hk + kh) * GS_D + r];
        }
        for (int idx = tid; idx < n * GS_COLS; idx += 128) {
            const int i = idx / GS_COLS, cc = idx % GS_COLS;
            vs[i][cc] = v[((size_t)(base + i) * hv + h) * GS_D + col0 + cc];
        }
        if (tid < n) {
            dec[tid] = expf(g[(size_t)(base + tid) * hv + h]);
            bet[tid] = beta[(size_t)(base + tid) * hv + h];
        }
        __syncthreads();
        for (int ii = 0; ii < n; ++ii) {
            const int i = base + ii;
            float delta;
            const float out = gs_token(s, &ks[ii][slice * GS_PAD], &qs[ii][slice * GS_PAD],
                                       dec[ii], bet[ii], vs[ii][c], &delta);
            if (slice == 0) {
                o[((size_t)i * hv + h) * GS_D + j] = out;
                if (u) u[((size_t)i * hv + h) * GS_D + j] = delta;
            }
            if (s_out && (states == 2 || i == t - 1)) {
                float* dst = s_out + (size_t)(states == 2 ? i : 0) * hv * GS_D * GS_D + head;
#pragma unroll
                for (int r = 0; r < GS_SLICE; ++r) dst[(size_t)(row0 + r) * GS_D + j] = s[r];
            }
        }
    }
}

// The delta rule over a tree of t tokens (one verify), every token from its parent's state:
// gdn_scan's arithmetic in the order of `order` (u32 [t], a depth-first pre-order of the
// tokens, so a token right after its parent continues from the registers) with depth `depth`
// (u32 [t], per position of `order`; roots 0). The state after every token is kept on a
// per-thread stack by depth (GS_MAX_DEPTH, local memory), from which a token whose parent is
// not the previous one starts. Writes o and u at each token's own index (tree order), no
// states (the commit rebuilds the accepted path's from u). Grid (hv, 128 / 16), 128 threads.
#define GS_MAX_DEPTH 32
extern "C" __global__ void __launch_bounds__(128) gdn_scan_tree(
    const float* __restrict__ s0, const float* __restrict__ q, const float* __restrict__ k,
    const float* __restrict__ v, const float* __restrict__ g, const float* __restrict__ beta,
    const unsigned* __restrict__ order, const unsigned* __restrict__ depth,
    float* __restrict__ o, float* __restrict__ u, int t, int hk, int hv) {
    __shared__ float qs[GS_MAX_T][8 * GS_PAD];
    __shared__ float ks[GS_MAX_T][8 * GS_PAD];
    __shared__ float vs[GS_MAX_T][GS_COLS];
    __shared__ float dec[GS_MAX_T], bet[GS_MAX_T];
    __shared__ int node_of[GS_MAX_T], depth_of[GS_MAX_T];
    const int h = blockIdx.x, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int kh = h / (hv / hk);
    const int col0 = blockIdx.y * GS_COLS;
    const int c = warp * 4 + (lane & 3), slice = lane >> 2;
    const int j = col0 + c, row0 = slice * GS_SLICE;
    const size_t head = (size_t)h * GS_D * GS_D;
    float s[GS_SLICE];
    float stack[GS_MAX_DEPTH][GS_SLICE];
#pragma unroll
    for (int r = 0; r < GS_SLICE; ++r) s[r] = s0[head + (size_t)(row0 + r) * GS_D + j];
    int prev = -1;  // depth of the previous token (-1: none yet, the registers hold s0)
    for (int base = 0; base < t; base += GS_MAX_T) {
        const int n = min(GS_MAX_T, t - base);
        if (base > 0) __syncthreads();
        if (tid < n) {
            node_of[tid] = (int)order[base + tid];
            depth_of[tid] = (int)depth[base + tid];
        }
        __syncthreads();
        for (int idx = tid; idx < n * GS_D; idx += 128) {
            const int i = idx / GS_D, r = idx % GS_D;
            const int at = (r / GS_SLICE) * GS_PAD + r % GS_SLICE;
            const size_t row = (size_t)node_of[i];
            qs[i][at] = q[(row * hk + kh) * GS_D + r];
            ks[i][at] = k[(row * hk + kh) * GS_D + r];
        }
        for (int idx = tid; idx < n * GS_COLS; idx += 128) {
            const int i = idx / GS_COLS, cc = idx % GS_COLS;
            vs[i][cc] = v[((size_t)node_of[i] * hv + h) * GS_D + col0 + cc];
        }
        if (tid < n) {
            dec[tid] = expf(g[(size_t)node_of[tid] * hv + h]);
            bet[tid] = beta[(size_t)node_of[tid] * hv + h];
        }
        __syncthreads();
        for (int ii = 0; ii < n; ++ii) {
            const int node = node_of[ii], d = depth_of[ii];
            if (d != prev + 1) {
                // Not the previous token's child: start from the parent's state (a root's: s0).
                if (d == 0) {
#pragma unroll
                    for (int r = 0; r < GS_SLICE; ++r)
                        s[r] = s0[head + (size_t)(row0 + r) * GS_D + j];
                } else {
#pragma unroll
                    for (int r = 0; r < GS_SLICE; ++r) s[r] = stack[d - 1][r];
                }
            }
            float delta;
            const float out = gs_token(s, &ks[ii][slice * GS_PAD], &qs[ii][slice * GS_PAD],
                                       dec[ii], bet[ii], vs[ii][c], &delta);
            if (slice == 0) {
                o[((size_t)node * hv + h) * GS_D + j] = out;
                u[((size_t)node * hv + h) * GS_D + j] = delta;
            }
#pragma unroll
            for (int r = 0; r < GS_SLICE; ++r) stack[d][r] = s[r];
            prev = d;
        }
    }
}

// s: f32 [hv, dk, dv] <- the state after m rows from s0 (same shape): per row i,
// s = s * e^{g[i, h]}, then s += k[i, h / (hv / hk), r] * u[i, h, c] (one fma), as gdn_scan
// updates its registers. k: f32 [m, hk, dk]; u: f32 [m, hv, dv]; g: f32 [m, hv]. One thread per
// state element, consecutive threads along dv.
extern "C" __global__ void __launch_bounds__(256) gdn_state_along(
    const float* __restrict__ s0, const float* __restrict__ k, const float* __restrict__ u,
    const float* __restrict__ g, float* __restrict__ s_out, int m, int hk, int hv, int dk,
    int dv) {
    const size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    const size_t n = (size_t)hv * dk * dv;
    if (idx >= n) return;
    const int c = (int)(idx % dv);
    const int r = (int)((idx / dv) % dk);
    const int h = (int)(idx / ((size_t)dk * dv));
    const int kh = h / (hv / hk);
    float s = s0[idx];
    for (int i = 0; i < m; ++i) {
        s *= expf(g[(size_t)i * hv + h]);
        s = fmaf(k[((size_t)i * hk + kh) * dk + r], u[((size_t)i * hv + h) * dv + c], s);
    }
    s_out[idx] = s;
}

// A commit of one path over every GDN layer at once (the batched settle, cuda/gdn_settle.rs):
// per layer l, table[5 l .. 5 l + 5) = s0, k, u, g, s_out (f32, as gdn_state_along's, the
// layer's staged rows of one forward), and the path's rows idx[0 .. m) within those staged rows
// (the same for every layer: one forward staged them all). gdn_state_along's operations in its
// order per state element, so the result equals it bit for bit. Grid (ceil(hv dk dv / 256),
// layers).
extern "C" __global__ void __launch_bounds__(256) gdn_state_along_layers(
    const u64* __restrict__ table, const u32* __restrict__ idx, int m, int hk, int hv, int dk,
    int dv) {
    const u64* t = table + (size_t)blockIdx.y * 5;
    const float* __restrict__ s0 = (const float*)t[0];
    const float* __restrict__ k = (const float*)t[1];
    const float* __restrict__ u = (const float*)t[2];
    const float* __restrict__ g = (const float*)t[3];
    float* __restrict__ s_out = (float*)t[4];
    const size_t i0 = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    const size_t n = (size_t)hv * dk * dv;
    if (i0 >= n) return;
    const int c = (int)(i0 % dv);
    const int r = (int)((i0 / dv) % dk);
    const int h = (int)(i0 / ((size_t)dk * dv));
    const int kh = h / (hv / hk);
    float s = s0[i0];
    for (int i = 0; i < m; ++i) {
        const size_t row = idx[i];
        s *= expf(g[row * hv + h]);
        s = fmaf(k[(row * hk + kh) * dk + r], u[(row * hv + h) * dv + c], s);
    }
    s_out[i0] = s;
}

// The conv windows of that commit: per layer l, table[3 l .. 3 l + 3) = the base window
// w0 [w, row_bytes], the staged pre-conv rows pre [t, row_bytes] and the new window out
// [w, row_bytes]; out row j is row m + j of [w0; pre[idx[0]]; ..; pre[idx[m - 1]]] (the last w
// rows along the path). 16-byte copies (row_bytes % 16 == 0). Grid (ceil(w row_bytes / 16 /
// 256), layers).
extern "C" __global__ void __launch_bounds__(256) gdn_conv_window_layers(
    const u64* __restrict__ table, const u32* __restrict__ idx, int m, int w, int row_bytes) {
    const u64* t = table + (size_t)blockIdx.y * 3;
    const uint4* __restrict__ w0 = (const uint4*)t[0];
    const uint4* __restrict__ pre = (const uint4*)t[1];
    uint4* __restrict__ out = (uint4*)t[2];
    const int per_row = row_bytes / 16;
    const int x = blockIdx.x * blockDim.x + threadIdx.x;
    if (x >= w * per_row) return;
    const int j = x / per_row, col = x % per_row;
    const int src = m + j;  // row of [w0; path rows]
    out[x] = src < w ? w0[(size_t)src * per_row + col]
                     : pre[(size_t)idx[src - w] * per_row + col];
}
