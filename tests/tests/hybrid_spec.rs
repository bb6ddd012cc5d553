//! Speculative decoding on a hybrid (Gated DeltaNet + gated attention) target is lossless.
//!
//! A tiny random Qwen3.5-shaped target (4 layers: GDN, gated attention, GDN, GDN) in f32 on the
//! CPU, driven by the greedy oracle and the noisy oracle (wrong top-1 drafts at random depths,
//! so chains break and trees branch around the error). At T = 0 every speculative run must
//! emit exactly the plain greedy tokens; after every engine step the committed recurrent state
//! (conv window and delta-rule memory of every GDN layer) and the K/V rows must equal a
//! from-scratch prefill of the committed tokens, and no per-node state of rejected branches may
//! remain. A tree node that started from the previous node's state instead of its parent's, or
//! a commit of the wrong node's state, breaks both.

use dflash_models::cache::LayerCache;
use dflash_models::speculative::{Algorithm, Engine, OracleProposer, Proposer};
use dflash_models::{AttnPattern, Qwen35Model, SeqForward, SequenceCache, Target};
use dflash_tests::spec_harness::{
    assert_committed_matches_recompute, assert_mixed_batch_matches_plain,
    assert_runs_match_plain_greedy, generate_checked, greedy_request as request,
    lossless_config as config, noisy_oracle, oracle_runs, pooled, PROMPTS,
};
use dflash_tests::{max_abs_diff, single_threaded_tensor_ops, tiny_hybrid};

#[test]
fn chain_and_ddtree_greedy_on_a_hybrid_target_match_plain_with_recomputed_states() {
    single_threaded_tensor_ops();
    let t = Target::from(tiny_hybrid(7));
    assert_runs_match_plain_greedy(&t, |p| oracle_runs(&t, p));
}

#[test]
fn a_batch_mixing_algorithms_on_a_hybrid_target_matches_plain() {
    single_threaded_tensor_ops();
    assert_mixed_batch_matches_plain(&tiny_hybrid(11).into());
}

#[test]
fn an_uncompacted_tree_cannot_be_extended_or_truncated_through() {
    single_threaded_tensor_ops();
    let m = tiny_hybrid(3);
    let mut cache = m.new_cache_with_rollback(32, 8).unwrap();
    let fwd =
        |cache: &mut SequenceCache, tokens: &[u32], positions: &[u32], pattern: &AttnPattern| {
            m.forward(
                &mut [SeqForward {
                    cache,
                    tokens,
                    positions,
                    pattern,
                    logit_rows: &[],
                }],
                &[],
            )
            .map(|_| ())
        };
    fwd(&mut cache, &[1, 2, 3], &[0, 1, 2], &AttnPattern::Causal).unwrap();
    // root, two children of the root, one grandchild under the second child
    let tree = AttnPattern::Tree {
        parents: vec![None, Some(0), Some(0), Some(2)],
    };
    fwd(&mut cache, &[4, 5, 6, 7], &[3, 4, 4, 5], &tree).unwrap();
    let e = fwd(&mut cache, &[8], &[7], &AttnPattern::Causal)
        .unwrap_err()
        .to_string();
    assert!(e.contains("uncommitted tree"), "{e}");
    assert!(cache
        .clone()
        .truncate(6)
        .unwrap_err()
        .to_string()
        .contains("tree"));
    assert!(
        cache.clone().compact(3, &[3, 4, 6]).is_err(),
        "not one path"
    );
    // The path root -> second child -> grandchild commits the grandchild's state.
    cache.compact(3, &[3, 5, 6]).unwrap();
    let mut fresh = m.new_cache(32).unwrap();
    fwd(
        &mut fresh,
        &[1, 2, 3, 4, 6, 7],
        &[0, 1, 2, 3, 4, 5],
        &AttnPattern::Causal,
    )
    .unwrap();
    let (LayerCache::Recurrent(a), LayerCache::Recurrent(b)) = (cache.layer(0), fresh.layer(0))
    else {
        panic!("layer 0 is GDN")
    };
    assert!(max_abs_diff(&a.last().unwrap().ssm, &b.last().unwrap().ssm) < 1e-4);
    assert!(max_abs_diff(&a.last().unwrap().conv, &b.last().unwrap().conv) < 1e-4);
}

/// A random DFlash drafter in the Qwen3.6 style (a sliding-window layer then a full one) tapping
/// two GDN layers and the attention layer of the hybrid target: drafts are mostly rejected, so
/// every round rolls recurrent state back, and the output must still be plain greedy's.
#[test]
fn dflash_drafter_tapping_recurrent_layers_keeps_hybrid_greedy_output() {
    use dflash_common::{DFlashConfig, LayerType, Qwen3Config, RopeScaling};
    use dflash_models::speculative::DFlashProposer;
    use dflash_models::{DFlashDrafter, OpsMode};
    single_threaded_tensor_ops();
    let m = tiny_hybrid(5);
    let layers = Qwen3Config {
        vocab_size: 96,
        hidden_size: 32,
        intermediate_size: 64,
        num_hidden_layers: 2,
        num_attention_heads: 2,
        num_key_value_heads: 1,
        head_dim: 16,
        rms_norm_eps: 1e-6,
        rope_theta: 1e4,
        rope_scaling: RopeScaling::Default,
        max_position_embeddings: 256,
        tie_word_embeddings: false,
        eos_token_ids: vec![],
        bos_token_id: None,
        layer_types: vec![LayerType::SlidingAttention, LayerType::FullAttention],
        sliding_window: Some(4),
        moe: None,
    };
    let cfg = DFlashConfig {
        layers,
        block_size: 8,
        mask_token_id: 95,
        target_layer_ids: vec![0, 1, 3],
    };
    for (p, prompt) in PROMPTS.iter().enumerate() {
        let want = Engine::new(m.clone(), None, config())
            .generate(request(prompt, Algorithm::Plain, 24))
            .unwrap()
            .0;
        for algorithm in [Algorithm::Chain, Algorithm::DDTree { budget: 16 }] {
            let drafter = DFlashDrafter::random(cfg.clone(), &m, 9, OpsMode::Fused).unwrap();
            let mut e = pooled(Engine::new(
                m.clone(),
                Some(Box::new(DFlashProposer::new(drafter))),
                config(),
            ));
            let what = format!("prompt {p}, dflash {algorithm:?}");
            let got = generate_checked(
                &mut e,
                &Target::from(m.clone()),
                request(prompt, algorithm, 24),
                &what,
            );
            assert_eq!(got, want, "{what}");
        }
    }
}

/// The built-in MTP head (random weights) as a chain and a tree proposer: drafting feeds back
/// the head's own output and rolls its cache back each round; the output must stay plain
/// greedy's and the committed target state must match a recomputation after every step.
#[test]
fn mtp_head_chain_and_tree_on_a_hybrid_target_match_plain() {
    use dflash_models::qwen3_5::MtpHead;
    use dflash_models::random::WeightRng;
    use dflash_models::speculative::MtpProposer;
    use dflash_models::OpsMode;
    single_threaded_tensor_ops();
    let m = tiny_hybrid(13);
    let mut accepted = 0;
    for (p, prompt) in PROMPTS.iter().enumerate() {
        let want = Engine::new(m.clone(), None, config())
            .generate(request(prompt, Algorithm::Plain, 24))
            .unwrap()
            .0;
        for algorithm in [Algorithm::Chain, Algorithm::DDTree { budget: 8 }] {
            let head = MtpHead::random(
                &mut WeightRng::new(17),
                m.config(),
                m.dtype(),
                m.device(),
                OpsMode::Fused,
            )
            .unwrap();
            let proposer = MtpProposer::new(m.clone(), head, 3);
            let mut e = pooled(Engine::new(m.clone(), Some(Box::new(proposer)), config()));
            let what = format!("prompt {p}, mtp {algorithm:?}");
            let id = e.add(request(prompt, algorithm, 24)).unwrap();
            let mut got = Vec::new();
            'run: loop {
                let events = e.step().unwrap();
                if let Some((tokens, cache)) = e.sequence(id) {
                    assert_committed_matches_recompute(
                        &Target::from(m.clone()),
                        tokens,
                        cache,
                        &what,
                    );
                }
                for ev in events {
                    accepted += ev.round.as_ref().map_or(0, |r| r.accepted_drafts);
                    got.extend_from_slice(&ev.tokens);
                    if ev.finished.is_some() {
                        break 'run;
                    }
                }
            }
            assert_eq!(got, want, "{what}");
        }
    }
    eprintln!("mtp accepted {accepted}");
}

/// The MTP proposer's drafts for a committed prefix do not depend on how the prefix was
/// committed: rounds that append 1..5 pairs at a time (rolling back 3 draft rows each time)
/// give the drafts of a fresh head fed the whole prefix at once.
#[test]
fn mtp_drafts_depend_only_on_the_committed_prefix() {
    use dflash_models::qwen3_5::MtpHead;
    use dflash_models::random::WeightRng;
    use dflash_models::speculative::{MtpProposer, ProposeItem};
    use dflash_models::OpsMode;
    single_threaded_tensor_ops();
    let m = tiny_hybrid(19);
    let tokens = Engine::new(m.clone(), None, config())
        .generate(request(PROMPTS[0], Algorithm::Plain, 20))
        .unwrap()
        .0;
    let tokens: Vec<u32> = PROMPTS[0].iter().copied().chain(tokens).collect();
    let n_all = tokens.len() - 1;
    let last = m.config().num_hidden_layers - 1;
    let mut cache = m.new_cache(64).unwrap();
    let positions: Vec<u32> = (0..n_all as u32).collect();
    let feats = m
        .forward(
            &mut [SeqForward {
                cache: &mut cache,
                tokens: &tokens[..n_all],
                positions: &positions,
                pattern: &AttnPattern::Causal,
                logit_rows: &[],
            }],
            &[last],
        )
        .unwrap()
        .taps
        .unwrap();
    let head = || {
        MtpHead::random(
            &mut WeightRng::new(3),
            m.config(),
            m.dtype(),
            m.device(),
            OpsMode::Fused,
        )
        .unwrap()
    };
    let mut incremental = MtpProposer::new(m.clone(), head(), 3);
    incremental.open(0, 64).unwrap();
    let mut n = PROMPTS[0].len();
    let mut prev = 0;
    for step in [1usize, 3, 2, 5, 1, 4].iter().cycle() {
        if n > n_all {
            break;
        }
        let f = feats.narrow(0, prev, n - prev).unwrap();
        let got = incremental
            .propose(&[ProposeItem {
                seq: 0,
                tokens: &tokens[..=n],
                features: Some(&f),
                top_k: 4,
            }])
            .unwrap();
        let mut fresh = MtpProposer::new(m.clone(), head(), 3);
        fresh.open(1, 64).unwrap();
        let f = feats.narrow(0, 0, n).unwrap();
        let want = fresh
            .propose(&[ProposeItem {
                seq: 1,
                tokens: &tokens[..=n],
                features: Some(&f),
                top_k: 4,
            }])
            .unwrap();
        for d in 0..3 {
            let (a, b) = (got[0].row(d), want[0].row(d));
            assert_eq!(
                a.iter().map(|x| x.0).collect::<Vec<_>>(),
                b.iter().map(|x| x.0).collect::<Vec<_>>(),
                "n {n} depth {d}"
            );
            for (x, y) in a.iter().zip(b) {
                assert!(
                    (x.1 - y.1).abs() < 1e-4,
                    "n {n} depth {d}: logprob {} vs {}",
                    x.1,
                    y.1
                );
            }
        }
        prev = n;
        n += step;
    }
}

/// The MoE fixture (every layer sparse: the router picks experts per verified row, tree nodes
/// included) decodes losslessly too: oracle chain, noisy DDTree and a (sparse) MTP head chain
/// emit the plain greedy tokens and keep the committed state equal to a recomputation.
#[test]
fn chain_and_ddtree_greedy_on_a_moe_hybrid_target_match_plain() {
    single_threaded_tensor_ops();
    let m = Qwen35Model::load(
        &dflash_tests::fixture("qwen3_5_moe-tiny-random"),
        candle_core::DType::F32,
        &candle_core::Device::Cpu,
        160,
        dflash_models::OpsMode::Fused,
    )
    .unwrap();
    let prompt = PROMPTS[0];
    let mut plain = Engine::new(m.clone(), None, config());
    let want = generate_checked(
        &mut plain,
        &Target::from(m.clone()),
        request(prompt, Algorithm::Plain, 24),
        "plain",
    );
    let runs: Vec<(&str, Box<dyn Proposer>, Algorithm)> = vec![
        (
            "oracle chain",
            Box::new(OracleProposer::new(m.clone(), 7, None)),
            Algorithm::Chain,
        ),
        (
            "noisy ddtree-8",
            noisy_oracle(m.clone(), 5),
            Algorithm::DDTree { budget: 8 },
        ),
        // A random MTP head whose layer is sparse too (as MoE checkpoints ship it).
        (
            "mtp chain",
            Box::new(dflash_models::speculative::MtpProposer::new(
                m.clone(),
                dflash_models::qwen3_5::MtpHead::random(
                    &mut dflash_models::random::WeightRng::new(17),
                    m.config(),
                    m.dtype(),
                    m.device(),
                    dflash_models::OpsMode::Fused,
                )
                .unwrap(),
                3,
            )),
            Algorithm::Chain,
        ),
    ];
    for (name, proposer, algorithm) in runs {
        let mut e = pooled(Engine::new(m.clone(), Some(proposer), config()));
        let what = format!("moe {name}");
        let got = generate_checked(
            &mut e,
            &Target::from(m.clone()),
            request(prompt, algorithm, 24),
            &what,
        );
        assert_eq!(
            got, want,
            "{what}: speculative output differs from plain greedy"
        );
    }
}
