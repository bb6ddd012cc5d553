// Forward and backward kernels of the trainer's elementwise and row ops (training/fused_ops.rs):
// RMSNorm with its weight gradient, per-head q/k RMSNorm + RoPE (neox, rotate half) writing the
// head-major layout attention reads, and the SiLU-gate product. bf16 or f32 storage, f32 math.
// The forwards round where candle's composition rounds (the normed value before the weight,
// silu before the product), so bf16 results stay next to the composed reference's. Weight
// gradients are reduced in a fixed order (per-block partials, then one sum over the blocks):
// no atomics, so a step's gradients are the same on every run.

#include "common.cuh"

template <typename T> __device__ __forceinline__ float ld(const T* p, size_t i);
template <> __device__ __forceinline__ float ld<float>(const float* p, size_t i) { return p[i]; }
template <> __device__ __forceinline__ float ld<bf16_t>(const bf16_t* p, size_t i) {
    return bf2f(p[i]);
}
template <typename T> __device__ __forceinline__ void st(T* p, size_t i, float v);
template <> __device__ __forceinline__ void st<float>(float* p, size_t i, float v) { p[i] = v; }
template <> __device__ __forceinline__ void st<bf16_t>(bf16_t* p, size_t i, float v) {
    p[i] = f2bf(v);
}
// The value a store of T would keep (the composition's intermediate rounding).
template <typename T> __device__ __forceinline__ float rnd(float v);
template <> __device__ __forceinline__ float rnd<float>(float v) { return v; }
template <> __device__ __forceinline__ float rnd<bf16_t>(float v) { return bf2f(f2bf(v)); }

#define WARPS 8

// ---- RMSNorm over rows of n: y = round(round(x * r) * w), r = rsqrt(mean(x^2) + eps) ----
// One warp per row, grid-stride.
template <typename T>
__device__ void rms_fwd(const T* __restrict__ x, const T* __restrict__ w, T* __restrict__ y,
                        int rows, int n, float eps) {
    int lane = threadIdx.x & 31;
    int warps = gridDim.x * WARPS;
    for (int row = blockIdx.x * WARPS + (threadIdx.x >> 5); row < rows; row += warps) {
        const T* xr = x + (size_t)row * n;
        float ss = 0.f;
        for (int c = lane; c < n; c += 32) {
            float v = ld(xr, c);
            ss += v * v;
        }
        float r = rsqrtf(warp_sum(ss) / n + eps);
        for (int c = lane; c < n; c += 32)
            st(y, (size_t)row * n + c, rnd<T>(ld(xr, c) * r) * ld(w, c));
    }
}

// dx = r * (g - xhat * mean(g * xhat)) with g = dy * w and xhat = x * r; writes r per row for
// the weight gradient.
template <typename T>
__device__ void rms_bwd(const T* __restrict__ x, const T* __restrict__ w,
                        const T* __restrict__ dy, T* __restrict__ dx, float* __restrict__ rstd,
                        int rows, int n, float eps) {
    int lane = threadIdx.x & 31;
    int warps = gridDim.x * WARPS;
    for (int row = blockIdx.x * WARPS + (threadIdx.x >> 5); row < rows; row += warps) {
        size_t o = (size_t)row * n;
        float ss = 0.f;
        for (int c = lane; c < n; c += 32) {
            float v = ld(x, o + c);
            ss += v * v;
        }
        float r = rsqrtf(warp_sum(ss) / n + eps);
        float dot = 0.f;
        for (int c = lane; c < n; c += 32) dot += ld(dy, o + c) * ld(w, c) * ld(x, o + c) * r;
        dot = warp_sum(dot) / n;
        for (int c = lane; c < n; c += 32) {
            float xh = ld(x, o + c) * r;
            st(dx, o + c, r * (ld(dy, o + c) * ld(w, c) - xh * dot));
        }
        if (lane == 0) rstd[row] = r;
    }
}

// part[blockIdx.y, c] = sum over the chunk's rows of dy * round(x * r): block (256 columns,
// one chunk of rows), grid (ceil(n / 256), chunks).
template <typename T>
__device__ void rms_dw_part(const T* __restrict__ x, const T* __restrict__ dy,
                            const float* __restrict__ rstd, float* __restrict__ part, int rows,
                            int n, int chunk) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= n) return;
    int r0 = blockIdx.y * chunk, r1 = min(rows, r0 + chunk);
    float acc = 0.f;
    for (int r = r0; r < r1; ++r) {
        size_t o = (size_t)r * n + c;
        acc += ld(dy, o) * rnd<T>(ld(x, o) * rstd[r]);
    }
    part[(size_t)blockIdx.y * n + c] = acc;
}

// out[c] = sum_p part[p, c], p in order.
extern "C" __global__ void sum_parts(const float* __restrict__ part, float* __restrict__ out,
                                     int parts, int n) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= n) return;
    float acc = 0.f;
    for (int p = 0; p < parts; ++p) acc += part[(size_t)p * n + c];
    out[c] = acc;
}

// ---- q/k RMSNorm + RoPE: x [t, h, d] -> y [h, t, d]; cs [t, d] f32 = (cos | sin) halves ----
// One warp per (token, head) row; lane holds columns lane + 32 j, so a column's rotation
// partner (j +- npl / 2) is in the same lane. d is a multiple of 64, at most 256.
template <typename T, int NPL>
__device__ void qk_fwd_n(const T* __restrict__ x, const T* __restrict__ w,
                         const float* __restrict__ cs, T* __restrict__ y, int t, int h,
                         float eps) {
    constexpr int npl = NPL, half = NPL / 2, d = NPL * 32, hd = d / 2;
    int lane = threadIdx.x & 31;
    int warps = gridDim.x * WARPS, rows = t * h;
    for (int row = blockIdx.x * WARPS + (threadIdx.x >> 5); row < rows; row += warps) {
        int tok = row / h, head = row % h;
        const T* xr = x + (size_t)row * d;
        float v[NPL], nv[NPL];
        float ss = 0.f;
#pragma unroll
        for (int j = 0; j < NPL; ++j)
            if (j < npl) {
                v[j] = ld(xr, lane + 32 * j);
                ss += v[j] * v[j];
            }
        float r = rsqrtf(warp_sum(ss) / d + eps);
#pragma unroll
        for (int j = 0; j < NPL; ++j)
            if (j < npl) nv[j] = rnd<T>(rnd<T>(v[j] * r) * ld(w, lane + 32 * j));
        T* yr = y + ((size_t)head * t + tok) * d;
#pragma unroll
        for (int j = 0; j < NPL; ++j)
            if (j < npl) {
                int e = lane + 32 * j;
                int f = e < hd ? e : e - hd;  // frequency index
                float c = cs[(size_t)tok * d + f], s = cs[(size_t)tok * d + hd + f];
                float z = j < half ? nv[j] * c - nv[j + half] * s : nv[j] * c + nv[j - half] * s;
                st(yr, e, z);
            }
    }
}

// Backward of qk_fwd: dz [h, t, d] -> dx [t, h, d], and part[blockIdx.x, d] the block's share
// of the weight gradient (a fixed grid of gridDim.x blocks, summed by sum_parts).
template <typename T, int NPL>
__device__ void qk_bwd_n(const T* __restrict__ x, const T* __restrict__ w,
                         const float* __restrict__ cs, const T* __restrict__ dz,
                         T* __restrict__ dx, float* __restrict__ part, int t, int h, float eps) {
    __shared__ float sdw[WARPS][NPL * 32];
    constexpr int npl = NPL, half = NPL / 2, d = NPL * 32, hd = d / 2;
    int lane = threadIdx.x & 31, wi = threadIdx.x >> 5;
    int warps = gridDim.x * WARPS, rows = t * h;
    float dw[NPL];
#pragma unroll
    for (int j = 0; j < NPL; ++j) dw[j] = 0.f;
    for (int row = blockIdx.x * WARPS + wi; row < rows; row += warps) {
        int tok = row / h, head = row % h;
        const T* xr = x + (size_t)row * d;
        const T* gr = dz + ((size_t)head * t + tok) * d;
        float v[NPL], g[NPL], dn[NPL];
        float ss = 0.f;
#pragma unroll
        for (int j = 0; j < NPL; ++j)
            if (j < npl) {
                v[j] = ld(xr, lane + 32 * j);
                g[j] = ld(gr, lane + 32 * j);
                ss += v[j] * v[j];
            }
        float r = rsqrtf(warp_sum(ss) / d + eps);
        // Transposed rotation: dn[e] = dz[e] c + dz[e + hd] s (e < hd), dz[e] c - dz[e - hd] s.
#pragma unroll
        for (int j = 0; j < NPL; ++j)
            if (j < npl) {
                int e = lane + 32 * j;
                int f = e < hd ? e : e - hd;
                float c = cs[(size_t)tok * d + f], s = cs[(size_t)tok * d + hd + f];
                dn[j] = j < half ? g[j] * c + g[j + half] * s : g[j] * c - g[j - half] * s;
            }
        float dot = 0.f;
#pragma unroll
        for (int j = 0; j < NPL; ++j)
            if (j < npl) {
                float xh = v[j] * r;
                float gw = dn[j] * ld(w, lane + 32 * j);
                dw[j] += dn[j] * rnd<T>(xh);
                dot += gw * xh;
                dn[j] = gw;
            }
        dot = warp_sum(dot) / d;
        T* dr = dx + (size_t)row * d;
#pragma unroll
        for (int j = 0; j < NPL; ++j)
            if (j < npl) st(dr, lane + 32 * j, r * (dn[j] - v[j] * r * dot));
    }
#pragma unroll
    for (int j = 0; j < NPL; ++j)
        if (j < npl) sdw[wi][lane + 32 * j] = dw[j];
    __syncthreads();
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        float acc = 0.f;
        for (int k = 0; k < WARPS; ++k) acc += sdw[k][c];
        part[(size_t)blockIdx.x * d + c] = acc;
    }
}

// head_dim / 32 values per lane as a compile-time constant (registers, not local memory).
template <typename T>
__device__ void qk_fwd(const T* x, const T* w, const float* cs, T* y, int t, int h, int d,
                       float eps) {
    switch (d >> 5) {
        case 2: qk_fwd_n<T, 2>(x, w, cs, y, t, h, eps); break;
        case 4: qk_fwd_n<T, 4>(x, w, cs, y, t, h, eps); break;
        case 6: qk_fwd_n<T, 6>(x, w, cs, y, t, h, eps); break;
        case 8: qk_fwd_n<T, 8>(x, w, cs, y, t, h, eps); break;
    }
}
template <typename T>
__device__ void qk_bwd(const T* x, const T* w, const float* cs, const T* dz, T* dx,
                       float* part, int t, int h, int d, float eps) {
    switch (d >> 5) {
        case 2: qk_bwd_n<T, 2>(x, w, cs, dz, dx, part, t, h, eps); break;
        case 4: qk_bwd_n<T, 4>(x, w, cs, dz, dx, part, t, h, eps); break;
        case 6: qk_bwd_n<T, 6>(x, w, cs, dz, dx, part, t, h, eps); break;
        case 8: qk_bwd_n<T, 8>(x, w, cs, dz, dx, part, t, h, eps); break;
    }
}

// ---- SiLU gate: y = round(round(silu(g)) * u) and its backward ----
template <typename T>
__device__ void silu_fwd(const T* __restrict__ g, const T* __restrict__ u, T* __restrict__ y,
                         size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        float a = ld(g, i);
        st(y, i, rnd<T>(a / (1.f + __expf(-a))) * ld(u, i));
    }
}

// dg = dy u sig(g) (1 + g (1 - sig(g))), du = dy silu(g).
template <typename T>
__device__ void silu_bwd(const T* __restrict__ g, const T* __restrict__ u,
                         const T* __restrict__ dy, T* __restrict__ dg, T* __restrict__ du,
                         size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        float a = ld(g, i), b = ld(u, i), e = ld(dy, i);
        float sg = 1.f / (1.f + __expf(-a));
        st(dg, i, e * b * sg * (1.f + a * (1.f - sg)));
        st(du, i, e * rnd<T>(a * sg));
    }
}

#define BOTH(NAME, ARGS, CALL)                                      \
    extern "C" __global__ void NAME##_bf16 ARGS(bf16_t) { NAME<bf16_t> CALL; } \
    extern "C" __global__ void NAME##_f32 ARGS(float) { NAME<float> CALL; }
#define RMS_FWD(T) (const T* x, const T* w, T* y, int rows, int n, float eps)
#define RMS_BWD(T) \
    (const T* x, const T* w, const T* dy, T* dx, float* rstd, int rows, int n, float eps)
#define RMS_DW(T) \
    (const T* x, const T* dy, const float* rstd, float* part, int rows, int n, int chunk)
#define QK_FWD(T) (const T* x, const T* w, const float* cs, T* y, int t, int h, int d, float eps)
#define QK_BWD(T)                                                                     \
    (const T* x, const T* w, const float* cs, const T* dz, T* dx, float* part, int t, int h, \
     int d, float eps)
#define SILU_FWD(T) (const T* g, const T* u, T* y, size_t n)
#define SILU_BWD(T) (const T* g, const T* u, const T* dy, T* dg, T* du, size_t n)
BOTH(rms_fwd, RMS_FWD, (x, w, y, rows, n, eps))
BOTH(rms_bwd, RMS_BWD, (x, w, dy, dx, rstd, rows, n, eps))
BOTH(rms_dw_part, RMS_DW, (x, dy, rstd, part, rows, n, chunk))
BOTH(qk_fwd, QK_FWD, (x, w, cs, y, t, h, d, eps))
BOTH(qk_bwd, QK_BWD, (x, w, cs, dz, dx, part, t, h, d, eps))
BOTH(silu_fwd, SILU_FWD, (g, u, y, n))
BOTH(silu_bwd, SILU_BWD, (g, u, dy, dg, du, n))
