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
