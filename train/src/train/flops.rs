//! Model FLOPs of a training step, for model FLOP utilisation (MFU = model FLOPs / (time x
//! peak)). Counted from the shapes, not from the kernels run: the useful matmul work, as
//! in PaLM's MFU. A multiply-add is 2 FLOPs.
//!
//! Target (frozen, forward only), per sequence of `S` tokens, summed over its `L` layers:
//! `2 S P_layer + 4 S(S+1)/2 n_h d_h` — `P_layer` the layer's linear weights (q, k, v, o,
//! gate, up, down), the second term causal attention (QK^T and PV over the `S(S+1)/2` visible
//! pairs). No LM head: the trainer only needs tapped hidden states.
//!
//! Drafter, per sequence with `N` anchors `a_i`, block `B`, `R` supervised label rows:
//! - forward: `fc` `2 S (T h) h`; per layer the context K/V projections `2 S h (2 n_kv d_h)`,
//!   the block rows' linear weights `2 N B P_layer`, attention over the visible keys
//!   `4 n_h d_h B (a_i + B)` summed over anchors; the LM head `2 R h V`.
//! - backward: 2x forward for trainable weights and attention (input and weight gradients),
//!   1x for `fc` (its input, the target features, needs no gradient) and 1x for the frozen LM
//!   head (input gradient only).
//!
//! So drafter = `3 (layers + context K/V + attention) + 2 fc + 2 head`, the refinement of the
//! usual `6 x params x tokens`.

use dflash_common::{DFlashConfig, Qwen3Config};

/// Linear weights of one decoder layer (q, k, v, o, gate, up, down).
pub fn layer_linear_params(c: &Qwen3Config) -> f64 {
    let (h, q, kv) = (
        c.hidden_size as f64,
        (c.num_attention_heads * c.head_dim) as f64,
        (c.num_key_value_heads * c.head_dim) as f64,
    );
    h * (q + 2.0 * kv) + q * h + 3.0 * h * c.intermediate_size as f64
}

/// Forward FLOPs of the target over one sequence of `s` tokens.
pub fn target_forward(c: &Qwen3Config, s: usize) -> f64 {
    let s = s as f64;
    let attn = 4.0 * s * (s + 1.0) / 2.0 * (c.num_attention_heads * c.head_dim) as f64;
    c.num_hidden_layers as f64 * (2.0 * s * layer_linear_params(c) + attn)
}

/// Forward + backward FLOPs of the drafter for one sequence of `s` tokens with `anchors`
/// and `label_rows` supervised slots.
pub fn drafter_step(cfg: &DFlashConfig, s: usize, anchors: &[usize], label_rows: usize) -> f64 {
    let c = &cfg.layers;
    let (h, b) = (c.hidden_size as f64, cfg.block_size as f64);
    let sf = s as f64;
    let taps = cfg.target_layer_ids.len() as f64;
    let fc = 2.0 * sf * taps * h * h;
    let ctx_kv = 2.0 * sf * h * 2.0 * (c.num_key_value_heads * c.head_dim) as f64;
    let block_rows = anchors.len() as f64 * b;
    let linear = 2.0 * block_rows * layer_linear_params(c);
    let qd = (c.num_attention_heads * c.head_dim) as f64;
    let attn: f64 = anchors.iter().map(|&a| 4.0 * qd * b * (a as f64 + b)).sum();
    let layers = c.num_hidden_layers as f64 * (ctx_kv + linear + attn);
    let head = 2.0 * label_rows as f64 * h * c.vocab_size as f64;
    3.0 * layers + 2.0 * fc + 2.0 * head
}

/// H200 SXM bf16 dense peak from the data sheet (989.4 TFLOP/s; ~770 is what a large GEMM
/// reaches in practice, see shared/GPU.md).
pub const H200_BF16_PEAK_TFLOPS: f64 = 989.0;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qwen3_8b_layer_count_and_forward_match_hand_numbers() {
        let c = crate::train::target::published_config("qwen3-8b").unwrap();
        // 36 layers x 192.9M linear weights = 6.95B (the 8.19B total adds embeddings and head).
        let p = layer_linear_params(&c) * c.num_hidden_layers as f64;
        assert!((p - 6.946e9).abs() < 0.001e9, "{p}");
        // 2 x params x tokens plus attention.
        let f = target_forward(&c, 1000);
        let expect = 2.0 * p * 1000.0 + 36.0 * 4.0 * 1000.0 * 1001.0 / 2.0 * 4096.0;
        assert!((f - expect).abs() / expect < 1e-12);
    }

    #[test]
    fn drafter_count_is_three_times_forward_plus_frozen_parts() {
        let t = crate::train::target::published_config("tiny").unwrap();
        let cfg = DFlashConfig::for_target(&t, 1, 4, 0, Some(vec![1]));
        let (h, v) = (64.0, 512.0);
        // One anchor at 0: no context attention, only the block's own 4 keys.
        let f = drafter_step(&cfg, 10, &[0], 3);
        let linear = 2.0 * 4.0 * layer_linear_params(&cfg.layers);
        let ctx_kv = 2.0 * 10.0 * h * 2.0 * 32.0;
        let attn = 4.0 * 64.0 * 4.0 * 4.0;
        let expect =
            3.0 * (linear + ctx_kv + attn) + 2.0 * (2.0 * 10.0 * h * h) + 2.0 * (2.0 * 3.0 * h * v);
        assert!((f - expect).abs() < 1e-6, "{f} vs {expect}");
    }
}
