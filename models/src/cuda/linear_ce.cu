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

// 16-byte vectors of a row: 8 bf16 or 4 f32 columns per load and store, so each thread keeps
// several bytes in flight (one 2-byte load per thread left the row pass latency-bound: ~0.7 TB/s
// on an H100, session 21's profile of the 8B recipe).
template <typename T>
struct Lanes {
    static constexpr int N = 16 / sizeof(T);
};

// Unpacked and packed by bit operations on the four words, so the compiler keeps one 128-bit
// load and store (through a reinterpreted pointer it split the load into eight u16 loads).
__device__ __forceinline__ void unpack_words(const uint4& raw, float* f, const bf16_t*) {
    const u32 w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int k = 0; k < 4; k++) {
        f[2 * k] = lo(w[k]);
        f[2 * k + 1] = hi(w[k]);
    }
}

__device__ __forceinline__ void unpack_words(const uint4& raw, float* f, const float*) {
    f[0] = __uint_as_float(raw.x);
    f[1] = __uint_as_float(raw.y);
    f[2] = __uint_as_float(raw.z);
    f[3] = __uint_as_float(raw.w);
}

__device__ __forceinline__ uint4 pack_words(const float* f, const bf16_t*) {
    u32 w[4];
#pragma unroll
    for (int k = 0; k < 4; k++) w[k] = pack2(f[2 * k], f[2 * k + 1]);
    return make_uint4(w[0], w[1], w[2], w[3]);
}

__device__ __forceinline__ uint4 pack_words(const float* f, const float*) {
    return make_uint4(__float_as_uint(f[0]), __float_as_uint(f[1]), __float_as_uint(f[2]),
                      __float_as_uint(f[3]));
}

template <typename T>
__device__ __forceinline__ void unpack(const uint4& raw, float* f) {
    unpack_words(raw, f, (const T*)nullptr);
}

template <typename T>
__device__ __forceinline__ uint4 pack(const float* f) {
    return pack_words(f, (const T*)nullptr);
}

template <typename T>
__device__ void ce_rows(T* __restrict__ logits, const u32* __restrict__ labels,
                        float* __restrict__ stats, int vocab) {
    __shared__ Acc part[CE_THREADS / 32];
    __shared__ float row_lse;
    __shared__ float label_logit;
    constexpr int W = Lanes<T>::N;
    const size_t row = blockIdx.x;
    T* x = logits + row * (size_t)vocab;
    const u32 label = labels[row];
    // Vector passes where every row starts on 16 bytes; each thread still sees its columns in
    // ascending order, so the lowest column among equal maxima wins as in the scalar form.
    const bool vec = vocab % W == 0 && (reinterpret_cast<size_t>(x) & 15) == 0;
    Acc a = {-INFINITY, 0.f, 0u};
    if (vec) {
        const uint4* xv = reinterpret_cast<const uint4*>(x);
        for (int c = threadIdx.x; c < vocab / W; c += blockDim.x) {
            float f[W];
            unpack<T>(xv[c], f);
#pragma unroll
            for (int k = 0; k < W; k++) {
                bool first = f[k] > a.m;
                push(a, f[k]);
                if (first) a.i = c * W + k;
            }
        }
    } else {
        for (int j = threadIdx.x; j < vocab; j += blockDim.x) {
            float v = load(x, j);
            bool first = v > a.m;
            push(a, v);
            if (first) a.i = j;
        }
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
    if (vec) {
        uint4* xv = reinterpret_cast<uint4*>(x);
        for (int c = threadIdx.x; c < vocab / W; c += blockDim.x) {
            float f[W];
            unpack<T>(xv[c], f);
#pragma unroll
            for (int k = 0; k < W; k++) {
                float p = expf(f[k] - lse);
                f[k] = (u32)(c * W + k) == label ? p - 1.f : p;
            }
            xv[c] = pack<T>(f);
        }
    } else {
        for (int j = threadIdx.x; j < vocab; j += blockDim.x) {
            float p = expf(load(x, j) - lse);
            store(x, j, (u32)j == label ? p - 1.f : p);
        }
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
