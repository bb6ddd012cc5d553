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
use crate::spec::profile;
use crate::spec::tree::{topk_from_logprobs, topk_logprobs, TopK};

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
        profile::mark(self.drafter.device(), "1_draft_prepare");
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
        profile::mark(self.drafter.device(), "2_draft_model");
        if logits.device().is_cpu() {
            let vocab = logits.dim(1)?;
            let rows = logits.flatten_all()?.to_vec1::<f32>()?;
            let per_seq = (b - 1) * vocab;
            return Ok(batch
                .iter()
                .enumerate()
                .map(|(s, item)| {
                    topk_logprobs(
                        &rows[s * per_seq..(s + 1) * per_seq],
                        vocab,
                        item.top_k.min(vocab),
                    )
                })
                .collect());
        }
        device_topk(&logits, batch, b - 1)
    }

    fn close(&mut self, seq: SeqId) {
        self.caches.remove(&seq);
    }
}

/// On an accelerator, keeps the vocabulary-wide work there: log-softmax on the device, then
/// either the argmax alone (chain, `top_k == 1`: a few bytes come back), the top-k selected on
/// the device (CUDA: k pairs per depth come back), or the rows copied once and their top-k
/// selected on host threads, one row each. The 15 x 151,936 host log-sum-exp
/// of [`topk_logprobs`] would cost ~15 ms per round. Tokens and order are the same; the
/// log-probs differ from the host's f64 log-sum-exp only by f32 rounding.
fn device_topk(logits: &Tensor, batch: &[ProposeItem<'_>], depth: usize) -> ModelResult<Vec<TopK>> {
    let vocab = logits.dim(1)?;
    if batch.iter().all(|i| i.top_k <= 1) && std::env::var_os("DFLASH_LEGACY_SELECT").is_none() {
        return device_argmax(logits, batch.len(), depth);
    }
    let logp = candle_nn::ops::log_softmax(logits, candle_core::D::Minus1)?;
    if batch.iter().all(|i| i.top_k <= 1) {
        let arg = logp.argmax_keepdim(1)?;
        let val = logp.gather(&arg, 1)?.flatten_all()?.to_vec1::<f32>()?;
        let arg = arg.flatten_all()?.to_vec1::<u32>()?;
        return Ok((0..batch.len())
            .map(|s| {
                TopK::new(
                    (0..depth)
                        .map(|d| vec![(arg[s * depth + d], val[s * depth + d])])
                        .collect(),
                )
            })
            .collect());
    }
    #[cfg(feature = "cuda")]
    if logp.device().is_cuda() && logp.dtype() == candle_core::DType::F32 {
        // Select on the device: k pairs per depth come back instead of the vocabulary.
        let k_max = batch
            .iter()
            .map(|i| i.top_k)
            .max()
            .unwrap_or(1)
            .clamp(1, vocab);
        let (idx, val) = crate::fast::topk_rows(&logp.contiguous()?, k_max)?;
        let idx = idx.flatten_all()?.to_vec1::<u32>()?;
        let val = val.flatten_all()?.to_vec1::<f32>()?;
        return Ok(batch
            .iter()
            .enumerate()
            .map(|(s, item)| {
                let k = item.top_k.clamp(1, vocab);
                let rows = (0..depth).map(|d| {
                    let r = s * depth + d;
                    let mut row: Vec<(u32, f32)> = (r * k_max..(r + 1) * k_max)
                        .map(|j| (idx[j], val[j]))
                        .collect();
                    // The k_max best in canonical order; an item asking fewer keeps its best k.
                    row.sort_unstable_by_key(|&(t, lp)| crate::spec::tree::rank_key(lp, t));
                    row.truncate(k);
                    row
                });
                TopK::new(rows.collect())
            })
            .collect());
    }
    let rows = logp.flatten_all()?.to_vec1::<f32>()?;
    let per_row: Vec<Vec<(u32, f32)>> = std::thread::scope(|scope| {
        let handles: Vec<_> = rows
            .chunks(vocab)
            .enumerate()
            .map(|(r, row)| {
                let k = batch[r / depth].top_k.min(vocab);
                scope.spawn(move || topk_from_logprobs(row, vocab, k).row(0).to_vec())
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_default())
            .collect()
    });
    let mut it = per_row.into_iter();
    Ok(batch
        .iter()
        .map(|_| TopK::new(it.by_ref().take(depth).collect()))
        .collect())
}

/// Chain drafts (`top_k == 1` for every item): each row's argmax and its log-prob
/// `max - logsumexp = -ln sum(exp(x - max))`, without materialising the log-softmax, and one
/// packed copy `[token, log-prob]` per row to the host (one wait for the device instead of
/// two). Token ids travel as f32, exact below 2^24.
fn device_argmax(logits: &Tensor, seqs: usize, depth: usize) -> ModelResult<Vec<TopK>> {
    let (rows, vocab) = logits.dims2()?;
    if rows != seqs * depth || vocab >= 1 << 24 {
        return Err(ModelError::BadInput(format!(
            "draft logits [{rows}, {vocab}] for {seqs} sequences of {depth} drafts"
        )));
    }
    let logits = logits.to_dtype(candle_core::DType::F32)?;
    let max = logits.max_keepdim(1)?;
    let arg = logits.argmax_keepdim(1)?.to_dtype(candle_core::DType::F32)?;
    let logp = logits
        .broadcast_sub(&max)?
        .exp()?
        .sum_keepdim(1)?
        .log()?
        .neg()?;
    let packed = Tensor::cat(&[&arg, &logp], 1)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    Ok((0..seqs)
        .map(|s| {
            TopK::new(
                (0..depth)
                    .map(|d| {
                        let r = 2 * (s * depth + d);
                        vec![(packed[r] as u32, packed[r + 1])]
                    })
                    .collect(),
            )
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn device_argmax_matches_the_host_top_1_tokens_and_log_probs() {
        let (seqs, depth, vocab) = (2, 3, 97);
        let mut v: Vec<f32> = (0..seqs * depth * vocab)
            .map(|i| ((i * 7919 % 1013) as f32 * 0.037).sin() * 6.0)
            .collect();
        // A row whose maximum is the last token, one with a very peaked maximum.
        v[vocab - 1] = 40.0;
        v[2 * vocab + 5] = 90.0;
        let logits = Tensor::from_vec(v.clone(), (seqs * depth, vocab), &Device::Cpu).unwrap();
        let got = device_argmax(&logits, seqs, depth).unwrap();
        assert_eq!(got.len(), seqs);
        for (s, topk) in got.iter().enumerate() {
            let per_seq = depth * vocab;
            let want = topk_logprobs(&v[s * per_seq..(s + 1) * per_seq], vocab, 1);
            assert_eq!(topk.argmax_tokens(), want.argmax_tokens(), "sequence {s}");
            for d in 0..depth {
                let (a, b) = (topk.row(d)[0].1, want.row(d)[0].1);
                assert!((a - b).abs() < 1e-5, "log-prob {a} vs {b} at {s}/{d}");
            }
        }
        assert_eq!(got[0].argmax_tokens()[0], vocab as u32 - 1);
        assert_eq!(got[0].argmax_tokens()[2], 5);
        assert!(got[0].row(2)[0].1 > -1e-6, "a peaked row's log-prob is ~0");
    }

    #[test]
    fn device_argmax_refuses_logits_of_another_shape() {
        let logits = Tensor::zeros((5, 10), candle_core::DType::F32, &Device::Cpu).unwrap();
        assert!(matches!(
            device_argmax(&logits, 2, 3),
            Err(ModelError::BadInput(_))
        ));
    }
}
