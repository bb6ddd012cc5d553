//! Per-sequence caches, preallocated to a capacity and written in place.
//!
//! Speculative decoding appends a block, keeps part of it and drops the rest every round, so
//! the cache must support `append`, `truncate(len)` and `compact(start, keep)` (the tree-accepted
//! rows moved next to the prefix) without re-concatenating tensors per step. Each layer's buffer
//! is `[num_kv_heads, capacity, head_dim]`; rows `[0, len)` are live.
//!
//! A cache is a list of per-layer caches behind [`LayerCache`]. Attention layers keep K/V rows;
//! the recurrent (Gated DeltaNet) layers of the hybrid targets will add a variant that keeps a
//! state snapshot per position, with the same truncate/compact contract.

use candle_core::{DType, Device, Result, Tensor};

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

    /// Writes `k`, `v` (`[num_kv_heads, n, head_dim]`) at rows `[at, at + n)`.
    pub fn write(&self, at: usize, k: &Tensor, v: &Tensor) -> Result<()> {
        self.k.slice_set(&k.contiguous()?, 1, at)?;
        self.v.slice_set(&v.contiguous()?, 1, at)
    }

    /// The whole preallocated K and V buffers `[num_kv_heads, capacity, head_dim]` (the fused
    /// kernels write and read rows in place).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn buffers(&self) -> (&Tensor, &Tensor) {
        (&self.k, &self.v)
    }

    /// Views of rows `[0, len)`: `[num_kv_heads, len, head_dim]`.
    pub fn view(&self, len: usize) -> Result<(Tensor, Tensor)> {
        Ok((self.k.narrow(1, 0, len)?, self.v.narrow(1, 0, len)?))
    }

    /// Moves rows `keep` (absolute, ascending, all `>= start`) to `[start, start + keep.len())`.
    fn compact(&self, start: usize, keep: &[usize]) -> Result<()> {
        let contiguous = keep.iter().enumerate().all(|(i, &r)| r == start + i);
        if contiguous || keep.is_empty() {
            return Ok(());
        }
        let idx: Vec<u32> = keep.iter().map(|&r| r as u32).collect();
        let idx = Tensor::new(idx.as_slice(), self.k.device())?;
        // index_select materialises the rows before slice_set overwrites any of them.
        let k = self.k.index_select(&idx, 1)?;
        let v = self.v.index_select(&idx, 1)?;
        self.write(start, &k, &v)
    }
}

#[derive(Debug, Clone)]
pub enum LayerCache {
    Attention(KvBuffer),
}

/// All layers' caches of one sequence plus the number of live positions.
#[derive(Debug, Clone)]
pub struct SequenceCache {
    layers: Vec<LayerCache>,
    len: usize,
    capacity: usize,
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
        })
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
        if self.len + n > self.capacity {
            return Err(ModelError::CacheFull {
                len: self.len,
                requested: n,
                capacity: self.capacity,
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
        self.len = len;
        Ok(())
    }

    /// Keeps rows `[0, start)` and the rows `keep` (ascending, in `[start, len)`), moved to
    /// `[start, start + keep.len())`; drops the rest. Used to commit an accepted tree path.
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
        for layer in &self.layers {
            match layer {
                LayerCache::Attention(kv) => kv.compact(start, keep)?,
            }
        }
        self.len = start + keep.len();
        Ok(())
    }
}
