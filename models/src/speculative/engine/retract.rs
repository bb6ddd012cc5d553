//! Pages on demand and retraction (SGLang's `retract_decode`): with a K/V pool a sequence
//! holds pages only for the rows it has filled, and takes more for each prefill chunk and each
//! round's verify rows. When the pool is short, the newest sequences give theirs back: a
//! retracted sequence keeps its committed tokens, waits, and is prefilled again up to its
//! bonus token when pages are free (the proposer's context is rebuilt from that prefill), so
//! its output is what it would have been (greedy: the same tokens). Older sequences are never
//! retracted for newer ones, so the oldest always progresses.

use super::{Engine, EngineError};
use crate::error::ModelError;
use crate::speculative::request::Algorithm;

impl Engine {
    /// Sequence indices, oldest (lowest id) first.
    pub(super) fn by_age(&self) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.seqs.len()).collect();
        order.sort_by_key(|&i| self.seqs[i].id);
        order
    }

    /// Backs `rows` rows of sequence `i`, retracting newer sequences that hold pages while
    /// the pool is short. `false`: not possible without retracting older ones (nothing
    /// changed for `i`). Always true without a pool.
    pub(super) fn reserve_rows(&mut self, i: usize, rows: usize) -> Result<bool, EngineError> {
        if self.pool.is_none() {
            return Ok(true);
        }
        loop {
            match self.seqs[i].cache.grow_to(rows) {
                Ok(()) => return Ok(true),
                Err(ModelError::PoolExhausted { pages, free, .. }) => {
                    // Cached pages nobody uses go before any sequence is retracted.
                    if self.evict_cached(pages.saturating_sub(free).max(1)) > 0 {
                        continue;
                    }
                    let me = self.seqs[i].id;
                    let victim = (0..self.seqs.len())
                        .filter(|&j| {
                            self.seqs[j].id > me
                                && !self.seqs[j].cache.page_table().pages().is_empty()
                        })
                        .max_by_key(|&j| self.seqs[j].id);
                    match victim {
                        Some(j) => self.retract(j)?,
                        None => return Ok(false),
                    }
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Backs sequence `i`'s proposer state (the drafter's context pages) for its next round,
    /// retracting newer speculating sequences while the drafter's pool is short. `false`: not
    /// possible without retracting older ones. Always true for plain decoding.
    fn reserve_draft(&mut self, i: usize) -> Result<bool, EngineError> {
        if self.seqs[i].req.algorithm == Algorithm::Plain {
            return Ok(true);
        }
        loop {
            let (id, committed) = (self.seqs[i].id, self.seqs[i].tokens.len());
            let Some(p) = self.proposer.as_mut() else {
                return Ok(true);
            };
            match p.reserve(id, committed) {
                Ok(()) => return Ok(true),
                Err(ModelError::PoolExhausted { .. }) => {
                    // A retracted sequence's drafter cache is reopened empty; only one past
                    // its prefill has drafter context (and it stops being one when retracted,
                    // so the loop ends).
                    let victim = (0..self.seqs.len())
                        .filter(|&j| {
                            self.seqs[j].id > id
                                && self.seqs[j].req.algorithm != Algorithm::Plain
                                && self.seqs[j].prefilled
                        })
                        .max_by_key(|&j| self.seqs[j].id);
                    match victim {
                        Some(j) => self.retract(j)?,
                        None => return Ok(false),
                    }
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Before a round: every decoding sequence, oldest first, backed for its verify rows;
    /// one that cannot be (even after retracting every newer one) is retracted itself.
    pub(super) fn make_room(&mut self) -> Result<(), EngineError> {
        if self.pool.is_none() {
            return Ok(());
        }
        for i in self.by_age() {
            let s = &self.seqs[i];
            if !s.prefilled {
                continue;
            }
            let rows = s.cache.len() + self.verify_width(s.req.algorithm);
            if !self.reserve_rows(i, rows)? || !self.reserve_draft(i)? {
                self.retract(i)?;
            }
        }
        Ok(())
    }

    /// Gives sequence `i`'s pages back and queues it for a re-prefill of its committed
    /// tokens (its proposer state reset too).
    pub(super) fn retract(&mut self, i: usize) -> Result<(), EngineError> {
        let Some(pool) = self.pool.clone() else {
            return Ok(());
        };
        let width = self.verify_width(self.seqs[i].req.algorithm);
        let capacity = self.seqs[i].capacity;
        // Empty: a cached prefix is looked up when its prefill starts again, so that it holds
        // no page while it waits.
        let fresh = self
            .target
            .new_cache_after(&pool, capacity, width, &[], 0)?;
        let seq = &mut self.seqs[i];
        // The old cache (and its pages) goes here.
        seq.cache = fresh;
        if seq.req.algorithm != Algorithm::Plain {
            if let Some(p) = self.proposer.as_mut() {
                p.close(seq.id);
                p.open(seq.id, capacity)?;
            }
        }
        seq.resumed = seq.prefilled || seq.resumed;
        seq.prefilled = false;
        seq.prefill_done = 0;
        seq.pending_features = None;
        seq.stats.retractions += 1;
        tracing::debug!(
            "retracted sequence {} ({} tokens committed) for lack of K/V pages",
            seq.id,
            seq.tokens.len()
        );
        Ok(())
    }
}
