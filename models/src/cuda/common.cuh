// Helpers shared by the fused kernels (kernels.cu) and the skinny GEMMs (gemv.cu).
// bf16 values travel as raw 16-bit words so no CUDA header is needed.
#pragma once

typedef unsigned short bf16_t;
typedef unsigned int u32;
typedef unsigned long long u64;

// Rows per page of the paged K/V pool (cache::PAGE_SIZE): a 64-key attention tile is a page.
#define KV_PAGE 64

// Buffer row of a sequence's logical cache row r: through its page table `pt` (page ids of
// KV_PAGE rows in the pool), or r itself for a cache in buffers of its own (pt null).
__device__ __forceinline__ size_t kv_row(const u32* __restrict__ pt, int r) {
    return pt ? (size_t)pt[r / KV_PAGE] * KV_PAGE + (r % KV_PAGE) : (size_t)r;
}

__device__ __forceinline__ float bf2f(bf16_t x) { return __uint_as_float(((u32)x) << 16); }

// Round to nearest even, NaN kept quiet (matches __float2bfloat16_rn).
__device__ __forceinline__ bf16_t f2bf(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over a block of blockDim.x (a multiple of 32, at most 1024) threads.
__device__ float block_sum(float v, float* shared32) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) shared32[w] = v;
    __syncthreads();
    float t = lane < nw ? shared32[lane] : 0.f;
    return warp_sum(t);
}

__device__ __forceinline__ void mma_bf16(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// The low / high bf16 of a packed pair as f32.
__device__ __forceinline__ float lo(u32 v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float hi(u32 v) { return __uint_as_float(v & 0xffff0000u); }

// Two floats to bf16x2 (round to nearest even, as f2bf), low half first.
__device__ __forceinline__ u32 pack2(float l, float h) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(h), "f"(l));
    return r;
}

// RMSNorm of 2 / 8 packed values: bf16(y * inv * w), rounded as add_rmsnorm rounds it.
__device__ __forceinline__ u32 norm2(u32 y, u32 w, float inv) {
    return pack2(lo(y) * inv * lo(w), hi(y) * inv * hi(w));
}
__device__ __forceinline__ uint4 norm8(uint4 y, uint4 w, float inv) {
    return make_uint4(norm2(y.x, w.x, inv), norm2(y.y, w.y, inv), norm2(y.z, w.z, inv),
                      norm2(y.w, w.w, inv));
}

// Key chunks per split when `splits` splits share the live keys [0, L) in chunks of `chunk`:
// the split kernels (attn_split_flash, attn_decode) and the merge (attn_combine) must agree.
__device__ __forceinline__ int chunks_per_split(int L, int chunk, int splits) {
    return ((L + chunk - 1) / chunk + splits - 1) / splits;
}

// One online-softmax step (FlashAttention-2) of a warp's two query rows A and B of an m16n8
// tile over NT 8-key tiles of masked, scaled scores s (row A in s[.][0..1], B in s[.][2..3];
// mxA / mxB: this lane's maxima of them). The four lanes sharing a row (tig) agree on the new
// maxima; O is rescaled; P = exp(S - m) is rounded to bf16 (round to nearest even) into the A
// fragments of P V (k-step j = key tiles 2j and 2j + 1, the even key in each pair's low half);
// the row sums lA / lB add the rounded P, the values P V sees. Shared by the split/prefill
// flash kernels (attn_prefill.cu) and the fused decode attention (attn_decode.cu), so both
// round and sum alike. ODT: 8-column output tiles of O (16 for head_dim 128, 8 for 64).
template <int NT, int ODT = 16>
__device__ __forceinline__ void softmax_step(const float (&s)[NT][4], float mxA, float mxB,
                                             float (&o)[ODT][4], float& mA, float& mB,
                                             float& lA, float& lB, u32 (&pf)[NT / 2][4]) {
    mxA = fmaxf(mxA, __shfl_xor_sync(0xffffffffu, mxA, 1));
    mxA = fmaxf(mxA, __shfl_xor_sync(0xffffffffu, mxA, 2));
    mxB = fmaxf(mxB, __shfl_xor_sync(0xffffffffu, mxB, 1));
    mxB = fmaxf(mxB, __shfl_xor_sync(0xffffffffu, mxB, 2));
    float nA = fmaxf(mA, mxA), nB = fmaxf(mB, mxB);
    float cA = nA == -INFINITY ? 1.f : __expf(mA - nA);
    float cB = nB == -INFINITY ? 1.f : __expf(mB - nB);
#pragma unroll
    for (int nt = 0; nt < ODT; ++nt) {
        o[nt][0] *= cA; o[nt][1] *= cA; o[nt][2] *= cB; o[nt][3] *= cB;
    }
    mA = nA;
    mB = nB;
    float sumA = 0.f, sumB = 0.f;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        float p0 = mA == -INFINITY ? 0.f : __expf(s[nt][0] - mA);
        float p1 = mA == -INFINITY ? 0.f : __expf(s[nt][1] - mA);
        float p2 = mB == -INFINITY ? 0.f : __expf(s[nt][2] - mB);
        float p3 = mB == -INFINITY ? 0.f : __expf(s[nt][3] - mB);
        u32 pa = pack2(p0, p1), pb = pack2(p2, p3);  // rows A and B
        sumA += lo(pa) + hi(pa);
        sumB += lo(pb) + hi(pb);
        int j = nt >> 1;
        if ((nt & 1) == 0) { pf[j][0] = pa; pf[j][1] = pb; }
        else { pf[j][2] = pa; pf[j][3] = pb; }
    }
    sumA += __shfl_xor_sync(0xffffffffu, sumA, 1);
    sumA += __shfl_xor_sync(0xffffffffu, sumA, 2);
    sumB += __shfl_xor_sync(0xffffffffu, sumB, 1);
    sumB += __shfl_xor_sync(0xffffffffu, sumB, 2);
    lA = lA * cA + sumA;
    lB = lB * cB + sumB;
}

// Programmatic dependent launch (PDL, sm_90; `cuda::pdl`): a kernel launched with the
// attribute may start while the kernel before it on the stream finishes. launch_dependents lets
// the next one launch early in turn, and comes after this kernel's own wait (so whatever a
// dependent reads before its wait, written two or more kernels back, is complete); wait blocks
// until the kernel before has completed and its writes are visible, and must come before
// anything that kernel wrote is read or anything is written. In a kernel launched without the
// attribute both return at once (the kernel before has finished), so a kernel may call them
// unconditionally.
__device__ __forceinline__ void pdl_launch_dependents() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
