//! The trainer's target forward (`Qwen3Model::forward_taps`: packed sequences, no cache, stops
//! after the deepest tap) against the full forward it replaced (`Qwen3Model::forward`, one
//! fresh cache per sequence, causal), on the CPU in f32 with the demo target tiny-coder-demo.
//! Sequences of different lengths share one call, so a row attending across a sequence
//! boundary, a position not restarting at 0 or a tap taken from the wrong layer shows up as a
//! difference. Tolerance 1e-4 max abs, as for the other parity tests (the same ops on both
//! sides; the GEMMs sum in a different order for a different row count: a one-token sequence
//! alone against packed with 112 others was off by 1.1e-5).

use candle_core::{DType, Device, Tensor};
use dflash_models::{AttnPattern, OpsMode, Qwen3Model, SeqForward};
use dflash_tests::{demo_model, max_abs_diff};

const TOL: f32 = 1e-4;

fn model() -> Qwen3Model {
    Qwen3Model::load(&demo_model(), DType::F32, &Device::Cpu, 256, OpsMode::Fused).unwrap()
}

/// Deterministic token ids below the demo vocabulary (8192).
fn tokens(len: usize, seed: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed * 97)) % 8000 + 5)
        .collect()
}

/// The taps of one sequence through the full forward with a fresh cache.
fn reference(m: &Qwen3Model, toks: &[u32], layers: &[usize]) -> Tensor {
    let mut cache = m.new_cache(toks.len()).unwrap();
    let positions: Vec<u32> = (0..toks.len() as u32).collect();
    m.forward(
        &mut [SeqForward {
            cache: &mut cache,
            tokens: toks,
            positions: &positions,
            pattern: &AttnPattern::Causal,
            logit_rows: &[],
        }],
        layers,
    )
    .unwrap()
    .taps
    .unwrap()
}

fn check(m: &Qwen3Model, reference_model: &Qwen3Model, layers: &[usize]) {
    let seqs = [tokens(5, 1), tokens(70, 2), tokens(1, 3), tokens(37, 4)];
    let refs: Vec<&[u32]> = seqs.iter().map(|s| s.as_slice()).collect();
    let out = m.forward_taps(&refs, layers).unwrap();
    assert_eq!(out.offsets, vec![0, 5, 75, 76, 113]);
    let h = m.config().hidden_size;
    assert_eq!(out.features.dims(), &[113, layers.len() * h]);
    for (s, toks) in seqs.iter().enumerate() {
        let want = reference(reference_model, toks, layers);
        let got = out.features.narrow(0, out.offsets[s], toks.len()).unwrap();
        let d = max_abs_diff(&got, &want);
        assert!(
            d < TOL,
            "taps {layers:?} of sequence {s} ({} tokens) differ by {d}",
            toks.len()
        );
    }
}

#[test]
fn packed_taps_equal_the_full_forwards_taps_per_sequence() {
    let m = model();
    // The trainer's taps (raw outputs of layers 0..=2) on the full model.
    check(&m, &m, &[0, 1, 2]);
    // The last layer's tap is the final-normed output; order and repeats as asked.
    check(&m, &m, &[3, 0, 3]);
}

#[test]
fn a_target_cut_after_the_last_tap_gives_the_full_models_taps() {
    let full = model();
    let cut = model().stop_after_layer(2).unwrap();
    // Layer 2 stays a raw tap on the cut model (it is not the true last layer).
    check(&cut, &full, &[0, 1, 2]);
}

#[test]
fn packed_taps_refuse_layers_past_the_cut_and_empty_input() {
    let cut = model().stop_after_layer(1).unwrap();
    let seq = tokens(4, 1);
    assert!(cut.forward_taps(&[&seq], &[2]).is_err());
    assert!(cut.forward_taps(&[&seq], &[]).is_err());
    assert!(cut.forward_taps(&[&[]], &[0]).is_err());
    assert!(cut.forward_taps(&[&[9000]], &[0]).is_err());
}
