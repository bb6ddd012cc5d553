//! The hybrid target's built-in MTP head as a proposer (SGLang `NEXTN` / `MTP`): the engine
//! verifies its drafts with the same transaction as DFlash's (chain, or a tree from its
//! per-depth top-K), so losslessness is the engine's, not the head's.
//!
//! Per sequence the head keeps its own K/V cache with one row per committed pair
//! (token p+1, target hidden p). Each round it first appends the pairs the last verify
//! committed (the engine hands over the target's last-layer tap for the accepted rows, which
//! [`crate::taps`] defines as the final-normed output), then drafts token by token, feeding back its own output, and
//! finally rolls its cache back to the committed pairs.

use std::collections::HashMap;

use crate::cache::SequenceCache;
use crate::error::{ModelError, ModelResult};
use crate::qwen3_5::{MtpHead, Qwen35Model};
use crate::speculative::proposer::{ProposeItem, Proposer, SeqId};
use crate::speculative::tree::{topk_logprobs, TopK};

pub struct MtpProposer {
    target: Qwen35Model,
    head: MtpHead,
    depth: usize,
    caches: HashMap<SeqId, SequenceCache>,
}

impl MtpProposer {
    /// `depth` drafts per round (SGLang `--speculative-num-steps`).
    pub fn new(target: Qwen35Model, head: MtpHead, depth: usize) -> Self {
        Self {
            target,
            head,
            depth: depth.max(1),
            caches: HashMap::new(),
        }
    }

    fn propose_one(&self, cache: &mut SequenceCache, item: &ProposeItem<'_>) -> ModelResult<TopK> {
        let n = item.tokens.len() - 1;
        let vocab = self.target.config().vocab_size;
        let max_pos = self.target.rope().max_positions();
        let m = item.features.map_or(Ok(0), |f| f.dim(0))?;
        if cache.len() + m != n {
            return Err(ModelError::BadInput(format!(
                "MTP head holds {} pairs and got {m} new hidden states, but {n} tokens are committed",
                cache.len()
            )));
        }
        let mut per_depth = Vec::with_capacity(self.depth);
        if let Some(f) = item.features.filter(|_| m > 0) {
            // Pairs (token p+1, hidden p) for the newly committed positions p = n-m .. n-1.
            let positions: Vec<u32> = ((n - m) as u32..n as u32).collect();
            let (mut out, mut logits) = self.head.forward(
                &self.target,
                cache,
                &item.tokens[n - m + 1..=n],
                f,
                &positions,
            )?;
            let k = item.top_k.min(vocab);
            loop {
                let last =
                    crate::speculative::greedy::host_row_f32(&logits.get(logits.dim(0)? - 1)?)?;
                let row = topk_logprobs(&last, vocab, k);
                let next = row.argmax_tokens()[0];
                per_depth.push(row.row(0).to_vec());
                let pos = n - 1 + per_depth.len();
                if per_depth.len() == self.depth || pos >= max_pos {
                    break;
                }
                let h = out.get(out.dim(0)? - 1)?.unsqueeze(0)?;
                (out, logits) =
                    self.head
                        .forward(&self.target, cache, &[next], &h, &[pos as u32])?;
            }
        }
        cache.truncate(n)?;
        Ok(TopK::new(per_depth))
    }
}

impl Proposer for MtpProposer {
    fn max_depth(&self) -> usize {
        self.depth
    }

    /// The last layer's tap: the post-norm hidden state SGLang and vLLM feed the head.
    fn target_layers(&self) -> Vec<usize> {
        vec![self.target.config().num_hidden_layers - 1]
    }

    fn cache_bytes_per_row(&self) -> usize {
        self.head.kv_bytes_per_row(self.target.dtype())
    }

    fn open(&mut self, seq: SeqId, capacity: usize) -> ModelResult<()> {
        let cache = self.head.new_cache(
            capacity + self.depth,
            self.target.dtype(),
            self.target.device(),
        )?;
        self.caches.insert(seq, cache);
        Ok(())
    }

    fn propose(&mut self, batch: &[ProposeItem<'_>]) -> ModelResult<Vec<TopK>> {
        let mut out = Vec::with_capacity(batch.len());
        for item in batch {
            let mut cache = self.caches.remove(&item.seq).ok_or_else(|| {
                ModelError::BadInput(format!("sequence {} was not opened", item.seq))
            })?;
            let result = self.propose_one(&mut cache, item);
            self.caches.insert(item.seq, cache);
            out.push(result?);
        }
        Ok(out)
    }

    fn close(&mut self, seq: SeqId) {
        self.caches.remove(&seq);
    }
}
