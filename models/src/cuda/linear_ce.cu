// Cross-entropy rows of the fused linear + cross-entropy (training/linear_ce.rs): one block per
// row of a [rows, vocab] logits chunk (the GEMM's output), in two passes over the row. The
// first keeps a running (max, scaled sum of exp, argmax) per thread and merges them over the
// block in a fixed order; the second overwrites the logits in place with their gradient
// softmax - onehot(label), so no second [rows, vocab] buffer exists. Per row it writes the
// cross-entropy lse - x[label] and the argmax (the lowest column among equal maxima, as a
// float: exact below 2^24 columns).

#include "common.cuh"

#define CE_THREADS 512

struct Acc {
    float m;  // running maximum (-inf: nothing seen)
    float s;  // sum of exp(x - m) over what was seen
    u32 i;    // lowest column holding m
};

__device__ __forceinline__ Acc merge(Acc a, Acc b) {
    if (b.m == -INFINITY && b.s == 0.f) return a;
    if (a.m == -INFINITY && a.s == 0.f) return b;
    Acc w = a, l = b;
    if (b.m > a.m || (b.m == a.m && b.i < a.i)) {
        w = b;
        l = a;
    }
    w.s = w.s + (l.m == w.m ? l.s : l.s * expf(l.m - w.m));
    return w;
}

// A NaN anywhere in a row makes its maximum and sum NaN (so the loss is non-finite and the
// step is skipped); -inf entries add nothing.
__device__ __forceinline__ void push(Acc& a, float v) {
    if (v != v) {
        a.m = v;
        a.s = v;
    } else if (v > a.m) {
        a.s = (a.m == -INFINITY ? 0.f : a.s * expf(a.m - v)) + 1.f;
        a.m = v;
    } else if (v != -INFINITY) {
        a.s += expf(v - a.m);
    }
}

__device__ __forceinline__ float load(const float* x, size_t j) { return x[j]; }
__device__ __forceinline__ float load(const bf16_t* x, size_t j) { return bf2f(x[j]); }
__device__ __forceinline__ void store(float* x, size_t j, float v) { x[j] = v; }
__device__ __forceinline__ void store(bf16_t* x, size_t j, float v) { x[j] = f2bf(v); }

template <typename T>
__device__ void ce_rows(T* __restrict__ logits, const u32* __restrict__ labels,
                        float* __restrict__ stats, int vocab) {
    __shared__ Acc part[CE_THREADS / 32];
    __shared__ float row_lse;
    __shared__ float label_logit;
    const size_t row = blockIdx.x;
    T* x = logits + row * (size_t)vocab;
    const u32 label = labels[row];
    Acc a = {-INFINITY, 0.f, 0u};
    for (int j = threadIdx.x; j < vocab; j += blockDim.x) {
        float v = load(x, j);
        bool first = v > a.m;
        push(a, v);
        if (first) a.i = j;
    }
    // Warp merge in a fixed butterfly order, then the warps' partials in order by thread 0.
    for (int o = 16; o > 0; o >>= 1) {
        Acc b;
        b.m = __shfl_xor_sync(0xffffffffu, a.m, o);
        b.s = __shfl_xor_sync(0xffffffffu, a.s, o);
        b.i = __shfl_xor_sync(0xffffffffu, a.i, o);
        a = merge(a, b);
    }
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = a;
    __syncthreads();
    if (threadIdx.x == 0) {
        Acc t = part[0];
        for (int w = 1; w < (int)(blockDim.x >> 5); w++) t = merge(t, part[w]);
        float lse = t.m + logf(t.s);
        float xl = label < (u32)vocab ? load(x, label) : NAN;
        row_lse = lse;
        label_logit = xl;
        stats[row * 2] = lse - xl;
        stats[row * 2 + 1] = (float)t.i;
    }
    __syncthreads();
    const float lse = row_lse;
    for (int j = threadIdx.x; j < vocab; j += blockDim.x) {
        float p = expf(load(x, j) - lse);
        store(x, j, (u32)j == label ? p - 1.f : p);
    }
}

extern "C" __global__ void ce_rows_bf16(bf16_t* logits, const u32* labels, float* stats,
                                        int vocab) {
    ce_rows(logits, labels, stats, vocab);
}

extern "C" __global__ void ce_rows_f32(float* logits, const u32* labels, float* stats,
                                       int vocab) {
    ce_rows(logits, labels, stats, vocab);
}
