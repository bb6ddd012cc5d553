//! Qwen3 target parity against transformers 4.57.1 (`Qwen3ForCausalLM`, eager attention, CPU,
//! float32) on the random 2-layer fixture in `tests/fixtures/qwen3-tiny-random`.
//!
//! Tolerance 1e-4 max abs: both sides compute in f32; the fixture's own independent torch
//! re-derivation agrees to 1.5e-6, so 1e-4 leaves room for summation order only, while any wrong
//! op (norm placement, RoPE layout, GQA grouping) moves values by 1e-1 or more.

use candle_core::{DType, Device};
use dflash_models::{AttnPattern, OpsMode, Qwen3Model, SeqForward};
use dflash_tests::{fixture, ids, load_expected, max_abs_diff};

const TOL: f32 = 1e-4;

fn model() -> Qwen3Model {
    Qwen3Model::load(
        &fixture("qwen3-tiny-random"),
        DType::F32,
        &Device::Cpu,
        64,
        OpsMode::Fused,
    )
    .unwrap()
}

#[test]
fn qwen3_logits_and_taps_match_transformers_f32() {
    let m = model();
    let exp = load_expected("qwen3-tiny-random");
    let tokens = ids(&exp["input_ids"]);
    let positions: Vec<u32> = (0..tokens.len() as u32).collect();
    let rows: Vec<usize> = (0..tokens.len()).collect();
    let mut cache = m.new_cache(64).unwrap();
    let out = m
        .forward(
            &mut [SeqForward {
                cache: &mut cache,
                tokens: &tokens,
                positions: &positions,
                pattern: &AttnPattern::Causal,
                logit_rows: &rows,
            }],
            &[0, 1],
        )
        .unwrap();
    let logits = out.logits.unwrap();
    let d = max_abs_diff(&logits, &exp["logits"].squeeze(0).unwrap());
    assert!(d < TOL, "logits differ by {d}");
    let taps = out.taps.unwrap();
    let h = m.config().hidden_size;
    // Layer 0's tap is its raw output; layer 1's (the last) is HF's hidden_states[2], the
    // final-normed output (dflash_models::taps), not the raw layer_outputs[1].
    let d = max_abs_diff(
        &taps.narrow(1, 0, h).unwrap(),
        &exp["layer_outputs"].get(0).unwrap().squeeze(0).unwrap(),
    );
    assert!(d < TOL, "tap of layer 0 differs from its raw output by {d}");
    let hs = &exp["hidden_states"];
    for l in 0..2 {
        let d = max_abs_diff(
            &taps.narrow(1, l * h, h).unwrap(),
            &hs.get(l + 1).unwrap().squeeze(0).unwrap(),
        );
        assert!(
            d < TOL,
            "tap of layer {l} differs from hidden_states[{}] by {d}",
            l + 1
        );
    }
    let d = max_abs_diff(
        &m.embed(&tokens).unwrap(),
        &hs.get(0).unwrap().squeeze(0).unwrap(),
    );
    assert!(d < TOL, "embeddings differ by {d}");
    assert_eq!(cache.len(), tokens.len());
}

#[test]
fn qwen3_rope_tables_match_transformers() {
    let m = model();
    let exp = load_expected("qwen3-tiny-random");
    let (cos, sin) = m.rope().full_tables(12).unwrap();
    assert!(max_abs_diff(&cos, &exp["rope_cos"]) < 1e-6);
    assert!(max_abs_diff(&sin, &exp["rope_sin"]) < 1e-6);
}

/// Prefill 5 tokens, then one token per forward: every row's logits equal the one-shot ones.
#[test]
fn qwen3_cached_decode_matches_transformers_logits() {
    let m = model();
    let exp = load_expected("qwen3-tiny-random");
    let tokens = ids(&exp["input_ids"]);
    let full = exp["logits"].squeeze(0).unwrap();
    let mut cache = m.new_cache(64).unwrap();
    let pos: Vec<u32> = (0..5).collect();
    let out = m
        .forward(
            &mut [SeqForward {
                cache: &mut cache,
                tokens: &tokens[..5],
                positions: &pos,
                pattern: &AttnPattern::Causal,
                logit_rows: &[4],
            }],
            &[],
        )
        .unwrap();
    assert!(max_abs_diff(&out.logits.unwrap(), &full.narrow(0, 4, 1).unwrap()) < TOL);
    for i in 5..tokens.len() {
        let out = m
            .forward(
                &mut [SeqForward {
                    cache: &mut cache,
                    tokens: &tokens[i..i + 1],
                    positions: &[i as u32],
                    pattern: &AttnPattern::Causal,
                    logit_rows: &[0],
                }],
                &[],
            )
            .unwrap();
        let d = max_abs_diff(&out.logits.unwrap(), &full.narrow(0, i, 1).unwrap());
        assert!(d < TOL, "position {i}: {d}");
    }
}

/// Two sequences of different lengths in one forward give the same logits as each alone.
#[test]
fn qwen3_batched_forward_matches_single_sequences() {
    let m = model();
    let exp = load_expected("qwen3-tiny-random");
    let tokens = ids(&exp["input_ids"]);
    let full = exp["logits"].squeeze(0).unwrap();
    let (mut c1, mut c2) = (m.new_cache(64).unwrap(), m.new_cache(64).unwrap());
    let p12: Vec<u32> = (0..12).collect();
    let p7: Vec<u32> = (0..7).collect();
    let rows12: Vec<usize> = (0..12).collect();
    let out = m
        .forward(
            &mut [
                SeqForward {
                    cache: &mut c1,
                    tokens: &tokens,
                    positions: &p12,
                    pattern: &AttnPattern::Causal,
                    logit_rows: &rows12,
                },
                SeqForward {
                    cache: &mut c2,
                    tokens: &tokens[..7],
                    positions: &p7,
                    pattern: &AttnPattern::Causal,
                    logit_rows: &[6],
                },
            ],
            &[],
        )
        .unwrap();
    let logits = out.logits.unwrap();
    assert_eq!(out.logit_offsets, vec![0, 12, 13]);
    assert!(max_abs_diff(&logits.narrow(0, 0, 12).unwrap(), &full) < TOL);
    assert!(
        max_abs_diff(
            &logits.narrow(0, 12, 1).unwrap(),
            &full.narrow(0, 6, 1).unwrap()
        ) < TOL
    );
}
