//! Proposers: whatever turns the committed context into per-depth draft distributions.
//!
//! The boundary carries tokens and (for DFlash) the target's tapped features of newly committed
//! positions; the proposer's own state (the drafter's context cache) stays inside it. The
//! engine only sees per-depth top-K lists, from which it builds a chain or a DDTree.

use std::collections::HashMap;

use candle_core::Tensor;

use crate::dflash::{DFlashDrafter, DraftInput};
use crate::error::{ModelError, ModelResult};
use crate::kv_cache::SequenceCache;
use crate::spec::tree::{topk_logprobs, TopK};

pub type SeqId = u64;

/// One sequence's proposal request.
pub struct ProposeItem<'a> {
    pub seq: SeqId,
    /// Every committed token; the last is the bonus token (sampled by the target, not yet in the
    /// target's cache). Drafts are for the positions after it.
    pub tokens: &'a [u32],
    /// Target features (`[n, taps * hidden]`) of the committed positions the proposer has not
    /// seen yet: positions `tokens.len() - 1 - n .. tokens.len() - 1`.
    pub features: Option<&'a Tensor>,
    /// How many candidates per depth the caller needs (1 for chain, min(budget, vocab) for DDTree).
    pub top_k: usize,
}

pub trait Proposer: Send {
    /// Drafts per round (block_size - 1 for DFlash).
    fn max_depth(&self) -> usize;
    /// Target layers whose outputs the proposer needs as features (empty when none).
    fn target_layers(&self) -> Vec<usize>;
    /// Prepares per-sequence state for up to `capacity` committed positions.
    fn open(&mut self, seq: SeqId, capacity: usize) -> ModelResult<()>;
    /// One proposal per item, each with `max_depth()` depths, in item order.
    fn propose(&mut self, batch: &[ProposeItem<'_>]) -> ModelResult<Vec<TopK>>;
    /// Drops per-sequence state.
    fn close(&mut self, seq: SeqId);
}

/// The DFlash drafter as a proposer: one batched drafter forward per round.
pub struct DFlashProposer {
    drafter: DFlashDrafter,
    caches: HashMap<SeqId, SequenceCache>,
}

impl DFlashProposer {
    pub fn new(drafter: DFlashDrafter) -> Self {
        Self {
            drafter,
            caches: HashMap::new(),
        }
    }

    pub fn drafter(&self) -> &DFlashDrafter {
        &self.drafter
    }
}

impl Proposer for DFlashProposer {
    fn max_depth(&self) -> usize {
        self.drafter.block_size() - 1
    }

    fn target_layers(&self) -> Vec<usize> {
        self.drafter.target_layer_ids().to_vec()
    }

    fn open(&mut self, seq: SeqId, capacity: usize) -> ModelResult<()> {
        let cache = self.drafter.new_cache(capacity)?;
        self.caches.insert(seq, cache);
        Ok(())
    }

    fn propose(&mut self, batch: &[ProposeItem<'_>]) -> ModelResult<Vec<TopK>> {
        let b = self.drafter.block_size();
        let mask = self.drafter.mask_token_id();
        // Take the caches out so the batch can hold one `&mut` per sequence.
        let mut caches = Vec::with_capacity(batch.len());
        for item in batch {
            match self.caches.remove(&item.seq) {
                Some(c) => caches.push(c),
                None => {
                    for (it, c) in batch.iter().zip(caches) {
                        self.caches.insert(it.seq, c);
                    }
                    return Err(ModelError::BadInput(format!(
                        "sequence {} was not opened",
                        item.seq
                    )));
                }
            }
        }
        let blocks: Vec<Vec<u32>> = batch
            .iter()
            .map(|item| {
                let mut block = vec![mask; b];
                block[0] = *item.tokens.last().unwrap_or(&mask);
                block
            })
            .collect();
        let result = {
            let mut inputs: Vec<DraftInput<'_>> = caches
                .iter_mut()
                .zip(batch)
                .zip(&blocks)
                .map(|((cache, item), block)| DraftInput {
                    cache,
                    context: item.features,
                    block,
                })
                .collect();
            self.drafter.draft_logits(&mut inputs)
        };
        for (item, cache) in batch.iter().zip(caches) {
            self.caches.insert(item.seq, cache);
        }
        let logits = result?;
        let vocab = logits.dim(1)?;
        let rows = logits.flatten_all()?.to_vec1::<f32>()?;
        let per_seq = (b - 1) * vocab;
        Ok(batch
            .iter()
            .enumerate()
            .map(|(s, item)| {
                topk_logprobs(
                    &rows[s * per_seq..(s + 1) * per_seq],
                    vocab,
                    item.top_k.min(vocab),
                )
            })
            .collect())
    }

    fn close(&mut self, seq: SeqId) {
        self.caches.remove(&seq);
    }
}
