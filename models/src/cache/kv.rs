//! Per-sequence caches, preallocated to a capacity and written in place.
//!
//! Speculative decoding appends a block, keeps part of it and drops the rest every round, so
//! the cache must support `append`, `truncate(len)` and `compact(start, keep)` (the tree-accepted
//! rows moved next to the prefix) without re-concatenating tensors per step. Each layer's buffer
//! is `[num_kv_heads, capacity, head_dim]`; rows `[0, len)` are live.
//!
//! A cache is a list of per-layer caches behind [`LayerCache`]. Attention layers keep K/V rows;
//! the recurrent (Gated DeltaNet) layers of the hybrid targets keep what rebuilds the state of
//! any rollback-able row ([`super::recurrent`]), with the same truncate/compact contract.

use std::sync::Arc;

use candle_core::{DType, Device, Result, Tensor};

use crate::cache::pool::{pages_for, KvPool, PageTable, PAGE_SIZE};
use crate::cache::recurrent::{RecurrentLayer, RowTracker, StagedState};
use crate::error::{ModelError, ModelResult};

/// K/V rows of one attention layer.
#[derive(Debug, Clone)]
pub struct KvBuffer {
    k: Tensor,
    v: Tensor,
}

impl KvBuffer {
    pub fn new(
        num_kv_heads: usize,
        capacity: usize,
        head_dim: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let shape = (num_kv_heads, capacity, head_dim);
        Ok(Self {
            k: Tensor::zeros(shape, dtype, device)?,
            v: Tensor::zeros(shape, dtype, device)?,
        })
    }

    /// Writes `k`, `v` (`[num_kv_heads, n, head_dim]`) at logical rows `[at, at + n)` of the
    /// sequence whose rows `table` places.
    fn write(&self, table: &PageTable, at: usize, k: &Tensor, v: &Tensor) -> Result<()> {
        let (k, v) = (k.contiguous()?, v.contiguous()?);
        for (logical, physical, n) in table.runs(at, k.dim(1)?) {
            let (kr, vr) = if n == k.dim(1)? {
                (k.clone(), v.clone())
            } else {
                (
                    k.narrow(1, logical - at, n)?.contiguous()?,
                    v.narrow(1, logical - at, n)?.contiguous()?,
                )
            };
            self.k.slice_set(&kr, 1, physical)?;
            self.v.slice_set(&vr, 1, physical)?;
        }
        Ok(())
    }

    /// The whole K and V buffers `[num_kv_heads, rows, head_dim]` (a pool's: every
    /// sequence's pages; the fused kernels write and read rows in place through page tables).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn buffers(&self) -> (&Tensor, &Tensor) {
        (&self.k, &self.v)
    }

    /// Logical rows `[0, len)`: `[num_kv_heads, len, head_dim]` (a view when they are
    /// consecutive in the buffer, else a gathered copy).
    fn view(&self, table: &PageTable, len: usize) -> Result<(Tensor, Tensor)> {
        let runs = table.runs(0, len);
        match runs.as_slice() {
            [] => Ok((self.k.narrow(1, 0, 0)?, self.v.narrow(1, 0, 0)?)),
            [(_, p, n)] => Ok((self.k.narrow(1, *p, *n)?, self.v.narrow(1, *p, *n)?)),
            many => {
                let ks: Vec<Tensor> = many
                    .iter()
                    .map(|&(_, p, n)| self.k.narrow(1, p, n))
                    .collect::<Result<_>>()?;
                let vs: Vec<Tensor> = many
                    .iter()
                    .map(|&(_, p, n)| self.v.narrow(1, p, n))
                    .collect::<Result<_>>()?;
                Ok((Tensor::cat(&ks, 1)?, Tensor::cat(&vs, 1)?))
            }
        }
    }

    /// Moves logical rows `keep` (ascending, all `>= start`) to `[start, start + keep.len())`.
    fn compact(&self, table: &PageTable, start: usize, keep: &[usize]) -> Result<()> {
        let contiguous = keep.iter().enumerate().all(|(i, &r)| r == start + i);
        if contiguous || keep.is_empty() {
            return Ok(());
        }
        let idx: Vec<u32> = keep.iter().map(|&r| table.physical(r) as u32).collect();
        let idx = Tensor::new(idx.as_slice(), self.k.device())?;
        // index_select materialises the rows before any of them is overwritten.
        let k = self.k.index_select(&idx, 1)?;
        let v = self.v.index_select(&idx, 1)?;
        self.write(table, start, &k, &v)
    }
}

#[derive(Debug, Clone)]
pub enum LayerCache {
    Attention(KvBuffer),
    Recurrent(RecurrentLayer),
}

impl LayerCache {
    /// The K/V rows of an attention layer; an error for a recurrent one.
    pub fn attention(&self) -> ModelResult<&KvBuffer> {
        match self {
            LayerCache::Attention(kv) => Ok(kv),
            LayerCache::Recurrent(_) => Err(ModelError::BadInput(
                "an attention layer was given a recurrent (GDN) layer cache".into(),
            )),
        }
    }

    pub fn recurrent(&self) -> ModelResult<&RecurrentLayer> {
        match self {
            LayerCache::Recurrent(r) => Ok(r),
            LayerCache::Attention(_) => Err(ModelError::BadInput(
                "a recurrent (GDN) layer was given an attention cache".into(),
            )),
        }
    }
}

/// All layers' caches of one sequence plus the number of live positions.
#[derive(Debug, Clone)]
pub struct SequenceCache {
    layers: Vec<LayerCache>,
    len: usize,
    capacity: usize,
    /// Where the attention layers' rows live (shared by every layer).
    table: Arc<PageTable>,
    /// Hybrid caches only: which rows the recurrent layers can still roll back.
    rows: Option<RowTracker>,
}

impl SequenceCache {
    pub fn new_attention(
        num_layers: usize,
        num_kv_heads: usize,
        head_dim: usize,
        capacity: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let layers = (0..num_layers)
            .map(|_| {
                KvBuffer::new(num_kv_heads, capacity, head_dim, dtype, device)
                    .map(LayerCache::Attention)
            })
            .collect::<Result<_>>()?;
        Ok(Self {
            layers,
            len: 0,
            capacity,
            table: Arc::new(PageTable::contiguous()),
            rows: None,
        })
    }

    /// A cache of `capacity` rows in pages of `pool`: `kinds[i]` is layer i's cache, `None`
    /// for an attention layer (the next of the pool's layers), a recurrent layer otherwise.
    /// `rollback` as [`SequenceCache::new_hybrid`] (ignored without recurrent layers). Fails,
    /// taking nothing, when the pool has too few free pages.
    pub fn new_paged(
        pool: &KvPool,
        kinds: Vec<Option<RecurrentLayer>>,
        capacity: usize,
        rollback: usize,
    ) -> ModelResult<Self> {
        Self::new_paged_with(pool, kinds, capacity, rollback, capacity)
    }

    /// [`SequenceCache::new_paged`] holding pages for only `rows` of its `capacity` rows for
    /// now; [`SequenceCache::grow_to`] takes more as it fills.
    pub fn new_paged_with(
        pool: &KvPool,
        kinds: Vec<Option<RecurrentLayer>>,
        capacity: usize,
        rollback: usize,
        rows: usize,
    ) -> ModelResult<Self> {
        Self::new_paged_after(pool, kinds, capacity, rollback, &[], rows)
    }

    /// [`SequenceCache::new_paged_with`] whose first rows are the cached prefix in the held
    /// pages `prefix` (a prefix cache's: shared, read only): they are live from the start
    /// (`len() == prefix.len() * PAGE_SIZE`) and new rows go to pages of its own after them.
    /// Attention-only caches: a recurrent layer's state at the prefix's end is not known.
    pub fn new_paged_after(
        pool: &KvPool,
        kinds: Vec<Option<RecurrentLayer>>,
        capacity: usize,
        rollback: usize,
        prefix: &[u32],
        rows: usize,
    ) -> ModelResult<Self> {
        let attention = kinds.iter().filter(|k| k.is_none()).count();
        if attention != pool.num_layers() {
            return Err(ModelError::BadInput(format!(
                "a paged cache with {attention} attention layers from a pool of {}",
                pool.num_layers()
            )));
        }
        let cached = prefix.len() * PAGE_SIZE;
        if !prefix.is_empty() && (attention != kinds.len() || cached >= capacity) {
            return Err(ModelError::BadCacheOp(format!(
                "a cached prefix of {cached} rows for a cache of {capacity} rows with {} recurrent layers",
                kinds.len() - attention
            )));
        }
        let fresh = pages_for(rows.min(capacity)).saturating_sub(prefix.len());
        let table = pool.allocate_after(prefix, fresh)?;
        let mut next = 0;
        let mut hybrid = false;
        let layers = kinds
            .into_iter()
            .map(|k| match k {
                Some(r) => {
                    hybrid = true;
                    Ok(LayerCache::Recurrent(r))
                }
                None => {
                    next += 1;
                    let (k, v) = pool.layer(next - 1).ok_or_else(|| {
                        ModelError::BadInput("the pool has fewer attention layers".into())
                    })?;
                    Ok(LayerCache::Attention(KvBuffer {
                        k: k.clone(),
                        v: v.clone(),
                    }))
                }
            })
            .collect::<ModelResult<Vec<_>>>()?;
        Ok(Self {
            layers,
            len: cached,
            capacity,
            table: Arc::new(table),
            rows: hybrid.then(|| RowTracker::new(rollback)),
        })
    }

    /// Takes pages from the pool until `rows` rows (at most the capacity) are backed; fails,
    /// changing nothing, when the pool has too few (a cache in buffers of its own has all).
    pub fn grow_to(&mut self, rows: usize) -> ModelResult<()> {
        let rows = rows.min(self.capacity);
        let Some(pool) = self.table.pool().cloned() else {
            return Ok(());
        };
        let have = self.table.pages().len();
        let want = pages_for(rows);
        if want <= have {
            return Ok(());
        }
        let table = Arc::get_mut(&mut self.table)
            .ok_or_else(|| ModelError::BadCacheOp("a shared cache's pages cannot grow".into()))?;
        pool.extend(table, want - have)
    }

    /// Rows the held pages back (the capacity for a cache in buffers of its own).
    pub fn backed_rows(&self) -> usize {
        self.table.rows().min(self.capacity)
    }

    /// Where the attention rows live (page ids and their device table, or contiguous).
    pub fn page_table(&self) -> &PageTable {
        &self.table
    }

    /// Writes `k`, `v` (`[num_kv_heads, n, head_dim]`) at rows `[at, at + n)` of attention
    /// layer `li` (not made live: see [`SequenceCache::advance`]).
    pub fn write_kv(&self, li: usize, at: usize, k: &Tensor, v: &Tensor) -> ModelResult<()> {
        let n = k.dim(1)?;
        if at + n > self.backed_rows() {
            return Err(ModelError::CacheFull {
                len: at,
                requested: n,
                capacity: self.backed_rows(),
            });
        }
        Ok(self.layers[li].attention()?.write(&self.table, at, k, v)?)
    }

    /// Rows `[0, len)` of attention layer `li`: `[num_kv_heads, len, head_dim]`.
    pub fn view_kv(&self, li: usize, len: usize) -> ModelResult<(Tensor, Tensor)> {
        if len > self.backed_rows() {
            return Err(ModelError::BadCacheOp(format!(
                "view of {len} rows of a cache backing {}",
                self.backed_rows()
            )));
        }
        Ok(self.layers[li].attention()?.view(&self.table, len)?)
    }

    /// A cache mixing attention and recurrent layers. Forwards of at most `rollback` rows keep
    /// what rebuilds each row's recurrent state (so they can be truncated or compacted); longer
    /// ones settle.
    pub fn new_hybrid(layers: Vec<LayerCache>, capacity: usize, rollback: usize) -> Self {
        Self {
            layers,
            len: 0,
            capacity,
            table: Arc::new(PageTable::contiguous()),
            rows: Some(RowTracker::new(rollback)),
        }
    }

    /// Sets the largest forward (in rows) whose recurrent states are kept per row (so that it
    /// can be truncated or compacted); longer forwards settle. Returns the previous value
    /// (0 for attention-only caches, where it means nothing).
    pub fn set_rollback(&mut self, rows: usize) -> usize {
        match self.rows.as_mut() {
            Some(t) => std::mem::replace(&mut t.rollback, rows),
            None => 0,
        }
    }

    /// The recurrent bookkeeping (None for pure attention caches).
    pub fn row_tracker(&self) -> Option<&RowTracker> {
        self.rows.as_ref()
    }

    /// Applies a successful forward's recurrent states and makes its `t` rows live. `parents`
    /// (relative to the new rows) is given when the forward kept its rows rollback-able.
    pub(crate) fn commit_recurrent(
        &mut self,
        t: usize,
        parents: Option<&[Option<usize>]>,
        staged: Vec<(usize, StagedState)>,
    ) -> ModelResult<()> {
        let tracker = self.rows.as_mut().ok_or_else(|| {
            ModelError::BadCacheOp("recurrent states for a cache without recurrent layers".into())
        })?;
        tracker.record(self.len, t, parents);
        let path = tracker.live_rows_are_a_path(self.len + t);
        for (li, st) in staged {
            if let LayerCache::Recurrent(r) = &mut self.layers[li] {
                r.apply(st, path);
            }
        }
        self.len += t;
        Ok(())
    }

    /// Folds every live row into the recurrent base states: nothing before `len` can be rolled
    /// back afterwards, and the staged rows are freed (a no-op for attention-only caches).
    pub fn settle(&mut self) -> ModelResult<()> {
        if let Some(tracker) = self.rows.as_mut() {
            let path = tracker.settle_all(self.len);
            for layer in &mut self.layers {
                if let LayerCache::Recurrent(r) = layer {
                    r.settle_on(&path)?;
                }
            }
        }
        Ok(())
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn layer(&self, i: usize) -> &LayerCache {
        &self.layers[i]
    }

    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Fails, changing nothing, when `n` more rows do not fit.
    pub fn check_room(&self, n: usize) -> ModelResult<()> {
        if self.len + n > self.backed_rows() {
            return Err(ModelError::CacheFull {
                len: self.len,
                requested: n,
                capacity: self.backed_rows(),
            });
        }
        Ok(())
    }

    /// Marks `n` rows (already written by every layer) as live.
    pub(crate) fn advance(&mut self, n: usize) {
        self.len += n;
    }

    /// Drops every row at or after `len`.
    pub fn truncate(&mut self, len: usize) -> ModelResult<()> {
        if len > self.len {
            return Err(ModelError::BadCacheOp(format!(
                "truncate to {len} but only {} rows are live",
                self.len
            )));
        }
        if let Some(tracker) = self.rows.as_mut() {
            let keep = tracker.truncate(len)?;
            for layer in &mut self.layers {
                if let LayerCache::Recurrent(r) = layer {
                    r.truncate_rows(keep);
                }
            }
        }
        self.len = len;
        Ok(())
    }

    /// Keeps rows `[0, start)` and the rows `keep` (ascending, in `[start, len)`), moved to
    /// `[start, start + keep.len())`; drops the rest. Used to commit an accepted tree path.
    /// In hybrid caches `keep` must be one path of the last forward, and compaction commits:
    /// the recurrent layers settle on the state of its last row.
    pub fn compact(&mut self, start: usize, keep: &[usize]) -> ModelResult<()> {
        let ascending = keep.windows(2).all(|w| w[0] < w[1]);
        if !ascending
            || keep.first().is_some_and(|&r| r < start)
            || keep.last().is_some_and(|&r| r >= self.len)
        {
            return Err(ModelError::BadCacheOp(format!(
                "compact(start={start}, keep={keep:?}) needs ascending rows in [{start}, {})",
                self.len
            )));
        }
        let recurrent_path = match self.rows.as_mut() {
            Some(tracker) => tracker.compact(start, keep)?,
            None => Vec::new(),
        };
        #[cfg(feature = "cuda")]
        let settled = crate::cuda::batched_gdn_settle() && {
            let mut recurrent: Vec<&mut RecurrentLayer> = self
                .layers
                .iter_mut()
                .filter_map(|l| match l {
                    LayerCache::Recurrent(r) => Some(r),
                    LayerCache::Attention(_) => None,
                })
                .collect();
            RecurrentLayer::settle_batched(&mut recurrent, &recurrent_path)?
        };
        #[cfg(not(feature = "cuda"))]
        let settled = false;
        for layer in &mut self.layers {
            match layer {
                LayerCache::Attention(kv) => kv.compact(&self.table, start, keep)?,
                LayerCache::Recurrent(_) if settled => {}
                LayerCache::Recurrent(r) => r.settle_on(&recurrent_path)?,
            }
        }
        self.len = start + keep.len();
        Ok(())
    }
}
