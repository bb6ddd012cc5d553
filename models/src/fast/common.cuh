// Helpers shared by the fused kernels (kernels.cu) and the skinny GEMMs (gemv.cu).
// bf16 values travel as raw 16-bit words so no CUDA header is needed.
#pragma once

typedef unsigned short bf16_t;
typedef unsigned int u32;
typedef unsigned long long u64;

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
