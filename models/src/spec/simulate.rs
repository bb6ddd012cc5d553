//! Simulated acceptance, for measuring system cost without a trained drafter (SGLang's
//! `SGLANG_SIMULATE_ACC_LEN`): the walk accepts a fixed or sampled number of drafts whatever
//! the target says, so a random-weight drafter and target run the exact kernels, shapes and
//! bookkeeping of a real run that reaches acceptance length `1 + mean_accepted`.
//!
//! NOT lossless: committed drafts are not checked against the target. Benchmarks only; the
//! engine uses it only when [`crate::spec::Engine::simulate_acceptance`] was called.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha20Rng;

use crate::error::ModelResult;
use crate::spec::proposer::{ProposeItem, Proposer, SeqId};
use crate::spec::tree::{DraftTree, TopK};

/// How many drafts the simulated walk accepts per round.
#[derive(Debug, Clone)]
pub struct SimulatedAcceptance {
    /// Mean accepted drafts per round; a fractional part is a Bernoulli draw
    /// (`5.5` accepts 5 or 6 with equal odds), so tokens per round average `1 + mean`.
    pub mean_accepted: f64,
    rng: ChaCha20Rng,
}

impl SimulatedAcceptance {
    pub fn new(mean_accepted: f64, seed: u64) -> Self {
        Self {
            mean_accepted: mean_accepted.max(0.0),
            rng: ChaCha20Rng::seed_from_u64(seed),
        }
    }

    /// Drafts to accept this round.
    fn draw(&mut self) -> usize {
        let whole = self.mean_accepted.floor();
        let frac = self.mean_accepted - whole;
        whole as usize + usize::from(frac > 0.0 && self.rng.random::<f64>() < frac)
    }

    /// The walk's contract ([`crate::spec::walk`]): accepted entries (root first) and the
    /// target's token after the last one. Follows the best-ranked child at every level, as a
    /// drafter whose top choice is right would; stops early only where the tree ends.
    pub fn walk(&mut self, tree: &DraftTree, target_tokens: &[u32]) -> (Vec<usize>, u32) {
        let want = self.draw();
        let mut accepted = vec![0];
        let mut cur = 0;
        while accepted.len() <= want {
            match tree.children(cur).first() {
                Some(&(_, child)) => {
                    cur = child;
                    accepted.push(cur);
                }
                None => break,
            }
        }
        (accepted, target_tokens[cur])
    }
}

/// Wraps a proposer, keeping its cost and its candidate tokens but replacing the log-probs by
/// a fixed profile (rank r at every depth: `ln(top)` for r = 0, then halving mass). A
/// random-weight drafter's flat distributions would build a wide, one-level DDTree; this gives
/// the deep-main-path shape of a trained drafter, so the simulated walk can reach its length.
pub struct PeakedProposer<P: Proposer> {
    inner: P,
    top: f32,
}

impl<P: Proposer> PeakedProposer<P> {
    /// `top`: probability of the rank-1 candidate at every depth (0 < top < 1).
    pub fn new(inner: P, top: f32) -> Self {
        Self {
            inner,
            top: top.clamp(1e-3, 0.999),
        }
    }

    fn reshape(&self, topk: TopK) -> TopK {
        // The profile depends on the rank alone: one ln per rank, not per candidate.
        let widest = (0..topk.depths())
            .map(|d| topk.row(d).len())
            .max()
            .unwrap_or(0);
        let profile: Vec<f32> = (0..widest)
            .map(|r| {
                let p = if r == 0 {
                    self.top
                } else {
                    (1.0 - self.top) * 0.5f32.powi(r as i32)
                };
                p.ln()
            })
            .collect();
        let rows = (0..topk.depths())
            .map(|d| {
                topk.row(d)
                    .iter()
                    .zip(&profile)
                    .map(|(&(t, _), &lp)| (t, lp))
                    .collect()
            })
            .collect();
        TopK::new(rows)
    }
}

impl<P: Proposer> Proposer for PeakedProposer<P> {
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
        Ok(self
            .inner
            .propose(batch)?
            .into_iter()
            .map(|t| self.reshape(t))
            .collect())
    }
    fn close(&mut self, seq: SeqId) {
        self.inner.close(seq)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::tree::{build_ddtree, chain_tree};

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

    fn tiny_engine(depth: usize) -> crate::spec::Engine {
        use candle_core::{DType, Device};
        use dflash_common::{LayerType, Qwen3Config, RopeScaling};
        let cfg = Qwen3Config {
            vocab_size: 64,
            hidden_size: 32,
            intermediate_size: 64,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 8,
            rms_norm_eps: 1e-6,
            rope_theta: 10000.0,
            rope_scaling: RopeScaling::Default,
            max_position_embeddings: 256,
            tie_word_embeddings: true,
            eos_token_ids: vec![],
            bos_token_id: None,
            layer_types: vec![LayerType::FullAttention; 2],
            sliding_window: None,
        };
        let target =
            crate::Qwen3Model::random(cfg, 1, DType::F32, &Device::Cpu, 256, crate::OpsMode::Fused)
                .unwrap();
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
        let config = crate::spec::EngineConfig {
            max_context: 200,
            max_ddtree_budget: 16,
            eos_token_ids: vec![],
            seed: 0,
        };
        crate::spec::Engine::new(target, Some(Box::new(Drafts(depth))), config)
    }

    #[test]
    fn engine_with_simulated_acceptance_k_commits_k_plus_one_tokens_per_round() {
        use crate::spec::{Algorithm, GenerationRequest, SamplingParams};
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
}
