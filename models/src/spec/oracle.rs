//! Test and benchmark proposers that know the target's own greedy continuation.
//!
//! `OracleProposer` runs the target itself greedily `max_depth` tokens ahead of the committed
//! context, so at temperature 0 every draft is accepted (tau reaches the block size). With
//! noise it corrupts some depths: a wrong token takes rank 1 and the true one drops to rank 2,
//! and probability is spread over alternatives, so chains break where trees branch around the
//! error. Both exercise long, partial and branching acceptances without a trained drafter.

use std::collections::HashMap;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::attention::AttnPattern;
use crate::error::{ModelError, ModelResult};
use crate::kv_cache::SequenceCache;
use crate::qwen3::SeqForward;
use crate::spec::proposer::{ProposeItem, Proposer, SeqId};
use crate::spec::tree::TopK;
use crate::target::{DraftTarget, Target};

#[derive(Debug, Clone, Copy)]
pub struct Noise {
    /// Chance that a depth's top-1 is replaced by a wrong token.
    pub corrupt_prob: f64,
    pub seed: u64,
}

pub struct OracleProposer {
    target: Target,
    max_depth: usize,
    noise: Option<Noise>,
    rng: ChaCha8Rng,
    caches: HashMap<SeqId, SequenceCache>,
}

impl OracleProposer {
    pub fn new(target: impl Into<Target>, max_depth: usize, noise: Option<Noise>) -> Self {
        let seed = noise.map(|n| n.seed).unwrap_or(0);
        Self {
            target: target.into(),
            max_depth,
            noise,
            rng: ChaCha8Rng::seed_from_u64(seed),
            caches: HashMap::new(),
        }
    }

    fn greedy_next(&self, cache: &mut SequenceCache, tokens: &[u32]) -> ModelResult<u32> {
        let start = cache.len() as u32;
        let positions: Vec<u32> = (start..start + tokens.len() as u32).collect();
        let out = self.target.forward(
            &mut [SeqForward {
                cache,
                tokens,
                positions: &positions,
                pattern: &AttnPattern::Causal,
                logit_rows: &[tokens.len() - 1],
            }],
            &[],
        )?;
        let logits = out
            .logits
            .ok_or_else(|| ModelError::BadInput("no logits".into()))?;
        Ok(logits.argmax(1)?.to_vec1::<u32>()?[0])
    }

    fn other_token(&mut self, avoid: u32) -> u32 {
        let vocab = self.target.vocab_size() as u32;
        loop {
            let t = self.rng.random_range(0..vocab);
            if t != avoid {
                return t;
            }
        }
    }

    fn distribution(&mut self, truth: u32, top_k: usize) -> Vec<(u32, f32)> {
        let corrupt = self
            .noise
            .is_some_and(|n| self.rng.random_bool(n.corrupt_prob));
        let wrong = self.other_token(truth);
        let mut third = self.other_token(truth);
        while third == wrong {
            third = self.other_token(truth);
        }
        let mut d = if corrupt {
            vec![
                (wrong, 0.55f32.ln()),
                (truth, 0.35f32.ln()),
                (third, 0.10f32.ln()),
            ]
        } else if self.noise.is_some() {
            vec![
                (truth, 0.80f32.ln()),
                (wrong, 0.15f32.ln()),
                (third, 0.05f32.ln()),
            ]
        } else {
            vec![(truth, 0.0)]
        };
        d.truncate(top_k.max(1));
        d
    }
}

impl Proposer for OracleProposer {
    fn max_depth(&self) -> usize {
        self.max_depth
    }

    fn target_layers(&self) -> Vec<usize> {
        Vec::new()
    }

    fn open(&mut self, seq: SeqId, capacity: usize) -> ModelResult<()> {
        // Rollouts are single tokens; each is rolled back after the proposal.
        let cache = self.target.new_cache(capacity + self.max_depth + 1, 1)?;
        self.caches.insert(seq, cache);
        Ok(())
    }

    fn propose(&mut self, batch: &[ProposeItem<'_>]) -> ModelResult<Vec<TopK>> {
        let mut out = Vec::with_capacity(batch.len());
        for item in batch {
            let mut cache = self.caches.remove(&item.seq).ok_or_else(|| {
                ModelError::BadInput(format!("sequence {} was not opened", item.seq))
            })?;
            let committed = item.tokens.len();
            let result = (|| {
                // The cache holds a committed prefix; catch up, roll out greedily, roll back.
                let seen = cache.len();
                let mut next = self.greedy_next(&mut cache, &item.tokens[seen..])?;
                // The committed tokens are final: recurrent layers need not keep their rows.
                cache.settle()?;
                let mut truth = vec![next];
                while truth.len() < self.max_depth {
                    next = self.greedy_next(&mut cache, &[next])?;
                    truth.push(next);
                }
                cache.truncate(committed)?;
                Ok::<_, ModelError>(truth)
            })();
            self.caches.insert(item.seq, cache);
            let truth = result?;
            let per_depth = truth
                .into_iter()
                .map(|t| self.distribution(t, item.top_k))
                .collect();
            out.push(TopK::new(per_depth));
        }
        Ok(out)
    }

    fn close(&mut self, seq: SeqId) {
        self.caches.remove(&seq);
    }
}
