//! The taps-only target ([`Qwen3Model::stop_after_layer`]) against the whole model.

use crate::batch::SeqForward;
use crate::layers::attention::AttnPattern;
use crate::speculative::tiny_test_target;

fn taps_of(model: &crate::Qwen3Model, tokens: &[u32], taps: &[usize]) -> Vec<Vec<f32>> {
    let mut cache = model.new_cache(tokens.len()).unwrap();
    let positions: Vec<u32> = (0..tokens.len() as u32).collect();
    let mut batch = [SeqForward {
        cache: &mut cache,
        tokens,
        positions: &positions,
        pattern: &AttnPattern::Causal,
        logit_rows: &[],
    }];
    let out = model.forward(&mut batch, taps).unwrap();
    out.taps.unwrap().to_vec2::<f32>().unwrap()
}

#[test]
fn a_target_cut_after_its_deepest_tap_gives_the_same_taps() {
    let full = tiny_test_target(32, 7);
    let cut = tiny_test_target(32, 7).stop_after_layer(0).unwrap();
    let tokens: Vec<u32> = (0..11).map(|i| (i * 5 + 3) % 64).collect();
    // Layer 0 of a 2-layer model is a raw tap in both (the cut model is not "its last layer").
    assert_eq!(
        taps_of(&full, &tokens, &[0, 0]),
        taps_of(&cut, &tokens, &[0, 0])
    );
    assert_eq!(cut.new_cache(4).unwrap().num_layers(), 1);
}

#[test]
fn a_cut_target_refuses_logits_and_deeper_taps() {
    let cut = tiny_test_target(32, 7).stop_after_layer(0).unwrap();
    let tokens = [1u32, 2, 3];
    let positions = [0u32, 1, 2];
    let mut cache = cut.new_cache(3).unwrap();
    let mut batch = [SeqForward {
        cache: &mut cache,
        tokens: &tokens,
        positions: &positions,
        pattern: &AttnPattern::Causal,
        logit_rows: &[2],
    }];
    let e = cut.forward(&mut batch, &[]).unwrap_err().to_string();
    assert!(e.contains("no logits"), "{e}");
    batch[0].logit_rows = &[];
    assert!(cut.forward(&mut batch, &[1]).is_err());
    assert!(tiny_test_target(32, 7).stop_after_layer(2).is_err());
}
