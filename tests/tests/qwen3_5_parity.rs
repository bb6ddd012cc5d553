//! Hybrid target parity against transformers 5.24.0 (torch fallback kernels, eager attention,
//! CPU, float32): `Qwen3_5ForCausalLM` on the random 6-layer fixture in
//! `tests/fixtures/qwen3_5-tiny-random` (layers: GDN, GDN, gated attention, twice), stored in the
//! released multimodal layout (`qwen3_5` + `text_config`, weights under `model.language_model.`),
//! and `Qwen3NextForCausalLM` on `qwen3_next-tiny-random` (three GDN layers, one attention).
//! The MoE fixtures (`make_qwen3_5_moe_parity.py`): `Qwen3_5MoeForCausalLM` on
//! `qwen3_5_moe-tiny-random` (every layer sparse: 8 experts, top-2 renormalised, shared expert;
//! 3D fused expert tensors) and `Qwen3NextForCausalLM` on `qwen3_next-moe-tiny-random` (4 experts,
//! top-2 not renormalised, layer 1 dense via `mlp_only_layers`; one tensor per expert). Their
//! router gaps between the 2nd and 3rd expert are > 1e-4, so f32 noise cannot change a choice,
//! while a wrong routing (softmax before/after top-k, renormalisation, shared gate) moves the
//! outputs by far more than the tolerance.
//!
//! Tolerance 1e-4 max abs on logits of std ~1 and taps of std ~1.8: transformers' own prefill,
//! decode and two-chunk paths agree with each other to 1.6e-5, while a wrong op (a missing
//! `1 + w`, the conv tap order, head grouping, the decay sign) moves values by 1e-1 or more.

use candle_core::{DType, Device, Tensor};
use dflash_models::qwen3_5::DeltaForm;
use dflash_models::{AttnPattern, OpsMode, Qwen35Model, SeqForward};
use dflash_tests::{fixture, ids, load_expected, max_abs_diff};

const TOL: f32 = 1e-4;
/// The Qwen3.5 fixture (split projections, nested config, `model.language_model.`) and the
/// Qwen3-Next one (fused group-interleaved `in_proj_qkvz`/`in_proj_ba`, flat config, three value
/// heads per key head, value dim 8 != key dim 16; dense MLPs via `mlp_only_layers`).
const FIXTURES: [&str; 4] = [
    "qwen3_5-tiny-random",
    "qwen3_next-tiny-random",
    "qwen3_5_moe-tiny-random",
    "qwen3_next-moe-tiny-random",
];

fn model(name: &str, form: DeltaForm) -> Qwen35Model {
    Qwen35Model::load(
        &fixture(name),
        DType::F32,
        &Device::Cpu,
        128,
        OpsMode::Fused,
    )
    .unwrap()
    .with_delta_form(form)
}

fn run(
    m: &Qwen35Model,
    cache: &mut dflash_models::SequenceCache,
    tokens: &[u32],
) -> (Tensor, Tensor) {
    // Every layer but the last, whose tap is the final-normed output (tap_parity.rs checks it
    // against transformers' hidden_states); the fixture's taps are raw layer outputs.
    let all_layers: Vec<usize> = (0..m.config().num_hidden_layers - 1).collect();
    let start = cache.len() as u32;
    let positions: Vec<u32> = (start..start + tokens.len() as u32).collect();
    let rows: Vec<usize> = (0..tokens.len()).collect();
    let out = m
        .forward(
            &mut [SeqForward {
                cache,
                tokens,
                positions: &positions,
                pattern: &AttnPattern::Causal,
                logit_rows: &rows,
            }],
            &all_layers,
        )
        .unwrap();
    (out.logits.unwrap(), out.taps.unwrap())
}

/// `[L, T, H]` reference raw layer outputs against our `[T, (L - 1) * H]`.
fn check_taps(ours: &Tensor, theirs: &Tensor, what: &str) {
    let h = theirs.dim(2).unwrap();
    for l in 0..theirs.dim(0).unwrap() - 1 {
        let d = max_abs_diff(&ours.narrow(1, l * h, h).unwrap(), &theirs.get(l).unwrap());
        assert!(d < TOL, "{what}: tap of layer {l} differs by {d}");
    }
}

#[test]
fn prefill_logits_and_taps_match_transformers_in_both_delta_rule_forms() {
    for name in FIXTURES {
        let exp = load_expected(name);
        let tokens = ids(&exp["tokens"]);
        // 80 tokens: two 64-token chunks, the second padded.
        for form in [DeltaForm::Chunked, DeltaForm::Recurrent] {
            let m = model(name, form);
            let mut cache = m.new_cache(128).unwrap();
            let (logits, taps) = run(&m, &mut cache, &tokens);
            let d = max_abs_diff(&logits, &exp["prefill_logits"]);
            assert!(d < TOL, "{name} {form:?}: prefill logits differ by {d}");
            check_taps(
                &taps,
                &exp["prefill_taps"],
                &format!("{name} {form:?} prefill"),
            );
        }
    }
}

#[test]
fn token_by_token_decode_matches_transformers() {
    for name in FIXTURES {
        let exp = load_expected(name);
        let tokens = ids(&exp["tokens"]);
        let m = model(name, DeltaForm::Auto);
        let mut cache = m.new_cache(128).unwrap();
        run(&m, &mut cache, &tokens[..5]);
        let (mut logits, mut taps) = (Vec::new(), Vec::new());
        for i in 5..17 {
            let (l, t) = run(&m, &mut cache, &tokens[i..i + 1]);
            logits.push(l);
            taps.push(t);
        }
        let d = max_abs_diff(&Tensor::cat(&logits, 0).unwrap(), &exp["decode_logits"]);
        assert!(d < TOL, "{name}: decode logits differ by {d}");
        let ours = Tensor::cat(&taps, 0).unwrap();
        check_taps(&ours, &exp["decode_taps"], &format!("{name} decode"));
    }
}

#[test]
fn chunked_prefill_continued_from_the_cache_matches_transformers() {
    for name in FIXTURES {
        let exp = load_expected(name);
        let tokens = ids(&exp["tokens"]);
        for form in [DeltaForm::Chunked, DeltaForm::Recurrent] {
            let m = model(name, form);
            let mut cache = m.new_cache(128).unwrap();
            run(&m, &mut cache, &tokens[..40]);
            let (logits, _) = run(&m, &mut cache, &tokens[40..]);
            let d = max_abs_diff(&logits, &exp["chunk2_logits"]);
            assert!(
                d < TOL,
                "{name} {form:?}: second chunk's logits differ by {d}"
            );
        }
    }
}
