//! Bad requests get typed errors at admission and leave the running batch untouched: a
//! sequence that was mid-generation when they arrived still produces plain greedy's tokens.

use candle_core::{DType, Device};
use dflash_models::speculative::{
    Algorithm, Engine, EngineConfig, EngineError, GenerationRequest, OracleProposer, SamplingError,
    SamplingParams,
};
use dflash_models::{OpsMode, Qwen3Model};
use dflash_tests::{demo_model, greedy_cases};

fn req(
    prompt: Vec<u32>,
    max_new_tokens: usize,
    sampling: SamplingParams,
    algorithm: Algorithm,
) -> GenerationRequest {
    GenerationRequest {
        prompt,
        max_new_tokens,
        sampling,
        stop_token_ids: vec![],
        ignore_eos: false,
        algorithm,
    }
}

#[test]
fn bad_requests_are_refused_with_typed_errors_and_the_batch_carries_on() {
    let t = Qwen3Model::load(
        &demo_model(),
        DType::F32,
        &Device::Cpu,
        1024,
        OpsMode::Fused,
    )
    .unwrap();
    let cfg = EngineConfig {
        max_context: 256,
        max_ddtree_budget: 64,
        eos_token_ids: vec![8188, 8186],
        seed: 0,
    };
    let mut e = Engine::new(
        t.clone(),
        Some(Box::new(OracleProposer::new(t.clone(), 15, None))),
        cfg.clone(),
    );
    let case = &greedy_cases("tiny-coder-demo")[1];
    let good = e
        .add(req(
            case.input_ids.clone(),
            48,
            SamplingParams::greedy(),
            Algorithm::DDTree { budget: 16 },
        ))
        .unwrap();
    let mut got = Vec::new();
    for ev in e.step().unwrap() {
        got.extend(ev.tokens);
    }
    let greedy = SamplingParams::greedy();
    let tree = Algorithm::DDTree { budget: 16 };
    let p = case.input_ids.clone();
    let bad: Vec<(GenerationRequest, fn(&EngineError) -> bool)> = vec![
        (req(vec![], 8, greedy, tree), |e| {
            matches!(e, EngineError::EmptyPrompt)
        }),
        (req(vec![5; 300], 8, greedy, tree), |e| {
            matches!(
                e,
                EngineError::PromptTooLong {
                    prompt: 300,
                    max_context: 256
                }
            )
        }),
        (req(p.clone(), 250, greedy, tree), |e| {
            matches!(e, EngineError::ContextExceeded { .. })
        }),
        (req(p.clone(), 0, greedy, tree), |e| {
            matches!(e, EngineError::ZeroMaxNewTokens)
        }),
        (
            req(
                p.clone(),
                8,
                SamplingParams {
                    top_p: 1.5,
                    ..greedy
                },
                tree,
            ),
            |e| matches!(e, EngineError::Sampling(SamplingError::TopP { .. })),
        ),
        (
            req(
                p.clone(),
                8,
                SamplingParams {
                    top_p: 0.0,
                    ..greedy
                },
                tree,
            ),
            |e| matches!(e, EngineError::Sampling(SamplingError::TopP { .. })),
        ),
        (
            req(
                p.clone(),
                8,
                SamplingParams {
                    temperature: -0.5,
                    ..greedy
                },
                tree,
            ),
            |e| matches!(e, EngineError::Sampling(SamplingError::Temperature { .. })),
        ),
        (
            req(p.clone(), 8, greedy, Algorithm::DDTree { budget: 65 }),
            |e| {
                matches!(
                    e,
                    EngineError::BadBudget {
                        budget: 65,
                        max: 64
                    }
                )
            },
        ),
        (
            req(p.clone(), 8, greedy, Algorithm::DDTree { budget: 0 }),
            |e| matches!(e, EngineError::BadBudget { budget: 0, .. }),
        ),
        (req(vec![9000], 8, greedy, tree), |e| {
            matches!(e, EngineError::TokenOutOfVocab { token: 9000, .. })
        }),
    ];
    for (r, is_expected) in bad {
        let err = e.add(r.clone()).unwrap_err();
        assert!(
            is_expected(&err),
            "unexpected error {err:?} for prompt len {} / {:?}",
            r.prompt.len(),
            r.algorithm
        );
        assert!(!err.to_string().is_empty());
    }
    assert_eq!(e.num_active(), 1, "refused requests leave no trace");
    while e.num_active() > 0 {
        for ev in e.step().unwrap() {
            assert_eq!(ev.id, good);
            got.extend(ev.tokens);
        }
    }
    assert_eq!(got, case.output_ids);

    let mut plain_only = Engine::new(t.clone(), None, cfg);
    let err = plain_only
        .add(req(p, 8, SamplingParams::greedy(), Algorithm::Chain))
        .unwrap_err();
    assert!(
        matches!(err, EngineError::NoProposer(Algorithm::Chain)),
        "{err:?}"
    );
}

/// A sequence that fills the whole context still decodes: trees are cut at the length limit
/// and at the end of the position table instead of failing the step.
#[test]
fn generation_up_to_the_context_limit_caps_tree_depth() {
    let t = Qwen3Model::load(&demo_model(), DType::F32, &Device::Cpu, 128, OpsMode::Fused).unwrap();
    let cfg = EngineConfig {
        max_context: 128,
        max_ddtree_budget: 64,
        eos_token_ids: vec![],
        seed: 0,
    };
    let case = &greedy_cases("tiny-coder-demo")[0];
    let n = 128 - case.input_ids.len();
    let mut plain = Engine::new(t.clone(), None, cfg.clone());
    let (expect, _) = plain
        .generate(req(
            case.input_ids.clone(),
            n,
            SamplingParams::greedy(),
            Algorithm::Plain,
        ))
        .unwrap();
    for alg in [Algorithm::Chain, Algorithm::DDTree { budget: 64 }] {
        let mut e = Engine::new(
            t.clone(),
            Some(Box::new(OracleProposer::new(t.clone(), 15, None))),
            cfg.clone(),
        );
        let (got, _) = e
            .generate(req(
                case.input_ids.clone(),
                n,
                SamplingParams::greedy(),
                alg,
            ))
            .unwrap();
        assert_eq!(got, expect, "{alg:?}");
        assert_eq!(got.len(), n);
    }
}
