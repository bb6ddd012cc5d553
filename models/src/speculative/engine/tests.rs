//! The engine sizes each sequence's caches by its request (rounded up), not by the context,
//! and with a paged pool takes and returns whole pages.

use super::prefill::long_prompt_piece;
use super::*;
use crate::batch::SeqForward;
use crate::layers::attention::AttnPattern;
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

#[test]
fn with_a_pool_a_sequence_takes_whole_pages_and_gives_them_back() {
    let mut e = engine(2000);
    e.use_kv_pool(40 * PAGE_SIZE + 5).expect("pool");
    assert_eq!(e.kv_pool_tokens(), Some(40 * PAGE_SIZE), "whole pages");
    // prompt + max_new + the bonus row, in pages.
    assert_eq!(e.cache_capacity(10, 20, Algorithm::Plain), PAGE_SIZE);
    assert_eq!(e.cache_capacity(64, 63, Algorithm::Plain), 2 * PAGE_SIZE);
    assert_eq!(e.cache_capacity(64, 64, Algorithm::Plain), 3 * PAGE_SIZE);
    // Pages are taken as sequences fill: none at admission, the prompt's at its prefill,
    // then the verify row of each round.
    let a = e.add(request(100, 10)).expect("admitted");
    let b = e.add(request(300, 100)).expect("admitted");
    assert_eq!(e.kv_pool_free_tokens(), Some(40 * PAGE_SIZE));
    e.step().unwrap();
    // 100 + 1 rows: 2 pages; 300 + 1: 5 pages.
    assert_eq!(e.kv_pool_free_tokens(), Some((40 - 2 - 5) * PAGE_SIZE));
    assert!(
        e.use_kv_pool(PAGE_SIZE).is_err(),
        "not once sequences hold pages"
    );
    e.remove(a).unwrap();
    e.remove(b).unwrap();
    assert_eq!(e.kv_pool_free_tokens(), Some(40 * PAGE_SIZE));
}

#[test]
fn greedy_decoding_on_the_pool_equals_decoding_in_caches_of_their_own() {
    // Several sequences in flight at once, so their pages interleave in the pool and every
    // forward reads K/V through page tables that are not in order.
    let run = |pool: bool| {
        let mut e = engine(600);
        let mut holders = Vec::new();
        if pool {
            e.use_kv_pool(24 * PAGE_SIZE).expect("pool");
            // One-page sequences on pages 0..6, every other one gone: the real sequences'
            // pages start in the gaps.
            holders = (0..6).map(|_| e.add(request(10, 20)).unwrap()).collect();
            e.step().unwrap();
            for id in holders.iter().step_by(2) {
                e.remove(*id).unwrap();
            }
        }
        let greedy = |p, n| GenerationRequest {
            sampling: SamplingParams {
                temperature: 0.0,
                ..SamplingParams::default()
            },
            ..request(p, n)
        };
        let ids: Vec<_> = [(70, 90), (5, 140), (130, 60), (1, 70)]
            .iter()
            .map(|&(p, n)| e.add(greedy(p, n)).expect("admitted"))
            .collect();
        let mut out: Vec<Vec<u32>> = vec![Vec::new(); ids.len()];
        let mut first = true;
        while e.num_active() > 0 {
            for ev in e.step().expect("step") {
                if let Some(i) = ids.iter().position(|&id| id == ev.id) {
                    out[i].extend(ev.tokens);
                }
            }
            if pool && first {
                // The first step took the prompts' pages, in the holders' gaps.
                let (_, cache) = e.sequence(ids[0]).unwrap();
                assert_eq!(cache.page_table().pages(), &[0, 2], "pages out of order");
                for id in holders.iter().skip(1).step_by(2) {
                    e.remove(*id).unwrap();
                }
            }
            first = false;
        }
        out
    };
    let own = run(false);
    assert_eq!(
        own.iter().map(Vec::len).collect::<Vec<_>>(),
        [90, 140, 60, 70]
    );
    let distinct: std::collections::BTreeSet<u32> = own.iter().flatten().copied().collect();
    assert!(
        distinct.len() >= 4,
        "a test model that says something: {distinct:?}"
    );
    let pooled = run(true);
    for (s, (a, b)) in pooled.iter().zip(&own).enumerate() {
        let first = a.iter().zip(b).position(|(x, y)| x != y);
        assert!(
            a == b,
            "sequence {s}: pooled output differs from step {first:?} (lengths {} / {})",
            a.len(),
            b.len()
        );
    }
}

#[test]
fn sixteen_sequences_in_a_pool_too_small_for_them_are_retracted_and_finish_as_alone() {
    let greedy = |p: usize, n: usize| GenerationRequest {
        sampling: SamplingParams {
            temperature: 0.0,
            ..SamplingParams::default()
        },
        ..request(p, n)
    };
    let sizes: Vec<(usize, usize)> = (0..16)
        .map(|i| (5 + 17 * i % 90, 40 + 13 * i % 70))
        .collect();
    let alone: Vec<Vec<u32>> = sizes
        .iter()
        .map(|&(p, n)| engine(600).generate(greedy(p, n)).unwrap().0)
        .collect();
    let mut e = engine(600);
    // 8 pages: at most four of these sequences (2 pages each when full) at a time.
    e.use_kv_pool(8 * PAGE_SIZE).expect("pool");
    let ids: Vec<_> = sizes
        .iter()
        .map(|&(p, n)| e.add(greedy(p, n)).unwrap())
        .collect();
    let mut out: Vec<Vec<u32>> = vec![Vec::new(); ids.len()];
    let mut retractions = vec![0; ids.len()];
    let mut steps = 0;
    while e.num_active() > 0 {
        for ev in e.step().expect("step") {
            let i = ids.iter().position(|&id| id == ev.id).unwrap();
            out[i].extend(ev.tokens);
            retractions[i] = ev.stats.retractions;
        }
        steps += 1;
        assert!(steps < 5000, "no progress");
    }
    for (i, (a, b)) in out.iter().zip(&alone).enumerate() {
        assert_eq!(
            a, b,
            "sequence {i} (prompt {}, {} new)",
            sizes[i].0, sizes[i].1
        );
    }
    let total: usize = retractions.iter().sum();
    assert!(
        total > 0,
        "the pool was too small for all of them: retractions expected"
    );
    assert_eq!(retractions[0], 0, "the oldest sequence is never retracted");
    assert_eq!(
        e.kv_pool_free_tokens(),
        Some(8 * PAGE_SIZE),
        "every page back"
    );
}

#[test]
fn long_prompt_pieces_shrink_deep_into_a_prompt() {
    assert_eq!(long_prompt_piece(256, 0), 256);
    assert_eq!(long_prompt_piece(256, 4096), 256);
    assert_eq!(long_prompt_piece(256, 8192), 128);
    assert_eq!(long_prompt_piece(256, 16384), 64);
    assert_eq!(long_prompt_piece(256, 32768), 32);
    // Pieces past 4096 positions attend to about the same number of (query, key) pairs.
    for p in [5000usize, 9000, 20000, 30000] {
        let pairs = long_prompt_piece(256, p) * p;
        assert!(
            (256 * 4096 * 9 / 10..=256 * 4096).contains(&pairs),
            "{p}: {pairs}"
        );
    }
    assert_eq!(long_prompt_piece(256, 1 << 20), 32, "at least 32");
    assert_eq!(
        long_prompt_piece(10, 1 << 20),
        10,
        "never more than the bound"
    );
}

#[test]
fn prompt_logprobs_are_each_tokens_log_softmax_under_the_previous_row_whatever_the_chunks() {
    let prompt: Vec<u32> = (0..40).map(|i| (i * 7 % 60) as u32 + 1).collect();
    // Reference: one forward over the whole prompt, every row.
    let t = crate::speculative::tiny_test_target(600, 3);
    let mut cache = t.new_cache(prompt.len()).unwrap();
    let positions: Vec<u32> = (0..prompt.len() as u32).collect();
    let rows: Vec<usize> = (0..prompt.len()).collect();
    let out = t
        .forward(
            &mut [SeqForward {
                cache: &mut cache,
                tokens: &prompt,
                positions: &positions,
                pattern: &AttnPattern::Causal,
                logit_rows: &rows,
            }],
            &[],
        )
        .unwrap();
    let all = out.logits.unwrap().to_vec2::<f32>().unwrap();
    for (chunk, start) in [(None, 0), (Some(3), 0), (Some(7), 25), (None, 39)] {
        let mut e = engine(600);
        e.set_chunked_prefill(chunk);
        let id = e
            .add(GenerationRequest {
                prompt: prompt.clone(),
                ..request(prompt.len(), 2)
            })
            .unwrap();
        e.set_prompt_logprobs(id, start, 2).unwrap();
        let mut got = None;
        while e.num_active() > 0 {
            for ev in e.step().unwrap() {
                if !ev.prompt_logprobs.is_empty() {
                    assert!(got.is_none(), "prompt logprobs come once");
                    got = Some(ev.prompt_logprobs);
                }
            }
        }
        let got = got.unwrap_or_default();
        let first = start.max(1);
        assert_eq!(
            got.len(),
            prompt.len() - first,
            "chunk {chunk:?} start {start}"
        );
        for (k, lp) in got.iter().enumerate() {
            let p = first + k;
            let want = logprobs::token_logprob(&all[p - 1], prompt[p], 2);
            assert_eq!(lp.token, prompt[p]);
            assert!(
                (lp.logprob - want.logprob).abs() < 1e-4,
                "chunk {chunk:?} token {p}: {} vs {}",
                lp.logprob,
                want.logprob
            );
            assert_eq!(lp.top.len(), 2);
        }
    }
}
