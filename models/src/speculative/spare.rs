//! Caches of finished sequences kept for the next sequence of the same size.
//!
//! CUDA step graphs (target and drafter) are keyed on a cache's memory: a request that gets
//! fresh cache memory runs its first rounds uncaptured and captures new graphs (on an H200,
//! Qwen3-8B shape: ~16 ms for the 16-token verify graph, ~3 ms per drafter round shape, plus
//! the uncaptured rounds), which a short request never earns back. Handing the next request
//! a finished sequence's cache (emptied) lets it replay the graphs already captured, and
//! saves the allocation. Only attention caches are kept: their rows past `len` are never
//! read, so an emptied cache is as good as a new one; hybrid caches carry recurrent state.

use crate::cache::SequenceCache;
use crate::error::ModelResult;

/// Spare caches kept at most (each holds a whole sequence's K/V; a server with more
/// concurrent sequences than this allocates the rest as before).
pub const SPARE_CACHES: usize = 2;

#[derive(Debug, Default)]
pub struct SpareCaches {
    /// (the capacity asked for when the cache was made, the emptied cache), oldest first.
    caches: Vec<(usize, SequenceCache)>,
}

impl SpareCaches {
    /// A kept cache made for `capacity`, emptied, or a new one from `make`. Before making one,
    /// the kept caches (all of other sizes) are freed, so that device memory never holds more
    /// caches than live sequences plus what was kept before.
    pub fn take_or(
        &mut self,
        capacity: usize,
        make: impl FnOnce() -> ModelResult<SequenceCache>,
    ) -> ModelResult<SequenceCache> {
        match self.caches.iter().rposition(|(c, _)| *c == capacity) {
            Some(i) => Ok(self.caches.remove(i).1),
            None => {
                self.caches.clear();
                make()
            }
        }
    }

    /// Keeps `cache` (made for `capacity`) emptied for a later [`SpareCaches::take_or`], the
    /// oldest kept one dropped past [`SPARE_CACHES`]; hybrid caches are dropped.
    pub fn put(&mut self, capacity: usize, mut cache: SequenceCache) {
        if cache.row_tracker().is_some() || cache.truncate(0).is_err() {
            return;
        }
        if self.caches.len() >= SPARE_CACHES {
            self.caches.remove(0);
        }
        self.caches.push((capacity, cache));
    }

    pub fn len(&self) -> usize {
        self.caches.len()
    }

    pub fn is_empty(&self) -> bool {
        self.caches.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    fn cache(capacity: usize) -> SequenceCache {
        SequenceCache::new_attention(1, 1, 2, capacity, DType::F32, &Device::Cpu).unwrap()
    }

    #[test]
    fn a_kept_cache_comes_back_empty_for_the_same_capacity_only() {
        let mut spare = SpareCaches::default();
        let mut c = cache(8);
        c.advance(5);
        spare.put(8, c);
        assert_eq!(spare.len(), 1);
        let again = spare.take_or(8, || panic!("must reuse")).unwrap();
        assert_eq!((again.capacity(), again.len()), (8, 0), "emptied");
        assert!(spare.is_empty());
        spare.put(8, again);
        let other = spare.take_or(9, || Ok(cache(9))).unwrap();
        assert_eq!(other.capacity(), 9, "other size: a new one");
        assert!(
            spare.is_empty(),
            "kept caches of other sizes are freed first"
        );
    }

    #[test]
    fn at_most_spare_caches_are_kept_oldest_dropped_first() {
        let mut spare = SpareCaches::default();
        for cap in 1..=SPARE_CACHES + 1 {
            spare.put(cap, cache(cap));
        }
        assert_eq!(spare.len(), SPARE_CACHES);
        for cap in 2..=SPARE_CACHES + 1 {
            assert_eq!(
                spare.take_or(cap, || panic!("kept")).unwrap().capacity(),
                cap
            );
        }
        assert!(spare.is_empty(), "the oldest (capacity 1) was dropped");
    }
}
