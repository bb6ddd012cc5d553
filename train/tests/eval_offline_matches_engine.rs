//! The offline round replay is exact: on tiny-coder-demo (f32, CPU) the per-round accepted
//! drafts it computes from the cache equal those of the real decoding loop (the engine at
//! temperature 0 with chain and DDTree verification, read from `SeqEvent::round`), round by
//! round, for
//! - a seeded random-init DFlash drafter (drafts almost always rejected) whose every proposal
//!   is also compared with the engine's, so its inputs (cached features of positions `< s`,
//!   block `[y_s, mask...]`) are checked, not only its acceptances;
//! - the noisy oracle (partial acceptances, accepted siblings, branching trees);
//! - the exact oracle (15 of 15 drafts accepted, trees cut at `max_new_tokens` in the last
//!   round).

mod eval_support;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use dflash_common::DFlashConfig;
use dflash_models::speculative::{
    DFlashProposer, Engine, EngineConfig, GenerationRequest, Noise, OracleProposer, ProposeItem,
    Proposer, SamplingParams, SeqId, TopK,
};
use dflash_models::{DFlashDrafter, ModelResult, OpsMode, Qwen3Model};
use dflash_train::eval::{offline_eval, replay_cache, EvalCache, Verify};
use eval_support::*;

const MAX_NEW: usize = 40;
const BUDGETS: [usize; 4] = [1, 4, 16, 64];

/// Proposals by (sequence id, committed length).
type Log = Arc<Mutex<HashMap<(SeqId, usize), TopK>>>;

/// Records every proposal of the proposer it wraps.
struct Recording {
    inner: Box<dyn Proposer>,
    log: Log,
}

impl Proposer for Recording {
    fn max_depth(&self) -> usize {
        self.inner.max_depth()
    }
    fn target_layers(&self) -> Vec<usize> {
        self.inner.target_layers()
    }
    fn open(&mut self, seq: SeqId, capacity: usize) -> ModelResult<()> {
        self.inner.open(seq, capacity)
    }
    fn propose(&mut self, batch: &[ProposeItem<'_>]) -> ModelResult<Vec<TopK>> {
        let out = self.inner.propose(batch)?;
        let mut log = self.log.lock().unwrap();
        for (item, topk) in batch.iter().zip(&out) {
            assert!(
                log.insert((item.seq, item.tokens.len()), topk.clone())
                    .is_none(),
                "one proposal per anchor"
            );
        }
        Ok(out)
    }
    fn close(&mut self, seq: SeqId) {
        self.inner.close(seq)
    }
}

/// Per prompt, the (accepted drafts, tree depth) of every verify round of the real engine;
/// also checks that the engine's output is the cached continuation.
fn engine_rounds(
    target: &Qwen3Model,
    proposer: Box<dyn Proposer>,
    cache: &EvalCache,
    verify: Verify,
) -> Vec<Vec<(usize, usize)>> {
    let budget = match verify {
        Verify::DDTree { budget } => budget,
        Verify::Chain => 1,
    };
    let mut engine = Engine::new(
        target.clone(),
        Some(proposer),
        EngineConfig {
            max_context: CONTEXT - 80,
            max_ddtree_budget: budget,
            eos_token_ids: cache.manifest.eos_token_ids.clone(),
            seed: 0,
        },
    );
    cache
        .prompts
        .iter()
        .map(|p| {
            let id = engine
                .add(GenerationRequest {
                    prompt: p.tokens[..p.prompt_len].to_vec(),
                    max_new_tokens: MAX_NEW,
                    sampling: SamplingParams::greedy(),
                    stop_token_ids: vec![],
                    ignore_eos: false,
                    algorithm: verify.algorithm(),
                })
                .unwrap();
            let (mut rounds, mut emitted) = (Vec::new(), Vec::new());
            'run: loop {
                for e in engine.step().unwrap() {
                    assert_eq!(e.id, id);
                    emitted.extend_from_slice(&e.tokens);
                    if let Some(r) = e.round {
                        rounds.push((r.accepted_drafts, r.max_depth));
                    }
                    if e.finished.is_some() {
                        break 'run;
                    }
                }
            }
            let reference = &p.tokens[p.prompt_len..p.prompt_len + p.generated];
            assert_eq!(
                emitted, reference,
                "{}: speculative output is the cached greedy continuation",
                p.id
            );
            rounds
        })
        .collect()
}

fn replayed(summary: &dflash_train::eval::EvalSummary, verify: Verify) -> Vec<Vec<usize>> {
    summary
        .mode(verify)
        .unwrap()
        .per_prompt
        .iter()
        .map(|p| p.streaks.clone())
        .collect()
}

fn accepted(rounds: &[Vec<(usize, usize)>]) -> Vec<Vec<usize>> {
    rounds
        .iter()
        .map(|r| r.iter().map(|x| x.0).collect())
        .collect()
}

/// The target and its greedy cache, built once and shared by the tests (they run in parallel;
/// the first one builds it).
fn setup() -> &'static (Qwen3Model, EvalCache) {
    static SETUP: OnceLock<(Qwen3Model, EvalCache)> = OnceLock::new();
    SETUP.get_or_init(|| {
        let dir = scratch("exact");
        let prompts = write_prompts(&dir, PROMPTS);
        let target = target();
        let cache =
            EvalCache::build(&target, &spec(&prompts, MAX_NEW, vec![1, 2]), CONTEXT).unwrap();
        for e in &cache.manifest.entries {
            assert_eq!(
                e.teacher_forced_mismatches, 0,
                "{}: f32 teacher forcing reproduces greedy decoding",
                e.id
            );
        }
        (target, cache)
    })
}

#[test]
fn random_drafter_replay_matches_engine_rounds_and_proposals() {
    let (target, cache) = setup();
    let cfg = DFlashConfig::for_target(target.config(), 2, 16, 8191, Some(vec![1, 2]));
    let drafter = DFlashDrafter::random(cfg, target, 7, OpsMode::Fused).unwrap();
    let verifies = Verify::chain_and_budgets(&BUDGETS);

    // The library entry point (prompts batched), and the same replay through a recording
    // proposer: sequence i is prompt i, as in the engine runs below.
    let summary = offline_eval(target, &drafter, cache, &verifies).unwrap();
    let offline: Log = Arc::default();
    let mut recording = Recording {
        inner: Box::new(DFlashProposer::new(drafter.clone())),
        log: offline.clone(),
    };
    let recorded = replay_cache(&mut recording, cache, &verifies, 16, |i| {
        cache.features_for(i, &[1, 2], target.device()).map(Some)
    })
    .unwrap();
    assert_eq!(recorded, summary);
    let offline = offline.lock().unwrap();

    for verify in &verifies {
        let log: Log = Arc::default();
        let proposer = Recording {
            inner: Box::new(DFlashProposer::new(drafter.clone())),
            log: log.clone(),
        };
        let rounds = engine_rounds(target, Box::new(proposer), cache, *verify);
        assert_eq!(
            accepted(&rounds),
            replayed(&summary, *verify),
            "{}",
            verify.label()
        );
        // Every engine proposal equals the offline one at the same anchor (the engine asks
        // for min(budget, vocab) candidates, the replay for the largest budget).
        for (&(seq, len), online) in log.lock().unwrap().iter() {
            let replay = offline.get(&(seq, len)).unwrap_or_else(|| {
                panic!(
                    "{}: no offline proposal for prompt {seq} at length {len}",
                    verify.label()
                )
            });
            assert_eq!(online.depths(), replay.depths());
            for d in 0..online.depths() {
                let (a, b) = (online.row(d), replay.row(d));
                assert_eq!(a.len(), b.len().min(a.len()));
                for (x, y) in a.iter().zip(b) {
                    // Same candidates in the same order, except where two log-probs are tied up
                    // to kernel numerics (the online features come from other forward shapes).
                    assert!(
                        x.0 == y.0 || (x.1 - y.1).abs() < 1e-5,
                        "{} anchor {len} depth {d}: {x:?} vs {y:?}",
                        verify.label()
                    );
                    assert!(
                        (x.1 - y.1).abs() < 1e-4,
                        "{} anchor {len} depth {d}: log-probs {x:?} vs {y:?}",
                        verify.label()
                    );
                }
            }
        }
    }
}

fn oracle_matches_engine(noise: Option<Noise>, budgets: &[usize]) -> Vec<f64> {
    let (target, cache) = setup();
    let mut taus = Vec::new();
    let mut warm = OracleProposer::new(target.clone(), 15, noise);
    for verify in Verify::chain_and_budgets(budgets) {
        // A fresh oracle per mode on both sides: its seeded noise follows the call sequence.
        // Restarted copies keep the greedy continuations already computed (same proposals).
        let mut oracle = warm.restarted();
        let summary = replay_cache(&mut oracle, cache, &[verify], 1, |_| Ok(None)).unwrap();
        let engine = Box::new(oracle.restarted());
        let rounds = engine_rounds(target, engine, cache, verify);
        warm = oracle;
        assert_eq!(
            accepted(&rounds),
            replayed(&summary, verify),
            "{}",
            verify.label()
        );
        taus.push(summary.tau(verify).unwrap());
    }
    taus
}

#[test]
fn noisy_oracle_replay_matches_engine_rounds() {
    let noise = Noise {
        corrupt_prob: 0.3,
        seed: 11,
    };
    let taus = oracle_matches_engine(Some(noise), &[4, 64]);
    // chain, ddtree-4, ddtree-64: partial acceptance, and the big tree beats the chain.
    assert!(taus[0] > 1.5 && taus[0] < 8.0, "chain tau {}", taus[0]);
    assert!(
        taus[2] > taus[0],
        "ddtree-64 tau {} vs chain {}",
        taus[2],
        taus[0]
    );
}

#[test]
fn exact_oracle_replay_matches_engine_rounds() {
    let taus = oracle_matches_engine(None, &BUDGETS);
    // Every draft is right: tau is capped by the depth (15), the budget and the length limit.
    assert!(taus[0] > 10.0, "chain tau {}", taus[0]);
    assert!(
        taus[1] > 1.9 && taus[1] <= 2.0,
        "ddtree-1 accepts one draft per round: {}",
        taus[1]
    );
}
