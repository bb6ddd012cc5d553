// Top-k of each row of an f32 matrix on the device, so a DDTree round copies k (token, log-prob)
// pairs per depth to the host instead of the whole vocabulary. One block per row: a 4-pass radix
// select (8 bits per pass, most significant first) over order-preserving u32 keys finds the k-th
// largest key; then every larger entry is kept and the equal ones fill the rest in token order,
// which is the host's tie rule (best value first, lower token id on ties). The order of the k
// entries is left to the host (TopK::new sorts them).

#include "common.cuh"

// -0.0 folds into +0.0 as the host's rank_key does.
__device__ __forceinline__ u32 ordered(float f) {
    u32 u = __float_as_uint(f + 0.0f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// x [rows, vocab]; idx/val [rows, k]; k <= vocab; blockDim.x == 1024.
extern "C" __global__ void __launch_bounds__(1024) topk_rows(const float* __restrict__ x, int vocab,
                                                             int k, u32* __restrict__ idx,
                                                             float* __restrict__ val) {
    __shared__ u32 hist[256];
    __shared__ u32 s_prefix, s_mask, s_krem, s_above, s_eq_taken;
    __shared__ u32 warp_eq[32];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const float* row = x + (size_t)blockIdx.x * vocab;
    u32* oi = idx + (size_t)blockIdx.x * k;
    float* ov = val + (size_t)blockIdx.x * k;
    if (tid == 0) {
        s_prefix = 0u;
        s_mask = 0u;
        s_krem = (u32)k;
        s_above = 0u;
        s_eq_taken = 0u;
    }
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = tid; i < 256; i += blockDim.x) hist[i] = 0u;
        __syncthreads();
        const u32 prefix = s_prefix, mask = s_mask;
        for (int i = tid; i < vocab; i += blockDim.x) {
            u32 key = ordered(row[i]);
            if ((key & mask) == prefix) atomicAdd(&hist[(key >> shift) & 255u], 1u);
        }
        __syncthreads();
        if (tid == 0) {
            u32 krem = s_krem;
            int b = 255;
            for (; b > 0; --b) {
                if (hist[b] >= krem) break;
                krem -= hist[b];
            }
            s_prefix = prefix | ((u32)b << shift);
            s_mask = mask | (255u << shift);
            s_krem = krem;
        }
        __syncthreads();
    }
    const u32 tau = s_prefix, need_eq = s_krem, above_total = (u32)k - need_eq;
    for (int base = 0; base < vocab; base += blockDim.x) {
        const int i = base + tid;
        const u32 key = i < vocab ? ordered(row[i]) : 0u;
        const bool above = i < vocab && key > tau, eq = i < vocab && key == tau;
        if (above) {
            u32 s = atomicAdd(&s_above, 1u);
            oi[s] = (u32)i;
            ov[s] = row[i];
        }
        const u32 ballot = __ballot_sync(0xffffffffu, eq);
        if (lane == 0) warp_eq[warp] = __popc(ballot);
        __syncthreads();
        const u32 taken = s_eq_taken;
        u32 before = 0u, tile = 0u;
        for (int w = 0; w < (int)(blockDim.x >> 5); ++w) {
            if (w < warp) before += warp_eq[w];
            tile += warp_eq[w];
        }
        if (eq) {
            u32 r = taken + before + __popc(ballot & ((1u << lane) - 1u));
            if (r < need_eq) {
                oi[above_total + r] = (u32)i;
                ov[above_total + r] = row[i];
            }
        }
        __syncthreads();
        if (tid == 0) s_eq_taken = taken + tile;
        __syncthreads();
    }
}
