//! Speculative decoding is lossless at temperature 0: plain decoding, DFlash-chain and DDTree
//! (budgets 1, 4, 16, 64, 256) emit identical tokens on tiny-coder-demo, alone and in a batch
//! of 4 sequences of different lengths and algorithms, with three proposers: a random-init
//! DFlash drafter (drafts mostly rejected), the greedy oracle (drafts all accepted) and the
//! noisy oracle (partial acceptances, branching trees).

use std::sync::OnceLock;

use candle_core::{DType, Device};
use dflash_common::DFlashConfig;
use dflash_models::speculative::{
    Algorithm, DFlashProposer, Engine, EngineConfig, GenerationRequest, Noise, OracleProposer,
    Proposer, SamplingParams,
};
use dflash_models::{DFlashDrafter, OpsMode, Qwen3Model};
use dflash_tests::{demo_model, greedy_cases};

const BUDGETS: [usize; 5] = [1, 4, 16, 64, 256];

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

#[derive(Clone, Copy, Debug)]
enum Which {
    RandomDrafter,
    Oracle,
    NoisyOracle,
}

fn proposer(t: &Qwen3Model, which: Which) -> Box<dyn Proposer> {
    match which {
        Which::RandomDrafter => {
            let cfg = DFlashConfig::for_target(t.config(), 2, 16, 8191, Some(vec![1, 2]));
            Box::new(DFlashProposer::new(
                DFlashDrafter::random(cfg, t, 7, OpsMode::Fused).unwrap(),
            ))
        }
        Which::Oracle => Box::new(OracleProposer::new(t.clone(), 15, None)),
        Which::NoisyOracle => Box::new(OracleProposer::new(
            t.clone(),
            15,
            Some(Noise {
                corrupt_prob: 0.3,
                seed: 11,
            }),
        )),
    }
}

fn engine_config() -> EngineConfig {
    EngineConfig {
        max_context: 512,
        max_ddtree_budget: 256,
        eos_token_ids: vec![8188, 8186],
        seed: 0,
    }
}

fn engine(t: &Qwen3Model, which: Which) -> Engine {
    pooled(Engine::new(
        t.clone(),
        Some(proposer(t, which)),
        engine_config(),
    ))
}

fn request(prompt: &[u32], n: usize, algorithm: Algorithm) -> GenerationRequest {
    GenerationRequest {
        prompt: prompt.to_vec(),
        max_new_tokens: n,
        sampling: SamplingParams::greedy(),
        stop_token_ids: vec![],
        ignore_eos: false,
        algorithm,
    }
}

fn algorithms() -> Vec<Algorithm> {
    let mut a = vec![Algorithm::Chain];
    a.extend(BUDGETS.iter().map(|&budget| Algorithm::DDTree { budget }));
    a
}

/// Plain greedy decoding of every prompt, 48 tokens, checked once against transformers and
/// shared by the tests below (they run in parallel; the first one computes it).
fn plain_reference() -> &'static [Vec<u32>] {
    static REFERENCE: OnceLock<Vec<Vec<u32>>> = OnceLock::new();
    REFERENCE.get_or_init(|| {
        let cases = greedy_cases("tiny-coder-demo");
        let mut plain = Engine::new(target(), None, engine_config());
        let reference: Vec<Vec<u32>> = cases
            .iter()
            .map(|c| {
                plain
                    .generate(request(&c.input_ids, 48, Algorithm::Plain))
                    .unwrap()
                    .0
            })
            .collect();
        for (c, r) in cases.iter().zip(&reference) {
            assert_eq!(
                r, &c.output_ids,
                "plain decoding reproduces transformers for {}",
                c.id
            );
        }
        reference
    })
}

/// Runs every request alone through one engine with `which`'s proposer, for each of `algs`,
/// and compares each output with plain greedy.
fn check_alone(which: Which, algs: &[Algorithm]) {
    let t = target();
    let cases = greedy_cases("tiny-coder-demo");
    let reference = plain_reference();
    let mut e = engine(&t, which);
    for &alg in algs {
        // Every prompt for chain and the big budgets; a subset for the rest keeps CI fast.
        let n_cases = if matches!(
            alg,
            Algorithm::Chain | Algorithm::DDTree { budget: 16 | 256 }
        ) {
            cases.len()
        } else {
            3
        };
        for (c, r) in cases.iter().zip(reference).take(n_cases) {
            let (got, stats) = e.generate(request(&c.input_ids, 48, alg)).unwrap();
            assert_eq!(&got, r, "{which:?} {alg:?} on {}", c.id);
            if let (Which::Oracle, Algorithm::Chain) = (which, alg) {
                // 1 prefill token, then full blocks of 16 until the limit cuts one.
                assert!(
                    stats.tau() >= 15.0,
                    "oracle chain tau {} on {}",
                    stats.tau(),
                    c.id
                );
            }
        }
    }
    assert_eq!(e.num_active(), 0);
    // Every request after the first ran on pages a finished one left (stale rows past its
    // length), and still matched plain greedy; all of them are back in the pool.
    assert!(e.kv_pool_tokens().is_some());
    assert_eq!(
        e.kv_pool_free_tokens(),
        e.kv_pool_tokens(),
        "pages returned"
    );
}

// One test per proposer (and the costly DDTree-256 of the random drafter on its own), so the
// harness spreads them over the cores; together they cover every algorithm and budget. The
// noisy oracle's chain and DDTree-64 runs are the ones its tau comparison makes (last test).

#[test]
fn random_drafter_chain_and_ddtree_up_to_64_match_plain_greedy_alone() {
    let algs = algorithms();
    let small: Vec<Algorithm> = algs
        .into_iter()
        .filter(|a| *a != Algorithm::DDTree { budget: 256 })
        .collect();
    check_alone(Which::RandomDrafter, &small);
}

#[test]
fn random_drafter_ddtree_256_matches_plain_greedy_alone() {
    check_alone(Which::RandomDrafter, &[Algorithm::DDTree { budget: 256 }]);
}

#[test]
fn oracle_chain_and_ddtree_match_plain_greedy_alone() {
    check_alone(Which::Oracle, &algorithms());
}

#[test]
fn noisy_oracle_ddtree_match_plain_greedy_alone() {
    // Chain and DDTree-64 run on every prompt in the test below.
    let algs: Vec<Algorithm> = algorithms()
        .into_iter()
        .filter(|a| !matches!(a, Algorithm::Chain | Algorithm::DDTree { budget: 64 }))
        .collect();
    check_alone(Which::NoisyOracle, &algs);
}

#[test]
fn batch_of_four_mixed_lengths_and_algorithms_matches_plain() {
    let t = target();
    let cases = greedy_cases("tiny-coder-demo");
    // Different prompt lengths: truncate the prompts differently.
    let prompts: Vec<Vec<u32>> = cases
        .iter()
        .take(4)
        .enumerate()
        .map(|(i, c)| c.input_ids[..c.input_ids.len() - 3 * i].to_vec())
        .collect();
    let mut plain = Engine::new(t.clone(), None, engine_config());
    let expect: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| plain.generate(request(p, 40, Algorithm::Plain)).unwrap().0)
        .collect();
    for which in [Which::RandomDrafter, Which::Oracle, Which::NoisyOracle] {
        let mut e = engine(&t, which);
        for algs in [
            [
                Algorithm::Chain,
                Algorithm::DDTree { budget: 16 },
                Algorithm::DDTree { budget: 64 },
                Algorithm::Plain,
            ],
            [
                Algorithm::DDTree { budget: 256 },
                Algorithm::DDTree { budget: 1 },
                Algorithm::Chain,
                Algorithm::DDTree { budget: 4 },
            ],
        ] {
            let ids: Vec<_> = prompts
                .iter()
                .zip(algs)
                .map(|(p, a)| e.add(request(p, 40, a)).unwrap())
                .collect();
            let mut got = vec![Vec::new(); 4];
            while e.num_active() > 0 {
                for ev in e.step().unwrap() {
                    let k = ids.iter().position(|&i| i == ev.id).unwrap();
                    got[k].extend_from_slice(&ev.tokens);
                }
            }
            assert_eq!(got, expect, "{which:?} batch {algs:?}");
        }
    }
}

#[test]
fn noisy_oracle_chain_and_ddtree_64_match_plain_greedy_and_the_tree_accepts_more() {
    let t = target();
    let cases = greedy_cases("tiny-coder-demo");
    let reference = plain_reference();
    let tau = |alg| {
        // Same noise seed: the chain and the tree see the same corrupted distributions.
        let mut e = engine(&t, Which::NoisyOracle);
        let mut total = dflash_models::speculative::SeqStats::new(15);
        for (c, r) in cases.iter().zip(reference) {
            let (got, s) = e.generate(request(&c.input_ids, 48, alg)).unwrap();
            assert_eq!(&got, r, "NoisyOracle {alg:?} on {}", c.id);
            total.rounds += s.rounds;
            total.accepted_drafts += s.accepted_drafts;
        }
        total.tau()
    };
    let chain = tau(Algorithm::Chain);
    let tree = tau(Algorithm::DDTree { budget: 64 });
    assert!(
        tree > chain + 0.5,
        "DDTree tau {tree} should exceed chain tau {chain}"
    );
}

/// The speculative engines run on a paged K/V pool (the plain references in caches of their
/// own), so every comparison also checks K/V read and compacted through page tables.
fn pooled(mut e: Engine) -> Engine {
    e.use_kv_pool(8 * 512).expect("K/V pool");
    e
}
