//! The hybrid (Qwen3.5/3.6) verify and commit forms and the MoE row gather: process-wide
//! switches, each on by default since a GPU checked and timed it (session 31, call L1 on an
//! H100: `deploy/bench/results/h100-2026-12-07-s31/`), each with its environment variable to
//! turn it off.

use super::switch::EnvSwitch;

static MOE_GATHER_KERNEL: EnvSwitch = EnvSwitch::new("DFLASH_MOE_GATHER_KERNEL", true);

/// Whether the grouped MoE path gathers its per-pair input rows with `moe_gather_rows` (16-byte
/// copies) instead of candle's `index_select`, which took 24 ms of a Qwen3-Coder-30B-A3B 4K
/// prefill's 143 on an H200 (session 29, call Z). Equal bit for bit (`gpu_check --moe`'s
/// `expert_paths`); the Coder's 4K prefill 0.146 -> 0.128 s, its gather 25.3 -> 4.7 ms (H100,
/// session 31). `DFLASH_MOE_GATHER_KERNEL=0` or this switch turns it off.
pub fn set_moe_gather_kernel(on: bool) {
    MOE_GATHER_KERNEL.set(on);
}

/// Whether the grouped MoE path gathers rows with its own kernel ([`set_moe_gather_kernel`]).
pub fn moe_gather_kernel() -> bool {
    MOE_GATHER_KERNEL.get()
}

static HYBRID_VERIFY_LT: EnvSwitch = EnvSwitch::new("DFLASH_HYBRID_VERIFY_LT", true);

/// The fewest weight elements a verify product takes cuBLASLt for ([`hybrid_lt_product`]):
/// above the 8.4M of the Qwen3.6-35B-A3B's out-projections (its chain-16 verify lost 1.4 ms with
/// them on cuBLASLt) and Qwen3-8B's 16.8M o-projection (the skinny GEMM wins there at 16 rows,
/// `h200-2026-12-03-gemm2`), below the 31.5M of the 27B's out-projections (won).
pub const HYBRID_LT_MIN_WEIGHT: usize = 24_000_000;

/// Whether a hybrid's verify forwards run their larger unnormed products on cuBLASLt (its
/// heuristic choice) instead of the skinny tensor-core GEMMs: in the fused chain forward of
/// 2..=16 rows the o-projections with the residual folded in as beta = 1, the dense MLP's
/// gate/up then `silu_mul` then down with the residual, the LM head; in the plain path (trees)
/// the dense MLP instead of candle's products, SiLU, product and add; each only where its
/// weight holds at least [`HYBRID_LT_MIN_WEIGHT`] elements. The normed products (GDN
/// in-projection, attention q|gate|k|v) stay on the skinny kernels, which fold the RMSNorm in:
/// on cuBLASLt they lost (27B chain-16, H100: in-projection 3.39 -> 3.68 ms, q|gate|k|v 1.04 ->
/// 1.07) where the others won (MLP 14.98 -> 13.49, GDN out 1.83 -> 1.37, attention out 0.62 ->
/// 0.51; e2e chain 4.40x -> 4.60x plain). `DFLASH_HYBRID_VERIFY_LT=0` or this switch turns it
/// off (every verify product on the skinny kernels).
pub fn set_hybrid_verify_lt(on: bool) {
    HYBRID_VERIFY_LT.set(on);
}

/// Whether the hybrid verify takes cuBLASLt products where they pay ([`set_hybrid_verify_lt`]).
pub fn hybrid_verify_lt() -> bool {
    HYBRID_VERIFY_LT.get()
}

/// Whether a hybrid verify of `rows` rows (2..=16: a chain; the fused tree forward takes
/// cuBLASLt past 16 itself) runs its unnormed product with a weight of `weight_elems` elements on
/// cuBLASLt ([`set_hybrid_verify_lt`]).
pub fn hybrid_lt_product(rows: usize, weight_elems: usize) -> bool {
    rows > 1 && weight_elems >= HYBRID_LT_MIN_WEIGHT && hybrid_verify_lt()
}

static HYBRID_FUSED_TREE: EnvSwitch = EnvSwitch::new("DFLASH_HYBRID_FUSED_TREE", true);

/// The most nodes a verify tree takes the fused forward with ([`set_hybrid_fused_tree`]): at 64
/// nodes its gated attention (262 us a layer) lost to the plain path's (134), the 27B's tree
/// 1.59x -> 1.61x a decode step (H100); at 16 (DDTree-16) the fused forward won (35B-A3B verify
/// 20.2 -> 16.6 ms a round, its e2e 1.24x -> 1.48x plain).
pub const HYBRID_FUSED_TREE_MAX_NODES: usize = 32;

/// Whether a hybrid's verify tree (one sequence, up to [`HYBRID_FUSED_TREE_MAX_NODES`] nodes,
/// depth the GDN tree kernels take) runs the fused forward (`qwen3_5/cuda.rs`) instead of the
/// plain path's candle ops: the norms, residual adds and SiLU gate fused around cuBLASLt
/// products, the GDN tree kernels as on the plain path, the gated attention on gattn.cu with the
/// tree's ancestor bits (`gpu_check --hybrid`'s `fused_attention_layer_vs_plain.*_tree64`).
/// `DFLASH_HYBRID_FUSED_TREE=0` or this switch turns it off.
pub fn set_hybrid_fused_tree(on: bool) {
    HYBRID_FUSED_TREE.set(on);
}

/// Whether hybrid verify trees take the fused forward ([`set_hybrid_fused_tree`]).
pub fn hybrid_fused_tree() -> bool {
    HYBRID_FUSED_TREE.get()
}

static BATCHED_GDN_SETTLE: EnvSwitch = EnvSwitch::new("DFLASH_BATCHED_GDN_SETTLE", true);

/// Whether a hybrid cache's commit settles every GDN layer on the accepted path in two launches
/// (`gdn_settle_layers`: all layers' states, then all conv windows) where each layer's path is
/// staged inputs of one forward (a `SplitInputs` verify, chain or tree), instead of a state
/// rebuild and a window copy per layer. Bit for bit the per-layer result (`gpu_check
/// --hybrid`'s `verify_lt.batched_settle`); the 27B's verify + commit 26.15 -> 26.03 ms
/// (chain-16), 35.28 -> 34.49 (64-node tree), the 35B-A3B's DDTree-16 commit 1.40 -> 0.96 ms a
/// round (H100). `DFLASH_BATCHED_GDN_SETTLE=0` or this switch turns it off.
pub fn set_batched_gdn_settle(on: bool) {
    BATCHED_GDN_SETTLE.set(on);
}

/// Whether commits settle the GDN layers in one batch ([`set_batched_gdn_settle`]).
pub fn batched_gdn_settle() -> bool {
    BATCHED_GDN_SETTLE.get()
}

static GDN_TREE_CHUNKED: EnvSwitch = EnvSwitch::new("DFLASH_GDN_TREE_CHUNKED", true);

/// The fewest nodes a verify tree takes the chunked GDN form with ([`set_gdn_tree_chunked`]):
/// its cost is one 64-row chunk whatever the tree (a 27B layer call 0.083-0.091 ms), the
/// depth-first walk's grows with the nodes (0.062 ms at 16, 0.137 at 64; H100, session 31), so
/// DDTree-16 stays on the walk (its 27B verify 24.7 ms a round on it, 26.1 chunked) and trees
/// past the fused tree forward's 32 nodes take the chunked form.
pub const GDN_TREE_CHUNKED_MIN_NODES: usize = 33;

/// Whether a hybrid's verify tree of [`GDN_TREE_CHUNKED_MIN_NODES`]..=64 nodes runs its GDN
/// layers' delta rule in the chunked form with the ancestor mask (`gdn_tree_chunked`: the
/// prefill's two tensor-core kernels on one chunk, any depth) instead of `gdn_scan_tree`'s walk
/// of one node after another. Within the check's tolerance of the plain tree form like the walk
/// (`gpu_check --hybrid`'s `gdn_layer_paths.gdn_tree_64_chunked`: y rel 9.6e-3, writes 5.1e-3,
/// the deepest path's rebuilt state 6.6e-3, the tree read as a star rejected); the 27B's
/// 64-node trees 1.513x / 1.547x -> **1.465x / 1.472x** a decode step (GDN mix 5.0 / 5.6 ->
/// 4.2 ms; H100, session 31, call L2). `DFLASH_GDN_TREE_CHUNKED=0` or this switch turns it off.
pub fn set_gdn_tree_chunked(on: bool) {
    GDN_TREE_CHUNKED.set(on);
}

/// Whether verify trees of [`GDN_TREE_CHUNKED_MIN_NODES`] nodes or more take the chunked GDN
/// form ([`set_gdn_tree_chunked`]).
pub fn gdn_tree_chunked_on() -> bool {
    GDN_TREE_CHUNKED.get()
}
