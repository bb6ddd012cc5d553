//! The harness the per-family losslessness tests share (`hybrid_spec.rs`, `moe_spec.rs`,
//! `hybrid_sampling.rs`, `spec_sampling.rs`): the prompts, requests, the noisy oracle, a
//! committed-state check against a from-scratch prefill, and the seeded sampling runs. Each test
//! file keeps only what is particular to its target family; the checks are the same for every
//! family so that a new target type gets the whole battery by calling these.

use dflash_models::cache::LayerCache;
use dflash_models::speculative::{
    Algorithm, Engine, EngineConfig, GenerationRequest, Noise, OracleProposer, Proposer,
    SamplingParams,
};
use dflash_models::{AttnPattern, SeqForward, SequenceCache, Target};

use crate::{max_abs_diff, sample_continuations};

/// Prompts of 7, 1 and 20 tokens (ids below 96, the tiny fixtures' smallest vocabulary).
pub const PROMPTS: [&[u32]; 3] = [
    &[5, 17, 33, 2, 90, 41, 7],
    &[60],
    &[
        12, 12, 12, 80, 3, 44, 19, 27, 65, 8, 1, 93, 50, 22, 71, 36, 4, 88, 9, 30,
    ],
];

/// Room for the longest prompt plus 40 new tokens and a DDTree of up to 32 nodes.
pub fn lossless_config() -> EngineConfig {
    EngineConfig {
        max_context: 160,
        max_ddtree_budget: 32,
        eos_token_ids: vec![],
        seed: 0,
    }
}

/// The engine on a paged K/V pool of 16 full-context sequences (the serving layout).
pub fn pooled(mut e: Engine) -> Engine {
    e.use_kv_pool(16 * 160).expect("K/V pool");
    e
}

pub fn greedy_request(
    prompt: &[u32],
    algorithm: Algorithm,
    max_new_tokens: usize,
) -> GenerationRequest {
    GenerationRequest {
        prompt: prompt.to_vec(),
        max_new_tokens,
        sampling: SamplingParams::greedy(),
        stop_token_ids: vec![],
        ignore_eos: true,
        algorithm,
    }
}

/// The oracle (the target's own top-1, 7 deep) with 30% of drafts replaced at random depths:
/// chains break and trees branch around the error.
pub fn noisy_oracle(target: impl Into<Target>, seed: u64) -> Box<dyn Proposer> {
    Box::new(OracleProposer::new(
        target,
        7,
        Some(Noise {
            corrupt_prob: 0.3,
            seed,
        }),
    ))
}

/// Plain greedy output of `prompt`, alone on a fresh engine.
pub fn plain_greedy(target: &Target, prompt: &[u32], max_new_tokens: usize) -> Vec<u32> {
    Engine::new(target.clone(), None, lossless_config())
        .generate(greedy_request(prompt, Algorithm::Plain, max_new_tokens))
        .unwrap()
        .0
}

/// The committed part of `cache` against a fresh prefill of `tokens[..cache.len()]`: the K/V
/// rows of attention layers, and for recurrent layers the conv window and delta-rule memory
/// after the last committed token; no per-row recurrent state may outlive the commit.
pub fn assert_committed_matches_recompute(
    target: &Target,
    tokens: &[u32],
    cache: &SequenceCache,
    what: &str,
) {
    let n = cache.len();
    if let Some(tracker) = cache.row_tracker() {
        assert_eq!(
            tracker.settled, n,
            "{what}: per-row states outlive the commit"
        );
    }
    let mut fresh = target.new_cache(n + 1, 0).unwrap();
    let positions: Vec<u32> = (0..n as u32).collect();
    target
        .forward(
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
        match (cache.layer(li), fresh.layer(li)) {
            (LayerCache::Recurrent(a), LayerCache::Recurrent(b)) => {
                assert_eq!(
                    a.staged_rows(),
                    0,
                    "{what}: layer {li} keeps staged rows after the commit"
                );
                let d_conv = max_abs_diff(&a.last().unwrap().conv, &b.last().unwrap().conv);
                let d_ssm = max_abs_diff(&a.last().unwrap().ssm, &b.last().unwrap().ssm);
                assert!(
                    d_conv < 1e-4 && d_ssm < 1e-4,
                    "{what}: layer {li} state after {n} tokens differs from recomputation (conv {d_conv}, ssm {d_ssm})"
                );
            }
            (LayerCache::Attention(_), LayerCache::Attention(_)) => {
                let (ka, va) = cache.view_kv(li, n).unwrap();
                let (kb, vb) = fresh.view_kv(li, n).unwrap();
                let d = max_abs_diff(&ka, &kb).max(max_abs_diff(&va, &vb));
                assert!(d < 1e-4, "{what}: layer {li} K/V differ by {d}");
            }
            _ => panic!("{what}: layer {li} kinds differ"),
        }
    }
}

/// Runs one request to the end, checking the committed state after every step.
pub fn generate_checked(
    e: &mut Engine,
    target: &Target,
    req: GenerationRequest,
    what: &str,
) -> Vec<u32> {
    let id = e.add(req).unwrap();
    let mut out = Vec::new();
    loop {
        let events = e.step().unwrap();
        if let Some((tokens, cache)) = e.sequence(id) {
            assert_committed_matches_recompute(target, tokens, cache, what);
        }
        for ev in events.into_iter().filter(|ev| ev.id == id) {
            out.extend_from_slice(&ev.tokens);
            if ev.finished.is_some() {
                return out;
            }
        }
    }
}

/// Each named run (a proposer and an algorithm) on every prompt equals plain greedy decoding
/// of 40 tokens, on the paged pool, with the committed state checked after every step.
/// `runs(prompt index)` builds fresh proposers for each prompt.
pub fn assert_runs_match_plain_greedy(
    target: &Target,
    mut runs: impl FnMut(usize) -> Vec<(&'static str, Box<dyn Proposer>, Algorithm)>,
) {
    for (p, prompt) in PROMPTS.iter().enumerate() {
        let mut plain = Engine::new(target.clone(), None, lossless_config());
        let plain_req = greedy_request(prompt, Algorithm::Plain, 40);
        let want = generate_checked(&mut plain, target, plain_req, &format!("prompt {p}, plain"));
        for (name, proposer, algorithm) in runs(p) {
            let mut e = pooled(Engine::new(
                target.clone(),
                Some(proposer),
                lossless_config(),
            ));
            let what = format!("prompt {p}, {name}");
            let got =
                generate_checked(&mut e, target, greedy_request(prompt, algorithm, 40), &what);
            assert_eq!(
                got, want,
                "{what}: speculative output differs from plain greedy"
            );
        }
    }
}

/// The oracle chain and the noisy chain and DDTree-4 / DDTree-32 runs every family must pass.
pub fn oracle_runs(target: &Target, p: usize) -> Vec<(&'static str, Box<dyn Proposer>, Algorithm)> {
    vec![
        (
            "oracle chain",
            Box::new(OracleProposer::new(target.clone(), 7, None)),
            Algorithm::Chain,
        ),
        (
            "noisy chain",
            noisy_oracle(target.clone(), p as u64),
            Algorithm::Chain,
        ),
        (
            "noisy ddtree-4",
            noisy_oracle(target.clone(), 10 + p as u64),
            Algorithm::DDTree { budget: 4 },
        ),
        (
            "noisy ddtree-32",
            noisy_oracle(target.clone(), 20 + p as u64),
            Algorithm::DDTree { budget: 32 },
        ),
    ]
}

/// One engine batch holding a chain, a DDTree-16 and a plain request (24 tokens each, one
/// noisy oracle for both speculative ones) emits what each emits alone, with every sequence's
/// committed state checked after every step.
pub fn assert_mixed_batch_matches_plain(target: &Target) {
    let want: Vec<Vec<u32>> = PROMPTS
        .iter()
        .map(|p| plain_greedy(target, p, 24))
        .collect();
    let mut e = pooled(Engine::new(
        target.clone(),
        Some(noisy_oracle(target.clone(), 3)),
        lossless_config(),
    ));
    let algos = [
        Algorithm::Chain,
        Algorithm::DDTree { budget: 16 },
        Algorithm::Plain,
    ];
    let ids: Vec<_> = PROMPTS
        .iter()
        .zip(algos)
        .map(|(p, a)| e.add(greedy_request(p, a, 24)).unwrap())
        .collect();
    let mut got = vec![Vec::new(); ids.len()];
    while e.num_active() > 0 {
        for ev in e.step().unwrap() {
            let i = ids.iter().position(|&id| id == ev.id).unwrap();
            got[i].extend_from_slice(&ev.tokens);
        }
        for (i, &id) in ids.iter().enumerate() {
            if let Some((tokens, cache)) = e.sequence(id) {
                assert_committed_matches_recompute(
                    target,
                    tokens,
                    cache,
                    &format!("batch seq {i}"),
                );
            }
        }
    }
    assert_eq!(got, want);
}

/// Seeded samples (T = 0.8, top-k 6) of `new_tokens` after `prompt`, from plain decoding and
/// from speculative runs; the speculative ones must decide enough tokens to give the
/// comparison power.
pub struct SamplingRun<'a> {
    pub target: &'a Target,
    pub prompt: &'a [u32],
    pub config: EngineConfig,
    pub samples: usize,
    pub new_tokens: usize,
}

impl SamplingRun<'_> {
    /// `(samples, accepted drafts)` of one proposer (None: plain) under seeds from `seed_base`.
    pub fn sample(
        &self,
        proposer: Option<Box<dyn Proposer>>,
        algorithm: Algorithm,
        seed_base: u64,
    ) -> (Vec<Vec<u32>>, usize) {
        let mut e = Engine::new(self.target.clone(), proposer, self.config.clone());
        sample_continuations(
            &mut e,
            self.prompt,
            algorithm,
            self.samples,
            self.new_tokens,
            seed_base,
        )
    }

    /// Plain samples, and the chain (exact oracle) and DDTree-8 (oracle with 40% of drafts
    /// corrupted) samples with their accepted drafts, oracle depth 3.
    #[allow(clippy::type_complexity)]
    pub fn plain_chain_tree(&self) -> (Vec<Vec<u32>>, [(&'static str, Vec<Vec<u32>>, usize); 2]) {
        let (plain, _) = self.sample(None, Algorithm::Plain, 1_000_000);
        let (chain, chain_accepted) = self.sample(
            Some(Box::new(OracleProposer::new(self.target.clone(), 3, None))),
            Algorithm::Chain,
            2_000_000,
        );
        let (tree, tree_accepted) = self.sample(
            Some(Box::new(OracleProposer::new(
                self.target.clone(),
                3,
                Some(Noise {
                    corrupt_prob: 0.4,
                    seed: 5,
                }),
            ))),
            Algorithm::DDTree { budget: 8 },
            3_000_000,
        );
        (
            plain,
            [
                ("chain", chain, chain_accepted),
                ("ddtree-8", tree, tree_accepted),
            ],
        )
    }
}
