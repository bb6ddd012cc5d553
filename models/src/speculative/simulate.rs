//! Simulated acceptance, for measuring system cost without a trained drafter (SGLang's
//! `SGLANG_SIMULATE_ACC_LEN`): the walk accepts a fixed or sampled number of drafts whatever
//! the target says, so a random-weight drafter and target run the exact kernels, shapes and
//! bookkeeping of a real run that reaches acceptance length `1 + mean_accepted`.
//!
//! NOT lossless: committed drafts are not checked against the target. Benchmarks only; the
//! engine uses it only when [`crate::speculative::Engine::simulate_acceptance`] was called.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha20Rng;

use crate::error::ModelResult;
use crate::speculative::proposer::{ProposeItem, Proposer, SeqId};
use crate::speculative::tree::{DraftTree, TopK};

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

    /// The walk's contract ([`crate::speculative::walk`]): accepted entries (root first) and the
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
    fn cache_bytes_per_row(&self) -> usize {
        self.inner.cache_bytes_per_row()
    }
    fn use_kv_pool(&mut self, pages: usize) -> ModelResult<()> {
        self.inner.use_kv_pool(pages)
    }
    fn reserve(&mut self, seq: SeqId, committed: usize) -> ModelResult<()> {
        self.inner.reserve(seq, committed)
    }
}

#[cfg(test)]
mod tests;
