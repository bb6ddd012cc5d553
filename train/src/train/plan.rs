//! Which sequences make up each trainer batch: a length-bucketed buffer over the shuffled
//! stream, decided deterministically.
//!
//! Sequences enter in a per-epoch shuffled order (seeded by `seed` and the epoch) and are held
//! in buckets by length (`bucket_width` tokens per bucket). A batch is drawn once at least
//! `min_ready` sequences wait, taking one sequence per non-empty bucket in turn (the starting
//! bucket rotates), so every step mixes lengths instead of following the shuffle's accidents.
//!
//! The plan depends only on the dataset lengths and these settings, never on how fast the
//! target workers run, so a resumed run replays it from the start, skips the batches already
//! trained, and continues with exactly the batches the uninterrupted run would have seen. The
//! feature buffer in [`super::pipeline`] holds at most `max_depth` computed sequences.

use std::collections::{BTreeMap, VecDeque};

use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PlanConfig {
    pub seed: u64,
    pub batch_size: usize,
    pub min_ready: usize,
    pub bucket_width: usize,
    /// `None`: epochs repeat without end (a step budget stops the run).
    pub epochs: Option<usize>,
}

/// The shuffled order of one epoch.
pub fn epoch_order(n: usize, seed: u64, epoch: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    let mut rng =
        ChaCha8Rng::seed_from_u64(seed ^ (0x9e37_79b9_7f4a_7c15u64.wrapping_mul(epoch as u64 + 1)));
    order.shuffle(&mut rng);
    order
}

/// An iterator of batches (dataset indices).
pub struct BatchPlan {
    cfg: PlanConfig,
    lens: Vec<usize>,
    epoch: usize,
    order: Vec<usize>,
    cursor: usize,
    buckets: BTreeMap<usize, VecDeque<usize>>,
    depth: usize,
    drawn: usize,
}

impl BatchPlan {
    pub fn new(cfg: PlanConfig, lens: Vec<usize>) -> Self {
        let order = epoch_order(lens.len(), cfg.seed, 0);
        Self {
            cfg,
            lens,
            epoch: 0,
            order,
            cursor: 0,
            buckets: BTreeMap::new(),
            depth: 0,
            drawn: 0,
        }
    }

    /// Batches in the whole run when it is bounded by epochs.
    pub fn total_batches(&self) -> Option<usize> {
        self.cfg
            .epochs
            .map(|e| (e * self.lens.len()).div_ceil(self.cfg.batch_size))
    }

    /// The epoch of the next sequence to enter the buffer.
    pub fn epoch(&self) -> usize {
        self.epoch
    }

    fn next_in_stream(&mut self) -> Option<usize> {
        if self.lens.is_empty() {
            return None;
        }
        if self.cursor == self.order.len() {
            if self.cfg.epochs.is_some_and(|e| self.epoch + 1 >= e) {
                return None;
            }
            self.epoch += 1;
            self.order = epoch_order(self.lens.len(), self.cfg.seed, self.epoch);
            self.cursor = 0;
        }
        self.cursor += 1;
        Some(self.order[self.cursor - 1])
    }
}

impl Iterator for BatchPlan {
    type Item = Vec<usize>;

    fn next(&mut self) -> Option<Vec<usize>> {
        let want = self.cfg.min_ready.max(self.cfg.batch_size);
        while self.depth < want {
            let Some(i) = self.next_in_stream() else {
                break;
            };
            let bucket = self.lens[i] / self.cfg.bucket_width.max(1);
            self.buckets.entry(bucket).or_default().push_back(i);
            self.depth += 1;
        }
        if self.depth == 0 {
            return None;
        }
        let mut batch = Vec::with_capacity(self.cfg.batch_size);
        let mut turn = self.drawn;
        while batch.len() < self.cfg.batch_size && self.depth > 0 {
            let keys: Vec<usize> = self.buckets.keys().copied().collect();
            let key = keys[turn % keys.len()];
            let queue = self.buckets.get_mut(&key).expect("listed key");
            batch.push(queue.pop_front().expect("non-empty bucket"));
            if queue.is_empty() {
                self.buckets.remove(&key);
            } else {
                turn += 1;
            }
            self.depth -= 1;
        }
        self.drawn += 1;
        Some(batch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(epochs: Option<usize>) -> PlanConfig {
        PlanConfig {
            seed: 3,
            batch_size: 4,
            min_ready: 8,
            bucket_width: 10,
            epochs,
        }
    }

    #[test]
    fn every_sequence_appears_once_per_epoch() {
        let lens: Vec<usize> = (0..23).map(|i| (i * 7) % 50).collect();
        let plan = BatchPlan::new(cfg(Some(2)), lens);
        assert_eq!(plan.total_batches(), Some(12));
        let batches: Vec<_> = plan.collect();
        assert_eq!(batches.len(), 12);
        let mut seen: Vec<usize> = batches.into_iter().flatten().collect();
        seen.sort();
        let mut want: Vec<usize> = (0..23).chain(0..23).collect();
        want.sort();
        assert_eq!(seen, want);
    }

    #[test]
    fn batches_mix_length_buckets() {
        let lens: Vec<usize> = (0..40).map(|i| if i % 2 == 0 { 5 } else { 45 }).collect();
        for b in BatchPlan::new(cfg(Some(1)), lens.clone()).take(8) {
            let long = b.iter().filter(|&&i| lens[i] > 10).count();
            assert!(long > 0 && long < b.len(), "batch {b:?} is one length");
        }
    }

    #[test]
    fn plan_is_a_function_of_its_settings() {
        let lens: Vec<usize> = (0..31).map(|i| (i * 13) % 64).collect();
        let a: Vec<_> = BatchPlan::new(cfg(None), lens.clone()).take(30).collect();
        let b: Vec<_> = BatchPlan::new(cfg(None), lens).take(30).collect();
        assert_eq!(a, b);
    }
}
