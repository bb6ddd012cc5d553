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
use dflash_models::speculative::{Algorithm, EngineConfig, MtpProposer};
use dflash_models::{OpsMode, Target};
use dflash_tests::spec_harness::SamplingRun;
use dflash_tests::{assert_same_distribution, single_threaded_tensor_ops, tiny_hybrid};

const SAMPLES: usize = 400;
const PROMPT: [u32; 6] = [5, 17, 33, 2, 90, 41];

#[test]
fn speculative_sampling_on_a_hybrid_target_matches_plain_sampling_distribution() {
    single_threaded_tensor_ops();
    let m = tiny_hybrid(21);
    let t = Target::from(m.clone());
    let run = SamplingRun {
        target: &t,
        prompt: &PROMPT,
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
    // The built-in MTP head (random weights) proposing a DDTree from its per-depth top-8: its
    // top-8 sometimes holds the token the target samples among its top-6 of 96 (about 60 accepted
    // drafts over the 400 samples, deterministic for these seeds: fewer decided tokens, so this
    // comparison has less power than the oracle ones).
    let head = MtpHead::random(
        &mut WeightRng::new(4),
        m.config(),
        m.dtype(),
        m.device(),
        OpsMode::Fused,
    )
    .unwrap();
    let (mtp, mtp_accepted) = run.sample(
        Some(Box::new(MtpProposer::new(m.clone(), head, 3))),
        Algorithm::DDTree { budget: 8 },
        4_000_000,
    );
    for (name, samples, accepted) in &spec {
        eprintln!("{name}: {accepted} accepted drafts");
        // The drafts must decide many tokens, or the test would only compare prefill samples.
        assert!(
            *accepted > SAMPLES / 2,
            "{name} accepted only {accepted} drafts"
        );
        assert_same_distribution(name, &plain, samples);
    }
    eprintln!("mtp ddtree: {mtp_accepted} accepted drafts");
    assert!(
        mtp_accepted > SAMPLES / 8,
        "mtp accepted only {mtp_accepted} drafts"
    );
    assert_same_distribution("mtp ddtree", &plain, &mtp);
}
