//! Test and benchmark proposers that know the target's own greedy continuation.
//!
//! `OracleProposer` runs the target itself greedily `max_depth` tokens ahead of the committed
//! context, so at temperature 0 every draft is accepted (tau reaches the block size). With
//! noise it corrupts some depths: a wrong token takes rank 1 and the true one drops to rank 2,
//! and probability is spread over alternatives, so chains break where trees branch around the
//! error. Both exercise long, partial and branching acceptances without a trained drafter.
//!
//! Greedy next tokens are memoised per proposer, so a continuation is computed once however
//! many rounds, sequences and requests reach it (the tests' engines revisit the same greedy
//! path many times: every algorithm, budget and sample of one prompt). The noise is drawn per
//! call as before, so proposals do not depend on what the memo already held.

use std::collections::HashMap;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::batch::SeqForward;
use crate::cache::SequenceCache;
use crate::error::{ModelError, ModelResult};
use crate::layers::attention::AttnPattern;
use crate::speculative::proposer::{ProposeItem, Proposer, SeqId};
use crate::speculative::tree::TopK;
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
    seqs: HashMap<SeqId, OracleSeq>,
    memo: GreedyMemo,
    target_forwards: usize,
}

/// One open sequence: its target cache, allocated on the first memo miss (a sequence whose
/// continuations are all known never runs the target). Between proposals the cache holds a
/// prefix of the committed tokens, all settled.
struct OracleSeq {
    capacity: usize,
    cache: Option<SequenceCache>,
}

/// Greedy next tokens already computed, as a trie over token prefixes (node 0 is the empty
/// prefix). The greedy continuation of a prefix never changes, so every round, sequence and
/// request of this proposer that reaches a known prefix reuses it: a rollout of `max_depth`
/// tokens then costs target forwards only for the tokens not seen before, instead of
/// `max_depth` sequential forwards every round (the drafts are the same either way).
#[derive(Clone)]
struct GreedyMemo {
    children: HashMap<(u32, u32), u32>,
    next: Vec<Option<u32>>,
}

/// Nodes kept before the memo starts over (bounds memory in long benchmark runs).
const MEMO_MAX_NODES: usize = 1 << 20;

impl GreedyMemo {
    fn new() -> Self {
        Self {
            children: HashMap::new(),
            next: vec![None],
        }
    }

    fn is_full(&self) -> bool {
        self.next.len() > MEMO_MAX_NODES
    }

    fn child(&mut self, node: u32, token: u32) -> u32 {
        let fresh = self.next.len() as u32;
        let child = *self.children.entry((node, token)).or_insert(fresh);
        if child == fresh {
            self.next.push(None);
        }
        child
    }

    /// The node of `tokens`, creating the path as needed.
    fn walk(&mut self, tokens: &[u32]) -> u32 {
        tokens.iter().fold(0, |node, &t| self.child(node, t))
    }
}

impl OracleProposer {
    pub fn new(target: impl Into<Target>, max_depth: usize, noise: Option<Noise>) -> Self {
        let seed = noise.map(|n| n.seed).unwrap_or(0);
        Self {
            target: target.into(),
            max_depth,
            noise,
            rng: ChaCha8Rng::seed_from_u64(seed),
            seqs: HashMap::new(),
            memo: GreedyMemo::new(),
            target_forwards: 0,
        }
    }

    /// A new proposer for the same target, depth and noise (restarted from its seed, with no
    /// open sequences) that keeps this one's memo: it proposes exactly what a new one would,
    /// without recomputing continuations this one already knows.
    pub fn restarted(&self) -> Self {
        Self {
            memo: self.memo.clone(),
            ..Self::new(self.target.clone(), self.max_depth, self.noise)
        }
    }

    /// Target forwards run so far (the memo's saving shows as fewer of them).
    pub fn target_forwards(&self) -> usize {
        self.target_forwards
    }

    /// Drops the memo and every sequence's cache (reallocated, and refilled from the committed
    /// tokens, on the next miss), so later proposals recompute everything from scratch.
    fn forget(&mut self) {
        self.memo = GreedyMemo::new();
        for seq in self.seqs.values_mut() {
            seq.cache = None;
        }
    }

    /// The target's greedy continuation of `tokens` (the committed context), `max_depth` tokens
    /// long (at least one): from the memo where known, otherwise by running the target.
    fn rollout(&mut self, seq: SeqId, tokens: &[u32]) -> ModelResult<Vec<u32>> {
        if tokens.is_empty() {
            return Err(ModelError::BadInput(format!(
                "sequence {seq} has no committed tokens"
            )));
        }
        if self.memo.is_full() {
            self.forget();
        }
        let Self {
            target,
            max_depth,
            seqs,
            memo,
            target_forwards,
            ..
        } = self;
        let state = seqs
            .get_mut(&seq)
            .ok_or_else(|| ModelError::BadInput(format!("sequence {seq} was not opened")))?;
        let committed = tokens.len();
        if state.cache.as_ref().is_some_and(|c| c.len() > committed) {
            // Committed tokens only grow; a shorter context starts the cache over.
            state.cache = None;
        }
        let mut node = memo.walk(tokens);
        let mut context = tokens.to_vec();
        let mut truth = Vec::with_capacity(*max_depth);
        let mut result = Ok(());
        while truth.len() < (*max_depth).max(1) {
            let next = match memo.next[node as usize] {
                Some(t) => t,
                None => match greedy_next(target, state, &context, committed) {
                    Ok((t, forwards)) => {
                        *target_forwards += forwards;
                        memo.next[node as usize] = Some(t);
                        t
                    }
                    Err(e) => {
                        result = Err(e);
                        break;
                    }
                },
            };
            truth.push(next);
            context.push(next);
            node = memo.child(node, next);
        }
        // Roll the rollout's rows back, also after an error; the committed ones stay.
        if let Some(cache) = state.cache.as_mut() {
            if let Err(e) = cache.truncate(cache.len().min(committed)) {
                state.cache = None;
                result = result.and(Err(e));
            }
        }
        result.map(|()| truth)
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
        let capacity = capacity + self.max_depth + 1;
        self.seqs.insert(
            seq,
            OracleSeq {
                capacity,
                cache: None,
            },
        );
        Ok(())
    }

    fn propose(&mut self, batch: &[ProposeItem<'_>]) -> ModelResult<Vec<TopK>> {
        let mut out = Vec::with_capacity(batch.len());
        for item in batch {
            let truth = self.rollout(item.seq, item.tokens)?;
            let per_depth = truth
                .into_iter()
                .map(|t| self.distribution(t, item.top_k))
                .collect();
            out.push(TopK::new(per_depth));
        }
        Ok(out)
    }

    fn close(&mut self, seq: SeqId) {
        self.seqs.remove(&seq);
    }
}

/// The target's argmax after `context` (whose first `committed` tokens are final) and the
/// number of target forwards run for it. The cache holds a prefix of `context`: committed
/// tokens seen before, then this rollout's tokens, which the caller rolls back afterwards.
fn greedy_next(
    target: &Target,
    state: &mut OracleSeq,
    context: &[u32],
    committed: usize,
) -> ModelResult<(u32, usize)> {
    let cache = match &mut state.cache {
        Some(cache) if cache.len() < context.len() => cache,
        // Nothing to run (asked again at a context the cache already holds, which only a
        // failed earlier call leaves): a settled row cannot be rerun, so start over.
        slot => slot.insert(target.new_cache(state.capacity, 0)?),
    };
    let mut forwards = 0;
    if cache.len() < committed && committed < context.len() {
        // New committed tokens first, on their own, so that they settle.
        feed(target, cache, &context[..committed], true)?;
        forwards += 1;
    }
    let settle = cache.len() < committed;
    let next = feed(target, cache, context, settle)?;
    Ok((next, forwards + 1))
}

/// Runs `context[cache.len()..]` on the target and returns its argmax after the last token.
/// `settle`: the tokens are committed and never roll back, so a hybrid target keeps only its
/// final recurrent state. Otherwise (at most `max_depth` rollout tokens, the cache's rollback
/// window) it keeps per-row states so that the rollout can be truncated.
fn feed(
    target: &Target,
    cache: &mut SequenceCache,
    context: &[u32],
    settle: bool,
) -> ModelResult<u32> {
    let start = cache.len();
    let tokens = &context[start..];
    let positions: Vec<u32> = (start as u32..context.len() as u32).collect();
    let rollback = cache.set_rollback(if settle { 0 } else { tokens.len() });
    let out = target.forward(
        &mut [SeqForward {
            cache,
            tokens,
            positions: &positions,
            pattern: &AttnPattern::Causal,
            logit_rows: &[tokens.len() - 1],
        }],
        &[],
    );
    cache.set_rollback(rollback);
    let logits = out?
        .logits
        .ok_or_else(|| ModelError::BadInput("the target returned no logits".into()))?;
    Ok(logits.argmax(1)?.to_vec1::<u32>()?[0])
}

#[cfg(test)]
mod tests;
