//! Target taps against transformers' `output_hidden_states` (transformers 5.24.0, torch 2.15.0,
//! CPU, float32, eager attention, torch kernels): a tap on layer i is `hidden_states[i + 1]`,
//! so the last layer's is the output after the final norm (`dflash_models::taps`). Covered for
//! every family: Qwen3 (`qwen3-tiny-random` and the demo target tiny-coder-demo, whose demo
//! drafter is served from these taps), the Qwen3.5 and Qwen3-Next hybrids, dense and MoE. The
//! fixtures are `tests/fixtures/hidden-states/*.safetensors`, made by
//! `tests/fixtures/scripts/make_hidden_states.py` from the models' own files.
//!
//! Each test taps every layer in reverse order (the order of the concatenation and the one
//! normed slot are both checked), over one forward and over a forward continued from a cache
//! (the rows a decode or verify step taps). Tolerance 1e-4 max abs, as for the other parity
//! tests (f32 on both sides; transformers' own continued and one-shot forwards agree to 3e-5),
//! while a raw last-layer tap instead of the normed one is off by 2.2 to 38.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use dflash_models::{AttnPattern, DraftTarget, OpsMode, SeqForward, Target};
use dflash_tests::{demo_model, fixture, ids, max_abs_diff};

const TOL: f32 = 1e-4;

fn golden(name: &str) -> HashMap<String, Tensor> {
    let path = fixture("hidden-states").join(format!("{name}.safetensors"));
    candle_core::safetensors::load(&path, &Device::Cpu)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The taps of `tokens[start..]` at their absolute positions, every layer from last to first.
fn taps(
    m: &Target,
    cache: &mut dflash_models::SequenceCache,
    tokens: &[u32],
    start: usize,
) -> Tensor {
    let layers: Vec<usize> = (0..m.num_layers()).rev().collect();
    let new = &tokens[start..];
    let positions: Vec<u32> = (start as u32..tokens.len() as u32).collect();
    m.forward(
        &mut [SeqForward {
            cache,
            tokens: new,
            positions: &positions,
            pattern: &AttnPattern::Causal,
            logit_rows: &[],
        }],
        &layers,
    )
    .unwrap()
    .taps
    .unwrap()
}

/// Our `[T, L * H]` (layers last to first) against transformers' `[L + 1, T, H]`.
fn check(ours: &Tensor, hidden_states: &Tensor, what: &str) {
    let l = hidden_states.dim(0).unwrap() - 1;
    let h = hidden_states.dim(2).unwrap();
    for (slot, layer) in (0..l).rev().enumerate() {
        let d = max_abs_diff(
            &ours.narrow(1, slot * h, h).unwrap(),
            &hidden_states.get(layer + 1).unwrap(),
        );
        let kind = if layer + 1 == l {
            "final-normed"
        } else {
            "raw"
        };
        assert!(
            d < TOL,
            "{what}: tap of layer {layer} ({kind}) differs from hidden_states[{}] by {d}",
            layer + 1
        );
    }
}

fn taps_match_transformers(name: &str, dir: &std::path::Path) {
    let m = Target::load(dir, DType::F32, &Device::Cpu, 256, OpsMode::Fused).unwrap();
    let exp = golden(name);
    let tokens = ids(&exp["tokens"]);
    let hs = &exp["hidden_states"];
    assert_eq!(hs.dim(0).unwrap(), m.num_layers() + 1);
    assert!(
        dflash_models::tap_is_final_normed(m.num_layers() - 1, m.num_layers()),
        "the last layer's tap is the normed one"
    );

    let mut cache = m.new_cache(256, tokens.len()).unwrap();
    check(
        &taps(&m, &mut cache, &tokens, 0),
        hs,
        &format!("{name} one forward"),
    );

    let c = tokens.len() / 2;
    let mut cache = m.new_cache(256, tokens.len()).unwrap();
    taps(&m, &mut cache, &tokens[..c], 0);
    check(
        &taps(&m, &mut cache, &tokens, c),
        &exp["continued_hidden_states"],
        &format!("{name} continued from a cache of {c}"),
    );
}

#[test]
fn qwen3_taps_on_every_layer_match_transformers_hidden_states() {
    taps_match_transformers("qwen3-tiny-random", &fixture("qwen3-tiny-random"));
}

#[test]
fn demo_target_taps_on_every_layer_match_transformers_hidden_states() {
    taps_match_transformers("tiny-coder-demo", &demo_model());
}

#[test]
fn qwen3_5_taps_on_every_layer_match_transformers_hidden_states() {
    taps_match_transformers("qwen3_5-tiny-random", &fixture("qwen3_5-tiny-random"));
}

#[test]
fn qwen3_next_taps_on_every_layer_match_transformers_hidden_states() {
    taps_match_transformers("qwen3_next-tiny-random", &fixture("qwen3_next-tiny-random"));
}

#[test]
fn qwen3_5_moe_taps_on_every_layer_match_transformers_hidden_states() {
    taps_match_transformers(
        "qwen3_5_moe-tiny-random",
        &fixture("qwen3_5_moe-tiny-random"),
    );
}

#[test]
fn qwen3_next_moe_taps_on_every_layer_match_transformers_hidden_states() {
    taps_match_transformers(
        "qwen3_next-moe-tiny-random",
        &fixture("qwen3_next-moe-tiny-random"),
    );
}
