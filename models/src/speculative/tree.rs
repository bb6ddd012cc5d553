//! DDTree draft trees (Ringel & Romano 2026, official code `liranringel/ddtree`): the per-depth
//! top-K log-probs of one DFlash draft pass, the best-first heap that turns them into the
//! budget-B tree of highest-probability prefixes (`build_ddtree_tree`), the single-path tree
//! vanilla DFlash verifies, and the acceptance walk over the target's per-node tokens
//! (`follow_verified_tree`).
//!
//! Everything here is a pure function of token ids and host-side numbers, so the serving engine
//! and the offline evaluator share it and it is tested without a model. Mask tensors, caches
//! and sampling of the target's tokens belong to the engine (`sampling.rs` samples one row).

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashSet};

/// Why a hand-built tree was refused by [`DraftTree::from_parents`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TreeError {
    #[error("a draft tree needs at least the root entry; got 0 tokens")]
    Empty,
    #[error("tokens ({tokens}) and parents ({parents}) must have the same length")]
    LengthMismatch { tokens: usize, parents: usize },
    #[error("entry 0 is the root and must have parent None, got Some({0})")]
    RootHasParent(usize),
    #[error("entry {node} needs a parent index below {node} (topological order), got {parent:?}")]
    NotTopological { node: usize, parent: Option<usize> },
    #[error("entry {node} repeats token {token} under parent {parent}; siblings must differ")]
    DuplicateChild {
        node: usize,
        parent: usize,
        token: u32,
    },
}

/// A draft tree flattened in verification order.
///
/// Entry 0 is the root: the bonus token, at depth 0 with no parent. Entries `1..=num_nodes()`
/// are draft nodes in heap-pop order, which is topological (a parent precedes its children);
/// the target's verify input is `tokens` as is, at [`positions`](Self::positions).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DraftTree {
    /// Token of each entry; `tokens[0]` is the root (bonus) token.
    pub tokens: Vec<u32>,
    /// Parent entry of each entry; `None` only for the root.
    pub parents: Vec<Option<usize>>,
    /// Depth of each entry: 0 for the root, parent depth + 1 otherwise.
    pub depths: Vec<usize>,
    /// Per entry, its children as (token, entry) in insertion (= rank) order. Kept private so
    /// that it can never disagree with `parents`.
    children: Vec<Vec<(u32, usize)>>,
}

impl DraftTree {
    /// The tree holding only the root: what verification degenerates to with no drafts.
    pub fn root_only(root: u32) -> Self {
        Self {
            tokens: vec![root],
            parents: vec![None],
            depths: vec![0],
            children: vec![Vec::new()],
        }
    }

    /// Builds a tree from flattened (token, parent) lists, checking the invariants the
    /// verifier and the walk rely on: entry 0 is the root, parents precede children, and
    /// siblings carry distinct tokens.
    pub fn from_parents(tokens: Vec<u32>, parents: Vec<Option<usize>>) -> Result<Self, TreeError> {
        if tokens.len() != parents.len() {
            return Err(TreeError::LengthMismatch {
                tokens: tokens.len(),
                parents: parents.len(),
            });
        }
        let Some(&root) = tokens.first() else {
            return Err(TreeError::Empty);
        };
        if let Some(p) = parents[0] {
            return Err(TreeError::RootHasParent(p));
        }
        let mut tree = Self::root_only(root);
        for node in 1..tokens.len() {
            let parent = match parents[node] {
                Some(p) if p < node => p,
                other => {
                    return Err(TreeError::NotTopological {
                        node,
                        parent: other,
                    })
                }
            };
            if tree.child(parent, tokens[node]).is_some() {
                return Err(TreeError::DuplicateChild {
                    node,
                    parent,
                    token: tokens[node],
                });
            }
            tree.push_child(parent, tokens[node]);
        }
        Ok(tree)
    }

    /// Appends a child of `parent` (which must already exist) and returns its entry index.
    fn push_child(&mut self, parent: usize, token: u32) -> usize {
        let idx = self.tokens.len();
        self.tokens.push(token);
        self.parents.push(Some(parent));
        self.depths.push(self.depths[parent] + 1);
        self.children[parent].push((token, idx));
        self.children.push(Vec::new());
        idx
    }

    /// Number of entries, root included: the verify input length `1 + num_nodes()`.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Always false: a tree has at least its root. Present for the `len` convention.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Number of draft nodes, root excluded (what the budget B counts).
    pub fn num_nodes(&self) -> usize {
        self.tokens.len() - 1
    }

    /// The root (bonus) token.
    pub fn root(&self) -> u32 {
        self.tokens[0]
    }

    /// The child of `node` carrying `token`, if any. Linear in the number of children, which
    /// is fine: the walk does at most L lookups per round.
    pub fn child(&self, node: usize, token: u32) -> Option<usize> {
        self.children
            .get(node)?
            .iter()
            .find(|&&(t, _)| t == token)
            .map(|&(_, idx)| idx)
    }

    /// Children of `node` as (token, entry), in the order they were added (best rank first).
    pub fn children(&self, node: usize) -> &[(u32, usize)] {
        self.children.get(node).map_or(&[], Vec::as_slice)
    }

    /// RoPE positions of the verify input: `start + depth`, where `start` is the absolute
    /// position of the bonus token. Siblings share a position; each node sits where it would
    /// sit if accepted, so the compacted KV cache needs no re-rotation.
    pub fn positions(&self, start: usize) -> Vec<u32> {
        self.depths.iter().map(|&d| (start + d) as u32).collect()
    }

    /// Parent entry of every entry (root: `None`), for building the ancestor-only mask.
    pub fn parents(&self) -> &[Option<usize>] {
        &self.parents
    }

    /// Tokens on the path from the root to `node`, root excluded (empty for the root).
    pub fn path(&self, node: usize) -> Vec<u32> {
        let mut path = Vec::with_capacity(self.depths.get(node).copied().unwrap_or(0));
        let mut cur = node;
        while let Some(Some(p)) = self.parents.get(cur) {
            path.push(self.tokens[cur]);
            cur = *p;
        }
        path.reverse();
        path
    }

    /// Row-major `len() x len()` visibility: `[i * len + j]` is true exactly when entry `j` is
    /// `i` itself or one of its ancestors (root included). Built by copying the parent's row,
    /// which is valid because parents precede children. The engine turns this into the tree
    /// block of the additive mask; the committed prefix is visible to every row.
    pub fn visibility(&self) -> Vec<bool> {
        let n = self.len();
        let mut vis = vec![false; n * n];
        for i in 0..n {
            if let Some(p) = self.parents[i] {
                let (done, rest) = vis.split_at_mut(i * n);
                rest[..i].copy_from_slice(&done[p * n..p * n + i]);
            }
            vis[i * n + i] = true;
        }
        vis
    }

    /// This tree with placeholder entries chained under its last entry (a leaf: children come
    /// after their parents), each repeating its token, up to `size` entries: the shape of a
    /// full tree for the target's verify forward. A chain stays a chain, the real entries keep
    /// their indices, and walks over `self` never reach the placeholders. A clone when it
    /// already has `size` entries.
    pub fn padded_to(&self, size: usize) -> Result<DraftTree, TreeError> {
        let mut tokens = self.tokens.clone();
        let mut parents = self.parents.clone();
        let token = tokens[tokens.len() - 1];
        while tokens.len() < size {
            parents.push(Some(tokens.len() - 1));
            tokens.push(token);
        }
        Self::from_parents(tokens, parents)
    }

    /// True when every entry's parent is the previous entry: the tree is a plain causal
    /// sequence and the engine may use a causal mask instead of the tree mask.
    pub fn is_chain(&self) -> bool {
        self.parents
            .iter()
            .enumerate()
            .skip(1)
            .all(|(i, p)| *p == Some(i - 1))
    }
}

/// A single-path tree `root -> drafts[0] -> drafts[1] -> ...`: vanilla DFlash verification
/// expressed as a tree, so chain and tree decoding share the walk.
pub fn chain_tree(root: u32, drafts: &[u32]) -> DraftTree {
    let mut tree = DraftTree::root_only(root);
    for (i, &token) in drafts.iter().enumerate() {
        tree.push_child(i, token);
    }
    tree
}

/// Per draft depth `d = 1..=L`, the top-K `(token, log-prob)` pairs sorted by descending
/// log-prob, ties broken by lower token id. Rows may be shorter than K (or empty).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct TopK {
    per_depth: Vec<Vec<(u32, f32)>>,
}

impl TopK {
    /// Wraps per-depth candidates computed elsewhere (for example a GPU top-k). Each row is
    /// sorted into the canonical order and a repeated token keeps only its best entry, so the
    /// tree never holds two siblings with one token.
    pub fn new(mut per_depth: Vec<Vec<(u32, f32)>>) -> Self {
        for row in &mut per_depth {
            row.sort_unstable_by_key(|&(t, lp)| rank_key(lp, t));
            if has_repeated_token(row) {
                let mut seen = HashSet::with_capacity(row.len());
                row.retain(|&(t, _)| seen.insert(t));
            }
        }
        Self { per_depth }
    }

    /// Number of draft depths L (the maximum tree depth).
    pub fn depths(&self) -> usize {
        self.per_depth.len()
    }

    /// Candidates of draft depth `index + 1` (0-based index), best first; empty if out of range.
    pub fn row(&self, index: usize) -> &[(u32, f32)] {
        self.per_depth.get(index).map_or(&[], Vec::as_slice)
    }

    /// The rank-1 token of each depth, stopping at the first empty row: vanilla DFlash's
    /// argmax drafts, to pass to [`chain_tree`].
    pub fn argmax_tokens(&self) -> Vec<u32> {
        self.per_depth
            .iter()
            .map_while(|row| row.first().map(|&(t, _)| t))
            .collect()
    }
}

/// Whether a row names a token twice. Rows come from top-k selections and almost never do,
/// so a sorted copy of the tokens answers first and only a row with a repeat pays for the
/// order-keeping hash-set pass (which cost more than the sort on 64-entry rows).
fn has_repeated_token(row: &[(u32, f32)]) -> bool {
    let mut tokens: Vec<u32> = row.iter().map(|&(t, _)| t).collect();
    tokens.sort_unstable();
    tokens.windows(2).any(|w| w[0] == w[1])
}

/// log-sum-exp of a row: `exp` in f32 (arguments are <= 0, so no overflow), sum in f64.
/// Non-finite maxima (all `-inf`, `+inf`, all NaN) return the max itself so that log-probs come
/// out as `-inf`/NaN instead of panicking.
fn logsumexp(row: &[f32]) -> f64 {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if !max.is_finite() {
        return f64::from(max);
    }
    let sum: f64 = row.iter().map(|&x| f64::from((x - max).exp())).sum();
    f64::from(max) + sum.ln()
}

/// Packs (logit, token) into one integer whose ascending order is "higher logit first, then
/// lower token id": the f32 bits mapped to `total_cmp` order (with -0.0 folded into +0.0),
/// inverted, above the token id. Integer keys keep the selection loop branch-light.
pub(crate) fn rank_key(x: f32, token: u32) -> u64 {
    let bits = (x + 0.0).to_bits();
    let ascending = if bits >> 31 == 1 {
        !bits
    } else {
        bits | 0x8000_0000
    };
    (u64::from(!ascending) << 32) | u64::from(token)
}

/// The value a [`rank_key`] was made from (-0.0 comes back as +0.0, as the key folds it).
pub(crate) fn rank_key_value(key: u64) -> f32 {
    let ascending = !((key >> 32) as u32);
    let bits = if ascending >> 31 == 1 {
        ascending & 0x7fff_ffff
    } else {
        !ascending
    };
    f32::from_bits(bits)
}

/// Top-`k` log-probs per row of row-major `[L, vocab]` draft logits: log-softmax at
/// temperature 1 (logit - logsumexp of the whole row, accumulated in f64, stored as f32) and a
/// bounded-heap selection. The decoding temperature is deliberately not applied: DDTree builds
/// the same tree at every temperature.
///
/// Cost per 151,936-token row in release builds: about 1 ms for the logsumexp (libm `expf`)
/// plus 0.1-0.5 ms for the selection. When the device already computed log-softmax, copy that
/// and call [`topk_from_logprobs`] to skip the `exp` pass.
///
/// `k` is clamped to `vocab`; DDTree uses `k = min(budget, vocab)`. A trailing partial row
/// (`logits.len()` not a multiple of `vocab`) is ignored, as is everything when `vocab == 0`.
pub fn topk_logprobs(logits: &[f32], vocab: usize, k: usize) -> TopK {
    topk_rows(logits, vocab, k, logsumexp)
}

/// Like [`topk_logprobs`] for rows that are already log-probabilities (for example
/// `log_softmax` computed on the GPU): selection only, values kept as given.
pub fn topk_from_logprobs(logprobs: &[f32], vocab: usize, k: usize) -> TopK {
    topk_rows(logprobs, vocab, k, |_| 0.0)
}

/// Per row, the `k` best `(token, value - offset(row))`, best first, ties by lower token id.
fn topk_rows(values: &[f32], vocab: usize, k: usize, offset: impl Fn(&[f32]) -> f64) -> TopK {
    if vocab == 0 {
        return TopK::default();
    }
    #[allow(clippy::manual_is_multiple_of)] // rust-version 1.85 predates is_multiple_of
    {
        debug_assert!(values.len() % vocab == 0);
    }
    let k = k.min(vocab);
    let per_depth = values
        .chunks_exact(vocab)
        .map(|row| {
            if k == 0 {
                return Vec::new();
            }
            let off = offset(row);
            // Max-heap of the k best keys seen so far: its top is the worst kept candidate, so
            // most tokens cost one integer comparison.
            let mut heap: BinaryHeap<u64> = BinaryHeap::with_capacity(k);
            for (t, &x) in row.iter().enumerate() {
                let key = rank_key(x, t as u32);
                if heap.len() < k {
                    heap.push(key);
                } else if let Some(mut worst) = heap.peek_mut() {
                    if key < *worst {
                        *worst = key;
                    }
                }
            }
            let mut keys = heap.into_vec();
            keys.sort_unstable();
            keys.iter()
                .map(|&key| {
                    let t = key as u32;
                    (t, (f64::from(row[t as usize]) - off) as f32)
                })
                .collect()
        })
        .collect();
    TopK { per_depth }
}

/// One frontier entry of the best-first search: the prefix whose last token is rank `rank` at
/// depth `depth` under entry `parent`.
struct Frontier {
    score: f64,
    ranks: Vec<u32>,
    parent: usize,
    depth: usize,
    rank: usize,
}

impl Ord for Frontier {
    /// Max-heap order: higher score first; equal scores pop the lexicographically smaller
    /// rank tuple first (a prefix before its extensions, a lower rank at the first difference),
    /// exactly like the official code's Python tuples `(-score, rank_tuple, ...)`.
    fn cmp(&self, other: &Self) -> Ordering {
        (self.score + 0.0)
            .total_cmp(&(other.score + 0.0))
            .then_with(|| other.ranks.cmp(&self.ranks))
    }
}

impl PartialOrd for Frontier {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for Frontier {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Frontier {}

/// DDTree Algorithm 1: the `budget` highest-probability prefixes of the factorized draft
/// distribution, found best-first with a heap.
///
/// `budget` counts draft nodes (the root does not count); depth is capped at `topk.depths()`.
/// Each pop adds one node and pushes at most its next sibling (same parent, next rank; score
/// `score - logp[rank] + logp[rank + 1]`, the official formula, so float rounding matches) and
/// its first child (next depth, rank 0). Scores are f64 sums of the f32 log-probs. Fewer than
/// `budget` nodes come back only when the candidates run out. `budget == 0` or no depths give
/// the root alone. Nodes come out in pop order: scores non-increasing, parents first.
pub fn build_ddtree(root: u32, topk: &TopK, budget: usize) -> DraftTree {
    let mut tree = DraftTree::root_only(root);
    let max_depth = topk.depths();
    let Some(&(_, first)) = topk.row(0).first() else {
        return tree;
    };
    if budget == 0 {
        return tree;
    }
    let mut heap = BinaryHeap::with_capacity(2 * budget + 1);
    heap.push(Frontier {
        score: f64::from(first),
        ranks: vec![0],
        parent: 0,
        depth: 1,
        rank: 0,
    });
    while tree.num_nodes() < budget {
        let Some(mut entry) = heap.pop() else {
            break;
        };
        let row = topk.row(entry.depth - 1);
        let (token, logp) = row[entry.rank];
        let idx = tree.push_child(entry.parent, token);
        if entry.depth < max_depth {
            if let Some(&(_, child_logp)) = topk.row(entry.depth).first() {
                let mut ranks = Vec::with_capacity(entry.ranks.len() + 1);
                ranks.extend_from_slice(&entry.ranks);
                ranks.push(0);
                heap.push(Frontier {
                    score: entry.score + f64::from(child_logp),
                    ranks,
                    parent: idx,
                    depth: entry.depth + 1,
                    rank: 0,
                });
            }
        }
        if let Some(&(_, next_logp)) = row.get(entry.rank + 1) {
            entry.score = entry.score - f64::from(logp) + f64::from(next_logp);
            entry.rank += 1;
            if let Some(last) = entry.ranks.last_mut() {
                *last += 1;
            }
            heap.push(entry);
        }
    }
    tree
}

/// The acceptance walk (sample-and-match). `target_tokens[i]` is the target's token sampled
/// (or argmaxed) at tree entry `i`, from logits computed with entry `i`'s true ancestor
/// context. Starting at the root, move to the child carrying the current entry's target token
/// while there is one.
///
/// Returns the accepted entries (starting with 0, increasing) and the next bonus token: the
/// target token at the last accepted entry. The emitted tokens are exactly the target's own
/// draws along the path, so the output is distributed as plain target sampling at any
/// temperature and with any filters; tokens sampled off the path are discarded. `tau =
/// accepted.len()`.
///
/// # Panics
/// If `target_tokens.len() != tree.len()`: one target token per verified entry is the
/// engine's contract, and a mismatch would silently commit wrong tokens.
pub fn walk(tree: &DraftTree, target_tokens: &[u32]) -> (Vec<usize>, u32) {
    assert_eq!(
        target_tokens.len(),
        tree.len(),
        "walk needs one target token per tree entry"
    );
    let mut accepted = vec![0];
    let mut next = target_tokens[0];
    let mut cur = 0;
    while let Some(child) = tree.child(cur, next) {
        cur = child;
        accepted.push(cur);
        next = target_tokens[cur];
    }
    (accepted, next)
}

#[cfg(test)]
mod tests;
