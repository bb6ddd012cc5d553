//! The prefix cache (SGLang's RadixAttention idea at page granularity): a tree of full pages
//! of committed token rows, each edge one page of [`PAGE_SIZE`] tokens, each node holding its
//! page of the K/V pool (a [`PageRef`]). A new sequence whose prompt starts with cached pages
//! takes them into its page table (read only; it writes its rows after them) and prefills only
//! the rest. Sequences insert their full pages when their prompt is prefilled and when they
//! finish. When the pool is short, least recently used leaves that no sequence holds any more
//! are evicted (their pages freed).
//!
//! A proposer that reads target features (a DFlash drafter's context) needs them for cached
//! rows too: a node can carry its rows' features, kept on the device they came from (a copy
//! there is asynchronous; a copy to the host would stall the step) within a byte budget the
//! server sets aside from the K/V memory; a speculating sequence uses a cached prefix only as
//! far as its nodes carry features.
//!
//! Only pure-attention targets share pages: a Gated DeltaNet hybrid's recurrent state at a
//! page boundary is not kept, so the engine does not enable the cache for them.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

use candle_core::Tensor;

use crate::cache::pool::{KvPool, PageRef, PageTable, PAGE_SIZE};
use crate::error::{ModelError, ModelResult};

#[derive(Debug)]
struct Node {
    /// The page's tokens (empty for the root).
    chunk: Vec<u32>,
    /// None only for the root.
    page: Option<PageRef>,
    /// The rows' proposer features `[PAGE_SIZE, F]`, on the features' device.
    features: Option<Tensor>,
    parent: usize,
    children: HashMap<Vec<u32>, usize>,
    last_use: u64,
}

/// A cached prefix found for a sequence.
#[derive(Debug, Default)]
pub struct PrefixMatch {
    /// Page ids of the prefix, in order (each holds `PAGE_SIZE` rows).
    pub pages: Vec<u32>,
    /// The prefix rows' features `[rows, F]` (on the features' device), when asked for.
    pub features: Option<Tensor>,
}

impl PrefixMatch {
    pub fn rows(&self) -> usize {
        self.pages.len() * PAGE_SIZE
    }
}

#[derive(Debug)]
pub struct PrefixCache {
    pool: KvPool,
    /// Arena of nodes (None: a freed slot); 0 is the root.
    nodes: Vec<Option<Node>>,
    free_slots: Vec<usize>,
    clock: u64,
    feature_bytes: usize,
    max_feature_bytes: usize,
}

impl PrefixCache {
    /// An empty cache over `pool`'s pages; at most `max_feature_bytes` of features kept.
    pub fn new(pool: KvPool, max_feature_bytes: usize) -> Self {
        let root = Node {
            chunk: Vec::new(),
            page: None,
            features: None,
            parent: 0,
            children: HashMap::new(),
            last_use: 0,
        };
        Self {
            pool,
            nodes: vec![Some(root)],
            free_slots: Vec::new(),
            clock: 0,
            feature_bytes: 0,
            max_feature_bytes,
        }
    }

    fn node(&self, i: usize) -> ModelResult<&Node> {
        self.nodes
            .get(i)
            .and_then(Option::as_ref)
            .ok_or_else(|| ModelError::BadCacheOp(format!("prefix cache node {i} is gone")))
    }

    fn node_mut(&mut self, i: usize) -> ModelResult<&mut Node> {
        self.nodes
            .get_mut(i)
            .and_then(Option::as_mut)
            .ok_or_else(|| ModelError::BadCacheOp(format!("prefix cache node {i} is gone")))
    }

    /// Pages the cache holds.
    pub fn cached_pages(&self) -> usize {
        self.nodes
            .iter()
            .flatten()
            .filter(|n| n.page.is_some())
            .count()
    }

    /// Pages only the cache holds: what eviction can free. (A sequence holding a node's page
    /// holds its ancestors' too, so these are whole subtrees.)
    pub fn evictable_pages(&self) -> usize {
        self.nodes
            .iter()
            .flatten()
            .filter(|n| n.page.as_ref().is_some_and(PageRef::sole_holder))
            .count()
    }

    /// Bytes of features held.
    pub fn feature_bytes(&self) -> usize {
        self.feature_bytes
    }

    /// The longest cached prefix of `tokens[..max_rows]` in whole pages; with
    /// `need_features`, only as far as the nodes carry features. Marks it used.
    pub fn lookup(
        &mut self,
        tokens: &[u32],
        max_rows: usize,
        need_features: bool,
    ) -> ModelResult<PrefixMatch> {
        self.clock += 1;
        let now = self.clock;
        let usable = max_rows.min(tokens.len()) / PAGE_SIZE;
        let mut at = 0;
        let mut found = PrefixMatch::default();
        let mut features = Vec::new();
        for chunk in tokens.chunks_exact(PAGE_SIZE).take(usable) {
            let Some(&child) = self.node(at)?.children.get(chunk) else {
                break;
            };
            let node = self.node_mut(child)?;
            if need_features && node.features.is_none() {
                break;
            }
            node.last_use = now;
            if let Some(page) = &node.page {
                found.pages.push(page.id());
            }
            if need_features {
                features.extend(node.features.clone());
            }
            at = child;
        }
        if need_features && !features.is_empty() {
            found.features = Some(Tensor::cat(&features, 0)?);
        }
        Ok(found)
    }

    /// Caches the first `rows / PAGE_SIZE` full pages of a sequence whose page table is
    /// `table` and whose committed tokens start with `tokens` (`rows` of them are in the
    /// cache). `features`, when given, are the rows' proposer features from row 0
    /// on; they are kept for new nodes and for cached nodes that had none. Pages already
    /// cached under the same tokens stay as they are. Returns the pages added.
    pub fn insert(
        &mut self,
        tokens: &[u32],
        table: &PageTable,
        rows: usize,
        features: Option<&Tensor>,
    ) -> ModelResult<usize> {
        if !table.pool().is_some_and(|p| p.same(&self.pool)) {
            return Err(ModelError::BadCacheOp(
                "a page table of another pool inserted into the prefix cache".into(),
            ));
        }
        let pages = (rows.min(tokens.len()) / PAGE_SIZE).min(table.pages().len());
        let feature_rows = features.map_or(Ok(0), |f| f.dim(0))?;
        let pages_with_features = if features.is_some() {
            pages.min(feature_rows / PAGE_SIZE)
        } else {
            0
        };
        // Which pages need features, found first so that they are copied in one piece.
        let mut path = Vec::with_capacity(pages);
        let mut at = 0;
        for chunk in tokens.chunks_exact(PAGE_SIZE).take(pages) {
            match self.node(at)?.children.get(chunk) {
                Some(&child) => {
                    path.push(Some(child));
                    at = child;
                }
                None => break,
            }
        }
        path.resize(pages, None);
        let first_needing = (0..pages_with_features).find(|&i| match path[i] {
            Some(n) => self.nodes[n].as_ref().is_some_and(|n| n.features.is_none()),
            None => true,
        });
        let host = match (features, first_needing) {
            (Some(f), Some(first)) if self.feature_bytes < self.max_feature_bytes => {
                let n = (pages_with_features - first) * PAGE_SIZE;
                Some((
                    first,
                    f.narrow(0, first * PAGE_SIZE, n)?.force_contiguous()?,
                ))
            }
            _ => None,
        };
        let page_features = |i: usize| -> ModelResult<Option<Tensor>> {
            match &host {
                Some((first, h)) if i >= *first && i < pages_with_features => Ok(Some(
                    h.narrow(0, (i - first) * PAGE_SIZE, PAGE_SIZE)?
                        .force_contiguous()?,
                )),
                _ => Ok(None),
            }
        };
        self.clock += 1;
        let now = self.clock;
        let mut added = 0;
        let mut at = 0;
        for (i, chunk) in tokens.chunks_exact(PAGE_SIZE).take(pages).enumerate() {
            let child = match path[i] {
                Some(child) => {
                    if self.node(child)?.features.is_none() {
                        if let Some(f) = self.budgeted(page_features(i)?) {
                            self.node_mut(child)?.features = Some(f);
                        }
                    }
                    child
                }
                None => {
                    let page = self.pool.share(table.pages()[i])?;
                    let features = self.budgeted(page_features(i)?);
                    let node = Node {
                        chunk: chunk.to_vec(),
                        page: Some(page),
                        features,
                        parent: at,
                        children: HashMap::new(),
                        last_use: now,
                    };
                    let slot = match self.free_slots.pop() {
                        Some(s) => {
                            self.nodes[s] = Some(node);
                            s
                        }
                        None => {
                            self.nodes.push(Some(node));
                            self.nodes.len() - 1
                        }
                    };
                    self.node_mut(at)?.children.insert(chunk.to_vec(), slot);
                    added += 1;
                    slot
                }
            };
            self.node_mut(child)?.last_use = now;
            at = child;
        }
        Ok(added)
    }

    /// `f` if the feature budget has room for it (counted), else None.
    fn budgeted(&mut self, f: Option<Tensor>) -> Option<Tensor> {
        let f = f?;
        let bytes = f.elem_count() * f.dtype().size_in_bytes();
        if self.feature_bytes + bytes > self.max_feature_bytes {
            return None;
        }
        self.feature_bytes += bytes;
        Some(f)
    }

    /// Frees up to `pages` pages by evicting least recently used leaves that only the cache
    /// holds; returns the pages freed.
    pub fn evict(&mut self, pages: usize) -> usize {
        let evictable =
            |n: &Node| n.children.is_empty() && n.page.as_ref().is_some_and(PageRef::sole_holder);
        let mut heap: BinaryHeap<Reverse<(u64, usize)>> = self
            .nodes
            .iter()
            .enumerate()
            .filter_map(|(i, n)| {
                n.as_ref()
                    .filter(|n| evictable(n))
                    .map(|n| Reverse((n.last_use, i)))
            })
            .collect();
        let mut freed = 0;
        while freed < pages {
            let Some(Reverse((_, i))) = heap.pop() else {
                break;
            };
            let Some(node) = self.nodes[i].take() else {
                continue;
            };
            self.free_slots.push(i);
            if let Some(f) = &node.features {
                self.feature_bytes -= f.elem_count() * f.dtype().size_in_bytes();
            }
            let parent = node.parent;
            drop(node.page);
            freed += 1;
            if let Some(p) = self.nodes[parent].as_mut() {
                p.children.remove(&node.chunk);
                if parent != 0 && evictable(p) {
                    heap.push(Reverse((p.last_use, parent)));
                }
            }
        }
        freed
    }

    /// Drops every cached page (pages that sequences still hold stay theirs).
    pub fn clear(&mut self) {
        let root = self.nodes[0].take();
        self.nodes.clear();
        self.free_slots.clear();
        self.feature_bytes = 0;
        if let Some(mut root) = root {
            root.children.clear();
            self.nodes.push(Some(root));
        }
    }
}

#[cfg(test)]
mod tests;
