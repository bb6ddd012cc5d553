//! Proposers: whatever turns the committed context into per-depth draft distributions.
//!
//! The boundary carries tokens and (for DFlash) the target's tapped features of newly committed
//! positions; the proposer's own state (the drafter's context cache) stays inside it. The
//! engine only sees per-depth top-K lists, from which it builds a chain or a DDTree.

use std::collections::HashMap;

use candle_core::Tensor;

use crate::cache::{KvPool, SequenceCache};
use crate::dflash::{DFlashDrafter, DraftInput};
use crate::error::{ModelError, ModelResult};
use crate::speculative::spare::SpareCaches;
use crate::speculative::tree::{topk_from_logprobs, topk_logprobs, TopK};
use crate::speculative::{greedy, profile};

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
    /// Device bytes per committed position of a sequence's proposer state (a drafter's K/V
    /// cache rows), for sizing a K/V budget; 0 for proposers that keep none.
    fn cache_bytes_per_row(&self) -> usize {
        0
    }
    /// Puts the proposer's per-sequence state in a paged pool of `pages` pages from now on
    /// (only before any sequence is opened); proposers that keep no K/V ignore it.
    fn use_kv_pool(&mut self, pages: usize) -> ModelResult<()> {
        let _ = pages;
        Ok(())
    }
    /// Backs sequence `seq`'s state for its next round after `committed` committed positions,
    /// taking pool pages; fails with [`ModelError::PoolExhausted`], changing nothing, when the
    /// pool is short (the engine then retracts a sequence). Nothing to do without a pool.
    fn reserve(&mut self, seq: SeqId, committed: usize) -> ModelResult<()> {
        let _ = (seq, committed);
        Ok(())
    }
}

/// A boxed proposer is one (so wrappers such as [`crate::speculative::PeakedProposer`] take
/// whatever proposer a server built).
impl<P: Proposer + ?Sized> Proposer for Box<P> {
    fn max_depth(&self) -> usize {
        (**self).max_depth()
    }
    fn target_layers(&self) -> Vec<usize> {
        (**self).target_layers()
    }
    fn open(&mut self, seq: SeqId, capacity: usize) -> ModelResult<()> {
        (**self).open(seq, capacity)
    }
    fn propose(&mut self, batch: &[ProposeItem<'_>]) -> ModelResult<Vec<TopK>> {
        (**self).propose(batch)
    }
    fn close(&mut self, seq: SeqId) {
        (**self).close(seq)
    }
    fn cache_bytes_per_row(&self) -> usize {
        (**self).cache_bytes_per_row()
    }
    fn use_kv_pool(&mut self, pages: usize) -> ModelResult<()> {
        (**self).use_kv_pool(pages)
    }
    fn reserve(&mut self, seq: SeqId, committed: usize) -> ModelResult<()> {
        (**self).reserve(seq, committed)
    }
}

/// The DFlash drafter as a proposer: one batched drafter forward per round.
pub struct DFlashProposer {
    drafter: DFlashDrafter,
    caches: HashMap<SeqId, SequenceCache>,
    /// Caches of closed sequences, for the next ones (their round graphs stay valid). Not
    /// used with a pool: a closed sequence's pages go back to it.
    spare: SpareCaches,
    /// The drafter's paged context pool ([`Proposer::use_kv_pool`]); None: each sequence gets
    /// a cache of its own.
    pool: Option<KvPool>,
}

impl DFlashProposer {
    pub fn new(drafter: DFlashDrafter) -> Self {
        Self {
            drafter,
            caches: HashMap::new(),
            spare: SpareCaches::default(),
            pool: None,
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

    fn cache_bytes_per_row(&self) -> usize {
        self.drafter.kv_bytes_per_row()
    }

    fn target_layers(&self) -> Vec<usize> {
        self.drafter.target_layer_ids().to_vec()
    }

    fn use_kv_pool(&mut self, pages: usize) -> ModelResult<()> {
        if !self.caches.is_empty() {
            return Err(ModelError::BadCacheOp(
                "the drafter's K/V pool is set before any sequence is opened".into(),
            ));
        }
        // The old pool's memory goes before the new one is allocated.
        self.spare = SpareCaches::default();
        self.pool = None;
        self.pool = Some(self.drafter.new_kv_pool(pages)?);
        Ok(())
    }

    fn reserve(&mut self, seq: SeqId, committed: usize) -> ModelResult<()> {
        let b = self.drafter.block_size();
        match self.caches.get_mut(&seq) {
            Some(cache) => cache.grow_to(committed + b),
            None => Ok(()),
        }
    }

    fn open(&mut self, seq: SeqId, capacity: usize) -> ModelResult<()> {
        let drafter = &self.drafter;
        let cache = match &self.pool {
            // Pages come as the context fills ([`Proposer::reserve`], `propose`).
            Some(pool) => drafter.new_cache_in(pool, capacity, 0)?,
            None => self
                .spare
                .take_or(capacity, || drafter.new_cache(capacity))?,
        };
        if let Some(old) = self.caches.insert(seq, cache) {
            self.spare_put(old);
        }
        Ok(())
    }

    fn propose(&mut self, batch: &[ProposeItem<'_>]) -> ModelResult<Vec<TopK>> {
        let b = self.drafter.block_size();
        let mask = self.drafter.mask_token_id();
        if self.pool.is_some() {
            // Back every cache for its new context and the block before anything runs, so a
            // short pool fails the round with nothing written.
            for item in batch {
                let n = item.features.map(|f| f.dim(0)).transpose()?.unwrap_or(0);
                if let Some(cache) = self.caches.get_mut(&item.seq) {
                    cache.grow_to(cache.len() + n + b)?;
                }
            }
        }
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
        if let Some(cache) = self.caches.remove(&seq) {
            self.spare_put(cache);
        }
    }
}

impl DFlashProposer {
    /// Keeps a closed sequence's cache under the capacity it was opened with
    /// ([`DFlashDrafter::new_cache`] adds room for one block).
    fn spare_put(&mut self, cache: SequenceCache) {
        if self.pool.is_some() {
            // Its pages go back to the pool.
            return;
        }
        let capacity = cache.capacity().saturating_sub(self.drafter.block_size());
        self.spare.put(capacity, cache);
    }

    /// Drafter caches kept from closed sequences.
    pub fn spare_caches(&self) -> usize {
        self.spare.len()
    }

    /// Free pages of the drafter's pool (None without one).
    pub fn kv_pool_free_pages(&self) -> Option<usize> {
        self.pool.as_ref().map(|p| p.free_pages())
    }
}

/// On an accelerator, keeps the vocabulary-wide work there: the chain (`top_k == 1` for every
/// item) takes each row's argmax and its log-prob from one kernel pair and one packed copy
/// ([`greedy::row_argmax_logprob`]); a CUDA DDTree selects the top-k of each piece of every
/// row of raw logits on the device ([`topk_parts`] pieces, so that many blocks share a row),
/// merges the pieces' candidates on the host ([`merge_parts`]) and turns them into log-probs
/// with the row's log-sum-exp from the same argmax kernels; elsewhere the rows get a log-softmax and are copied
/// once, their top-k selected on host threads, one row each. The 15 x 151,936 host log-sum-exp
/// of [`topk_logprobs`] would cost ~15 ms per round. Tokens and order are the same; the
/// log-probs differ from the host's f64 log-sum-exp only by f32 rounding.
fn device_topk(logits: &Tensor, batch: &[ProposeItem<'_>], depth: usize) -> ModelResult<Vec<TopK>> {
    let (rows, vocab) = logits.dims2()?;
    if rows != batch.len() * depth {
        return Err(ModelError::BadInput(format!(
            "draft logits have {rows} rows for {} sequences of {depth} drafts",
            batch.len()
        )));
    }
    if batch.iter().all(|i| i.top_k <= 1) {
        let best = greedy::row_argmax_logprob(logits)?;
        return Ok(best
            .chunks(depth)
            .map(|d| TopK::new(d.iter().map(|&p| vec![p]).collect()))
            .collect());
    }
    #[cfg(feature = "cuda")]
    if logits.device().is_cuda() {
        // Select on the device: k pairs per depth come back instead of the vocabulary.
        let k_max = batch
            .iter()
            .map(|i| i.top_k)
            .max()
            .unwrap_or(1)
            .clamp(1, vocab);
        let x = logits.to_dtype(candle_core::DType::F32)?.contiguous()?;
        let best = crate::cuda::argmax_logprob(&x)?;
        // The radix select runs one block per row: split each row into `parts` rows so that
        // many blocks share the work, and merge their candidates on the host.
        let parts = topk_parts(vocab, k_max);
        let width = vocab / parts;
        let (idx, val) = crate::cuda::topk_rows(&x.reshape((rows * parts, width))?, k_max)?;
        profile::mark(logits.device(), "3a_topk_kernels");
        // Column ids travel as f32 beside the logits (exact below 2^24) in one copy.
        let packed = Tensor::cat(&[&idx.to_dtype(candle_core::DType::F32)?, &val], 1)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let best = best.flatten_all()?.to_vec1::<u32>()?;
        profile::mark(logits.device(), "3b_topk_copies");
        let per_row = parts * 2 * k_max;
        return Ok(batch
            .iter()
            .enumerate()
            .map(|(s, item)| {
                let k = item.top_k.clamp(1, vocab);
                let rows = (0..depth).map(|d| {
                    let r = s * depth + d;
                    let lp_max = f32::from_bits(best[2 * r + 1]);
                    merge_parts(
                        &packed[r * per_row..(r + 1) * per_row],
                        width,
                        k_max,
                        lp_max,
                        k,
                    )
                });
                TopK::new(rows.collect())
            })
            .collect());
    }
    let logp = candle_nn::ops::log_softmax(logits, candle_core::D::Minus1)?;
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

/// Pieces each row is split into for the device top-k: as many as divide the vocabulary into
/// pieces of at least `k` columns, at most 32 (enough blocks to fill the device for a round's
/// 15 rows) and at most 2048 candidates per row to merge on the host.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn topk_parts(vocab: usize, k: usize) -> usize {
    [32, 16, 8, 4, 2]
        .into_iter()
        .find(|&p| vocab.is_multiple_of(p) && vocab / p >= k && p * k <= 2048)
        .unwrap_or(1)
}

/// One row's best `k` `(token, log-prob)` from the top `k_max` of each of its pieces of
/// `width` columns (`packed`: per piece `k_max` column ids as f32, then their logits). The
/// row's top k lies in the union of its pieces' top k, and is chosen by the host's rule
/// (higher logit first, the lower token on ties); `lp_max` is the log-prob of the row's
/// maximum, so `ln p(x) = (x - max) + lp_max`.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn merge_parts(
    packed: &[f32],
    width: usize,
    k_max: usize,
    lp_max: f32,
    k: usize,
) -> Vec<(u32, f32)> {
    // Every candidate's rank key (smaller is better; the token is the key's low half), then
    // one select. This runs for every row of every DDTree round over up to 2048 candidates,
    // most of them close to the k-th value: a filter on the pieces' minima (a valid but loose
    // bound) kept ~75% of them behind an unpredictable branch, and a bounded heap paid for its
    // sift-downs; measured on the host per 15-row round of k = 64 from 32 pieces (release):
    // filter + select 0.27 ms, heap 0.25-0.29, keys + one select 0.16.
    let mut best: Vec<u64> = Vec::with_capacity(packed.len() / 2);
    for (p, piece) in packed.chunks_exact(2 * k_max).enumerate() {
        let base = (p * width) as u32;
        let (ids, vals) = piece.split_at(k_max);
        best.extend(
            ids.iter()
                .zip(vals)
                .map(|(&id, &x)| crate::speculative::tree::rank_key(x, base + id as u32)),
        );
    }
    if best.len() > k {
        best.select_nth_unstable(k.max(1) - 1);
        best.truncate(k);
    }
    let chosen: Vec<(u32, f32)> = best
        .into_iter()
        .map(|key| (key as u32, crate::speculative::tree::rank_key_value(key)))
        .collect();
    let max = chosen.iter().map(|c| c.1).fold(f32::NEG_INFINITY, f32::max);
    chosen
        .into_iter()
        .map(|(t, x)| (t, (x - max) + lp_max))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn item(seq: SeqId, top_k: usize) -> ProposeItem<'static> {
        ProposeItem {
            seq,
            tokens: &[],
            features: None,
            top_k,
        }
    }

    /// Deterministic logits with a few planted maxima (one at the last column).
    fn logits(rows: usize, vocab: usize) -> Vec<f32> {
        let mut v: Vec<f32> = (0..rows * vocab)
            .map(|i| ((i * 7919 % 1013) as f32 * 0.037).sin() * 6.0)
            .collect();
        v[vocab - 1] = 40.0;
        if rows > 2 {
            v[2 * vocab + 5] = 90.0;
        }
        v
    }

    #[test]
    fn chain_selection_matches_the_host_top_1_tokens_and_log_probs() {
        let (depth, vocab) = (3, 97);
        let v = logits(2 * depth, vocab);
        let t = Tensor::from_vec(v.clone(), (2 * depth, vocab), &Device::Cpu).unwrap();
        let got = device_topk(&t, &[item(0, 1), item(1, 1)], depth).unwrap();
        assert_eq!(got.len(), 2);
        for (s, topk) in got.iter().enumerate() {
            let per_seq = depth * vocab;
            let want = topk_logprobs(&v[s * per_seq..(s + 1) * per_seq], vocab, 1);
            assert_eq!(topk.argmax_tokens(), want.argmax_tokens(), "sequence {s}");
            for d in 0..depth {
                let (a, b) = (topk.row(d)[0].1, want.row(d)[0].1);
                assert!((a - b).abs() < 1e-5, "log-prob {a} vs {b} at {s}/{d}");
            }
        }
        assert_eq!(
            got[0].argmax_tokens(),
            vec![vocab as u32 - 1, got[0].argmax_tokens()[1], 5]
        );
        assert!(got[0].row(2)[0].1 > -1e-6, "a peaked row's log-prob is ~0");
    }

    #[test]
    fn tree_selection_matches_the_host_top_k() {
        let (depth, vocab, k) = (2, 61, 5);
        let v = logits(depth, vocab);
        let t = Tensor::from_vec(v.clone(), (depth, vocab), &Device::Cpu).unwrap();
        let got = device_topk(&t, &[item(0, k)], depth).unwrap().remove(0);
        let want = topk_logprobs(&v, vocab, k);
        for d in 0..depth {
            let (a, b) = (got.row(d), want.row(d));
            assert_eq!(a.len(), k);
            for (x, y) in a.iter().zip(b) {
                assert_eq!(x.0, y.0, "depth {d}");
                assert!((x.1 - y.1).abs() < 1e-5);
            }
        }
    }

    #[test]
    fn pieces_divide_the_vocabulary_and_bound_the_candidates() {
        assert_eq!(topk_parts(151_936, 16), 32);
        assert_eq!(topk_parts(151_936, 64), 32);
        assert_eq!(topk_parts(151_936, 256), 8);
        assert_eq!(topk_parts(97, 5), 1, "a prime vocabulary stays whole");
        assert_eq!(topk_parts(64, 40), 1, "pieces must hold k columns");
    }

    /// What the device top-k leaves for `row` cut into `parts` pieces: per piece its best
    /// `k_max` column ids (as f32), then their values, in the order `arrange` gives them.
    fn device_pieces(
        row: &[f32],
        parts: usize,
        k_max: usize,
        mut arrange: impl FnMut(&mut Vec<usize>),
    ) -> Vec<f32> {
        let width = row.len() / parts;
        let mut packed = Vec::new();
        for piece in row.chunks_exact(width) {
            let mut cols: Vec<usize> = (0..width).collect();
            cols.sort_by_key(|&j| crate::speculative::tree::rank_key(piece[j], j as u32));
            cols.truncate(k_max);
            arrange(&mut cols);
            packed.extend(cols.iter().map(|&j| j as f32));
            packed.extend(cols.iter().map(|&j| piece[j]));
        }
        packed
    }

    #[test]
    fn merged_piece_candidates_are_the_host_top_k() {
        // Nine values above 3.9, so the 11th place falls among the five planted ties.
        let (vocab, k) = (96, 11);
        let mut row: Vec<f32> = (0..vocab)
            .map(|i| ((i * 37 % 23) as f32 * 0.5).cos() * 4.0)
            .collect();
        // Equal values in different pieces straddling the k-th place: lower tokens win.
        for t in [5, 40, 41, 77, 90] {
            row[t] = 3.9;
        }
        let want = topk_logprobs(&row, vocab, k);
        let tied: Vec<u32> = want
            .row(0)
            .iter()
            .map(|p| p.0)
            .filter(|t| [5, 40, 41, 77, 90].contains(t))
            .collect();
        assert_eq!(
            tied,
            vec![5, 40],
            "the host keeps the two lowest tied tokens"
        );
        let lp_max = greedy::row_argmax_logprob(
            &Tensor::from_vec(row.clone(), (1, vocab), &Device::Cpu).unwrap(),
        )
        .unwrap()[0]
            .1;
        // k_max > k: the batch's largest top-k (another sequence's) sets the pieces' size.
        for (parts, k_max) in [(1, k), (2, k), (4, k), (8, k), (2, k + 5), (8, k + 1)] {
            let width = vocab / parts;
            // Each piece's top k_max (as the device kernel selects them, in any order).
            let packed = device_pieces(&row, parts, k_max, |cols| cols.reverse());
            let got = TopK::new(vec![merge_parts(&packed, width, k_max, lp_max, k)]);
            assert_eq!(got.row(0).len(), k);
            for (a, b) in got.row(0).iter().zip(want.row(0)) {
                assert_eq!(a.0, b.0, "{parts} pieces");
                assert!(
                    (a.1 - b.1).abs() < 1e-5,
                    "{parts} pieces: {} vs {}",
                    a.1,
                    b.1
                );
            }
        }
    }

    #[test]
    fn merged_pieces_match_the_host_top_k_on_random_rows_with_ties() {
        // Logits on a coarse grid, so many values tie at the k-th place.
        let mut state = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for trial in 0..200 {
            let parts = [1, 2, 4, 8][trial % 4];
            let width = 8 + (next() % 40) as usize;
            let vocab = parts * width;
            let k = 1 + (next() % width as u64) as usize;
            let k_max = k + (next() % (width - k + 1) as u64) as usize;
            let row: Vec<f32> = (0..vocab)
                .map(|_| (next() % 9) as f32 * 0.25 - 1.0)
                .collect();
            let want = topk_logprobs(&row, vocab, k);
            let lp_max = want.row(0)[0].1;
            // The device leaves a piece's top k in no particular order.
            let packed = device_pieces(&row, parts, k_max, |cols| {
                cols.rotate_left((next() % k_max as u64) as usize)
            });
            let got = TopK::new(vec![merge_parts(&packed, width, k_max, lp_max, k)]);
            let tokens = |t: &TopK| t.row(0).iter().map(|e| e.0).collect::<Vec<_>>();
            assert_eq!(
                tokens(&got),
                tokens(&want),
                "trial {trial}: {parts} x {width}, k {k}"
            );
            for (a, b) in got.row(0).iter().zip(want.row(0)) {
                assert!((a.1 - b.1).abs() < 1e-5, "trial {trial}");
            }
        }
    }

    #[test]
    fn logits_of_another_shape_are_refused() {
        let t = Tensor::zeros((5, 10), candle_core::DType::F32, &Device::Cpu).unwrap();
        assert!(matches!(
            device_topk(&t, &[item(0, 1), item(1, 1)], 3),
            Err(ModelError::BadInput(_))
        ));
    }
}
