// Shared by the sparse-MoE kernels: the routing (moe_route.cu) and the experts (moe.cu).

// Routing metadata, u32 `meta` (P = rows * k pairs):
//   [0]              n_uniq, the number of experts used
//   [1, 1+P)         top-k experts of every row, highest probability first
//   [1+P, 1+2P)      the used experts, ascending (n_uniq of them)
//   [1+2P, 2+3P)     first pair of each used expert; entry n_uniq is P
//   [2+3P, 2+4P)     row of every pair (pairs grouped by expert, rows ascending within one)
//   [2+4P, 2+5P)     expert of every pair
//   [2+5P, 2+6P)     row r's k pairs in ascending expert order (at r * k)
// f32 `wts`: [0, P) the top-k weights (routing order), [P, 2P) the weights of row r's pairs in
// ascending expert order.

#pragma once
#include "gemv_impl.cuh"

#define MOE_MAX_E 512
#define MOE_MAX_E_SH (MOE_MAX_E + 32)  // room for the shared expert's id E
#define MOE_MAX_K 16
#define MOE_MAX_ROWS 64
#define ROUTE_WARPS 8

__device__ __forceinline__ float bf16r(float v) { return bf2f(f2bf(v)); }
