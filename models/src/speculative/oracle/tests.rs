//! The memo must not change a proposal. A memoised oracle is checked against greedy decoding
//! by full re-forwards, and against an oracle that forgets everything before each call (no
//! memo, a new cache prefilled from the committed tokens), on both target families, through
//! engine-like rounds that commit a varying number of drafts and sometimes a non-greedy token
//! (as sampling at T > 0 does).

use candle_core::{DType, Device};

use super::*;
use crate::layers::ops::OpsMode;
use crate::{Qwen35Model, Qwen3Model};

/// The bundled demo target: a trained model, so greedy continuations vary.
fn qwen3() -> Target {
    let dir =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../serve/assets/tiny-coder-demo");
    Qwen3Model::load(&dir, DType::F32, &Device::Cpu, 256, OpsMode::Fused)
        .unwrap()
        .into()
}

/// A tiny random hybrid target (GDN, gated attention, GDN, GDN), as in tests/src/lib.rs.
fn hybrid() -> Target {
    let cfg = serde_json::json!({
        "model_type": "qwen3_5_text", "vocab_size": 96, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 16,
        "layer_types": ["linear_attention", "full_attention", "linear_attention", "linear_attention"],
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
        "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    });
    let cfg =
        dflash_common::HybridConfig::from_value(std::path::Path::new("tiny-hybrid"), &cfg).unwrap();
    let mut rng = crate::random::WeightRng::new(3);
    Qwen35Model::random(cfg, &mut rng, DType::F32, &Device::Cpu, 256, OpsMode::Fused)
        .unwrap()
        .into()
}

/// Prompts for `t`: two sequences share the first one (the memo serves the second).
fn prompts(t: &Target) -> Vec<Vec<u32>> {
    let v = t.vocab_size() as u32;
    let a: Vec<u32> = [8187, 1723, 198, 1865, 324, 921, 621, 480, 43, 49]
        .iter()
        .map(|x| x % v)
        .collect();
    vec![a.clone(), a, vec![5, 17, 33, 2]]
}

/// Greedy decoding by full re-forwards of the whole context: no cache reuse, no oracle code.
fn reference_greedy(t: &Target, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut ctx = prompt.to_vec();
    for _ in 0..n {
        let mut cache = t.new_cache(ctx.len(), 0).unwrap();
        let positions: Vec<u32> = (0..ctx.len() as u32).collect();
        let out = t
            .forward(
                &mut [SeqForward {
                    cache: &mut cache,
                    tokens: &ctx,
                    positions: &positions,
                    pattern: &AttnPattern::Causal,
                    logit_rows: &[ctx.len() - 1],
                }],
                &[],
            )
            .unwrap();
        let next = out
            .logits
            .unwrap()
            .argmax(1)
            .unwrap()
            .to_vec1::<u32>()
            .unwrap()[0];
        ctx.push(next);
    }
    ctx[prompt.len()..].to_vec()
}

fn propose(p: &mut OracleProposer, seq: SeqId, tokens: &[u32], top_k: usize) -> TopK {
    let item = ProposeItem {
        seq,
        tokens,
        features: None,
        top_k,
    };
    p.propose(&[item]).unwrap().remove(0)
}

/// No rollout row outlives a proposal: the cache holds settled committed tokens only.
fn assert_rolled_back(p: &OracleProposer, seq: SeqId, committed: usize) {
    if let Some(cache) = p.seqs[&seq].cache.as_ref() {
        assert!(cache.len() <= committed, "{} > {committed}", cache.len());
        if let Some(rows) = cache.row_tracker() {
            assert_eq!(
                rows.settled,
                cache.len(),
                "per-row states outlive the proposal"
            );
        }
    }
}

fn exact_oracle_follows_reference(t: Target) {
    let prompt = prompts(&t).remove(0);
    let truth = reference_greedy(&t, &prompt, 11);
    let mut p = OracleProposer::new(t, 4, None);
    p.open(0, 64).unwrap();
    // Round by round, committing 1 or 3 tokens, as the engine would at T=0.
    let mut committed = prompt.clone();
    for step in [1, 3, 1, 1] {
        let got = propose(&mut p, 0, &committed, 1).argmax_tokens();
        let at = committed.len() - prompt.len();
        assert_eq!(got, truth[at..at + 4], "after {at} generated tokens");
        assert_rolled_back(&p, 0, committed.len());
        committed.extend_from_slice(&truth[at..at + step]);
    }
    // A second sequence on the same prompt is answered from the memo alone.
    let forwards = p.target_forwards();
    p.open(1, 64).unwrap();
    assert_eq!(propose(&mut p, 1, &prompt, 1).argmax_tokens(), truth[..4]);
    assert_eq!(
        p.target_forwards(),
        forwards,
        "known prefixes run no target forward"
    );
    assert!(p.seqs[&1].cache.is_none());
    // Past the known continuation it runs the target again, prefilling its own cache.
    let far = [&prompt[..], &truth[..7]].concat();
    assert_eq!(propose(&mut p, 1, &far, 1).argmax_tokens(), truth[7..11]);
    assert!(p.target_forwards() > forwards);
    assert_rolled_back(&p, 1, far.len());
}

#[test]
fn exact_oracle_proposes_the_reference_greedy_continuation_qwen3() {
    exact_oracle_follows_reference(qwen3());
}

#[test]
fn exact_oracle_proposes_the_reference_greedy_continuation_hybrid() {
    exact_oracle_follows_reference(hybrid());
}

/// Noisy top-3 proposals of a memoised oracle and a forgetful one over engine-like rounds;
/// returns both oracles' target forward counts. A round after a greedy bonus starts on the
/// memoised path and leaves it part-way (committed tokens and known drafts fed in one go).
fn memo_matches_fresh(t: Target) -> (usize, usize) {
    let noise = Some(Noise {
        corrupt_prob: 0.3,
        seed: 5,
    });
    let depth = 6;
    let vocab = t.vocab_size() as u32;
    let mut memo = OracleProposer::new(t.clone(), depth, noise);
    let mut fresh = OracleProposer::new(t, depth, noise);
    let mut committed = prompts(&memo.target);
    for i in 0..committed.len() {
        memo.open(i as SeqId, 64).unwrap();
        fresh.open(i as SeqId, 64).unwrap();
    }
    for round in 0..8 {
        let items: Vec<ProposeItem<'_>> = committed
            .iter()
            .enumerate()
            .map(|(i, c)| ProposeItem {
                seq: i as SeqId,
                tokens: c,
                features: None,
                top_k: 3,
            })
            .collect();
        let got = memo.propose(&items).unwrap();
        // One item at a time, each after forgetting, so the noise is drawn in the same order.
        let want: Vec<TopK> = items
            .iter()
            .map(|item| {
                fresh.forget();
                fresh.propose(std::slice::from_ref(item)).unwrap().remove(0)
            })
            .collect();
        assert_eq!(got, want, "round {round}");
        if round == 4 {
            // A restarted copy keeps the memo and proposes what a new oracle would.
            let mut copy = memo.restarted();
            let mut new = OracleProposer::new(copy.target.clone(), depth, noise);
            for p in [&mut copy, &mut new] {
                p.open(0, 64).unwrap();
            }
            assert_eq!(
                propose(&mut copy, 0, items[0].tokens, 3),
                propose(&mut new, 0, items[0].tokens, 3)
            );
            assert_eq!(
                copy.target_forwards(),
                0,
                "known prefixes run no target forward"
            );
        }
        for (i, c) in committed.iter_mut().enumerate() {
            assert_rolled_back(&memo, i as SeqId, c.len());
            // Accept some greedy drafts, then a bonus: greedy on even rounds, another token on
            // odd ones (a sample at T > 0 that leaves the greedy path).
            let truth = memo.rollout(i as SeqId, c).unwrap();
            let accept = (round + 2 * i) % depth;
            c.extend_from_slice(&truth[..accept]);
            let bonus = truth[accept];
            c.push(if round % 2 == 1 {
                (bonus + 1) % vocab
            } else {
                bonus
            });
        }
    }
    (memo.target_forwards(), fresh.target_forwards())
}

#[test]
fn memoised_proposals_equal_fresh_ones_qwen3() {
    let (memo, fresh) = memo_matches_fresh(qwen3());
    assert!(
        memo < fresh,
        "memo {memo} vs fresh {fresh} forwards: the memo served nothing"
    );
}

#[test]
fn memoised_proposals_equal_fresh_ones_hybrid() {
    let (memo, fresh) = memo_matches_fresh(hybrid());
    assert!(
        memo < fresh,
        "memo {memo} vs fresh {fresh} forwards: the memo served nothing"
    );
}
