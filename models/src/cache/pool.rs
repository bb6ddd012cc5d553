//! The paged K/V pool: every attention layer's K and V rows for all sequences, allocated once
//! (`[num_kv_heads, pages * PAGE_SIZE, head_dim]` per layer) and handed out in pages of
//! [`PAGE_SIZE`] rows. A sequence holds a page table ([`PageTable`]): logical row `r` lives
//! at pool row `ids[r / PAGE_SIZE] * PAGE_SIZE + r % PAGE_SIZE` in every layer. Pages go back
//! to the pool when the table is dropped.
//!
//! Pages are reference-counted so that sequences with a common prefix share its pages (the
//! prefix cache, [`super::radix`]): a page returns to the free list when its last holder (a
//! page table or a [`PageRef`]) lets it go. Shared pages are only ever read: a sequence
//! writes rows at or after its cached prefix, which lie in pages of its own.
//!
//! Why one pool: caches sized per request fragment device memory and give every sequence its
//! own buffer addresses, so a captured CUDA graph serves one sequence only; with the pool the
//! K/V addresses are fixed for the process, a graph reads the page tables as inputs and serves
//! any batch of sequences, and admission counts free pages exactly (SGLang's token pool).
//!
//! A cache made on its own (`SequenceCache::new_attention`, the benches and unit tests) is a
//! [`PageTable::contiguous`] one: its own buffers of exactly its capacity, rows in order, and
//! the fused kernels read it with no page table at all.

use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Result, Tensor};

use crate::error::{ModelError, ModelResult};

/// Rows per page. The fused attention kernels stage keys in tiles of 64 rows that start at
/// multiples of 64, so a tile is one page and a page table costs one lookup per tile.
pub const PAGE_SIZE: usize = 64;

/// Pages needed for `rows` rows.
pub fn pages_for(rows: usize) -> usize {
    rows.div_ceil(PAGE_SIZE)
}

#[derive(Debug)]
struct PageState {
    /// Free page ids; the lowest ids are handed out first (sequences stay compact in memory).
    free: Vec<u32>,
    /// Holders of each page (0: free).
    refs: Vec<u32>,
}

#[derive(Debug)]
struct Shared {
    /// One (K, V) buffer pair per attention layer, in model order, each
    /// `[num_kv_heads, (pages + 1) * PAGE_SIZE, head_dim]`.
    layers: Vec<(Tensor, Tensor)>,
    pages: usize,
    state: Mutex<PageState>,
    device: Device,
}

/// The shared K/V pool of one model (cheap to clone: a handle).
#[derive(Debug, Clone)]
pub struct KvPool {
    shared: Arc<Shared>,
}

impl KvPool {
    /// A pool of `pages` pages for `attention_layers` layers of `num_kv_heads` x `head_dim`.
    pub fn new(
        attention_layers: usize,
        num_kv_heads: usize,
        head_dim: usize,
        pages: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        // One page more than handed out: the scratch page (see `scratch_page`).
        let rows = (pages + 1) * PAGE_SIZE;
        let shape = (num_kv_heads, rows, head_dim);
        let layers = (0..attention_layers)
            .map(|_| {
                Ok((
                    Tensor::zeros(shape, dtype, device)?,
                    Tensor::zeros(shape, dtype, device)?,
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        // Reversed so that `pop` hands out the lowest ids first.
        let free = (0..pages as u32).rev().collect();
        Ok(Self {
            shared: Arc::new(Shared {
                layers,
                pages,
                state: Mutex::new(PageState {
                    free,
                    refs: vec![0; pages],
                }),
                device: device.clone(),
            }),
        })
    }

    /// A page no sequence ever holds: batched CUDA graphs pad a batch with sequences whose
    /// rows go there.
    pub fn scratch_page(&self) -> u32 {
        self.shared.pages as u32
    }

    pub fn total_pages(&self) -> usize {
        self.shared.pages
    }

    pub fn free_pages(&self) -> usize {
        self.shared.state.lock().map_or(0, |s| s.free.len())
    }

    /// Holders of page `id` (0: free).
    pub fn holders(&self, id: u32) -> usize {
        self.shared
            .state
            .lock()
            .ok()
            .and_then(|s| s.refs.get(id as usize).copied())
            .unwrap_or(0) as usize
    }

    fn state(&self) -> ModelResult<std::sync::MutexGuard<'_, PageState>> {
        self.shared
            .state
            .lock()
            .map_err(|_| ModelError::BadCacheOp("K/V pool lock poisoned".into()))
    }

    /// One more holder of page `id` (a page some table or reference holds now).
    pub fn share(&self, id: u32) -> ModelResult<PageRef> {
        let mut st = self.state()?;
        match st.refs.get_mut(id as usize) {
            Some(r) if *r > 0 => *r += 1,
            _ => {
                return Err(ModelError::BadCacheOp(format!(
                    "page {id} shared while nobody holds it"
                )))
            }
        }
        Ok(PageRef {
            id,
            pool: self.clone(),
        })
    }

    /// Layer `i`'s K and V buffers (the `i`-th attention layer).
    pub fn layer(&self, i: usize) -> Option<(&Tensor, &Tensor)> {
        self.shared.layers.get(i).map(|(k, v)| (k, v))
    }

    pub fn num_layers(&self) -> usize {
        self.shared.layers.len()
    }

    /// Whether two handles name the same pool.
    pub fn same(&self, other: &KvPool) -> bool {
        Arc::ptr_eq(&self.shared, &other.shared)
    }

    /// A page table of `pages` pages, or an error (changing nothing) when fewer are free.
    pub fn allocate(&self, pages: usize) -> ModelResult<PageTable> {
        self.allocate_after(&[], pages)
    }

    /// A page table starting with the held pages `prefix` (shared: one more holder each, read
    /// only) followed by `pages` fresh ones, or an error changing nothing.
    pub fn allocate_after(&self, prefix: &[u32], pages: usize) -> ModelResult<PageTable> {
        let ids = {
            let mut st = self.state()?;
            if st.free.len() < pages {
                return Err(ModelError::PoolExhausted {
                    pages,
                    free: st.free.len(),
                    total: self.shared.pages,
                });
            }
            if let Some(&id) = prefix
                .iter()
                .find(|&&id| st.refs.get(id as usize).is_none_or(|&r| r == 0))
            {
                return Err(ModelError::BadCacheOp(format!(
                    "page {id} shared while nobody holds it"
                )));
            }
            let at = st.free.len() - pages;
            let mut fresh = st.free.split_off(at);
            fresh.reverse();
            let mut ids = prefix.to_vec();
            ids.append(&mut fresh);
            for &id in &ids {
                st.refs[id as usize] += 1;
            }
            ids
        };
        // Made before the upload, so that a failed upload gives the pages back.
        let mut table = PageTable {
            ids,
            pool: Some(self.clone()),
            device_table: None,
        };
        table.device_table = Some(self.device_table(&table.ids)?);
        Ok(table)
    }

    /// `ids` as a u32 `[1, n]` tensor on the pool's device.
    fn device_table(&self, ids: &[u32]) -> ModelResult<Tensor> {
        let n = ids.len();
        Ok(Tensor::new(ids, &self.shared.device)?.reshape((1, n))?)
    }

    /// `more` pages appended to `table` (one of this pool's), or an error changing nothing.
    pub fn extend(&self, table: &mut PageTable, more: usize) -> ModelResult<()> {
        if !table.pool.as_ref().is_some_and(|p| p.same(self)) {
            return Err(ModelError::BadCacheOp(
                "pages of one pool appended to a table of another".into(),
            ));
        }
        if more == 0 {
            return Ok(());
        }
        // `extra` gives its pages back when dropped, unless they were moved into `table`.
        let mut extra = self.allocate(more)?;
        let mut ids = table.ids.clone();
        ids.extend_from_slice(&extra.ids);
        let device = self.device_table(&ids)?;
        extra.ids.clear();
        table.ids = ids;
        table.device_table = Some(device);
        Ok(())
    }

    /// One holder fewer of each of `ids`; pages nobody holds go back to the free list.
    fn release(&self, ids: &mut Vec<u32>) {
        if let Ok(mut st) = self.shared.state.lock() {
            let mut freed = false;
            for id in ids.drain(..) {
                if let Some(r) = st.refs.get_mut(id as usize) {
                    *r = r.saturating_sub(1);
                    if *r == 0 {
                        st.free.push(id);
                        freed = true;
                    }
                }
            }
            if freed {
                // Lowest ids first again (pop takes from the end).
                st.free.sort_unstable_by(|a, b| b.cmp(a));
            }
        }
    }
}

/// One holder of one page of a pool (the prefix cache's hold on a cached page); the page is
/// let go on drop.
#[derive(Debug)]
pub struct PageRef {
    id: u32,
    pool: KvPool,
}

impl PageRef {
    pub fn id(&self) -> u32 {
        self.id
    }

    /// Whether this is the page's only holder (dropping it frees the page).
    pub fn sole_holder(&self) -> bool {
        self.pool.holders(self.id) == 1
    }
}

impl Drop for PageRef {
    fn drop(&mut self) {
        self.pool.release(&mut vec![self.id]);
    }
}

/// Where a sequence's rows live: pages of a [`KvPool`], or (no pool) its own contiguous
/// buffers.
#[derive(Debug)]
pub struct PageTable {
    ids: Vec<u32>,
    /// The pool the pages came from (None: contiguous, no pages).
    pool: Option<KvPool>,
    /// `ids` on the device (u32 `[1, pages]`), for the fused kernels.
    device_table: Option<Tensor>,
}

impl PageTable {
    /// Rows in order in buffers of their own.
    pub fn contiguous() -> Self {
        Self {
            ids: Vec::new(),
            pool: None,
            device_table: None,
        }
    }

    pub fn is_contiguous(&self) -> bool {
        self.pool.is_none()
    }

    pub fn pages(&self) -> &[u32] {
        &self.ids
    }

    /// Writes the page ids into the start of `row` (one row of a batch's page-table upload;
    /// the rest of the row is the caller's padding).
    pub fn copy_into(&self, row: &mut [u32]) {
        row[..self.ids.len()].copy_from_slice(&self.ids);
    }

    /// Rows the pages hold (`usize::MAX` for contiguous buffers: their capacity rules).
    pub fn rows(&self) -> usize {
        if self.is_contiguous() {
            usize::MAX
        } else {
            self.ids.len() * PAGE_SIZE
        }
    }

    pub fn pool(&self) -> Option<&KvPool> {
        self.pool.as_ref()
    }

    /// The page ids on the device, u32 `[1, pages]` (None: contiguous; the kernels then index
    /// rows directly).
    pub fn device_table(&self) -> Option<&Tensor> {
        self.device_table.as_ref()
    }

    /// Pool row of logical row `r`.
    pub fn physical(&self, r: usize) -> usize {
        if self.is_contiguous() {
            r
        } else {
            self.ids[r / PAGE_SIZE] as usize * PAGE_SIZE + r % PAGE_SIZE
        }
    }

    /// Logical rows `[at, at + n)` as runs of consecutive pool rows: `(logical start, pool
    /// start, rows)`.
    pub fn runs(&self, at: usize, n: usize) -> Vec<(usize, usize, usize)> {
        if self.is_contiguous() {
            return if n == 0 {
                Vec::new()
            } else {
                vec![(at, at, n)]
            };
        }
        let mut out: Vec<(usize, usize, usize)> = Vec::new();
        let mut r = at;
        while r < at + n {
            let take = (PAGE_SIZE - r % PAGE_SIZE).min(at + n - r);
            let p = self.physical(r);
            match out.last_mut() {
                Some(last) if last.1 + last.2 == p => last.2 += take,
                _ => out.push((r, p, take)),
            }
            r += take;
        }
        out
    }
}

impl Drop for PageTable {
    fn drop(&mut self) {
        if let Some(pool) = self.pool.take() {
            pool.release(&mut self.ids);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_are_handed_out_lowest_first_and_come_back_on_drop() {
        let pool = KvPool::new(2, 1, 4, 8, DType::F32, &Device::Cpu).unwrap();
        let a = pool.allocate(3).unwrap();
        assert_eq!(a.pages(), &[0, 1, 2]);
        let b = pool.allocate(2).unwrap();
        assert_eq!(b.pages(), &[3, 4]);
        assert_eq!(pool.free_pages(), 3);
        let err = pool.allocate(4).unwrap_err();
        assert!(matches!(
            err,
            ModelError::PoolExhausted {
                pages: 4,
                free: 3,
                total: 8
            }
        ));
        assert_eq!(pool.free_pages(), 3, "a refused allocation takes nothing");
        drop(a);
        assert_eq!(pool.free_pages(), 6);
        let c = pool.allocate(4).unwrap();
        assert_eq!(c.pages(), &[0, 1, 2, 5]);
        assert_eq!(c.physical(PAGE_SIZE * 3 + 7), 5 * PAGE_SIZE + 7);
    }

    #[test]
    fn runs_merge_adjacent_pages_and_split_at_gaps() {
        let pool = KvPool::new(1, 1, 4, 8, DType::F32, &Device::Cpu).unwrap();
        let hold = pool.allocate(2).unwrap(); // pages 0, 1
        let t = pool.allocate(3).unwrap(); // pages 2, 3, 4
        drop(hold);
        assert_eq!(t.pages(), &[2, 3, 4]);
        let p = PAGE_SIZE;
        assert_eq!(t.runs(5, 2 * p), vec![(5, 2 * p + 5, 2 * p)]);
        let u = pool.allocate(2).unwrap(); // pages 0, 1
        drop(t);
        let v = pool.allocate(3).unwrap(); // pages 2, 3, 4 again
        drop(u);
        let w = pool.allocate(1).unwrap(); // page 0
        drop(v);
        let x = pool.allocate(3).unwrap(); // pages 1, 2, 3
        assert_eq!(x.pages(), &[1, 2, 3]);
        drop(w);
        let y = pool.allocate(2).unwrap(); // pages 0, 4
        assert_eq!(y.pages(), &[0, 4]);
        assert_eq!(y.runs(p - 2, 4), vec![(p - 2, p - 2, 2), (p, 4 * p, 2)]);
        assert!(PageTable::contiguous().runs(3, 0).is_empty());
        assert_eq!(PageTable::contiguous().runs(3, 5), vec![(3, 3, 5)]);
    }
}
