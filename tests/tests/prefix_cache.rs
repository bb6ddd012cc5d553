//! The prefix cache: later requests start on K/V pages cached from earlier ones with the same
//! token prefix (multi-turn chat), prefill only the rest, and decode exactly what they decode
//! without the cache (greedy, f32, CPU) — plain, DFlash chain and DDTree, one after another
//! and with sharing sequences in flight together, through eviction in a pool too small to
//! keep everything, and after a flush.

use candle_core::{DType, Device};
use dflash_common::DFlashConfig;
use dflash_models::speculative::{
    Algorithm, DFlashProposer, Engine, EngineConfig, GenerationRequest, SamplingParams, SeqId,
};
use dflash_models::{DFlashDrafter, OpsMode, Qwen3Model, PAGE_SIZE};
use dflash_tests::{demo_model, greedy_cases};

fn target() -> Qwen3Model {
    Qwen3Model::load(
        &demo_model(),
        DType::F32,
        &Device::Cpu,
        1024,
        OpsMode::Fused,
    )
    .unwrap()
}

fn config() -> EngineConfig {
    EngineConfig {
        max_context: 1024,
        max_ddtree_budget: 16,
        eos_token_ids: vec![],
        seed: 0,
    }
}

/// An engine with a random-init DFlash drafter; on a pool of `pool_tokens` with the prefix
/// cache when given.
fn engine(t: &Qwen3Model, pool_tokens: Option<usize>) -> Engine {
    let cfg = DFlashConfig::for_target(t.config(), 2, 16, 8191, Some(vec![1, 2]));
    let drafter = DFlashDrafter::random(cfg, t, 7, OpsMode::Fused).unwrap();
    let mut e = Engine::new(
        t.clone(),
        Some(Box::new(DFlashProposer::new(drafter))),
        config(),
    );
    if let Some(tokens) = pool_tokens {
        e.use_kv_pool(tokens).unwrap();
        e.enable_prefix_cache(usize::MAX).unwrap();
    }
    e
}

fn request(prompt: &[u32], n: usize, algorithm: Algorithm) -> GenerationRequest {
    GenerationRequest {
        prompt: prompt.to_vec(),
        max_new_tokens: n,
        sampling: SamplingParams::greedy(),
        stop_token_ids: vec![],
        ignore_eos: true,
        algorithm,
    }
}

/// A "system prompt" of `n` tokens made of the fixture prompts.
fn system_prompt(n: usize) -> Vec<u32> {
    let cases = greedy_cases("tiny-coder-demo");
    cases
        .iter()
        .flat_map(|c| c.input_ids.iter().copied())
        .cycle()
        .take(n)
        .collect()
}

fn user_turn(k: usize) -> Vec<u32> {
    let cases = greedy_cases("tiny-coder-demo");
    cases[k % cases.len()].input_ids.clone()
}

const ALGORITHMS: [Algorithm; 3] = [
    Algorithm::Plain,
    Algorithm::Chain,
    Algorithm::DDTree { budget: 16 },
];

#[test]
fn multi_turn_chat_starts_on_cached_pages_and_decodes_as_without_the_cache() {
    let t = target();
    for algorithm in ALGORITHMS {
        let mut plain = engine(&t, None);
        let mut cached = engine(&t, Some(32 * 1024));
        let mut history = system_prompt(150);
        for turn in 0..3 {
            history.extend(user_turn(turn));
            let (want, base) = plain.generate(request(&history, 40, algorithm)).unwrap();
            let (got, stats) = cached.generate(request(&history, 40, algorithm)).unwrap();
            assert_eq!(got, want, "{algorithm:?}, turn {turn}");
            assert_eq!(base.cached_tokens, 0);
            if turn == 0 {
                assert_eq!(
                    stats.cached_tokens, 0,
                    "nothing cached before the first turn"
                );
            } else {
                // The earlier turns' full pages (a speculating turn: the pages whose drafter
                // features were cached, its prompts'; plain: its answers too).
                assert!(
                    stats.cached_tokens >= 2 * PAGE_SIZE && stats.cached_tokens % PAGE_SIZE == 0,
                    "{algorithm:?}, turn {turn}: {} cached tokens",
                    stats.cached_tokens
                );
                assert!(stats.cached_tokens < history.len());
            }
            history.extend(got);
        }
        assert!(cached.prefix_cache_tokens().unwrap() > 0);
        cached.flush_prefix_cache();
        assert_eq!(cached.prefix_cache_tokens(), Some(0));
        assert_eq!(
            cached.kv_pool_free_tokens(),
            cached.kv_pool_tokens(),
            "a flush with nothing running frees every page"
        );
        let (_, stats) = cached.generate(request(&history, 4, algorithm)).unwrap();
        assert_eq!(stats.cached_tokens, 0, "nothing cached after the flush");
    }
}

/// What [`run_together`] returns per request.
struct Outcome {
    tokens: Vec<u32>,
    cached_tokens: usize,
    retractions: usize,
}

/// Runs `requests` together, each admitted after `delay[i]` steps.
fn run_together(e: &mut Engine, requests: &[GenerationRequest], delay: &[usize]) -> Vec<Outcome> {
    let mut ids: Vec<Option<SeqId>> = vec![None; requests.len()];
    let mut out: Vec<Outcome> = (0..requests.len())
        .map(|_| Outcome {
            tokens: Vec::new(),
            cached_tokens: 0,
            retractions: 0,
        })
        .collect();
    let mut done = 0;
    let mut step = 0;
    while done < requests.len() {
        for (i, r) in requests.iter().enumerate() {
            if ids[i].is_none() && delay[i] <= step {
                ids[i] = Some(e.add(r.clone()).unwrap());
            }
        }
        for ev in e.step().unwrap() {
            let i = ids.iter().position(|&id| id == Some(ev.id)).unwrap();
            out[i].tokens.extend(&ev.tokens);
            out[i].cached_tokens = ev.stats.cached_tokens;
            out[i].retractions = ev.stats.retractions;
            if ev.finished.is_some() {
                done += 1;
            }
        }
        step += 1;
    }
    out
}

#[test]
fn sequences_in_flight_together_share_a_prefix_and_decode_as_alone() {
    let t = target();
    let system = system_prompt(200);
    for algorithm in ALGORITHMS {
        let requests: Vec<GenerationRequest> = (0..4)
            .map(|k| {
                let mut p = system.clone();
                p.extend(user_turn(k));
                request(&p, 24, algorithm)
            })
            .collect();
        let mut alone = engine(&t, None);
        let want: Vec<Vec<u32>> = requests
            .iter()
            .map(|r| alone.generate(r.clone()).unwrap().0)
            .collect();
        let mut e = engine(&t, Some(32 * 1024));
        // The first request's prefill caches the system prompt's pages; the others arrive
        // while it decodes.
        let got = run_together(&mut e, &requests, &[0, 1, 1, 3]);
        for (k, o) in got.iter().enumerate() {
            assert_eq!(o.tokens, want[k], "{algorithm:?}, request {k}");
            if k > 0 {
                assert_eq!(o.cached_tokens, 3 * PAGE_SIZE, "{algorithm:?}, request {k}");
            }
        }
    }
}

#[test]
fn a_pool_too_small_to_keep_everything_evicts_cached_pages_and_decodes_as_without_them() {
    let t = target();
    // Room for about two sequences: the cache must give pages back for every new prompt.
    let pool = 12 * PAGE_SIZE;
    for algorithm in [Algorithm::Plain, Algorithm::Chain] {
        let mut alone = engine(&t, None);
        let mut e = engine(&t, Some(pool));
        for k in 0..6 {
            // Two families of prompts, alternating: the older family's pages are evicted.
            let mut p = system_prompt(140 + 40 * (k % 2));
            p.reverse();
            p.extend(user_turn(k));
            let want = alone.generate(request(&p, 30, algorithm)).unwrap().0;
            let (got, _) = e.generate(request(&p, 30, algorithm)).unwrap();
            assert_eq!(got, want, "{algorithm:?}, prompt {k}");
            assert!(e.prefix_cache_tokens().unwrap() <= pool);
        }
        assert!(e.prefix_cache_tokens().unwrap() > 0);
        // Several sequences at once in the small pool: cached pages go before retractions.
        let requests: Vec<GenerationRequest> = (0..3)
            .map(|k| {
                let mut p = system_prompt(100 + 30 * k);
                p.extend(user_turn(k));
                request(&p, 20, algorithm)
            })
            .collect();
        let want: Vec<Vec<u32>> = requests
            .iter()
            .map(|r| alone.generate(r.clone()).unwrap().0)
            .collect();
        let got = run_together(&mut e, &requests, &[0, 0, 0]);
        for (k, o) in got.iter().enumerate() {
            assert_eq!(o.tokens, want[k], "{algorithm:?}, together, request {k}");
        }
    }
}

#[test]
fn sequences_sharing_a_prefix_that_outgrow_the_drafter_pool_retract_and_decode_as_alone() {
    let t = target();
    // Target pages of the 400-token prompt are shared, but every drafter cache holds the
    // whole context in pages of its own: six sequences fit the target's 26 pages and not the
    // drafter's (26 + 4), so the newest ones are retracted for drafter pages and resumed.
    let system = system_prompt(400);
    let pool = 26 * PAGE_SIZE;
    for algorithm in [
        Algorithm::Plain,
        Algorithm::Chain,
        Algorithm::DDTree { budget: 8 },
    ] {
        let requests: Vec<GenerationRequest> = (0..6)
            .map(|k| {
                let mut p = system.clone();
                p.extend(user_turn(k));
                request(&p, 24, algorithm)
            })
            .collect();
        let mut alone = engine(&t, None);
        let want: Vec<Vec<u32>> = requests
            .iter()
            .map(|r| alone.generate(r.clone()).unwrap().0)
            .collect();
        let mut e = engine(&t, Some(pool));
        // The first request caches the prompt's pages; the others come after it.
        let got = run_together(&mut e, &requests, &[0, 1, 1, 1, 1, 1]);
        for (k, o) in got.iter().enumerate() {
            assert_eq!(o.tokens, want[k], "{algorithm:?}, request {k}");
        }
        let retractions: usize = got.iter().map(|o| o.retractions).sum();
        if algorithm == Algorithm::Plain {
            // The control: the target's pool alone holds all six.
            assert_eq!(retractions, 0, "plain decoding retracted");
        } else {
            assert!(
                retractions > 0,
                "{algorithm:?}: the drafter's pool never ran short"
            );
        }
        assert_eq!(e.kv_pool_free_tokens().map(|f| f > 0), Some(true));
    }
}

#[test]
fn the_drafter_takes_context_pages_as_it_fills_and_gives_them_back() {
    use dflash_models::speculative::{ProposeItem, Proposer};
    let t = target();
    let cfg = DFlashConfig::for_target(t.config(), 2, 16, 8191, Some(vec![1, 2]));
    let drafter = DFlashDrafter::random(cfg, &t, 7, OpsMode::Fused).unwrap();
    let width = 2 * t.config().hidden_size;
    let mut p = DFlashProposer::new(drafter);
    p.use_kv_pool(8).unwrap();
    assert_eq!(p.kv_pool_free_pages(), Some(8));
    // Opened for a long context, it holds nothing yet.
    p.open(1, 1000).unwrap();
    assert_eq!(p.kv_pool_free_pages(), Some(8));
    assert!(
        p.use_kv_pool(4).is_err(),
        "the pool is not replaced under open caches"
    );
    // 100 committed rows plus a block: two pages.
    p.reserve(1, 100).unwrap();
    assert_eq!(p.kv_pool_free_pages(), Some(6));
    let features = candle_core::Tensor::zeros((99, width), DType::F32, &Device::Cpu).unwrap();
    let tokens: Vec<u32> = (0..100).collect();
    let out = p
        .propose(&[ProposeItem {
            seq: 1,
            tokens: &tokens,
            features: Some(&features),
            top_k: 1,
        }])
        .unwrap();
    assert_eq!(out.len(), 1);
    assert_eq!(p.kv_pool_free_pages(), Some(6));
    // More than the pool holds: refused, nothing taken.
    assert!(matches!(
        p.reserve(1, 600),
        Err(dflash_models::ModelError::PoolExhausted { .. })
    ));
    assert_eq!(p.kv_pool_free_pages(), Some(6));
    p.close(1);
    assert_eq!(p.kv_pool_free_pages(), Some(8));
}
