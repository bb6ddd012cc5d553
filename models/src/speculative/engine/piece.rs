//! How much of a long prompt a step prefills beside decoding sequences: as many tokens as keep
//! the step's estimated cost within a bound relative to a decode step of the running batch
//! (`Engine::set_mixed_step_budget`), not a fixed count. A fixed count cannot hold a bound: a
//! 256-token piece costs ~6 ms beside 16 decoding streams at the start of a prompt and ~49 ms
//! at 32K positions (H200, Qwen3-8B), because its attention reads every earlier position.
//!
//! **Cost model** (seconds of one target forward, from the model's shape, [`CostShape`]):
//!
//! ```text
//! decode step, R rows (decode or verify), the sequences holding C cached positions in all:
//!     t_dec = L * t_layer + max(W / BW, R * F_row / G) + C * B_kv / BW
//! a prefill piece of n tokens at positions p .. p + n, in the same forward:
//!     t_piece(n, p) = n * F_row / G + (n * p + n * (n + 1) / 2) * F_pair / A
//! plus once per step that carries pieces:  t_mix = L * t_mix_layer
//! ```
//!
//! W: bytes of every linear weight and the LM head (read once per forward); F_row: 2 FLOPs per
//! linear weight a token goes through (the active experts of MoE layers); F_pair: 4 x head_dim x
//! heads FLOPs per (query, key) pair per attention layer (QK^T and PV); B_kv: K/V bytes per
//! cached position; L: layers. Hardware ([`Rates`]): BW bytes/s, G GEMM FLOP/s, A prefill
//! attention FLOP/s, fixed per-layer costs t_layer (a decode step's launches) and t_mix_layer
//! (a mixed step's: the piece's own attention launches, the decode rows run uncaptured). The
//! defaults are fitted to the H200's mixed steps (deploy/bench/results/h200-2026-12-03-scale2,
//! 16 streams + one piece of 64-256 tokens at 8-32K positions: t_mix 2.28 ms, 17.9 us per
//! piece token, 5.08 ms per million pairs; every figure within 0.35 ms).
//!
//! A step's pieces may cost `(budget - 1) * t_dec - t_mix`, i.e. the step at most `budget`
//! decode steps. The first piece gets at least [`MIN_PIECE`] tokens (a prompt always moves);
//! `--prefill-tokens-while-decoding` caps every piece and `--chunked-prefill-size` the step; a
//! piece that does not finish its prompt is cut to whole [`ROW_QUANTUM`]s of the step's rows.
//!
//! **Calibration** ([`Calibration`], `Engine::calibrate_step_costs`; the server turns it on): measured step times scale the estimates, the
//! decode step by the ratio measured / estimated of steps that only decode, the piece terms by
//! that of mixed steps (their time less the decode reference, over `t_mix + t_piece`); both are
//! moving averages, so the model's constants only have to be right in their proportions.

use dflash_common::{HybridConfig, HybridLayerType, Qwen3Config};

use crate::target::{DraftTarget, Target};

/// Fewest tokens the first piece of a step takes, however expensive (or all that is left).
pub const MIN_PIECE: usize = 16;

/// A piece that does not finish its prompt is cut so that the step's rows (decoding rows and
/// every piece) are a multiple of this. The first forward with a new row count costs 7-18 ms
/// more than the next ones with it (the GEMMs' per-shape setup; H200, Qwen3-8B, 16 streams: in
/// h200-2026-12-06-s16-interf every one of the 13-18 steps per 32K prompt that took over 1.4x
/// their estimate had a row count not seen before, and none of ~850 that repeated one did), so
/// a server should see few row counts: with this, at most one per 16 up to the chunk size.
pub const ROW_QUANTUM: usize = 16;

/// `n` cut down so that `rows_before + n` is a multiple of [`ROW_QUANTUM`], unless that leaves
/// fewer than `floor` (at least 1) tokens: then `n`.
pub fn aligned(n: usize, rows_before: usize, floor: usize) -> usize {
    match n.checked_sub((rows_before + n) % ROW_QUANTUM) {
        Some(cut) if cut >= floor.max(1) => cut,
        _ => n,
    }
}

/// The target's shape, as the cost model sees it (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CostShape {
    pub layers: usize,
    /// W: weight bytes one forward reads (linear layers and the LM head).
    pub weight_bytes: f64,
    /// F_row: FLOPs of one token through the linear layers (LM head not included: a piece
    /// needs logits for its last row at most).
    pub row_flops: f64,
    /// F_pair: FLOPs of one (query, key) pair over all attention layers.
    pub pair_flops: f64,
    /// B_kv: K/V bytes of one cached position over all attention layers.
    pub kv_bytes: f64,
}

impl CostShape {
    /// A Qwen3 target, dense or MoE, with weights of `dtype_bytes` bytes.
    pub fn qwen3(cfg: &Qwen3Config, dtype_bytes: usize) -> Self {
        let (h, hd) = (cfg.hidden_size as f64, cfg.head_dim as f64);
        let (nh, nkv) = (
            cfg.num_attention_heads as f64,
            cfg.num_key_value_heads as f64,
        );
        let attn = h * hd * (2.0 * nh + 2.0 * nkv);
        let dense_mlp = 3.0 * h * cfg.intermediate_size as f64;
        let (mut stored, mut active) = (0.0, 0.0);
        for i in 0..cfg.num_hidden_layers {
            let (s, a) = match &cfg.moe {
                Some(m) if m.is_sparse(i) => {
                    let expert = 3.0 * h * m.block.moe_intermediate_size as f64;
                    let shared =
                        3.0 * h * m.block.shared_expert_intermediate_size.unwrap_or(0) as f64;
                    (
                        expert * m.block.num_experts as f64 + shared,
                        expert * m.block.num_experts_per_tok as f64 + shared,
                    )
                }
                _ => (dense_mlp, dense_mlp),
            };
            stored += attn + s;
            active += attn + a;
        }
        // Every Qwen3 layer attends (a sliding window bounds its pairs; not counted).
        let attention_layers = cfg.num_hidden_layers;
        Self::from_parts(
            cfg.num_hidden_layers,
            stored + h * cfg.vocab_size as f64,
            active,
            (attention_layers as f64, nh, nkv, hd),
            dtype_bytes,
        )
    }

    /// A Gated DeltaNet hybrid (its linear-attention layers cost per token, counted with
    /// the rows; only its full-attention layers cost per pair).
    pub fn hybrid(cfg: &HybridConfig, dtype_bytes: usize) -> Self {
        let (h, hd) = (cfg.hidden_size as f64, cfg.head_dim as f64);
        let (nh, nkv) = (
            cfg.num_attention_heads as f64,
            cfg.num_key_value_heads as f64,
        );
        let full = h * hd * (2.0 * nh + 2.0 * nkv);
        let (kd, vd) = (
            cfg.linear_key_head_dim as f64,
            cfg.linear_value_head_dim as f64,
        );
        let (nk, nv) = (
            cfg.linear_num_key_heads as f64,
            cfg.linear_num_value_heads as f64,
        );
        let linear = h * (2.0 * nk * kd + 2.0 * nv * vd + 2.0 * nv) + nv * vd * h;
        let dense_mlp = 3.0 * h * cfg.intermediate_size as f64;
        let (mut stored, mut active, mut attention_layers) = (0.0, 0.0, 0usize);
        for i in 0..cfg.num_hidden_layers {
            let mixer = match cfg.layer_types.get(i) {
                Some(HybridLayerType::LinearAttention) => linear,
                _ => {
                    attention_layers += 1;
                    full
                }
            };
            let (s, a) = match &cfg.moe {
                Some(m) if cfg.sparse_layers.get(i).copied().unwrap_or(false) => {
                    let expert = 3.0 * h * m.moe_intermediate_size as f64;
                    let shared = 3.0 * h * m.shared_expert_intermediate_size.unwrap_or(0) as f64;
                    (
                        expert * m.num_experts as f64 + shared,
                        expert * m.num_experts_per_tok as f64 + shared,
                    )
                }
                _ => (dense_mlp, dense_mlp),
            };
            stored += mixer + s;
            active += mixer + a;
        }
        Self::from_parts(
            cfg.num_hidden_layers,
            stored + h * cfg.vocab_size as f64,
            active,
            (attention_layers as f64, nh, nkv, hd),
            dtype_bytes,
        )
    }

    /// The shape of a loaded target, at its weights' dtype.
    pub fn of(target: &Target) -> Self {
        let bytes = target.dtype().size_in_bytes();
        match target {
            Target::Qwen3(m) => Self::qwen3(m.config(), bytes),
            Target::Hybrid(m) => Self::hybrid(m.config(), bytes),
        }
    }

    fn from_parts(
        layers: usize,
        stored_params: f64,
        active_params: f64,
        (attention_layers, nh, nkv, hd): (f64, f64, f64, f64),
        dtype_bytes: usize,
    ) -> Self {
        Self {
            layers,
            weight_bytes: stored_params * dtype_bytes as f64,
            row_flops: 2.0 * active_params,
            pair_flops: 4.0 * hd * nh * attention_layers,
            kv_bytes: 2.0 * nkv * hd * attention_layers * dtype_bytes as f64,
        }
    }
}

/// Hardware rates of the cost model (module docs); the defaults are an H200's (bf16).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rates {
    /// BW: bytes/s a decode step streams weights and K/V at.
    pub bandwidth: f64,
    /// G: FLOP/s of a piece's rows through the linear layers.
    pub gemm_flops: f64,
    /// A: FLOP/s of a piece's causal attention over its context.
    pub attn_flops: f64,
    /// t_layer: fixed seconds per layer of a decode step.
    pub layer_s: f64,
    /// t_mix_layer: fixed seconds per layer that a step carrying pieces adds.
    pub mix_layer_s: f64,
}

impl Default for Rates {
    /// H200, Qwen3-8B shape (h200-2026-12-03-scale2): the mixed-step fit gives 17.9 us per
    /// piece token (13.9 GFLOP: 776 TFLOP/s), 5.08 ns per pair (590K FLOP: 116 TFLOP/s) and
    /// 2.28 ms per mixed step (36 layers: 63 us); a 16-stream decode step at 640 positions
    /// took 6.42 ms (15.1 GB of weights and 1.5 GB of K/V at 4.0 TB/s leave 60 us per layer).
    fn default() -> Self {
        Self {
            bandwidth: 4.0e12,
            gemm_flops: 7.76e14,
            attn_flops: 1.16e14,
            layer_s: 60e-6,
            mix_layer_s: 63e-6,
        }
    }
}

/// The cost model of one step (module docs).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepCost {
    pub shape: CostShape,
    pub rates: Rates,
}

impl StepCost {
    /// t_dec: a step of `rows` decode or verify rows over `cached` positions in all.
    pub fn decode(&self, rows: usize, cached: usize) -> f64 {
        let (s, r) = (&self.shape, &self.rates);
        let weights = (s.weight_bytes / r.bandwidth).max(rows as f64 * s.row_flops / r.gemm_flops);
        s.layers as f64 * r.layer_s + weights + cached as f64 * s.kv_bytes / r.bandwidth
    }

    /// t_piece: `n` prompt tokens at positions `from..from + n`.
    pub fn piece(&self, n: usize, from: usize) -> f64 {
        let (s, r) = (&self.shape, &self.rates);
        let (n, p) = (n as f64, from as f64);
        let pairs = n * p + n * (n + 1.0) / 2.0;
        n * s.row_flops / r.gemm_flops + pairs * s.pair_flops / r.attn_flops
    }

    /// The most tokens, up to `max`, of a piece at positions `from..` whose cost at `scale`
    /// fits in `left` seconds; at least `floor.min(max)`.
    pub fn piece_within(
        &self,
        scale: f64,
        from: usize,
        max: usize,
        left: f64,
        floor: usize,
    ) -> usize {
        tokens_within(|k| scale * self.piece(k, from), max, left, floor)
    }

    /// t_mix: what carrying any piece adds to a step.
    pub fn mixed_fixed(&self) -> f64 {
        self.shape.layers as f64 * self.rates.mix_layer_s
    }
}

/// Scales of the model's estimates from measured step times (module docs): 1 until measured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Calibration {
    pub decode: f64,
    pub piece: f64,
    decode_seen: bool,
    piece_seen: bool,
}

impl Default for Calibration {
    fn default() -> Self {
        Self {
            decode: 1.0,
            piece: 1.0,
            decode_seen: false,
            piece_seen: false,
        }
    }
}

/// Weight of the newest measurement in the moving averages.
const DECODE_WEIGHT: f64 = 0.1;
const PIECE_WEIGHT: f64 = 0.2;
/// Scales stay within this factor of the model (a scale that far off is a broken clock).
const MAX_SCALE: f64 = 1000.0;
/// Once measured, a step more than this factor off the current scale counts as this factor
/// off: a CUDA-graph capture or a page fault is not the batch's cost.
const MAX_JUMP: f64 = 3.0;

impl Calibration {
    /// A step that only decoded took `measured` seconds; the model said `estimated`.
    pub fn observe_decode(&mut self, measured: f64, estimated: f64) {
        if let Some(x) = ratio(measured, estimated) {
            self.decode = blend(self.decode, x, DECODE_WEIGHT, &mut self.decode_seen);
        }
    }

    /// A step that decoded (the model: `decode` seconds before scaling) and prefilled pieces
    /// (`pieces` seconds with the fixed part, before scaling) took `measured` seconds.
    pub fn observe_mixed(&mut self, measured: f64, decode: f64, pieces: f64) {
        if let Some(x) = ratio(measured - self.decode * decode, pieces) {
            self.piece = blend(self.piece, x, PIECE_WEIGHT, &mut self.piece_seen);
        }
    }
}

fn ratio(measured: f64, estimated: f64) -> Option<f64> {
    (measured.is_finite() && estimated > 0.0 && measured > 0.0)
        .then(|| (measured / estimated).clamp(1.0 / MAX_SCALE, MAX_SCALE))
}

fn blend(old: f64, new: f64, weight: f64, seen: &mut bool) -> f64 {
    if std::mem::replace(seen, true) {
        old + weight * (new.clamp(old / MAX_JUMP, old * MAX_JUMP) - old)
    } else {
        new
    }
}

/// What the engine's last step held, took and was expected to take
/// ([`crate::speculative::Engine::last_step`]), for logs.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepReport {
    /// Sequences that decoded (or verified) and their rows and cached positions at the start.
    pub decode_seqs: usize,
    pub decode_rows: usize,
    pub cached: usize,
    /// (tokens, first position) of each prefill chunk, oldest sequence first.
    pub chunks: Vec<(usize, usize)>,
    /// The chunks rode in the round's forward.
    pub mixed: bool,
    /// Wall time of the step.
    pub seconds: f64,
    /// The calibrated model: a decode step of this batch, and this step.
    pub decode_estimate: f64,
    pub estimate: f64,
}

/// The most tokens, up to `max`, whose cost `cost(n)` (non-decreasing in n) fits in `left`
/// seconds; at least `floor.min(max)` whatever they cost.
pub fn tokens_within(cost: impl Fn(usize) -> f64, max: usize, left: f64, floor: usize) -> usize {
    let floor = floor.min(max);
    if max == 0 || cost(max) <= left {
        return max;
    }
    // cost(hi) > left; find the largest lo with cost(lo) <= left.
    let (mut lo, mut hi) = (0usize, max);
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if cost(mid) <= left {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    lo.max(floor)
}

#[cfg(test)]
mod tests;
