//! A forward's token forest for the gated delta rule: each sequence's tokens (a chain, or a
//! verify tree given by its parents) planned once per forward and shared by every GDN layer:
//! the depth levels of [`super::delta_rule::recurrent`], the conv taps along each path, and
//! for the CUDA tree kernels the ancestor bits and the depth-first walk ([`dfs_order`]).

use std::sync::OnceLock;

use candle_core::{Device, Result, Tensor};

/// A depth-first pre-order of the tokens of a tree given by `parents` (each parent before its
/// children; children in index order) and each visited token's depth: in this order a token
/// right after its parent continues from its state, any other one restarts from its parent's
/// (the CUDA tree scan, `cuda::gdn_tree`). None when a parent does not come before its child
/// or the tree is `max_depth` or more deep.
pub fn dfs_order(parents: &[Option<usize>], max_depth: usize) -> Option<(Vec<u32>, Vec<u32>)> {
    let t = parents.len();
    let mut children: Vec<Vec<usize>> = vec![Vec::new(); t];
    let mut roots = Vec::new();
    for (i, p) in parents.iter().enumerate() {
        match *p {
            Some(p) if p < i => children[p].push(i),
            Some(_) => return None,
            None => roots.push(i),
        }
    }
    let (mut order, mut depth) = (Vec::with_capacity(t), Vec::with_capacity(t));
    let mut stack: Vec<(usize, usize)> = roots.iter().rev().map(|&r| (r, 0)).collect();
    while let Some((node, d)) = stack.pop() {
        if d >= max_depth {
            return None;
        }
        order.push(node as u32);
        depth.push(d as u32);
        stack.extend(children[node].iter().rev().map(|&c| (c, d + 1)));
    }
    Some((order, depth))
}

/// The token forests of one or more sequences (segments) for a forward, planned once and shared
/// by every GDN layer: depth levels across all segments (so nodes of one depth in every
/// sequence step together), where each token's parent state sits, which segment each root
/// starts from, and the conv-tap rows along each path. Index tensors are uploaded once per
/// forward, not once per layer; chains need none beyond the conv taps.
pub struct Forest {
    /// Start and length of each segment in the combined token order.
    pub segments: Vec<(usize, usize)>,
    pub(super) depth: Vec<usize>,
    pub(super) pos_in_level: Vec<usize>,
    /// `(start, len)` of each depth level in level order.
    pub(super) levels: Vec<(usize, usize)>,
    /// Level order -> token index, and back; `None` when level order is token order.
    pub(super) order: Option<(Tensor, Tensor)>,
    /// Per level: rows of the previous level's states that its tokens continue from; `None`
    /// for the roots and wherever the previous level has a single token (a broadcast).
    pub(super) parent_rows: Vec<Option<Tensor>>,
    /// Segment of each root, in level order; `None` when root j belongs to segment j.
    pub(super) root_segments: Option<Tensor>,
    /// Rows of the segments' `[cached window (K-1 rows) ; new rows]` blocks, stacked in segment
    /// order, that each token's conv reads, oldest first.
    pub conv_taps: Tensor,
    pub kernel: usize,
    /// The parents of a forest of one segment (a verify tree or one chain), for what the CUDA
    /// tree kernels need of it, built on the device by the first GDN layer that asks and shared
    /// by the others (none of it for forwards that never ask, e.g. prefills).
    tree: Option<Vec<Option<usize>>>,
    dev: Device,
    /// [`Self::ancestor_bits`], once built.
    ancestor_bits: OnceLock<Option<Tensor>>,
    /// [`Self::depth_first_walk`], once built: order, depths and the deepest depth.
    walk: OnceLock<Option<(Tensor, Tensor, usize)>>,
}

impl Forest {
    /// One segment per sequence; `parents` are local to each segment.
    pub fn new(segments: &[&[Option<usize>]], kernel: usize, dev: &Device) -> Result<Self> {
        let t: usize = segments.iter().map(|s| s.len()).sum();
        let mut parents: Vec<Option<usize>> = Vec::with_capacity(t);
        let mut seg_of = Vec::with_capacity(t);
        let mut spans = Vec::with_capacity(segments.len());
        for (j, seg) in segments.iter().enumerate() {
            let off = parents.len();
            spans.push((off, seg.len()));
            parents.extend(seg.iter().map(|p| p.map(|p| p + off)));
            seg_of.extend(std::iter::repeat_n(j, seg.len()));
        }
        let mut depth = vec![0usize; t];
        let mut by_level: Vec<Vec<usize>> = Vec::new();
        for (i, p) in parents.iter().enumerate() {
            depth[i] = p.map_or(0, |p| depth[p] + 1);
            if by_level.len() <= depth[i] {
                by_level.resize(depth[i] + 1, Vec::new());
            }
            by_level[depth[i]].push(i);
        }
        let mut pos_in_level = vec![0usize; t];
        let mut levels = Vec::with_capacity(by_level.len());
        let mut start = 0;
        for lvl in &by_level {
            for (j, &i) in lvl.iter().enumerate() {
                pos_in_level[i] = j;
            }
            levels.push((start, lvl.len()));
            start += lvl.len();
        }
        let order_vec: Vec<u32> = by_level.iter().flatten().map(|&i| i as u32).collect();
        let order = if order_vec.iter().enumerate().all(|(j, &i)| i as usize == j) {
            None
        } else {
            let mut inverse = vec![0u32; t];
            for (j, &i) in order_vec.iter().enumerate() {
                inverse[i as usize] = j as u32;
            }
            Some((
                Tensor::new(order_vec.as_slice(), dev)?,
                Tensor::new(inverse.as_slice(), dev)?,
            ))
        };
        let roots: Vec<u32> = by_level.first().map_or(Vec::new(), |l| {
            l.iter().map(|&i| seg_of[i] as u32).collect()
        });
        let root_segments = if roots.iter().enumerate().all(|(j, &s)| s as usize == j)
            && roots.len() == segments.len()
        {
            None
        } else {
            Some(Tensor::new(roots.as_slice(), dev)?)
        };
        let mut parent_rows = vec![None];
        for d in 1..by_level.len() {
            if by_level[d - 1].len() == 1 {
                parent_rows.push(None);
            } else {
                let rows: Vec<u32> = by_level[d]
                    .iter()
                    .map(|&i| pos_in_level[parents[i].expect("non-root has a parent")] as u32)
                    .collect();
                parent_rows.push(Some(Tensor::new(rows.as_slice(), dev)?));
            }
        }
        let w = kernel - 1;
        let mut taps = Vec::with_capacity(t * kernel);
        for (j, &(off, len)) in spans.iter().enumerate() {
            // This segment's block starts after the earlier segments' windows and rows.
            let base = j * w + off;
            for i in off..off + len {
                let mut path = Vec::with_capacity(kernel);
                let (mut node, mut window_next) = (Some(i), w);
                while path.len() < kernel {
                    match node {
                        Some(n) => {
                            path.push((base + w + n - off) as u32);
                            node = parents[n];
                        }
                        None => {
                            window_next -= 1;
                            path.push((base + window_next) as u32);
                        }
                    }
                }
                path.reverse();
                taps.extend(path);
            }
        }
        Ok(Self {
            tree: match segments {
                [seg] => Some(seg.to_vec()),
                _ => None,
            },
            dev: dev.clone(),
            ancestor_bits: OnceLock::new(),
            walk: OnceLock::new(),
            conv_taps: Tensor::new(taps.as_slice(), dev)?,
            segments: spans,
            depth,
            pos_in_level,
            levels,
            order,
            parent_rows,
            root_segments,
            kernel,
        })
    }

    /// Tokens over all segments.
    pub fn len(&self) -> usize {
        self.depth.len()
    }

    pub fn is_empty(&self) -> bool {
        self.depth.is_empty()
    }

    /// Every token's ancestor bits (`cuda::tree_bits`: one i64 a token, itself included; i64
    /// `[t]` on the device) for the CUDA kernels that mask a verify tree by them, uploaded once
    /// per forward: `None` unless the forest is one segment of at most 64 tokens, each parent
    /// before its children.
    pub fn ancestor_bits(&self) -> Result<Option<&Tensor>> {
        if let Some(bits) = self.ancestor_bits.get() {
            return Ok(bits.as_ref());
        }
        let bits = match &self.tree {
            Some(seg)
                if seg.len() <= 64
                    && seg.iter().enumerate().all(|(i, p)| p.is_none_or(|p| p < i)) =>
            {
                Some(Tensor::new(
                    crate::cuda::tree_bits(seg).as_slice(),
                    &self.dev,
                )?)
            }
            _ => None,
        };
        Ok(self.ancestor_bits.get_or_init(|| bits).as_ref())
    }

    /// The depth-first order and depths (`[t]` u32 each, on the device) of this forest's one
    /// segment for the CUDA tree scan (`cuda::gdn_tree`), uploaded once per forward: `None`
    /// for several segments, a parent after its child, or a tree `max_depth` or more deep
    /// (as [`dfs_order`]).
    pub fn depth_first_walk(&self, max_depth: usize) -> Result<Option<(&Tensor, &Tensor)>> {
        let walk = match self.walk.get() {
            Some(walk) => walk,
            None => {
                let walk = match self.tree.as_deref().and_then(|p| dfs_order(p, usize::MAX)) {
                    Some((order, depth)) => {
                        let deepest = depth.iter().max().map_or(0, |&d| d as usize);
                        Some((
                            Tensor::new(order.as_slice(), &self.dev)?,
                            Tensor::new(depth.as_slice(), &self.dev)?,
                            deepest,
                        ))
                    }
                    None => None,
                };
                self.walk.get_or_init(|| walk)
            }
        };
        Ok(match walk {
            Some((order, depth, deepest)) if *deepest < max_depth => Some((order, depth)),
            _ => None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::dfs_order;

    #[test]
    fn dfs_order_visits_each_subtree_after_its_root_with_depths() {
        // 0 -> {1 -> {3, 4}, 2 -> {5}}: pre-order 0 1 3 4 2 5.
        let parents = [None, Some(0), Some(0), Some(1), Some(1), Some(2)];
        let (order, depth) = dfs_order(&parents, 32).unwrap();
        assert_eq!(order, vec![0, 1, 3, 4, 2, 5]);
        assert_eq!(depth, vec![0, 1, 2, 2, 1, 2]);
        // In pre-order, a token whose depth is one more than the previous token's is that
        // token's child (the scan keeps its registers only then).
        for w in 1..order.len() {
            if depth[w] == depth[w - 1] + 1 {
                assert_eq!(parents[order[w] as usize], Some(order[w - 1] as usize));
            }
        }
        // A chain is its own order; two roots each start at depth 0.
        let chain: Vec<Option<usize>> = (0..5).map(|i: usize| i.checked_sub(1)).collect();
        assert_eq!(dfs_order(&chain, 32).unwrap().0, vec![0, 1, 2, 3, 4]);
        let forest = [None, None, Some(0)];
        assert_eq!(
            dfs_order(&forest, 32).unwrap(),
            (vec![0, 2, 1], vec![0, 1, 0])
        );
    }

    #[test]
    fn dfs_order_refuses_deep_trees_and_parents_after_children() {
        let chain: Vec<Option<usize>> = (0..5).map(|i: usize| i.checked_sub(1)).collect();
        assert!(dfs_order(&chain, 5).is_some());
        assert!(dfs_order(&chain, 4).is_none());
        assert!(dfs_order(&[Some(1), None], 32).is_none());
    }

    /// The forest's depth-first walk is the segment's [`dfs_order`], built once and shared by
    /// every later call; none for several segments or a tree the walk refuses.
    #[test]
    fn forest_depth_first_walk_built_once_for_one_segment() -> candle_core::Result<()> {
        let dev = candle_core::Device::Cpu;
        let tree = [None, Some(0), Some(0), Some(1), Some(1), Some(2)];
        let f = super::Forest::new(&[&tree], 4, &dev)?;
        let (order, depth) = f.depth_first_walk(32)?.expect("a shallow tree");
        assert_eq!(order.to_vec1::<u32>()?, vec![0, 1, 3, 4, 2, 5]);
        assert_eq!(depth.to_vec1::<u32>()?, vec![0, 1, 2, 2, 1, 2]);
        let again = f.depth_first_walk(32)?.expect("kept");
        assert!(std::ptr::eq(again.0, f.depth_first_walk(32)?.unwrap().0));
        assert!(super::Forest::new(&[&tree], 4, &dev)?
            .depth_first_walk(2)?
            .is_none());
        let two = super::Forest::new(&[&tree, &tree], 4, &dev)?;
        assert!(two.depth_first_walk(32)?.is_none());
        Ok(())
    }

    /// The forest carries a verify tree's ancestor bits (`cuda::tree_bits`) for one segment of
    /// up to 64 tokens, parents first; none for several segments, longer trees or a parent
    /// after its child.
    #[test]
    fn forest_ancestor_bits_only_for_one_short_ordered_tree() -> candle_core::Result<()> {
        let dev = candle_core::Device::Cpu;
        let tree = [None, Some(0), Some(0), Some(1)];
        let f = super::Forest::new(&[&tree], 4, &dev)?;
        let bits = f.ancestor_bits()?.expect("a 4-node tree has bits");
        assert_eq!(bits.to_vec1::<i64>()?, vec![0b1, 0b11, 0b101, 0b1011]);
        assert!(super::Forest::new(&[&tree, &tree], 4, &dev)?
            .ancestor_bits()?
            .is_none());
        let long: Vec<Option<usize>> = (0..65).map(|i: usize| i.checked_sub(1)).collect();
        assert!(super::Forest::new(&[&long], 4, &dev)?
            .ancestor_bits()?
            .is_none());
        assert!(super::Forest::new(&[&[Some(1), None]], 4, &dev)?
            .ancestor_bits()?
            .is_none());
        Ok(())
    }
}
