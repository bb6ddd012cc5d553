//! Speculative decoding on a hybrid target is lossless at T > 0: the first generated tokens of
//! chain and DDTree verification have the distribution of plain sampling from the target.
//!
//! As `spec_sampling.rs` (with half its sample count, to keep CI short), on the tiny random
//! hybrid target of `dflash_tests::tiny_hybrid` (GDN and gated-attention layers): 400 seeded
//! samples of 4 new tokens per algorithm, temperature 0.8 and top_k 6, drafts from the greedy
//! oracle (chain), the noisy oracle (DDTree-8) and the built-in MTP head (random weights,
//! DDTree-8 from its per-depth top-8); a two-sample chi-square test per position 2..4 and for
//! the pair (2, 3) against plain sampling,
//! bound at p = 1e-4. A sampled token committed with the state of a rejected sibling, or a walk
//! that keeps a draft the target did not sample, moves these distributions far past the bound.

use dflash_models::qwen3_5::MtpHead;
use dflash_models::random::WeightRng;
use dflash_models::speculative::MtpProposer;
use dflash_models::speculative::{
    Algorithm, Engine, EngineConfig, Noise, OracleProposer, Proposer,
};
use dflash_models::{OpsMode, Qwen35Model};
use dflash_tests::{
    assert_same_distribution, sample_continuations, single_threaded_tensor_ops, tiny_hybrid,
};

const SAMPLES: usize = 400;
const NEW: usize = 4;
const PROMPT: [u32; 6] = [5, 17, 33, 2, 90, 41];

fn sample_all(
    t: &Qwen35Model,
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
    sample_continuations(&mut e, &PROMPT, algorithm, SAMPLES, NEW, seed_base)
}

#[test]
fn speculative_sampling_on_a_hybrid_target_matches_plain_sampling_distribution() {
    single_threaded_tensor_ops();
    let t = tiny_hybrid(21);
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
    // The built-in MTP head (random weights) proposing a DDTree from its per-depth top-8: its
    // top-8 sometimes holds the token the target samples among its top-6 of 96 (about 60 accepted
    // drafts over the 400 samples, deterministic for these seeds: fewer decided tokens, so this
    // comparison has less power than the oracle ones).
    let head = MtpHead::random(
        &mut WeightRng::new(4),
        t.config(),
        t.dtype(),
        t.device(),
        OpsMode::Fused,
    )
    .unwrap();
    let (mtp, mtp_accepted) = sample_all(
        &t,
        Some(Box::new(MtpProposer::new(t.clone(), head, 3))),
        Algorithm::DDTree { budget: 8 },
        4_000_000,
    );
    eprintln!(
        "accepted drafts: chain {chain_accepted}, ddtree {tree_accepted}, mtp {mtp_accepted}"
    );
    // The drafts must decide many tokens, or the test would only compare prefill samples.
    assert!(
        chain_accepted > SAMPLES / 2,
        "chain accepted only {chain_accepted} drafts"
    );
    assert!(
        tree_accepted > SAMPLES / 2,
        "tree accepted only {tree_accepted} drafts"
    );
    assert!(
        mtp_accepted > SAMPLES / 8,
        "mtp accepted only {mtp_accepted} drafts"
    );
    for (name, spec) in [("chain", &chain), ("ddtree", &tree), ("mtp ddtree", &mtp)] {
        assert_same_distribution(name, &plain, spec);
    }
}
