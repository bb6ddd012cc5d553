//! The engine sizes each sequence's caches by its request (rounded up), not by the context.

use super::*;
use crate::speculative::sampling::SamplingParams;

fn engine(max_context: usize) -> Engine {
    Engine::new(
        crate::speculative::tiny_test_target(max_context + 64, 3),
        None,
        EngineConfig {
            max_context,
            max_ddtree_budget: 0,
            eos_token_ids: vec![],
            seed: 0,
        },
    )
}

fn request(prompt: usize, max_new_tokens: usize) -> GenerationRequest {
    GenerationRequest {
        prompt: (0..prompt).map(|i| (i % 60) as u32 + 1).collect(),
        max_new_tokens,
        sampling: SamplingParams::default(),
        stop_token_ids: vec![],
        ignore_eos: true,
        algorithm: Algorithm::Plain,
    }
}

#[test]
fn a_sequence_gets_its_request_rounded_up_to_a_power_of_two_not_the_context() {
    let e = engine(2000);
    let plain = |p, n| e.cache_capacity(p, n, Algorithm::Plain);
    // Plain verify width is 1 (the bonus row).
    assert_eq!(plain(10, 20), MIN_CACHE_ROWS + 1);
    assert_eq!(plain(200, 56), 256 + 1);
    assert_eq!(plain(200, 57), 512 + 1);
    assert_eq!(
        plain(900, 600),
        2000 + 1,
        "2048 capped at the context length"
    );
    assert_eq!(plain(1, 1999), 2000 + 1);
}

#[test]
fn the_cache_an_admitted_sequence_holds_is_the_capacity_admission_reserves() {
    let mut e = engine(2000);
    for (p, n) in [(5, 8), (300, 300), (1000, 1000)] {
        let want = e.cache_capacity(p, n, Algorithm::Plain);
        let id = e.add(request(p, n)).expect("admitted");
        let (_, cache) = e.sequence(id).expect("active");
        assert_eq!(cache.capacity(), want, "prompt {p} + {n}");
    }
    // The request runs to its length in that cache.
    let mut e = engine(2000);
    let (tokens, _) = e.generate(request(250, 6)).expect("generates");
    assert_eq!(tokens.len(), 6);
}
