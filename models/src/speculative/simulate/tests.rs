//! Tests of the simulated acceptance walk and of the engine under it (a separate file: they
//! drive the engine, which itself uses this walk).

use super::*;
use crate::speculative::tree::{build_ddtree, chain_tree};

#[test]
fn fixed_acceptance_k_commits_exactly_k_drafts_and_the_target_token() {
    let tree = chain_tree(7, &[10, 11, 12, 13, 14, 15]);
    let target: Vec<u32> = (100..107).collect();
    for k in 0..=6 {
        let mut sim = SimulatedAcceptance::new(k as f64, 0);
        let (acc, next) = sim.walk(&tree, &target);
        assert_eq!(acc, (0..=k).collect::<Vec<_>>(), "k = {k}");
        assert_eq!(
            next, target[k],
            "bonus token is the target's at the last node"
        );
    }
    // deeper than the tree: stops at the leaf
    let (acc, next) = SimulatedAcceptance::new(9.0, 0).walk(&tree, &target);
    assert_eq!((acc.len(), next), (7, 106));
}

#[test]
fn fractional_acceptance_averages_its_mean() {
    let tree = chain_tree(0, &[1; 15]);
    let target = vec![5u32; 16];
    let mut sim = SimulatedAcceptance::new(5.5, 3);
    let n = 4000;
    let mut total = 0;
    for _ in 0..n {
        let (acc, _) = sim.walk(&tree, &target);
        assert!(
            acc.len() == 6 || acc.len() == 7,
            "5 or 6 drafts, got {}",
            acc.len() - 1
        );
        total += acc.len() - 1;
    }
    let mean = total as f64 / n as f64;
    assert!((mean - 5.5).abs() < 0.05, "mean accepted {mean}");
}

#[test]
fn simulated_walk_follows_the_best_ranked_path_of_a_tree() {
    // Peaked profile: the rank-1 chain is the tree's main path.
    let rows: Vec<Vec<(u32, f32)>> = (0..4)
        .map(|d| (0..3).map(|r| (10 * d + r, 0.0)).collect())
        .collect();
    struct Fixed(Vec<Vec<(u32, f32)>>);
    impl Proposer for Fixed {
        fn max_depth(&self) -> usize {
            self.0.len()
        }
        fn target_layers(&self) -> Vec<usize> {
            vec![]
        }
        fn open(&mut self, _: SeqId, _: usize) -> ModelResult<()> {
            Ok(())
        }
        fn propose(&mut self, b: &[ProposeItem<'_>]) -> ModelResult<Vec<TopK>> {
            Ok(b.iter().map(|_| TopK::new(self.0.clone())).collect())
        }
        fn close(&mut self, _: SeqId) {}
    }
    let mut p = PeakedProposer::new(Fixed(rows), 0.9);
    let topk = p
        .propose(&[ProposeItem {
            seq: 0,
            tokens: &[1],
            features: None,
            top_k: 3,
        }])
        .unwrap()
        .remove(0);
    let tree = build_ddtree(1, &topk, 8);
    assert!(
        tree.depths.iter().copied().max() == Some(4),
        "main path reaches depth 4"
    );
    let target = vec![0u32; tree.len()];
    let (acc, _) = SimulatedAcceptance::new(4.0, 0).walk(&tree, &target);
    let path: Vec<u32> = acc[1..].iter().map(|&n| tree.tokens[n]).collect();
    assert_eq!(path, vec![0, 10, 20, 30], "rank-1 token at every depth");
}

fn tiny_engine(depth: usize) -> crate::speculative::Engine {
    let target = crate::speculative::tiny_test_target(256, 1);
    struct Drafts(usize);
    impl Proposer for Drafts {
        fn max_depth(&self) -> usize {
            self.0
        }
        fn target_layers(&self) -> Vec<usize> {
            vec![]
        }
        fn open(&mut self, _: SeqId, _: usize) -> ModelResult<()> {
            Ok(())
        }
        fn propose(&mut self, b: &[ProposeItem<'_>]) -> ModelResult<Vec<TopK>> {
            let rows = (0..self.0)
                .map(|d| vec![(d as u32 + 1, -0.1), (d as u32 + 20, -2.0)])
                .collect::<Vec<_>>();
            Ok(b.iter().map(|_| TopK::new(rows.clone())).collect())
        }
        fn close(&mut self, _: SeqId) {}
    }
    let config = crate::speculative::EngineConfig {
        max_context: 200,
        max_ddtree_budget: 16,
        eos_token_ids: vec![],
        seed: 0,
    };
    crate::speculative::Engine::new(target, Some(Box::new(Drafts(depth))), config)
}

#[test]
fn engine_with_simulated_acceptance_k_commits_k_plus_one_tokens_per_round() {
    use crate::speculative::{Algorithm, GenerationRequest, SamplingParams};
    for (algorithm, k) in [
        (Algorithm::Chain, 3usize),
        (Algorithm::DDTree { budget: 12 }, 4),
        (Algorithm::Chain, 0),
    ] {
        let mut engine = tiny_engine(6);
        engine.simulate_acceptance(SimulatedAcceptance::new(k as f64, 0));
        let id = engine
            .add(GenerationRequest {
                prompt: vec![3, 4, 5],
                max_new_tokens: 1 + 5 * (k + 1),
                sampling: SamplingParams::greedy(),
                stop_token_ids: vec![],
                ignore_eos: true,
                algorithm,
            })
            .unwrap();
        let mut rounds = Vec::new();
        let mut done = false;
        while !done {
            for e in engine.step().unwrap() {
                assert_eq!(e.id, id);
                if let Some(r) = e.round {
                    rounds.push((r.accepted_drafts, e.tokens.len()));
                }
                done |= e.finished.is_some();
            }
        }
        assert_eq!(rounds.len(), 5, "{algorithm:?}: {rounds:?}");
        for (acc, committed) in rounds {
            assert_eq!((acc, committed), (k, k + 1), "{algorithm:?}");
        }
    }
}
