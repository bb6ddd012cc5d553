// Greedy selection over the vocabulary: each row's argmax (the lowest column among equal
// maxima, the host's tie rule) and its log-probability -ln(sum_j exp(x_j - max)), for the
// engine's greedy verification and chain drafts. candle's argmax runs one block per row and
// computes a strided index per element (~0.14 ms for one 151,936-column row on an H200);
// here each row is split over PARTS blocks that keep a running (max, scaled sum, column) per
// thread, and a second launch merges the PARTS partials of a row in a fixed order, so the
// result does not depend on scheduling.

#include "common.cuh"

#define PARTS 32
#define THREADS 256

struct Acc {
    float m;  // running maximum (-inf: nothing seen)
    float s;  // sum of exp(x - m) over what was seen
    u32 i;    // lowest column holding m
};

// Merges b into a: the larger maximum wins (the lower column on ties), the sums are rescaled
// to it. -inf maxima (empty partials) contribute nothing.
__device__ __forceinline__ Acc merge(Acc a, Acc b) {
    if (b.m == -INFINITY) return a;
    if (a.m == -INFINITY) return b;
    Acc w = a, l = b;
    if (b.m > a.m || (b.m == a.m && b.i < a.i)) {
        w = b;
        l = a;
    }
    w.s = w.s + (l.m == w.m ? l.s : l.s * expf(l.m - w.m));
    return w;
}

__device__ __forceinline__ void take(Acc& a, float x, u32 col) {
    // NaN and -inf entries are skipped (probability 0).
    if (!(x > -INFINITY)) return;
    if (x > a.m) {
        a.s = (a.m == -INFINITY ? 0.0f : a.s * expf(a.m - x)) + 1.0f;
        a.m = x;
        a.i = col;
    } else {
        // Columns only grow within a thread, so an equal value keeps the earlier column.
        a.s += expf(x - a.m);
    }
}

// Merges the accumulators of a warp into lane 0's (lane l takes lane l + o, o = 16 .. 1).
__device__ __forceinline__ Acc warp_merge(Acc a) {
    for (int o = 16; o > 0; o >>= 1) {
        Acc b;
        b.m = __shfl_down_sync(0xffffffffu, a.m, o);
        b.s = __shfl_down_sync(0xffffffffu, a.s, o);
        b.i = __shfl_down_sync(0xffffffffu, a.i, o);
        a = merge(a, b);
    }
    return a;
}

// Merges the accumulators of a block (blockDim.x == THREADS) into thread 0's.
__device__ Acc block_merge(Acc a) {
    __shared__ float sm[THREADS / 32], ss[THREADS / 32];
    __shared__ u32 si[THREADS / 32];
    a = warp_merge(a);
    const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    if (lane == 0) {
        sm[w] = a.m;
        ss[w] = a.s;
        si[w] = a.i;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int k = 1; k < THREADS / 32; ++k) {
            Acc b = {sm[k], ss[k], si[k]};
            a = merge(a, b);
        }
    }
    return a;
}

__device__ __forceinline__ float load_logit(const float* p) { return *p; }
__device__ __forceinline__ float load_logit(const bf16_t* p) { return bf2f(*p); }

// x [rows, vocab] f32 or bf16 (read as is: a bf16 row is widened in registers, exactly as a
// converted copy would hold it, without writing that copy); part [rows, PARTS, 3] u32 (max
// bits, sum bits, column). grid (PARTS, rows), block THREADS.
template <typename T>
__device__ __forceinline__ void argmax_partial_impl(const T* __restrict__ x, int vocab,
                                                    u32* __restrict__ part) {
    const T* row = x + (size_t)blockIdx.y * vocab;
    const int per = (vocab + PARTS - 1) / PARTS;
    const int lo = blockIdx.x * per;
    const int hi = min(vocab, lo + per);
    Acc a = {-INFINITY, 0.0f, 0xffffffffu};
    int c = lo + threadIdx.x;
    // Four independent loads in flight per thread before they are folded in, in column order.
    for (; c + 3 * THREADS < hi; c += 4 * THREADS) {
        float v0 = load_logit(row + c), v1 = load_logit(row + c + THREADS),
              v2 = load_logit(row + c + 2 * THREADS), v3 = load_logit(row + c + 3 * THREADS);
        take(a, v0, c);
        take(a, v1, c + THREADS);
        take(a, v2, c + 2 * THREADS);
        take(a, v3, c + 3 * THREADS);
    }
    for (; c < hi; c += THREADS) take(a, load_logit(row + c), c);
    a = block_merge(a);
    if (threadIdx.x == 0) {
        u32* p = part + ((size_t)blockIdx.y * PARTS + blockIdx.x) * 3;
        p[0] = __float_as_uint(a.m);
        p[1] = __float_as_uint(a.s);
        p[2] = a.i;
    }
}

extern "C" __global__ void __launch_bounds__(THREADS)
    argmax_partial(const float* __restrict__ x, int vocab, u32* __restrict__ part) {
    argmax_partial_impl(x, vocab, part);
}

extern "C" __global__ void __launch_bounds__(THREADS)
    argmax_partial_bf16(const bf16_t* __restrict__ x, int vocab, u32* __restrict__ part) {
    argmax_partial_impl(x, vocab, part);
}

// part as above; out [rows, 2] u32: column, bits of its log-probability (-inf bits for a row
// with no finite entry, column 0xffffffff). grid rows, block 32.
extern "C" __global__ void argmax_final(const u32* __restrict__ part, u32* __restrict__ out) {
    const u32* p = part + (size_t)blockIdx.x * PARTS * 3;
    Acc a = {-INFINITY, 0.0f, 0xffffffffu};
    if (threadIdx.x < PARTS) {
        a.m = __uint_as_float(p[threadIdx.x * 3]);
        a.s = __uint_as_float(p[threadIdx.x * 3 + 1]);
        a.i = p[threadIdx.x * 3 + 2];
    }
    a = warp_merge(a);
    if (threadIdx.x == 0) {
        out[blockIdx.x * 2] = a.i;
        out[blockIdx.x * 2 + 1] = __float_as_uint(a.m == -INFINITY ? -INFINITY : -logf(a.s));
    }
}
