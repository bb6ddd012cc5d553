//! The prefix cache in the engine ([`crate::cache::radix`]): a new sequence (or a retracted
//! one coming back) starts on the longest cached run of whole pages of its tokens, at least
//! one token short of what it prefills (that token's logits sample the first new token), and
//! prefills only the rest; speculating sequences whose proposer reads target features start
//! only on pages whose features are cached too, and get them as their first pending features.
//! Sequences insert their full pages when their prefill completes (with features) and when
//! they leave the engine (without). Cached pages nobody else holds are evicted, least recently
//! used first, before any sequence is retracted for pages.
//!
//! Output does not change: a cached page holds exactly the K/V rows a prefill of the same
//! tokens at the same positions writes.

use candle_core::Tensor;

use super::{Engine, EngineError, Sequence};
use crate::cache::{PrefixCache, SequenceCache, PAGE_SIZE};
use crate::error::ModelError;
use crate::speculative::proposer::SeqId;
use crate::speculative::request::Algorithm;

/// A sequence's target cache, opened on a cached prefix where there is one.
pub(super) struct OpenedCache {
    pub cache: SequenceCache,
    /// Rows of the cache already live (the cached prefix).
    pub cached: usize,
    /// The cached rows' proposer features.
    pub features: Option<Tensor>,
}

impl Engine {
    /// Shares K/V pages of common prefixes between sequences (needs the pool,
    /// [`Engine::use_kv_pool`], and a pure-attention target; hybrids are refused with an
    /// error saying so). Cached rows' proposer features are kept (on the target's device) up
    /// to `max_feature_bytes`; a speculating sequence starts only on pages whose features are
    /// kept. Outputs do not change.
    pub fn enable_prefix_cache(&mut self, max_feature_bytes: usize) -> Result<(), EngineError> {
        let pool = self.pool.clone().ok_or_else(|| {
            EngineError::Model(ModelError::BadCacheOp(
                "the prefix cache needs the K/V pool (use_kv_pool first)".into(),
            ))
        })?;
        if !self.target.supports_prefix_cache() {
            return Err(EngineError::Model(ModelError::BadCacheOp(
                "the prefix cache is not available for hybrid (Gated DeltaNet) targets: their recurrent state at a cached page boundary is not kept".into(),
            )));
        }
        self.prefix = Some(PrefixCache::new(pool, max_feature_bytes));
        Ok(())
    }

    /// Whether the proposer reads target features (then the prefix cache keeps them for
    /// cached rows, within the budget given to [`Engine::enable_prefix_cache`]).
    pub fn proposer_reads_features(&self) -> bool {
        !self.taps().is_empty()
    }

    /// Drops every cached page (running sequences keep the pages they use).
    pub fn flush_prefix_cache(&mut self) {
        if let Some(p) = self.prefix.as_mut() {
            p.clear();
        }
    }

    /// Rows the prefix cache holds (None without one).
    pub fn prefix_cache_tokens(&self) -> Option<usize> {
        self.prefix.as_ref().map(|p| p.cached_pages() * PAGE_SIZE)
    }

    /// Makes sequence `id`, admitted on a cached prefix and not prefilled at all yet, prefill
    /// its whole prompt instead (its prompt logprobs need every row).
    pub(super) fn forget_cached_prefix(&mut self, id: SeqId) -> Result<(), EngineError> {
        let Some(i) = self.seqs.iter().position(|s| s.id == id) else {
            return Err(EngineError::UnknownSequence(id));
        };
        let (Some(pool), true) = (self.pool.clone(), self.seqs[i].stats.cached_tokens > 0) else {
            return Ok(());
        };
        let s = &self.seqs[i];
        let width = self.verify_width(s.req.algorithm);
        let fresh = self
            .target
            .new_cache_after(&pool, s.capacity, width, &[], 0)?;
        let seq = &mut self.seqs[i];
        seq.cache = fresh;
        seq.prefill_done = 0;
        seq.pending_features = None;
        seq.stats.cached_tokens = 0;
        Ok(())
    }

    /// Frees up to `pages` pages from the prefix cache; the pages freed.
    pub(super) fn evict_cached(&mut self, pages: usize) -> usize {
        self.prefix.as_mut().map_or(0, |p| p.evict(pages))
    }

    /// The target cache for a sequence of `tokens` that prefills `prefill` of them: on the
    /// longest cached prefix of at most `prefill - 1` rows (with features when `algorithm`'s
    /// proposer reads them), or empty.
    pub(super) fn open_cache(
        &mut self,
        tokens: &[u32],
        prefill: usize,
        algorithm: Algorithm,
        capacity: usize,
    ) -> Result<OpenedCache, EngineError> {
        let width = self.verify_width(algorithm);
        let Some(pool) = self.pool.clone() else {
            let target = &self.target;
            let cache = self
                .spare
                .take_or(capacity, || target.new_cache(capacity, width))?;
            return Ok(OpenedCache {
                cache,
                cached: 0,
                features: None,
            });
        };
        let need_features = algorithm != Algorithm::Plain && !self.taps().is_empty();
        let found = match self.prefix.as_mut() {
            Some(p) => p.lookup(tokens, prefill.saturating_sub(1), need_features)?,
            None => Default::default(),
        };
        let cache = self
            .target
            .new_cache_after(&pool, capacity, width, &found.pages, 0)?;
        let features = found.features.filter(|_| need_features);
        Ok(OpenedCache {
            cached: cache.len(),
            cache,
            features,
        })
    }

    /// Caches the full pages of sequence `i`'s committed rows with its pending features
    /// (right after its prefill they cover the rows from row 0).
    pub(super) fn cache_rows(&mut self, i: usize) {
        let seq = &self.seqs[i];
        cache_sequence(self.prefix.as_mut(), seq, seq.pending_features.as_ref());
    }

    /// [`Engine::cache_rows`] for a sequence leaving the engine (its features are gone).
    pub(super) fn cache_leaving(&mut self, seq: &Sequence) {
        cache_sequence(self.prefix.as_mut(), seq, None);
    }
}

/// Inserts `seq`'s full pages into `prefix`; a failure only costs the cache.
fn cache_sequence(prefix: Option<&mut PrefixCache>, seq: &Sequence, features: Option<&Tensor>) {
    let Some(prefix) = prefix else {
        return;
    };
    let (table, rows) = (seq.cache.page_table(), seq.cache.len());
    if let Err(e) = prefix.insert(&seq.tokens, table, rows, features) {
        tracing::warn!("prefix cache: sequence {} not cached: {e}", seq.id);
    }
}
