//! Speculative decoding on a `qwen3_moe` target is lossless: the random MoE fixture
//! `tests/fixtures/qwen3_moe-tiny-random` (sparse, dense, sparse, sparse MLPs; 8 experts, top-2;
//! its parity with transformers is `qwen3_moe_parity.rs`) in f32 on the CPU.
//!
//! A verify forward routes every row (chain block or tree node) through the experts in one
//! batch, so a routing that leaked between rows, or a tree node's MLP computed from another
//! node's hidden state, would change the verified logits and with them the output.
//! - T = 0: chain and DDTree (budgets 4 and 32) with the greedy oracle, the noisy oracle (wrong
//!   drafts at random depths: chains break, trees branch) and a random DFlash drafter (drafts
//!   mostly rejected) emit exactly the plain greedy tokens, alone and in a batch mixing
//!   algorithms; after every engine step the committed K/V rows equal a from-scratch prefill.
//! - T > 0: as `hybrid_sampling.rs` (400 seeded samples of 4 new tokens, temperature 0.8,
//!   top_k 6), chain and DDTree-8 against plain sampling, a two-sample chi-square test per
//!   position 2..4 and for the pair (2, 3), bound at p = 1e-4.

use candle_core::{DType, Device};
use dflash_common::DFlashConfig;
use dflash_models::speculative::{
    Algorithm, DFlashProposer, Engine, EngineConfig, GenerationRequest, Noise, OracleProposer,
    Proposer, SamplingParams,
};
use dflash_models::{AttnPattern, DFlashDrafter, OpsMode, Qwen3Model, SeqForward, SequenceCache};
use dflash_tests::{
    assert_same_distribution, fixture, max_abs_diff, sample_continuations,
    single_threaded_tensor_ops,
};

const PROMPTS: [&[u32]; 3] = [
    &[5, 17, 33, 2, 90, 41, 7],
    &[60],
    &[
        12, 12, 12, 80, 3, 44, 19, 27, 65, 8, 1, 93, 50, 22, 71, 36, 4, 88, 9, 30,
    ],
];

fn target() -> Qwen3Model {
    Qwen3Model::load(
        &fixture("qwen3_moe-tiny-random"),
        DType::F32,
        &Device::Cpu,
        256,
        OpsMode::Fused,
    )
    .unwrap()
}

fn config() -> EngineConfig {
    EngineConfig {
        max_context: 160,
        max_ddtree_budget: 32,
        eos_token_ids: vec![],
        seed: 0,
    }
}

fn pooled(mut e: Engine) -> Engine {
    e.use_kv_pool(16 * 160).expect("K/V pool");
    e
}

fn greedy(prompt: &[u32], algorithm: Algorithm, max_new_tokens: usize) -> GenerationRequest {
    GenerationRequest {
        prompt: prompt.to_vec(),
        max_new_tokens,
        sampling: SamplingParams::greedy(),
        stop_token_ids: vec![],
        ignore_eos: true,
        algorithm,
    }
}

fn noisy(m: &Qwen3Model, seed: u64) -> Box<dyn Proposer> {
    Box::new(OracleProposer::new(
        m.clone(),
        7,
        Some(Noise {
            corrupt_prob: 0.3,
            seed,
        }),
    ))
}

fn drafter(m: &Qwen3Model, seed: u64) -> Box<dyn Proposer> {
    // Two dense layers tapping a sparse and the dense target layer; mask token 255.
    let cfg = DFlashConfig::for_target(m.config(), 2, 8, 255, Some(vec![0, 1]));
    Box::new(DFlashProposer::new(
        DFlashDrafter::random(cfg, m, seed, OpsMode::Fused).unwrap(),
    ))
}

/// The committed K/V rows of `cache` against a fresh prefill of `tokens[..cache.len()]`.
fn check_against_recompute(m: &Qwen3Model, tokens: &[u32], cache: &SequenceCache, what: &str) {
    let n = cache.len();
    let mut fresh = m.new_cache(n + 1).unwrap();
    let positions: Vec<u32> = (0..n as u32).collect();
    m.forward(
        &mut [SeqForward {
            cache: &mut fresh,
            tokens: &tokens[..n],
            positions: &positions,
            pattern: &AttnPattern::Causal,
            logit_rows: &[],
        }],
        &[],
    )
    .unwrap();
    for li in 0..cache.num_layers() {
        let (ka, va) = cache.view_kv(li, n).unwrap();
        let (kb, vb) = fresh.view_kv(li, n).unwrap();
        let d = max_abs_diff(&ka, &kb).max(max_abs_diff(&va, &vb));
        assert!(d < 1e-4, "{what}: layer {li} K/V differ by {d}");
    }
}

fn generate_checked(
    e: &mut Engine,
    m: &Qwen3Model,
    req: GenerationRequest,
    what: &str,
) -> Vec<u32> {
    let id = e.add(req).unwrap();
    let mut out = Vec::new();
    loop {
        let events = e.step().unwrap();
        if let Some((tokens, cache)) = e.sequence(id) {
            check_against_recompute(m, tokens, cache, what);
        }
        for ev in events.into_iter().filter(|ev| ev.id == id) {
            out.extend_from_slice(&ev.tokens);
            if ev.finished.is_some() {
                return out;
            }
        }
    }
}

#[test]
fn chain_and_ddtree_greedy_on_a_moe_target_match_plain() {
    single_threaded_tensor_ops();
    let m = target();
    for (p, prompt) in PROMPTS.iter().enumerate() {
        let want = Engine::new(m.clone(), None, config())
            .generate(greedy(prompt, Algorithm::Plain, 40))
            .unwrap()
            .0;
        let runs: Vec<(&str, Box<dyn Proposer>, Algorithm)> = vec![
            (
                "oracle chain",
                Box::new(OracleProposer::new(m.clone(), 7, None)),
                Algorithm::Chain,
            ),
            ("noisy chain", noisy(&m, p as u64), Algorithm::Chain),
            (
                "noisy ddtree-4",
                noisy(&m, 10 + p as u64),
                Algorithm::DDTree { budget: 4 },
            ),
            (
                "noisy ddtree-32",
                noisy(&m, 20 + p as u64),
                Algorithm::DDTree { budget: 32 },
            ),
            ("dflash chain", drafter(&m, 9), Algorithm::Chain),
            (
                "dflash ddtree-16",
                drafter(&m, 9),
                Algorithm::DDTree { budget: 16 },
            ),
        ];
        for (name, proposer, algorithm) in runs {
            let mut e = pooled(Engine::new(m.clone(), Some(proposer), config()));
            let what = format!("prompt {p}, {name}");
            let got = generate_checked(&mut e, &m, greedy(prompt, algorithm, 40), &what);
            assert_eq!(
                got, want,
                "{what}: speculative output differs from plain greedy"
            );
        }
    }
}

#[test]
fn a_batch_mixing_algorithms_on_a_moe_target_matches_plain() {
    single_threaded_tensor_ops();
    let m = target();
    let want: Vec<Vec<u32>> = PROMPTS
        .iter()
        .map(|p| {
            Engine::new(m.clone(), None, config())
                .generate(greedy(p, Algorithm::Plain, 24))
                .unwrap()
                .0
        })
        .collect();
    let mut e = pooled(Engine::new(m.clone(), Some(noisy(&m, 3)), config()));
    let algos = [
        Algorithm::Chain,
        Algorithm::DDTree { budget: 16 },
        Algorithm::Plain,
    ];
    let ids: Vec<_> = PROMPTS
        .iter()
        .zip(algos)
        .map(|(p, a)| e.add(greedy(p, a, 24)).unwrap())
        .collect();
    let mut got = vec![Vec::new(); ids.len()];
    while e.num_active() > 0 {
        for ev in e.step().unwrap() {
            let i = ids.iter().position(|&id| id == ev.id).unwrap();
            got[i].extend_from_slice(&ev.tokens);
        }
    }
    assert_eq!(got, want);
}

const SAMPLES: usize = 400;
const NEW: usize = 4;

fn sample_all(
    t: &Qwen3Model,
    proposer: Option<Box<dyn Proposer>>,
    algorithm: Algorithm,
    seed_base: u64,
) -> (Vec<Vec<u32>>, usize) {
    let cfg = EngineConfig {
        max_context: 64,
        max_ddtree_budget: 8,
        eos_token_ids: vec![],
        seed: 0,
    };
    let mut e = Engine::new(t.clone(), proposer, cfg);
    sample_continuations(&mut e, PROMPTS[0], algorithm, SAMPLES, NEW, seed_base)
}

#[test]
fn speculative_sampling_on_a_moe_target_matches_plain_sampling_distribution() {
    single_threaded_tensor_ops();
    let t = target();
    let (plain, _) = sample_all(&t, None, Algorithm::Plain, 1_000_000);
    let (chain, chain_accepted) = sample_all(
        &t,
        Some(Box::new(OracleProposer::new(t.clone(), 3, None))),
        Algorithm::Chain,
        2_000_000,
    );
    let (tree, tree_accepted) = sample_all(
        &t,
        Some(Box::new(OracleProposer::new(
            t.clone(),
            3,
            Some(Noise {
                corrupt_prob: 0.4,
                seed: 5,
            }),
        ))),
        Algorithm::DDTree { budget: 8 },
        3_000_000,
    );
    eprintln!("accepted drafts: chain {chain_accepted}, ddtree {tree_accepted}");
    // The drafts must decide many tokens, or the test would only compare prefill samples.
    assert!(
        chain_accepted > SAMPLES / 2,
        "chain accepted only {chain_accepted} drafts"
    );
    assert!(
        tree_accepted > SAMPLES / 2,
        "tree accepted only {tree_accepted} drafts"
    );
    for (name, spec) in [("chain", &chain), ("ddtree", &tree)] {
        assert_same_distribution(name, &plain, spec);
    }
}
