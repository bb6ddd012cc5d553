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
use dflash_models::speculative::{Algorithm, DFlashProposer, EngineConfig, Proposer};
use dflash_models::{DFlashDrafter, OpsMode, Qwen3Model, Target};
use dflash_tests::spec_harness::{
    assert_mixed_batch_matches_plain, assert_runs_match_plain_greedy, oracle_runs, SamplingRun,
    PROMPTS,
};
use dflash_tests::{assert_same_distribution, fixture, single_threaded_tensor_ops};

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

fn drafter(m: &Qwen3Model, seed: u64) -> Box<dyn Proposer> {
    // Two dense layers tapping a sparse and the dense target layer; mask token 255.
    let cfg = DFlashConfig::for_target(m.config(), 2, 8, 255, Some(vec![0, 1]));
    Box::new(DFlashProposer::new(
        DFlashDrafter::random(cfg, m, seed, OpsMode::Fused).unwrap(),
    ))
}

#[test]
fn chain_and_ddtree_greedy_on_a_moe_target_match_plain() {
    single_threaded_tensor_ops();
    let m = target();
    let t = Target::from(m.clone());
    assert_runs_match_plain_greedy(&t, |p| {
        let mut runs = oracle_runs(&t, p);
        runs.push(("dflash chain", drafter(&m, 9), Algorithm::Chain));
        runs.push((
            "dflash ddtree-16",
            drafter(&m, 9),
            Algorithm::DDTree { budget: 16 },
        ));
        runs
    });
}

#[test]
fn a_batch_mixing_algorithms_on_a_moe_target_matches_plain() {
    single_threaded_tensor_ops();
    assert_mixed_batch_matches_plain(&target().into());
}

const SAMPLES: usize = 400;

#[test]
fn speculative_sampling_on_a_moe_target_matches_plain_sampling_distribution() {
    single_threaded_tensor_ops();
    let t = target().into();
    let run = SamplingRun {
        target: &t,
        prompt: PROMPTS[0],
        config: EngineConfig {
            max_context: 64,
            max_ddtree_budget: 8,
            eos_token_ids: vec![],
            seed: 0,
        },
        samples: SAMPLES,
        new_tokens: 4,
    };
    let (plain, spec) = run.plain_chain_tree();
    for (name, samples, accepted) in &spec {
        eprintln!("{name}: {accepted} accepted drafts");
        // The drafts must decide many tokens, or the test would only compare prefill samples.
        assert!(
            *accepted > SAMPLES / 2,
            "{name} accepted only {accepted} drafts"
        );
        assert_same_distribution(name, &plain, samples);
    }
}
