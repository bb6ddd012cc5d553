//! Anchors, labels and the decayed cross-entropy (SpecForge `OnlineDFlashModel`, DFLASH.md
//! §3.3 and §3.5).
//!
//! Slot `k` of the block anchored at `a` predicts `x_{a+k}` (same position, no shift) for
//! `k = 1..B-1`, weighted `w_k = exp(-(k-1)/gamma)`; a slot is excluded when `a + k` is past
//! the sequence or not supervised. The loss is `Σ w·CE / Σ w` over every valid slot of the
//! optimizer step, so gradient accumulation does not change what is averaged.

use candle_core::{DType, Device, Tensor, D};
use rand::seq::index::sample;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use super::dataset::Example;
use super::HeadLoss;
use dflash_models::DFlashDrafter;

/// gamma for the published block sizes (7 for 16; 5 for 10 and 4 for 8 as SpecForge
/// suggests), and `7 * B / 16` otherwise.
pub fn default_gamma(block_size: usize) -> f64 {
    match block_size {
        16 => 7.0,
        10 => 5.0,
        8 => 4.0,
        b => (7.0 * b as f64 / 16.0).max(1.0),
    }
}

/// The anchor rng of one trainer batch: a function of the run seed and the batch index, so a
/// resumed run draws the same anchors.
pub fn anchor_rng(seed: u64, batch_index: usize) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed.wrapping_mul(0x100_0000_01b3) ^ (batch_index as u64 + 1))
}

/// Up to `num_anchors` distinct anchors drawn uniformly from the candidates, ascending.
pub fn sample_anchors(ex: &Example, num_anchors: usize, rng: &mut ChaCha8Rng) -> Vec<usize> {
    let cand = ex.anchor_candidates();
    let n = num_anchors.min(cand.len());
    let mut picked: Vec<usize> = sample(rng, cand.len(), n)
        .into_iter()
        .map(|i| cand[i])
        .collect();
    picked.sort_unstable();
    picked
}

/// The supervised slots of a batch's blocks, as rows of the drafter's block output.
#[derive(Debug, Default, Clone)]
pub struct BlockTargets {
    /// Row of `train_hidden`'s output (`block * B + k`).
    pub rows: Vec<u32>,
    pub labels: Vec<u32>,
    pub weights: Vec<f32>,
    /// Block number and slot of each row (for acceptance streaks).
    pub block: Vec<u32>,
    pub slot: Vec<u32>,
    pub blocks: usize,
}

impl BlockTargets {
    pub fn total_weight(&self) -> f64 {
        self.weights.iter().map(|&w| w as f64).sum()
    }

    /// Adds one sequence's blocks (anchors in the order given to the forward).
    pub fn push(&mut self, ex: &Example, anchors: &[usize], block_size: usize, gamma: f64) {
        for &a in anchors {
            let block = self.blocks as u32;
            for k in 1..block_size {
                let p = a + k;
                if p >= ex.tokens.len() || ex.loss_mask[p] == 0 {
                    continue;
                }
                self.rows.push(block * block_size as u32 + k as u32);
                self.labels.push(ex.tokens[p]);
                self.weights.push((-((k - 1) as f64) / gamma).exp() as f32);
                self.block.push(block);
                self.slot.push(k as u32);
            }
            self.blocks += 1;
        }
    }
}

impl BlockTargets {
    /// The gradient of every block row, `[block_rows, h]`, from `d: [rows.len(), h]`, the
    /// gradient of the label rows: row `rows[j]` takes `d[j]`, rows without a label take zeros.
    /// The label rows are unique (one per block slot), so this is a gather through the inverse
    /// map, parallel over every element; candle's `index_add` along dim 0 runs one thread per
    /// column looping over all rows in turn (256 threads over ~123K rows at the tiny recipe's
    /// hidden size, tens of ms on the GPU).
    pub fn scatter_rows(&self, d: &Tensor, block_rows: usize) -> candle_core::Result<Tensor> {
        let (m, h) = d.dims2()?;
        if m != self.rows.len() {
            candle_core::bail!(
                "scatter_rows: {m} gradient rows for {} labels",
                self.rows.len()
            )
        }
        let zero_row = m as u32;
        let mut inverse = vec![zero_row; block_rows];
        for (j, &r) in self.rows.iter().enumerate() {
            match inverse.get_mut(r as usize) {
                Some(slot) if *slot == zero_row => *slot = j as u32,
                Some(_) => candle_core::bail!("scatter_rows: label row {r} appears twice"),
                None => candle_core::bail!("scatter_rows: label row {r} past {block_rows} rows"),
            }
        }
        let padded = Tensor::cat(&[d, &Tensor::zeros((1, h), d.dtype(), d.device())?], 0)?;
        padded.index_select(&Tensor::new(inverse.as_slice(), d.device())?, 0)
    }
}

/// `Σ w·CE(logits, labels) / total_weight` for `logits: [n, vocab]` (f32).
pub fn weighted_cross_entropy(
    logits: &Tensor,
    targets: &BlockTargets,
    total_weight: f64,
    device: &Device,
) -> candle_core::Result<Tensor> {
    let n = targets.labels.len();
    let labels = Tensor::from_slice(&targets.labels, (n, 1), device)?;
    let weights = Tensor::from_slice(&targets.weights, n, device)?;
    let logp = candle_nn::ops::log_softmax(&logits.to_dtype(DType::F32)?, D::Minus1)?;
    let picked = logp.gather(&labels, 1)?.squeeze(1)?;
    (picked * weights)?.sum_all()? * (-1.0 / total_weight)
}

/// As [`weighted_cross_entropy`] of `head`'s logits over `hidden: [n, h]` (the drafter's
/// final hidden states of the label rows), fused: the logits exist one row chunk at a time and
/// the frozen head gets no gradient. Returns the loss and each row's argmax (u32).
pub fn fused_weighted_cross_entropy(
    hidden: &Tensor,
    head: &Tensor,
    targets: &BlockTargets,
    total_weight: f64,
    device: &Device,
) -> candle_core::Result<(Tensor, Tensor)> {
    let n = targets.labels.len();
    let labels = Tensor::from_slice(&targets.labels, n, device)?;
    let weights = Tensor::from_slice(&targets.weights, n, device)?;
    let ce = dflash_models::training::linear_ce::linear_cross_entropy(hidden, head, &labels)?;
    let loss = ((ce.loss * weights)?.sum_all()? * (1.0 / total_weight))?;
    Ok((loss, ce.argmax))
}

/// The loss of one micro-batch's label rows `hidden: [n, h]` (the drafter's final hidden
/// states) under `kind`, and each row's argmax (u32): fused over the frozen `head`, or the
/// composition of the drafter's head and [`weighted_cross_entropy`].
pub fn head_cross_entropy(
    kind: HeadLoss,
    hidden: &Tensor,
    drafter: &DFlashDrafter,
    head: &Tensor,
    targets: &BlockTargets,
    total_weight: f64,
) -> dflash_models::ModelResult<(Tensor, Tensor)> {
    let dev = drafter.device();
    Ok(match kind {
        HeadLoss::Fused => fused_weighted_cross_entropy(hidden, head, targets, total_weight, dev)?,
        HeadLoss::Composed => {
            let logits = drafter.lm_head(hidden)?;
            let predicted = logits.argmax(D::Minus1)?;
            let loss = weighted_cross_entropy(&logits, targets, total_weight, dev)?;
            (loss, predicted)
        }
    })
}

/// Top-1 hits and acceptance streaks of one batch, from the argmax of its logits.
#[derive(Debug, Default, Clone, Copy)]
pub struct Hits {
    pub correct: usize,
    pub scored: usize,
    /// Σ over blocks of the number of leading slots (1, 2, ...) drafted right.
    pub streak_sum: usize,
    pub blocks: usize,
}

impl Hits {
    pub fn add(&mut self, o: Hits) {
        self.correct += o.correct;
        self.scored += o.scored;
        self.streak_sum += o.streak_sum;
        self.blocks += o.blocks;
    }
    pub fn accuracy(&self) -> f64 {
        self.correct as f64 / self.scored.max(1) as f64
    }
    /// Estimated tokens per round: the bonus plus the mean streak against the data's tokens
    /// (the target's own tokens when the data was regenerated by it).
    pub fn tau(&self) -> f64 {
        1.0 + self.streak_sum as f64 / self.blocks.max(1) as f64
    }
}

pub fn hits(predicted: &[u32], targets: &BlockTargets) -> Hits {
    let mut h = Hits {
        blocks: targets.blocks,
        scored: predicted.len(),
        ..Default::default()
    };
    let mut streak_block = u32::MAX;
    let mut expect_slot = 1;
    for (i, &p) in predicted.iter().enumerate() {
        let ok = p == targets.labels[i];
        h.correct += usize::from(ok);
        if targets.block[i] != streak_block {
            streak_block = targets.block[i];
            expect_slot = 1;
        }
        if ok && targets.slot[i] == expect_slot {
            h.streak_sum += 1;
            expect_slot += 1;
        } else {
            expect_slot = u32::MAX;
        }
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The gather equals candle's `index_add` of the label rows into zeros; a repeated row is
    /// refused rather than summed wrongly.
    #[test]
    fn scatter_rows_equals_index_add() {
        let dev = Device::Cpu;
        let t = BlockTargets {
            rows: vec![1, 2, 5, 7],
            ..Default::default()
        };
        let d = Tensor::arange(0f32, 12.0, &dev)
            .unwrap()
            .reshape((4, 3))
            .unwrap();
        let got = t.scatter_rows(&d, 9).unwrap();
        let ids = Tensor::new(t.rows.as_slice(), &dev).unwrap();
        let want = Tensor::zeros((9, 3), DType::F32, &dev)
            .unwrap()
            .index_add(&ids, &d, 0)
            .unwrap();
        assert_eq!(
            got.to_vec2::<f32>().unwrap(),
            want.to_vec2::<f32>().unwrap()
        );
        let twice = BlockTargets {
            rows: vec![1, 1],
            ..Default::default()
        };
        assert!(twice.scatter_rows(&d.narrow(0, 0, 2).unwrap(), 9).is_err());
        assert!(t.scatter_rows(&d, 7).is_err());
    }

    #[test]
    fn gamma_seven_for_block_sixteen() {
        assert_eq!(default_gamma(16), 7.0);
        assert_eq!(default_gamma(8), 4.0);
    }

    #[test]
    fn labels_are_same_position_and_skip_unsupervised_slots() {
        let ex = Example {
            tokens: vec![10, 11, 12, 13, 14, 15],
            loss_mask: vec![0, 1, 1, 0, 1, 1],
        };
        let mut t = BlockTargets::default();
        t.push(&ex, &[1, 4], 3, 7.0);
        // anchor 1: slot 1 -> x2 (ok), slot 2 -> x3 (mask 0); anchor 4: slot 1 -> x5, slot 2 past end
        assert_eq!(t.rows, vec![1, 4]);
        assert_eq!(t.labels, vec![12, 15]);
        assert_eq!(t.weights, vec![1.0, 1.0]);
        assert_eq!(t.blocks, 2);
    }

    #[test]
    fn streak_stops_at_first_miss() {
        let t = BlockTargets {
            rows: vec![1, 2, 3, 5],
            labels: vec![1, 2, 3, 4],
            weights: vec![1.0; 4],
            block: vec![0, 0, 0, 1],
            slot: vec![1, 2, 3, 1],
            blocks: 2,
        };
        let h = hits(&[1, 9, 3, 4], &t);
        assert_eq!(h.correct, 3);
        assert_eq!(h.streak_sum, 2);
        assert_eq!(h.tau(), 2.0);
    }
}
