//! Mixed steps (`Engine::set_mixed_prefill`, SGLang's mixed chunk): a prompt's prefill chunk
//! rides in the same target forward as the running sequences' decode or verify rows. The
//! tokens must be exactly those of separate prefill forwards and of each request run alone
//! (greedy, f32), for plain decoding, DFlash chains and DDTrees on the dense target, with and
//! without a paged pool short enough to retract, and for the hybrid target.

use candle_core::{DType, Device};
use dflash_models::speculative::{
    Algorithm, DFlashProposer, Engine, EngineConfig, GenerationRequest, OracleProposer,
    SamplingParams, SeqId,
};
use dflash_models::{DFlashDrafter, OpsMode, Qwen3Model};
use dflash_tests::{demo_model, greedy_cases, single_threaded_tensor_ops, tiny_hybrid};

fn config() -> EngineConfig {
    EngineConfig {
        max_context: 512,
        max_ddtree_budget: 16,
        eos_token_ids: vec![8188, 8186],
        seed: 0,
    }
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

fn engine(t: &Qwen3Model, mixed: bool, pool: Option<usize>) -> Engine {
    let dir = demo_model().with_file_name("tiny-coder-demo-dflash");
    let drafter = DFlashDrafter::load(&dir, t, OpsMode::Fused).unwrap();
    let mut e = Engine::new(
        t.clone(),
        Some(Box::new(DFlashProposer::new(drafter))),
        config(),
    );
    if let Some(tokens) = pool {
        e.use_kv_pool(tokens).unwrap();
    }
    e.set_chunked_prefill(Some(64));
    e.set_prefill_while_decoding(Some(24));
    e.set_mixed_prefill(mixed);
    e
}

/// Runs `reqs` (request, the step it arrives at) to completion; returns each one's tokens.
fn run(e: &mut Engine, reqs: &[(GenerationRequest, usize)]) -> Vec<Vec<u32>> {
    let mut ids: Vec<Option<SeqId>> = vec![None; reqs.len()];
    let mut out: Vec<Vec<u32>> = vec![Vec::new(); reqs.len()];
    let mut done = vec![false; reqs.len()];
    for step in 0..2000 {
        for (k, (req, at)) in reqs.iter().enumerate() {
            if *at == step {
                ids[k] = Some(e.add(req.clone()).unwrap());
            }
        }
        for ev in e.step().unwrap() {
            assert!(ev.error.is_none(), "sequence {}: {:?}", ev.id, ev.error);
            let k = ids.iter().position(|&i| i == Some(ev.id)).unwrap();
            out[k].extend(&ev.tokens);
            done[k] |= ev.finished.is_some();
        }
        if done.iter().all(|&d| d) {
            return out;
        }
    }
    panic!("requests did not finish");
}

/// Three short requests decode while two long prompts (150 and 200 tokens) arrive and are
/// prefilled in pieces alongside them.
fn workload(algorithm: Algorithm) -> Vec<(GenerationRequest, usize)> {
    let cases = greedy_cases("tiny-coder-demo");
    let all: Vec<u32> = cases.iter().flat_map(|c| c.input_ids.clone()).collect();
    assert!(
        all.len() >= 260,
        "the fixtures hold {} prompt tokens",
        all.len()
    );
    vec![
        (request(&cases[0].input_ids[..12], 40, algorithm), 0),
        (request(&cases[1].input_ids[..9], 48, algorithm), 0),
        (request(&all[..150], 20, algorithm), 2),
        (request(&cases[2].input_ids[..15], 30, algorithm), 3),
        (request(&all[60..260], 16, algorithm), 4),
    ]
}

#[test]
fn mixed_steps_give_the_tokens_of_separate_prefills_and_of_each_request_alone() {
    let t = target();
    for algorithm in [
        Algorithm::Plain,
        Algorithm::Chain,
        Algorithm::DDTree { budget: 8 },
    ] {
        let reqs = workload(algorithm);
        let alone: Vec<Vec<u32>> = reqs
            .iter()
            .map(|(r, _)| engine(&t, false, None).generate(r.clone()).unwrap().0)
            .collect();
        let mut separate = engine(&t, false, None);
        let separate_out = run(&mut separate, &reqs);
        assert_eq!(separate.mixed_steps(), 0);
        let mut mixed = engine(&t, true, None);
        let mixed_out = run(&mut mixed, &reqs);
        assert!(
            mixed.mixed_steps() >= 10,
            "{algorithm:?}: only {} mixed steps",
            mixed.mixed_steps()
        );
        assert_eq!(separate_out, alone, "{algorithm:?}: separate prefills");
        assert_eq!(mixed_out, alone, "{algorithm:?}: mixed steps");
        // Pieces sized by the cost budget (the server's default) and calibrated from this
        // machine's step times: never larger, often smaller, the same tokens.
        let mut budgeted = engine(&t, true, None);
        budgeted.set_mixed_step_budget(Some(2.0));
        budgeted.calibrate_step_costs(true);
        let budgeted_out = run(&mut budgeted, &reqs);
        assert!(
            budgeted.mixed_steps() >= mixed.mixed_steps(),
            "{algorithm:?}"
        );
        assert_eq!(budgeted_out, alone, "{algorithm:?}: cost-sized pieces");
    }
}

/// On a pool too small for all of them, mixed steps retract and resume sequences (their
/// re-prefill rides in mixed steps too) and the tokens stay those of each request alone.
#[test]
fn mixed_steps_on_a_short_pool_retract_and_keep_the_tokens() {
    let t = target();
    for algorithm in [Algorithm::Plain, Algorithm::Chain] {
        let reqs = workload(algorithm);
        let alone: Vec<Vec<u32>> = reqs
            .iter()
            .map(|(r, _)| engine(&t, false, None).generate(r.clone()).unwrap().0)
            .collect();
        // 6 pages of 64 rows: the two long prompts alone need 6.
        let mut e = engine(&t, true, Some(6 * 64));
        let out = run(&mut e, &reqs);
        assert!(e.mixed_steps() > 0);
        assert_eq!(out, alone, "{algorithm:?}");
    }
}

/// The hybrid target's chunks (no rollback state) and verify rows (a state per node) share
/// mixed forwards: greedy tokens equal each request alone.
#[test]
fn mixed_steps_on_the_hybrid_target_keep_the_tokens() {
    single_threaded_tensor_ops();
    let m = tiny_hybrid(7);
    let config = EngineConfig {
        max_context: 160,
        max_ddtree_budget: 16,
        eos_token_ids: vec![],
        seed: 0,
    };
    let make = |mixed: bool| {
        let mut e = Engine::new(
            m.clone(),
            Some(Box::new(OracleProposer::new(m.clone(), 5, None))),
            config.clone(),
        );
        e.set_chunked_prefill(Some(32));
        e.set_prefill_while_decoding(Some(8));
        e.set_mixed_prefill(mixed);
        e
    };
    let long: Vec<u32> = (0..70u32).map(|i| (i * 37 + 11) % 96).collect();
    let reqs = vec![
        (request(&[5, 17, 33, 2, 90], 30, Algorithm::Chain), 0),
        (request(&[60, 3], 24, Algorithm::Plain), 0),
        (request(&long, 12, Algorithm::DDTree { budget: 6 }), 2),
    ];
    let alone: Vec<Vec<u32>> = reqs
        .iter()
        .map(|(r, _)| make(false).generate(r.clone()).unwrap().0)
        .collect();
    let mut e = make(true);
    let out = run(&mut e, &reqs);
    assert!(e.mixed_steps() >= 5, "{} mixed steps", e.mixed_steps());
    assert_eq!(out, alone);
}
