//! A device failure in a step ends only the sequences whose forward fails: with a fault
//! injected into one sequence's target forward (`Engine::inject_forward_failure`), while it
//! decodes or while its prompt is prefilled beside others, that sequence ends with an error
//! event and leaves the engine with its pages, and every other sequence decodes exactly what
//! it decodes alone (greedy, f32, CPU), plain, DFlash chain and DDTree; the engine then goes on
//! serving new requests.

use std::collections::HashMap;

use candle_core::{DType, Device};
use dflash_common::DFlashConfig;
use dflash_models::speculative::{
    Algorithm, DFlashProposer, Engine, EngineConfig, GenerationRequest, SamplingParams, SeqId,
};
use dflash_models::{DFlashDrafter, OpsMode, Qwen3Model};
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

fn engine(t: &Qwen3Model, pool: bool) -> Engine {
    let cfg = DFlashConfig::for_target(t.config(), 2, 16, 8191, Some(vec![1, 2]));
    let drafter = DFlashDrafter::random(cfg, t, 7, OpsMode::Fused).unwrap();
    let config = EngineConfig {
        max_context: 1024,
        max_ddtree_budget: 16,
        eos_token_ids: vec![],
        seed: 0,
    };
    let mut e = Engine::new(
        t.clone(),
        Some(Box::new(DFlashProposer::new(drafter))),
        config,
    );
    if pool {
        e.use_kv_pool(16 * 1024).unwrap();
    }
    e
}

fn requests() -> Vec<GenerationRequest> {
    let algorithms = [
        Algorithm::Plain,
        Algorithm::Chain,
        Algorithm::DDTree { budget: 16 },
        Algorithm::Chain,
    ];
    greedy_cases("tiny-coder-demo")
        .iter()
        .zip(algorithms)
        .map(|(c, algorithm)| GenerationRequest {
            prompt: c.input_ids.clone(),
            max_new_tokens: 32,
            sampling: SamplingParams::greedy(),
            stop_token_ids: vec![],
            ignore_eos: true,
            algorithm,
        })
        .collect()
}

/// Runs `reqs` together; the one at `faulty` gets a fault injected after `after` steps.
/// Returns each request's tokens and error.
fn run(
    e: &mut Engine,
    reqs: &[GenerationRequest],
    faulty: usize,
    after: usize,
) -> Vec<(Vec<u32>, Option<String>)> {
    let ids: Vec<SeqId> = reqs.iter().map(|r| e.add(r.clone()).unwrap()).collect();
    let index: HashMap<SeqId, usize> = ids.iter().enumerate().map(|(i, &id)| (id, i)).collect();
    let mut out: Vec<(Vec<u32>, Option<String>)> = vec![(Vec::new(), None); reqs.len()];
    let mut step = 0;
    while e.num_active() > 0 {
        if step == after {
            e.inject_forward_failure(ids[faulty]);
        }
        let events = e.step().expect("a failing sequence does not fail the step");
        for ev in events {
            let i = index[&ev.id];
            out[i].0.extend(&ev.tokens);
            if let Some(err) = ev.error {
                assert!(out[i].1.is_none(), "one error event");
                out[i].1 = Some(err);
            }
        }
        step += 1;
        assert!(step < 200, "the engine finishes");
    }
    out
}

#[test]
fn a_fault_in_one_sequence_ends_it_alone_and_the_others_decode_as_alone() {
    let t = target();
    let reqs = requests();
    let mut alone = engine(&t, false);
    let want: Vec<Vec<u32>> = reqs
        .iter()
        .map(|r| alone.generate(r.clone()).unwrap().0)
        .collect();
    // While decoding (step 3), and during the prefill (step 0: the prompts are prefilled
    // together), for a plain and a speculating sequence, on the pool and off it.
    for (pool, faulty, after) in [(true, 1, 3), (true, 2, 0), (false, 0, 3), (true, 0, 0)] {
        let mut e = engine(&t, pool);
        let got = run(&mut e, &reqs, faulty, after);
        for (i, (tokens, error)) in got.iter().enumerate() {
            if i == faulty {
                let error = error.as_deref().expect("the faulty sequence gets an error");
                assert!(error.contains("injected device fault"), "{error}");
                assert_eq!(
                    tokens[..],
                    want[i][..tokens.len()],
                    "what it emitted before is right"
                );
                assert!(tokens.len() < want[i].len());
            } else {
                assert!(error.is_none(), "request {i}: {error:?}");
                assert_eq!(
                    tokens, &want[i],
                    "pool {pool}, faulty {faulty}, request {i}"
                );
            }
        }
        if pool {
            assert_eq!(
                e.kv_pool_free_tokens(),
                e.kv_pool_tokens(),
                "every page is back"
            );
        }
        // The engine goes on serving.
        let (tokens, _) = e.generate(reqs[3].clone()).unwrap();
        assert_eq!(tokens, want[3]);
    }
}

#[test]
fn a_lone_failing_sequence_gets_an_error_event_and_the_engine_goes_on() {
    let t = target();
    let reqs = requests();
    let mut e = engine(&t, true);
    let got = run(&mut e, &reqs[1..2], 0, 2);
    assert!(got[0].1.as_deref().is_some_and(|m| m.contains("device")));
    let mut alone = engine(&t, false);
    let want = alone.generate(reqs[2].clone()).unwrap().0;
    assert_eq!(e.generate(reqs[2].clone()).unwrap().0, want);
}
