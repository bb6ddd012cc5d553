// Multi-tensor AdamW over flat f32 buffers (training/adamw.rs), with global-norm clipping
// and the non-finite skip decided on the device, so a step needs no host read:
//   1. adamw_sumsq: each of SUMSQ_BLOCKS blocks writes the sum of squares of its grid-stride
//      share of the flat gradient (fixed order: deterministic);
//   2. adamw_plan (one block): sums the partials in order, and writes the step's plan into
//      the state: the norm, whether the step runs (norm and loss finite), the clip scale,
//      the bias corrections of the next step count, and the counters (steps taken, skipped);
//   3. adamw_apply: every element's PyTorch AdamW update with the clipped gradient, writing
//      the f32 master, both moments and the bf16 working copy in one pass; nothing when the
//      plan says skip.
// State (f32 words): [0] steps taken, [1] steps skipped, [2] last norm, [3] ran (1/0),
// [4] clip scale, [5] 1 / (1 - beta1^t), [6] 1 / (1 - beta2^t) of the step being applied.
// The arithmetic is the reference's (train/src/train/optim.rs, candle ops in f32: products
// with f32-rounded constants, no fused multiply-adds), so the two agree to rounding.

#include "common.cuh"

#define SUMSQ_BLOCKS 1024
#define SUMSQ_THREADS 256

extern "C" __global__ void adamw_sumsq(const float* __restrict__ g, long long n,
                                       float* __restrict__ partials) {
    __shared__ float s32[32];
    float acc = 0.f;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        float v = g[i];
        acc += v * v;
    }
    float t = block_sum(acc, s32);
    if (threadIdx.x == 0) partials[blockIdx.x] = t;
}

// `loss` may be null; a non-finite loss skips the step as a non-finite gradient does.
extern "C" __global__ void adamw_plan(const float* __restrict__ partials, int parts,
                                      const float* __restrict__ loss, float* __restrict__ state,
                                      float clip, float beta1, float beta2) {
    __shared__ float s32[32];
    // Fixed order: thread i sums partials i, i + blockDim, ...; then the block sum.
    double acc = 0.0;
    for (int i = threadIdx.x; i < parts; i += blockDim.x) acc += (double)partials[i];
    float total = block_sum((float)acc, s32);
    if (threadIdx.x != 0) return;
    float norm = sqrtf(total);
    bool finite = isfinite(norm) && (loss == nullptr || isfinite(*loss));
    state[2] = norm;
    state[3] = finite ? 1.f : 0.f;
    if (finite) {
        state[0] += 1.f;
        double t = state[0];
        state[4] = (clip > 0.f && norm > clip) ? clip / (norm + 1e-6f) : 1.f;
        state[5] = (float)(1.0 / (1.0 - pow((double)beta1, t)));
        state[6] = (float)(1.0 / (1.0 - pow((double)beta2, t)));
    } else {
        state[1] += 1.f;
    }
}

extern "C" __global__ void adamw_apply(float* __restrict__ p, float* __restrict__ m,
                                       float* __restrict__ v, bf16_t* __restrict__ working,
                                       const float* __restrict__ g, long long n,
                                       const float* __restrict__ state, float lr, float beta1,
                                       float one_minus_beta1, float beta2,
                                       float one_minus_beta2, float eps, float lr_wd) {
    if (state[3] == 0.f) return;
    const float scale = state[4], inv_bc1 = state[5], inv_bc2 = state[6];
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        float gi = __fmul_rn(g[i], scale);
        float mi = __fadd_rn(__fmul_rn(m[i], beta1), __fmul_rn(gi, one_minus_beta1));
        float vi = __fadd_rn(__fmul_rn(v[i], beta2), __fmul_rn(__fmul_rn(gi, gi), one_minus_beta2));
        float upd = __fdiv_rn(__fmul_rn(mi, inv_bc1), __fadd_rn(sqrtf(__fmul_rn(vi, inv_bc2)), eps));
        float pi = p[i];
        float next = __fsub_rn(pi, __fmul_rn(upd, lr));
        if (lr_wd != 0.f) next = __fsub_rn(next, __fmul_rn(pi, lr_wd));
        p[i] = next;
        m[i] = mi;
        v[i] = vi;
        if (working) working[i] = f2bf(next);
    }
}

// One parameter's gradient (bf16 or f32, contiguous) written as f32 into its segment of the
// flat gradient: the cast and the packing in one pass (candle's cast and then cat read and
// wrote it twice, ~16 ms per 8B-recipe step on an H100, session 21). 16-byte accesses where
// both ends allow, else one element at a time.
//
// W elements of T per 16-byte load, written as W / 4 float4s; taking the bf16 halves of the
// words (common.cuh's lo / hi) keeps the 128-bit load whole.
template <typename T>
struct Pack;

template <>
struct Pack<bf16_t> {
    static constexpr int W = 8;
    __device__ static void vec(const uint4& r, float4* d) {
        d[0] = make_float4(lo(r.x), hi(r.x), lo(r.y), hi(r.y));
        d[1] = make_float4(lo(r.z), hi(r.z), lo(r.w), hi(r.w));
    }
    __device__ static float one(bf16_t x) { return bf2f(x); }
};

template <>
struct Pack<float> {
    static constexpr int W = 4;
    __device__ static void vec(const uint4& r, float4* d) {
        d[0] = make_float4(__uint_as_float(r.x), __uint_as_float(r.y), __uint_as_float(r.z),
                           __uint_as_float(r.w));
    }
    __device__ static float one(float x) { return x; }
};

template <typename T>
__device__ void pack_f32(const T* __restrict__ src, float* __restrict__ dst, long long n) {
    constexpr int W = Pack<T>::W;
    const long long tid = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    const long long stride = (long long)gridDim.x * blockDim.x;
    long long done = 0;
    if (((size_t)src & 15) == 0 && ((size_t)dst & 15) == 0) {
        const uint4* s = reinterpret_cast<const uint4*>(src);
        float4* d = reinterpret_cast<float4*>(dst);
        for (long long c = tid; c < n / W; c += stride) Pack<T>::vec(s[c], d + c * (W / 4));
        done = n / W * W;
    }
    for (long long i = done + tid; i < n; i += stride) dst[i] = Pack<T>::one(src[i]);
}

extern "C" __global__ void pack_bf16_f32(const bf16_t* __restrict__ src, float* __restrict__ dst,
                                         long long n) {
    pack_f32(src, dst, n);
}

extern "C" __global__ void pack_f32_f32(const float* __restrict__ src, float* __restrict__ dst,
                                        long long n) {
    pack_f32(src, dst, n);
}
