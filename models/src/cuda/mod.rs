//! The CUDA wing of the crate (`cuda` feature): the kernels (`*.cu`, `common.cuh`) and their
//! launch wrappers (`launch.rs` the shared helpers; `kernels.rs`, `gemv.rs`, `attn_*.rs`,
//! `topk.rs`, `argmax.rs`, `moe.rs` (the sparse-MoE block) one per kernel file), the decoder-layer stack the models' fused
//! forwards run through (`decoder_stack.rs`), CUDA-graph capture and replay generic over the
//! forward recorded (`graphs.rs`), page-locked host staging for large device -> host copies
//! (`pinned.rs`), and the kernel checks the GPU bench runs (`check*.rs`).
//! Nothing here names a model; the models' CUDA forwards live in their folders (`cuda.rs`).
//!
//! Fused CUDA kernels for decode, speculative verification, drafting and prefill (bf16,
//! head_dim 128): per-head q/k RMSNorm + RoPE + cache write in one kernel,
//! split-K attention on tensor cores straight over the preallocated cache with the tree given
//! as ancestor bit rows (no dense mask), for decode steps all of that in one launch
//! (`fused_attention`), a one-pass FlashAttention-2-style causal attention for prefill
//! pieces (`attn_prefill.cu`), SiLU-gate product, residual add + RMSNorm, and skinny
//! GEMMs for up to [`GEMV_MAX_ROWS`] rows with the input norm, the residual add or the SiLU
//! product fused around them (wider products stay on cuBLAS). [`crate::Qwen3Model`] and [`crate::DFlashDrafter`] use them when
//! [`available`] (on by default there; `with_fast_kernels(false)` turns them off); causal
//! forwards longer than [`MAX_FAST_TOKENS`] (prefills) run as consecutive pieces. CPU, f32,
//! training (`OpsMode::Differentiable`) and batches of several long sequences take the plain
//! candle path, which stays the reference the kernels are checked against (`check`).

use candle_core::{DType, Device};

use crate::layers::ops::OpsMode;

#[cfg(feature = "cuda")]
mod adamw;
mod adamw_consts;
mod switch;
mod switch_hybrid;
#[cfg(feature = "cuda")]
pub use adamw::{adamw_step, pack_f32, SUMSQ_BLOCKS};
pub use adamw_consts::AdamWConsts;
pub use switch_hybrid::{
    batched_gdn_settle, gdn_tree_chunked_on, hybrid_fused_tree, hybrid_lt_product,
    hybrid_verify_lt, moe_gather_kernel, set_batched_gdn_settle, set_gdn_tree_chunked,
    set_hybrid_fused_tree, set_hybrid_verify_lt, set_moe_gather_kernel, GDN_TREE_CHUNKED_MIN_NODES,
    HYBRID_FUSED_TREE_MAX_NODES, HYBRID_LT_MIN_WEIGHT,
};
#[cfg(feature = "cuda")]
mod argmax;
#[cfg(feature = "cuda")]
pub use argmax::argmax_logprob;
#[cfg(feature = "cuda")]
mod attn_decode;
#[cfg(feature = "cuda")]
mod attn_dflash;
#[cfg(feature = "cuda")]
mod attn_dflash_dims;
#[cfg(feature = "cuda")]
mod attn_dflash_tc;
#[cfg(feature = "cuda")]
pub use attn_dflash::{
    dflash_attention_bwd_packed, dflash_attention_fwd, dflash_attention_fwd_packed,
};
mod attn_plan;
mod varlen_plan;
#[cfg(feature = "cuda")]
pub use attn_decode::{
    fused_attention, fused_attention_fits, set_batch_launch, BatchKernel, BATCH_SPLIT_BLOCKS,
    DEFAULT_BATCH_LAUNCH, FUSED_ATTN_MAX_TOKENS,
};
#[cfg(feature = "cuda")]
mod attn_prefill;
#[cfg(feature = "cuda")]
mod attn_scratch;
#[cfg(feature = "cuda")]
mod attn_step;
#[cfg(feature = "cuda")]
mod attn_varlen;
#[cfg(feature = "cuda")]
pub use attn_varlen::{attention_varlen_causal, varlen_head_dim_supported};
#[cfg(feature = "cuda")]
pub use varlen_plan::varlen_tiles;
#[cfg(feature = "cuda")]
pub mod check;
#[cfg(feature = "cuda")]
mod check_attn;
#[cfg(feature = "cuda")]
pub mod check_attn_batch;
#[cfg(feature = "cuda")]
mod check_gdn;
#[cfg(feature = "cuda")]
pub mod check_scale;
#[cfg(feature = "cuda")]
pub(crate) mod decoder_stack;
pub mod graphs;
#[cfg(feature = "cuda")]
mod kernels;
#[cfg(feature = "cuda")]
mod mempool;
#[cfg(feature = "cuda")]
mod preload;
#[cfg(feature = "cuda")]
pub use mempool::keep_freed_memory;
#[cfg(feature = "cuda")]
pub use preload::preload_kernel_modules;
#[cfg(feature = "nccl")]
pub mod nccl;
#[cfg(feature = "cuda")]
pub use kernels::{
    add_rmsnorm, attention, attention_for_context, kv_norm_rope_cache, linear, qk_norm_rope_cache,
    silu_mul, split_plan, QkvRows, CHUNK,
};
#[cfg(feature = "cuda")]
mod launch;
#[cfg(feature = "cuda")]
mod linear_ce;
#[cfg(feature = "cuda")]
pub use launch::{device_address, pdl, set_pdl, upload_i64, upload_u32};
#[cfg(feature = "cuda")]
mod pinned;
#[cfg(feature = "cuda")]
pub use linear_ce::ce_rows_in_place;
#[cfg(feature = "cuda")]
pub use pinned::PinnedStaging;
#[cfg(feature = "cuda")]
mod gattn;
#[cfg(feature = "cuda")]
pub use gattn::{
    gated_attention_chain, gated_attention_chain_split, planned_keys_per_split, GattnRows,
    GraphSplit, GATTN_HEAD_DIM,
};
#[cfg(feature = "cuda")]
mod gdn;
#[cfg(feature = "cuda")]
pub use gdn::{gdn_chain, ChainOut, GdnWeights, GDN_HEAD_DIM, GDN_MAX_CHAIN, GDN_MAX_CONV};
#[cfg(feature = "cuda")]
mod gdn_chunk;
#[cfg(feature = "cuda")]
pub use gdn_chunk::{GDN_CHUNK, GDN_CHUNKED_MIN_T};
#[cfg(feature = "cuda")]
mod gdn_settle;
#[cfg(feature = "cuda")]
pub use gdn_settle::{gdn_settle_layers, SettleLayer};
#[cfg(feature = "cuda")]
mod gdn_split;
#[cfg(feature = "cuda")]
pub use gdn_split::{
    gdn_split, gdn_state_along, gdn_tree, gdn_tree_chunked, ScanStates, SplitOut, GDN_SPLIT_MAX_T,
    GDN_TREE_MAX_DEPTH,
};
#[cfg(feature = "cuda")]
mod gemv;
#[cfg(feature = "cuda")]
mod lt_gemm;
#[cfg(feature = "cuda")]
pub mod phases;
#[cfg(feature = "cuda")]
pub use lt_gemm::{linear_lt, linear_lt_dense, tuned_timings, LtMode};
#[cfg(feature = "cuda")]
mod moe;
#[cfg(feature = "cuda")]
mod moe_grouped;
#[cfg(feature = "cuda")]
pub use moe::{moe_block, moe_experts, MoeWeights, SharedExpertRefs};
#[cfg(feature = "cuda")]
pub use moe_grouped::GROUPED_MIN_ROWS as MOE_GROUPED_MIN_ROWS;
#[cfg(feature = "cuda")]
mod moe_route;
#[cfg(feature = "cuda")]
pub use moe_route::{
    moe_route, moe_route_shared, moe_route_wide, router_route, MoeRouting, SHARED_ROUTER_PAD,
};
#[cfg(feature = "cuda")]
mod splitk;
#[cfg(feature = "cuda")]
pub use splitk::{splitk_gemm, splitk_gemm_blocks, SplitkEpi};
#[cfg(feature = "cuda")]
mod topk;
#[cfg(feature = "cuda")]
pub(crate) mod train_ops;
#[cfg(feature = "cuda")]
pub use gemv::{
    gemv, gemv_resid, gemv_silu, gemv_variant, project, rms_apply, row_sumsq, Prefetch, RowNorm,
};
#[cfg(feature = "cuda")]
pub use topk::topk_rows;

static DFLASH_TENSOR_CORES: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(true);

/// Turns the tensor-core kernels of the DFlash training attention (`attn_dflash_tc.cu`: bf16,
/// block 16) on or off (off: its scalar kernels everywhere), for comparisons (`gpu_check
/// --train`, `dflash-train --train-attention fused-scalar`). On by default; process-wide. A
/// no-op without CUDA.
pub fn set_dflash_tensor_cores(on: bool) {
    DFLASH_TENSOR_CORES.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// Whether [`set_dflash_tensor_cores`] left them on.
pub fn dflash_tensor_cores() -> bool {
    DFLASH_TENSOR_CORES.load(std::sync::atomic::Ordering::Relaxed)
}

static DFLASH_DKV_PIPELINED: switch::EnvSwitch =
    switch::EnvSwitch::new("DFLASH_DKV_PIPELINED", true);

/// Turns the pipelined form of the tensor-core context dk/dv kernel on or off
/// (`attn_dflash_tc.cu`: two buffers of the visited blocks' Q and dO rows, the next block's
/// copies in flight during the current one's products; the same sums bit for bit). On by
/// default: `gpu_check --train` (`attn_dflash_dkv_pipelined_*`, H100, session 22) found it
/// bit-identical to the single-buffered form and faster at all three shapes (backward 7.19
/// vs 7.22 ms at the tiny recipe's, 8.85 vs 8.95 at the 8B recipe's);
/// `DFLASH_DKV_PIPELINED=0` or this switch turns it off. Process-wide.
pub fn set_dflash_dkv_pipelined(on: bool) {
    DFLASH_DKV_PIPELINED.set(on);
}

/// Whether the pipelined context dk/dv kernel is on ([`set_dflash_dkv_pipelined`], else
/// `DFLASH_DKV_PIPELINED`, read once; on unless it is `0`).
pub fn dflash_dkv_pipelined() -> bool {
    DFLASH_DKV_PIPELINED.get()
}

static BATCHED_CONTEXT_APPEND: switch::EnvSwitch =
    switch::EnvSwitch::new("DFLASH_BATCHED_CONTEXT_APPEND", true);

/// Whether a batched drafter round writes the new context rows of every sequence of one pool
/// with one norm + RoPE + cache-write launch per layer (each row carrying its own committed
/// length and page-table row) instead of one launch per sequence per layer (160 launches a
/// round at 32 sequences, each with its host-side views). On by default: `gpu_check --pooled`
/// gives the same logits both ways, and the chain server (Qwen3-8B shape, simulated tau 6.5,
/// H100, session 22) served 5,520 output tok/s at c=32 with it against 5,402 without;
/// `DFLASH_BATCHED_CONTEXT_APPEND=0` or this switch turns it off. Process-wide.
pub fn set_batched_context_append(on: bool) {
    BATCHED_CONTEXT_APPEND.set(on);
}

/// Whether the batched context append is on ([`set_batched_context_append`], else
/// `DFLASH_BATCHED_CONTEXT_APPEND`, read once; on unless it is `0`).
pub fn batched_context_append() -> bool {
    BATCHED_CONTEXT_APPEND.get()
}

static GDN_TREE_KERNEL: switch::EnvSwitch = switch::EnvSwitch::new("DFLASH_GDN_TREE_KERNEL", true);

/// Whether a hybrid target's tree verify runs its GDN layers on the tree kernels
/// (`gdn_split.cu` `gdn_scan_tree`: one scan over a depth-first order, three launches per layer)
/// instead of the plain path's tree form in candle ops. On by default: at the Qwen3.6-27B shape
/// (H100, session 19) a DDTree-16 verify took 27.9 ms on them against 95.8 on the plain form,
/// a DDTree-64 verify 34.3 against 492 (`gpu_check --hybrid` `gdn_tree_*` cases check them
/// against the plain form). `DFLASH_GDN_TREE_KERNEL=0` or this switch turns them off.
/// Process-wide.
pub fn set_gdn_tree_kernel(on: bool) {
    GDN_TREE_KERNEL.set(on);
}

/// Whether the tree kernels are on ([`set_gdn_tree_kernel`], else `DFLASH_GDN_TREE_KERNEL`,
/// read once; on unless it is `0`).
pub fn gdn_tree_kernel() -> bool {
    GDN_TREE_KERNEL.get()
}

static GDN_CHUNKED: switch::EnvSwitch = switch::EnvSwitch::new("DFLASH_GDN_CHUNKED", true);

/// Whether a hybrid target's prefill of at least [`GDN_CHUNKED_MIN_T`] tokens runs the delta
/// rule of its GDN layers in the chunked form on the tensor cores (`gdn_chunk.cu`: 64-token
/// chunks, a parallel solve per chunk, then one pass over the chunks per 32 value columns)
/// instead of `gdn_scan`'s token-by-token recurrence, which at the Qwen3.6-27B shape took 125 ms
/// of a 4K prefill's 0.60 s (H100, session 24, `prefill_4096_phases` `gdn.scan`). On by
/// default since session 26 (H100: `gpu_check --gdn-chunk` and the family bench's
/// `kernel_checks` pass at hv 48 and 32, 1,000 and 4,396 tokens, within 2e-2 of the scale of
/// the scan's output; 1.6 ms against the scan's 3.3 at 4,396 tokens of the 27B heads; the
/// 27B's 4K prefill 0.536 s = 0.517 of the matmul rate, against 0.453 with the scan);
/// `DFLASH_GDN_CHUNKED=0` or this switch turns it off. Process-wide.
pub fn set_gdn_chunked(on: bool) {
    GDN_CHUNKED.set(on);
}

/// Whether prefills take the chunked delta rule ([`set_gdn_chunked`]).
pub fn gdn_chunked() -> bool {
    GDN_CHUNKED.get()
}

static MOE_SHARED_IN_BLOCK: switch::EnvSwitch =
    switch::EnvSwitch::new("DFLASH_MOE_SHARED_IN_BLOCK", true);

/// Whether a one-row sparse-MoE block with a shared expert of the routed width (Qwen3.5/3.6
/// MoE) runs that expert inside the device block (`moe.cu`: the gate row stacked under the
/// router, one more pair per row with weight sigmoid(gate), the post-attention norm inside
/// the kernels: 4 launches for the block) instead of beside it (norm, two GEMVs, the gate GEMV,
/// sigmoid, scale, add: 7 more). On by default: checked by `gpu_check --moe`
/// (`moe_hybrid_block` `rows_1`: 0.067 ms against 0.133 beside it) and faster end to end (H100,
/// session 24, 12-layer Qwen3.6-35B-A3B shape, 1K context: decode 2.15 ms eager against 2.48
/// beside it, 2.005 against 2.09 from graphs; deploy/bench/results/h100-2026-12-07-s24).
/// `DFLASH_MOE_SHARED_IN_BLOCK=0` or this switch turns it off. Process-wide.
pub fn set_moe_shared_in_block(on: bool) {
    MOE_SHARED_IN_BLOCK.set(on);
}

/// Whether the shared expert rides in the one-row block ([`set_moe_shared_in_block`]).
pub fn moe_shared_in_block() -> bool {
    MOE_SHARED_IN_BLOCK.get()
}

static HYBRID_VARLEN_PREFILL: switch::EnvSwitch =
    switch::EnvSwitch::new("DFLASH_HYBRID_VARLEN_PREFILL", true);

/// Whether a hybrid target's gated-attention layers attend a forward from an empty cache on
/// the tensor-core varlen kernel (`attn_varlen.cu`, head dim 256;
/// `Qwen35Model::fresh_causal_attention`) instead of the plain path's materialised f32 scores.
/// On by default: the family bench's `kernel_checks` (`attention_varlen:*`, max abs diff
/// 0.016 at head dim 128 and 256) pass and the Qwen3.6-27B shape's 4K prefill went from 0.914 s
/// (0.305 of the matmul rate) to 0.602 s (0.453) (H100, session 24,
/// deploy/bench/results/h100-2026-12-07-s24). `DFLASH_HYBRID_VARLEN_PREFILL=0` or this switch
/// turns it off. Process-wide.
pub fn set_hybrid_varlen_prefill(on: bool) {
    HYBRID_VARLEN_PREFILL.set(on);
}

/// Whether the hybrid prefill takes the varlen kernel ([`set_hybrid_varlen_prefill`]).
pub fn hybrid_varlen_prefill() -> bool {
    HYBRID_VARLEN_PREFILL.get()
}

static HYBRID_DECODE_GRAPHS: switch::EnvSwitch =
    switch::EnvSwitch::new("DFLASH_HYBRID_DECODE_GRAPHS", false);

/// Whether a hybrid target built from now on replays its decode steps from CUDA graphs
/// (`qwen3_5/graph.rs`, `Qwen35Model::forward_decode_graph`; a model's own setting is
/// `with_step_graphs`). Without a call or `DFLASH_HYBRID_DECODE_GRAPHS` (`1` on, `0` off) they
/// are off: for dense hybrids, whose launches are few and long, the replay's state copies cost
/// more than the launches it saves (27B 23.38 ms against 22.99 eager, H100, session 24); for
/// sparse-MoE hybrids (~15 small launches a layer) graphs won only before programmatic
/// dependent launch ([`pdl`], on since session 28: the 12-layer 35B-A3B shape 2.005 ms against
/// 2.15 eager in session 24). With PDL the eager step overlaps each launch's prologue with the
/// previous kernel's tail, and the full Qwen3.6-35B-A3B shape decoded faster eager in 8 of 11
/// paired runs through the engine (`decode_through_engine` against `decode_step_graphs_off`,
/// sessions 29 and 31, 1K context), by 0.13 ms a token on average over the ten H100 runs and
/// by 0.44 ms (4.07 -> 3.63 ms, 0.347 -> 0.389 of the roofline) on the H200
/// (deploy/bench/results/h200-2026-12-07-s29/callO.tar.xz, `o/h35.json`). With PDL off
/// (`DFLASH_PDL=0`) they stay on for sparse-MoE hybrids, as measured then. Process-wide.
pub fn set_hybrid_decode_graphs(on: bool) {
    HYBRID_DECODE_GRAPHS.set(on);
}

/// Whether hybrid decode graphs are on for a model with (`sparse_moe`) or without sparse-MoE
/// layers ([`set_hybrid_decode_graphs`], else `DFLASH_HYBRID_DECODE_GRAPHS`, else `sparse_moe`
/// without [`pdl`]).
pub fn hybrid_decode_graphs(sparse_moe: bool) -> bool {
    #[cfg(feature = "cuda")]
    let pdl_on = pdl();
    #[cfg(not(feature = "cuda"))]
    let pdl_on = false;
    HYBRID_DECODE_GRAPHS.get_or(sparse_moe && !pdl_on)
}

static MOE_GROUPED_GEMM: switch::EnvSwitch =
    switch::EnvSwitch::new("DFLASH_MOE_GROUPED_GEMM", true);

/// Whether a sparse-MoE block of more than 512 rows (prefills) outside CUDA graph capture runs
/// its experts as two cuBLAS grouped GEMMs (moe_grouped.rs: one launch per projection for every
/// used expert, after a copy of the per-expert pair counts to the host) instead of the tiled
/// tensor-core kernels, which re-read an expert's weights per 64 of its pairs. On by default
/// (H100, session 29: a 1,000-row Qwen3-Coder-30B-A3B block 0.90 ms against 1.56, equal to the
/// plain block where the tiles differ by 2.8e-3; 4K prefill 0.146 s against 0.283, the
/// Qwen3.6-35B-A3B's 0.215 against 0.338); `DFLASH_MOE_GROUPED_GEMM=0` or this switch turns it
/// off. Process-wide.
pub fn set_moe_grouped_gemm(on: bool) {
    MOE_GROUPED_GEMM.set(on);
}

/// Whether wide MoE blocks run on grouped GEMMs ([`set_moe_grouped_gemm`]).
pub fn moe_grouped_gemm() -> bool {
    MOE_GROUPED_GEMM.get()
}

static GATTN_SPLIT2: switch::EnvSwitch = switch::EnvSwitch::new("DFLASH_GATTN_SPLIT2", true);

/// Whether the hybrids' gated attention runs its key splits on `gattn_split2` (gattn.cu: lanes
/// over keys for the scores with q staged in shared memory, lanes over dims for the outputs, one
/// online-softmax step per 32 keys) instead of `gattn_split` (a warp-wide sum per key and
/// row: ~540 instructions a key; 45 us for a Qwen3.6-35B-A3B decode step at a 1K context on an
/// H100 with the SMs 11% active, session 27's ncu). Same splits and partials, so the same
/// combine. On by default: `gpu_check --hybrid`'s `fused_attention_layer_vs_plain` passes with
/// it (f32 8.5e-7 / 1.3e-6, bf16 1.4e-2 / 9.9e-3 at 1 / 16 query rows, each wrong case
/// rejected) and the 27B layer's call takes 48.7 / 77.8 us against the first form's 54.2 /
/// 127.3 (H100, session 28, deploy/bench/results/h100-2026-12-07-s28). `DFLASH_GATTN_SPLIT2=0`
/// or this switch turns it off. Process-wide.
pub fn set_gattn_split2(on: bool) {
    GATTN_SPLIT2.set(on);
}

/// Whether the gated attention takes `gattn_split2` ([`set_gattn_split2`]).
pub fn gattn_split2() -> bool {
    GATTN_SPLIT2.get()
}

static STEP_ATTN_ONE: switch::EnvSwitch = switch::EnvSwitch::new("DFLASH_STEP_ATTN_ONE", true);

/// Whether a one-sequence, one-token decode step's attention runs the batched step kernel
/// (`attn_step.cu`: the query heads of a KV head as one tensor-core tile, warp-private cp.async
/// rings, splits over the SMs) instead of `attn_decode.cu`'s general one-launch kernel. On by
/// default since session 27 (H100, deploy/bench/results/h100-2026-12-07-s27): the Qwen3-8B
/// bench's one-launch attention at 1K / 8K context 13.2 / 24.0 us -> 9.9 / 16.9 (its
/// `fused_attention:*device_split*` checks as before: 9.8e-4 from the plain path), decode from
/// graphs 6.06 -> 5.87 ms; the Qwen3-Coder-30B-A3B shape's decode 4.08 -> 3.85 ms (ncu: 25.7 ->
/// 16.2 us a layer); greedy tokens graphs vs eager identical. `DFLASH_STEP_ATTN_ONE=0` or this
/// switch turns it off. Process-wide; a graph keeps the kernel it captured.
pub fn set_step_attn_one(on: bool) {
    STEP_ATTN_ONE.set(on);
}

/// Whether one-sequence decode takes the step kernel ([`set_step_attn_one`]).
pub fn step_attn_one() -> bool {
    STEP_ATTN_ONE.get()
}

/// Most rows the skinny GEMMs (`gemv*`) take (four m16 tiles per warp); wider products go to
/// cuBLAS.
pub const GEMV_MAX_ROWS: usize = 64;

/// Most rows a fused forward sends through the skinny GEMMs by default: one-row decode steps.
/// Measured on the H200 (Qwen3-8B shape, 1K context, CUDA graphs, one call,
/// deploy/bench/results/h200-2026-11-30c/skinny_vs_wide_rows.json): 1 row 4.53 ms skinny
/// against 5.22 on cuBLAS; 2 / 4 / 8 rows 5.16 / 5.32 / 5.63 skinny against 4.96 / 5.01 /
/// 5.21 on cuBLAS with the vectorised residual add + RMSNorm between the products (before
/// that, 8 rows favoured the skinny kernels: 5.8 against 6.2 ms). The 17..64-row kernels lose
/// too: a pooled decode step of 32 / 64 sequences at 640 positions took 10.59 / 18.23 ms on
/// them against 7.48 / 9.04 on cuBLAS (deploy/bench/results/h200-2026-12-03-scale2).
pub const GEMV_DEFAULT_ROWS: usize = 1;

/// Most rows of a cuBLASLt product with its algorithm picked by timing (`lt_gemm.rs`: a
/// batched decode step of up to 64 sequences); wider products (prefill chunks, whose row
/// counts are many) keep cuBLAS's default choice.
pub const TUNED_MAX_ROWS: usize = 64;

/// Most rows a fused forward's wide path sends through the tuned cuBLASLt products by
/// default: none. Measured on the H200 (Qwen3-8B, pooled decode at 640 positions, CUDA graphs,
/// deploy/bench/results/h200-2026-12-03-gemm2): b16 / b32 / b64 6.394 / 7.602 / 8.932 ms tuned
/// against 6.339 / 7.429 / 9.031 on cuBLAS's default; cuBLASLt's first heuristic choice is
/// bit-identical to cuBLAS's (the same kernel), and the best of ~24-39 timed candidates is
/// within 0-3% of it in GPU time (a win only where the residual add is folded in).
pub const TUNED_DEFAULT_ROWS: usize = 0;

/// Most rows a fused forward's wide path sends through the split-K kernels (`splitk.cu`) by
/// default: none. They lose (deploy/bench/results/h200-2026-12-03-gemm2): a b32 decode step
/// at 640 positions took 11.93 ms on them against 7.43 on cuBLAS (1.0-2.1 TB/s per product).
pub const SPLITK_DEFAULT_ROWS: usize = 0;

/// Most rows one routing and expert launch set of the device MoE block takes (`moe.cu`); more
/// rows run as consecutive pieces.
pub const MOE_MAX_ROWS: usize = 64;
/// Most experts and experts per token the MoE routing kernel holds (`moe.cu`'s shared arrays).
pub const MOE_MAX_EXPERTS: usize = 512;
pub const MOE_MAX_TOP_K: usize = 16;

/// Whether the device MoE kernels take a block of `e` experts (top `k`), hidden size `h` and
/// expert width `i`: true for every published Qwen MoE shape (Qwen3-30B-A3B: 128 / 8 / 2048 /
/// 768; Qwen3.5/3.6-35B-A3B: 256 / 8 / 2048 / 512).
pub fn moe_shape_fits(e: usize, h: usize, i: usize, k: usize) -> bool {
    e.is_multiple_of(32)
        && e <= MOE_MAX_EXPERTS
        && (1..=MOE_MAX_TOP_K.min(e)).contains(&k)
        && h.is_multiple_of(256)
        && i.is_multiple_of(256)
        && (256..=1024).contains(&i)
}

/// Longest per-sequence forward the fused path takes in one piece (and the longest CUDA-graph
/// step); longer causal forwards (prefills) run as consecutive pieces.
pub const MAX_FAST_TOKENS: usize = 4096;

/// Default piece length of a fused prefill (see `Qwen3Model::with_prefill_chunk`). Measured on
/// the H200 (Qwen3-8B shape, 4096-token prompt, one-pass prefill attention): pieces of 512 /
/// 1024 / 2048 / 4096 tokens gave 28.1K / 30.6K / 31.7K / 32.3K tok/s (20.0K / 21.6K / 22.1K /
/// 23.1K with the split-K attention).
pub const PREFILL_CHUNK: usize = 4096;

/// Whether the fused kernels can run a model of this device, dtype, head size and mode.
pub fn available(device: &Device, dtype: DType, head_dim: usize, mode: OpsMode) -> bool {
    cfg!(feature = "cuda")
        && device.is_cuda()
        && dtype == DType::BF16
        && head_dim == 128
        && mode == OpsMode::Fused
}

/// The tree pattern as bit rows: bit j of word `i * words + j / 64` is set when new token j is
/// token i itself or one of its ancestors (`words = ceil(t / 64)`), the layout the attention
/// kernel reads. Bits are built from the parent's row, valid because parents precede children.
pub fn tree_bits(parents: &[Option<usize>]) -> Vec<i64> {
    let t = parents.len();
    let words = t.div_ceil(64);
    let mut bits = vec![0u64; t * words];
    for i in 0..t {
        if let Some(p) = parents[i] {
            let (done, rest) = bits.split_at_mut(i * words);
            rest[..words].copy_from_slice(&done[p * words..p * words + words]);
        }
        bits[i * words + i / 64] |= 1u64 << (i % 64);
    }
    bits.into_iter().map(|w| w as i64).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layers::attention::AttnPattern;
    use crate::speculative::tree::DraftTree;

    #[test]
    fn tree_bits_match_the_dense_mask_visibility() {
        // 130 nodes: spans three 64-bit words; parent of i is (i - 1) / 3 (a ternary tree).
        let parents: Vec<Option<usize>> = (0..130)
            .map(|i| if i == 0 { None } else { Some((i - 1) / 3) })
            .collect();
        let t = parents.len();
        let words = t.div_ceil(64);
        let bits = tree_bits(&parents);
        let tokens: Vec<u32> = (0..t as u32).collect();
        let vis = DraftTree::from_parents(tokens, parents.clone())
            .unwrap()
            .visibility();
        let mask = AttnPattern::Tree { parents }
            .mask(0, t, &Device::Cpu)
            .unwrap()
            .unwrap()
            .to_vec2::<f32>()
            .unwrap();
        for i in 0..t {
            for j in 0..t {
                let bit = (bits[i * words + j / 64] as u64 >> (j % 64)) & 1 == 1;
                assert_eq!(bit, vis[i * t + j], "node {i} sees {j} (tree)");
                assert_eq!(bit, mask[i][j] == 0.0, "node {i} sees {j} (mask)");
            }
        }
    }

    #[test]
    fn fused_kernels_are_never_chosen_on_cpu() {
        assert!(!available(&Device::Cpu, DType::BF16, 128, OpsMode::Fused));
    }
}
