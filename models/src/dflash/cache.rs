//! The drafter's context caches: one of its own per sequence (benches, tests, the CPU demo)
//! or pages of a [`KvPool`] of the drafter's layers, which a server sizes with the target's
//! (SGLang keeps the draft model's K/V in its token pool too). In the pool a sequence holds
//! pages for the rows it has filled plus one block, not a whole context up front.

use crate::cache::{KvPool, SequenceCache};
use crate::dflash::DFlashDrafter;
use crate::error::ModelResult;

impl DFlashDrafter {
    /// Bytes of K/V one cached context row takes across the drafter's layers.
    pub fn kv_bytes_per_row(&self) -> usize {
        let c = &self.cfg.layers;
        c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * self.dtype.size_in_bytes()
    }

    /// A context cache of its own for up to `capacity` committed positions (plus the
    /// transient block rows).
    pub fn new_cache(&self, capacity: usize) -> ModelResult<SequenceCache> {
        let c = &self.cfg.layers;
        Ok(SequenceCache::new_attention(
            c.num_hidden_layers,
            c.num_key_value_heads,
            c.head_dim,
            capacity + self.cfg.block_size,
            self.dtype,
            &self.device,
        )?)
    }

    /// A pool of `pages` pages for every drafter layer (all of them attention layers).
    pub fn new_kv_pool(&self, pages: usize) -> ModelResult<KvPool> {
        let c = &self.cfg.layers;
        Ok(KvPool::new(
            c.num_hidden_layers,
            c.num_key_value_heads,
            c.head_dim,
            pages,
            self.dtype,
            &self.device,
        )?)
    }

    /// A context cache for up to `capacity` committed positions (plus the block rows) in
    /// pages of `pool`, backing `rows` rows for now ([`SequenceCache::grow_to`] takes more).
    /// Fails, taking nothing, when the pool is short.
    pub fn new_cache_in(
        &self,
        pool: &KvPool,
        capacity: usize,
        rows: usize,
    ) -> ModelResult<SequenceCache> {
        let kinds = vec![None; self.cfg.layers.num_hidden_layers];
        SequenceCache::new_paged_with(pool, kinds, capacity + self.cfg.block_size, 0, rows)
    }
}

/// The pool every one of `caches` lives in; None when one has buffers of its own or they
/// live in different pools (then no launch can write them all through one set of buffers).
pub(crate) fn one_pool<'a>(caches: &[&'a SequenceCache]) -> Option<&'a KvPool> {
    let pool = caches.first()?.page_table().pool()?;
    caches
        .iter()
        .all(|c| c.page_table().pool().is_some_and(|p| p.same(pool)))
        .then_some(pool)
}

/// Per-row write targets of a batched context append (`dflash/cuda.rs`): for `caches` taking
/// `new_rows[s]` new context rows each (in batch order), every row's cache row index (its
/// cache's committed length plus its index among that cache's new rows) and its cache's page
/// table padded to `width` entries (the longest table), `rows x width` entries. None unless
/// every cache is in one pool (the buffers the launch writes) and two or more take rows.
/// Host work only, so the CPU tests check it; only the CUDA build launches with it.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn batched_append_rows(
    caches: &[&SequenceCache],
    new_rows: &[usize],
) -> Option<(Vec<u32>, Vec<u32>, usize)> {
    if new_rows.iter().filter(|&&n| n > 0).count() < 2 {
        return None;
    }
    one_pool(caches)?;
    let width = caches
        .iter()
        .map(|c| c.page_table().pages().len())
        .max()
        .unwrap_or(0)
        .max(1);
    let rows: usize = new_rows.iter().sum();
    let (mut lens, mut pages) = (Vec::with_capacity(rows), vec![0u32; rows * width]);
    let mut at = 0;
    for (cache, &n) in caches.iter().zip(new_rows) {
        for i in 0..n {
            lens.push((cache.len() + i) as u32);
            cache
                .page_table()
                .copy_into(&mut pages[(at + i) * width..(at + i + 1) * width]);
        }
        at += n;
    }
    Some((lens, pages, width))
}

#[cfg(test)]
mod tests {
    use super::batched_append_rows;
    use crate::cache::{KvPool, SequenceCache};
    use candle_core::{DType, Device};

    /// Rows of three pooled caches (one taking none) get their cache's length plus their
    /// index and their cache's page table; caches outside one pool, or one cache alone, get
    /// no batched append.
    #[test]
    fn batched_append_rows_follow_each_cache() {
        let dev = Device::Cpu;
        let pool = KvPool::new(1, 1, 8, 32, DType::F32, &dev).unwrap();
        let paged =
            |rows: usize| SequenceCache::new_paged_with(&pool, vec![None], 256, 0, rows).unwrap();
        let (mut a, b, mut c) = (paged(40), paged(20), paged(70));
        a.advance(33);
        c.advance(65);
        let caches = [&a, &b, &c];
        let (lens, pages, width) = batched_append_rows(&caches, &[3, 0, 2]).unwrap();
        assert_eq!(lens, vec![33, 34, 35, 65, 66]);
        let table = |s: &SequenceCache| {
            let mut row = vec![0u32; width];
            s.page_table().copy_into(&mut row);
            row
        };
        assert_eq!(width, c.page_table().pages().len());
        for (r, cache) in [&a, &a, &a, &c, &c].iter().enumerate() {
            assert_eq!(&pages[r * width..(r + 1) * width], table(cache).as_slice());
        }
        assert!(batched_append_rows(&caches, &[3, 0, 0]).is_none());
        let own = SequenceCache::new_attention(1, 1, 8, 64, DType::F32, &dev).unwrap();
        assert!(batched_append_rows(&[&a, &own], &[1, 1]).is_none());
    }
}
