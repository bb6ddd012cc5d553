//! The gated delta rule (HF `torch_recurrent_gated_delta_rule` / `torch_chunk_gated_delta_rule`,
//! FLA's kernels): per value head a `[key_dim, value_dim]` f32 memory S, for each token
//! `S <- exp(g) S;  S <- S + k (beta (v - Sᵀk))ᵀ;  o = Sᵀ q`.
//!
//! Three forms with equal outputs up to rounding:
//! - [`recurrent`] walks a forest of tokens by depth. Each token starts from its parent's state
//!   (a chain is the one-path forest), all tokens of one depth run together, and the state after
//!   every token is returned: what chain and tree verification need to commit any accepted node.
//! - [`chunked`] is the prefill form: 64-token chunks, the intra-chunk updates condensed by the
//!   UT transform (a unit lower-triangular solve), one sequential step per chunk; it returns only
//!   the final state.
//! - [`tree`] is the block form of a verify tree: every node's output from the committed state
//!   through the ancestor mask, and the state only for the nodes asked (the accepted path's end).
//!   [`tree_writes`] (and [`chunked_writes`] for long chains) return instead the value each node
//!   wrote, from which [`state_along`] rebuilds any node's state later: the verify staging of
//!   [`crate::cache::recurrent`].

use candle_core::{DType, Device, Result, Tensor, D};

pub const CHUNK: usize = 64;

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

/// One sequence's delta-rule inputs in f32, already expanded to the value heads: `q`, `k`
/// `[t, Hv, dk]` (L2-normalised, `q` scaled by dk^-1/2), `v` `[t, Hv, dv]`, log-decay `g` and
/// write strength `beta` `[t, Hv]`.
pub struct DeltaInputs {
    pub q: Tensor,
    pub k: Tensor,
    pub v: Tensor,
    pub g: Tensor,
    pub beta: Tensor,
}

/// The token forests of one or more sequences (segments) for a forward, planned once and shared
/// by every GDN layer: depth levels across all segments (so nodes of one depth in every
/// sequence step together), where each token's parent state sits, which segment each root
/// starts from, and the conv-tap rows along each path. Index tensors are uploaded once per
/// forward, not once per layer; chains need none beyond the conv taps.
pub struct Forest {
    /// Start and length of each segment in the combined token order.
    pub segments: Vec<(usize, usize)>,
    depth: Vec<usize>,
    pos_in_level: Vec<usize>,
    /// `(start, len)` of each depth level in level order.
    levels: Vec<(usize, usize)>,
    /// Level order -> token index, and back; `None` when level order is token order.
    order: Option<(Tensor, Tensor)>,
    /// Per level: rows of the previous level's states that its tokens continue from; `None`
    /// for the roots and wherever the previous level has a single token (a broadcast).
    parent_rows: Vec<Option<Tensor>>,
    /// Segment of each root, in level order; `None` when root j belongs to segment j.
    root_segments: Option<Tensor>,
    /// Rows of the segments' `[cached window (K-1 rows) ; new rows]` blocks, stacked in segment
    /// order, that each token's conv reads, oldest first.
    pub conv_taps: Tensor,
    pub kernel: usize,
    /// One segment of at most 64 tokens, each parent before its children: every token's
    /// ancestor bits (`cuda::tree_bits`: one i64 a token, itself included), on the device, for
    /// the CUDA kernels that mask a verify tree by them; `None` otherwise.
    pub ancestor_bits: Option<Tensor>,
    /// One segment's depth-first walk for the CUDA tree scan (`cuda::gdn_tree`): its
    /// [`dfs_order`] and depths on the device, built by the first GDN layer that asks
    /// ([`Self::depth_first_walk`]) and shared by the others.
    walk: std::sync::OnceLock<Option<(Tensor, Tensor)>>,
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
        let ancestor_bits = match segments {
            [seg]
                if seg.len() <= 64
                    && seg.iter().enumerate().all(|(i, p)| p.is_none_or(|p| p < i)) =>
            {
                Some(Tensor::new(crate::cuda::tree_bits(seg).as_slice(), dev)?)
            }
            _ => None,
        };
        Ok(Self {
            ancestor_bits,
            walk: std::sync::OnceLock::new(),
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

    /// The depth-first order and depths (`[t]` u32 each, on `dev`) of this forest's one segment
    /// `parents` (the tree it was built from) for a walk at most `max_depth` deep, uploaded
    /// once per forward: `None` for several segments or where [`dfs_order`] refuses the tree.
    pub fn depth_first_walk(
        &self,
        parents: &[Option<usize>],
        max_depth: usize,
        dev: &Device,
    ) -> Result<Option<&(Tensor, Tensor)>> {
        if self.segments.len() != 1 || parents.len() != self.len() {
            return Ok(None);
        }
        if let Some(walk) = self.walk.get() {
            return Ok(walk.as_ref());
        }
        let walk = match dfs_order(parents, max_depth) {
            Some((order, depth)) => Some((
                Tensor::new(order.as_slice(), dev)?,
                Tensor::new(depth.as_slice(), dev)?,
            )),
            None => None,
        };
        Ok(self.walk.get_or_init(|| walk).as_ref())
    }
}

/// Token-by-token recurrence over `forest` from `initial` `[segments, Hv, dk, dv]` (one state
/// per segment): all tokens of one depth step together, each from its parent's state (roots
/// from their segment's). Returns the outputs `[t, Hv, dv]` and the state after each token
/// (`[Hv, dk, dv]` views).
pub fn recurrent(
    inp: &DeltaInputs,
    forest: &Forest,
    initial: &Tensor,
) -> Result<(Tensor, Vec<Tensor>)> {
    let (_, hv, dk, dv) = initial.dims4()?;
    let in_level_order = |x: &Tensor| -> Result<Tensor> {
        match &forest.order {
            Some((order, _)) => x.index_select(order, 0),
            None => Ok(x.clone()),
        }
    };
    let q = in_level_order(&inp.q)?;
    let k = in_level_order(&inp.k)?;
    let v = in_level_order(&inp.v)?;
    let decay = in_level_order(&inp.g.exp()?)?.unsqueeze(2)?.unsqueeze(3)?;
    let beta = in_level_order(&inp.beta)?.unsqueeze(2)?.unsqueeze(3)?;
    let mut level_states: Vec<Tensor> = Vec::with_capacity(forest.levels.len());
    let mut outs: Vec<Tensor> = Vec::with_capacity(forest.levels.len());
    for (d, &(start, n)) in forest.levels.iter().enumerate() {
        let shape = (n, hv, dk, dv);
        let s_prev = match (d, &forest.parent_rows[d]) {
            (0, _) => match &forest.root_segments {
                None => initial.clone(),
                Some(segs) => initial.index_select(segs, 0)?,
            },
            (_, Some(rows)) => level_states[d - 1].index_select(rows, 0)?,
            (_, None) => level_states[d - 1].broadcast_as(shape)?,
        };
        let at = |x: &Tensor| x.narrow(0, start, n);
        let (q, k) = (at(&q)?, at(&k)?);
        let s = s_prev.broadcast_mul(&at(&decay)?)?;
        let remembered = k.unsqueeze(2)?.matmul(&s)?; // [n, Hv, 1, dv]
        let delta = (at(&v)?.unsqueeze(2)? - remembered)?.broadcast_mul(&at(&beta)?)?;
        let s = (s + k.unsqueeze(3)?.matmul(&delta)?)?;
        outs.push(q.unsqueeze(2)?.matmul(&s)?.squeeze(2)?);
        level_states.push(s);
    }
    let out = if outs.len() == 1 {
        outs.pop().expect("one level")
    } else {
        Tensor::cat(&outs, 0)?
    };
    let out = match &forest.order {
        Some((_, inverse)) => out.index_select(inverse, 0)?,
        None => out,
    };
    let states = (0..forest.len())
        .map(|i| level_states[forest.depth[i]].get(forest.pos_in_level[i]))
        .collect::<Result<Vec<_>>>()?;
    Ok((out, states))
}

/// Solves `(I + N) X = B` for the strictly lower-triangular part N of `a` (`[.., C, C]`) by
/// forward substitution (HF uses `solve_triangular(unitriangular=True)`, which reads the same N).
fn unit_lower_solve(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let c = a.dim(D::Minus1)?;
    let mut rows: Vec<Tensor> = Vec::with_capacity(c);
    for i in 0..c {
        let bi = b.narrow(D::Minus2, i, 1)?;
        let xi = if i == 0 {
            bi
        } else {
            let n_i = a.narrow(D::Minus2, i, 1)?.narrow(D::Minus1, 0, i)?;
            let prev = Tensor::cat(&rows, D::Minus2)?;
            (bi - n_i.contiguous()?.matmul(&prev)?)?
        };
        rows.push(xi);
    }
    Tensor::cat(&rows, D::Minus2)
}

/// The chunked form from `initial` `[Hv, dk, dv]`: outputs `[t, Hv, dv]` and the final state.
pub fn chunked(inp: &DeltaInputs, initial: &Tensor) -> Result<(Tensor, Tensor)> {
    let (o, s, _) = chunked_form(inp, initial, false)?;
    Ok((o, s))
}

/// [`chunked`] also returning the value each token wrote into the memory, `[t, Hv, dv]` (the
/// chunks' corrected values, `u` of [`tree_writes`]): the staging of long rollback-able chains.
pub fn chunked_writes(inp: &DeltaInputs, initial: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
    let (o, s, u) = chunked_form(inp, initial, true)?;
    let u = u.ok_or_else(|| candle_core::Error::Msg("chunked form kept no writes".into()))?;
    Ok((o, s, u))
}

fn chunked_form(
    inp: &DeltaInputs,
    initial: &Tensor,
    keep_writes: bool,
) -> Result<(Tensor, Tensor, Option<Tensor>)> {
    let dev = inp.q.device();
    let (t, hv, dk) = inp.k.dims3()?;
    let dv = inp.v.dim(2)?;
    let pad = (CHUNK - t % CHUNK) % CHUNK;
    let nc = (t + pad) / CHUNK;
    // [t, Hv, x] -> [Hv, nc, CHUNK, x], zero rows padding the last chunk.
    let heads_first = |x: &Tensor, width: usize| -> Result<Tensor> {
        let x = x.transpose(0, 1)?.contiguous()?; // [Hv, t, width]
        let x = if pad > 0 {
            let z = Tensor::zeros((hv, pad, width), DType::F32, dev)?;
            Tensor::cat(&[&x, &z], 1)?
        } else {
            x
        };
        x.reshape((hv, nc, CHUNK, width))
    };
    let q = heads_first(&inp.q, dk)?;
    let k = heads_first(&inp.k, dk)?;
    let v = heads_first(&inp.v, dv)?;
    let g = heads_first(&inp.g.unsqueeze(2)?, 1)?.squeeze(3)?; // [Hv, nc, C]
    let beta = heads_first(&inp.beta.unsqueeze(2)?, 1)?; // [Hv, nc, C, 1]
    let v_beta = v.broadcast_mul(&beta)?;
    let k_beta = k.broadcast_mul(&beta)?;
    let cum = g.cumsum(D::Minus1)?; // [Hv, nc, C]
                                    // decay[i, j] = exp(cum_i - cum_j) for j <= i, 0 above the diagonal.
    let diff = cum.unsqueeze(3)?.broadcast_sub(&cum.unsqueeze(2)?)?;
    let upper: Vec<f32> = (0..CHUNK)
        .flat_map(|i| (0..CHUNK).map(move |j| if j > i { f32::NEG_INFINITY } else { 0.0 }))
        .collect();
    let upper = Tensor::from_vec(upper, (CHUNK, CHUNK), dev)?;
    let decay = diff.broadcast_add(&upper)?.exp()?;
    let kt = k.transpose(2, 3)?.contiguous()?;
    let ut = (k_beta.matmul(&kt)? * &decay)?;
    let intra = (q.matmul(&kt)? * &decay)?;
    let cum_exp = cum.exp()?.unsqueeze(3)?;
    let decayed_k_beta = k_beta.broadcast_mul(&cum_exp)?;
    let solved = unit_lower_solve(&ut, &Tensor::cat(&[&v_beta, &decayed_k_beta], 3)?)?;
    let new_values = solved.narrow(3, 0, dv)?;
    let k_cumdecay = solved.narrow(3, dv, dk)?;
    let q_dec = q.broadcast_mul(&cum_exp)?;
    let last = cum.narrow(2, CHUNK - 1, 1)?; // [Hv, nc, 1]
    let k_dec = k.broadcast_mul(&last.broadcast_sub(&cum)?.exp()?.unsqueeze(3)?)?;
    let chunk_decay = last.exp()?.unsqueeze(3)?; // [Hv, nc, 1, 1]
    let mut s = initial.clone();
    let mut outs = Vec::with_capacity(nc);
    let mut writes = Vec::with_capacity(if keep_writes { nc } else { 0 });
    for i in 0..nc {
        let at = |x: &Tensor| x.narrow(1, i, 1).and_then(|y| y.squeeze(1));
        let v_new = (at(&new_values)? - at(&k_cumdecay)?.contiguous()?.matmul(&s)?)?;
        let inter = at(&q_dec)?.contiguous()?.matmul(&s)?;
        outs.push((inter + at(&intra)?.contiguous()?.matmul(&v_new)?)?);
        let kd = at(&k_dec)?.transpose(1, 2)?.contiguous()?;
        s = (s.broadcast_mul(&at(&chunk_decay)?)? + kd.matmul(&v_new)?)?;
        if keep_writes {
            writes.push(v_new);
        }
    }
    let out = Tensor::cat(&outs, 1)?.narrow(1, 0, t)?; // [Hv, t, dv]
    let writes = if keep_writes {
        let u = Tensor::cat(&writes, 1)?.narrow(1, 0, t)?;
        Some(u.transpose(0, 1)?.contiguous()?)
    } else {
        None
    };
    Ok((out.transpose(0, 1)?.contiguous()?, s, writes))
}

/// The delta rule over a token tree in one block, from the committed state `initial`
/// `[Hv, dk, dv]`: every node's output without a state per node, and the state after each node
/// in `state_of` only (for a verify, the accepted path's end). `parents` lists each node's
/// parent (`None`: a root, continuing from `initial`); parents precede their children.
///
/// The chunked form with the causal mask replaced by the ancestor mask. Along the path to
/// node i the states are a chain, so with `γ_i` the log-decay summed over the path (i
/// included) and `u_j` the values each node writes,
/// `S_i = e^{γ_i} S0 + Σ_{j ∈ path(i)} e^{γ_i - γ_j} k_j u_jᵀ` and
/// `u_i = β_i (v_i - e^{γ_i} S0ᵀ k_i - Σ_{j strict ancestor of i} e^{γ_i - γ_j} (k_i·k_j) u_j)`,
/// a unit lower-triangular system in node order; then
/// `o_i = e^{γ_i} S0ᵀ q_i + Σ_{j ∈ path(i)} e^{γ_i - γ_j} (q_i·k_j) u_j`.
/// Memory is O(t²) per head: meant for verify trees (tens of nodes), not prefills (see
/// [`chunked`]). Outputs `[t, Hv, dv]`; states `[Hv, dk, dv]`.
pub fn tree(
    inp: &DeltaInputs,
    parents: &[Option<usize>],
    initial: &Tensor,
    state_of: &[usize],
) -> Result<(Tensor, Vec<Tensor>)> {
    let t = parents.len();
    if state_of.iter().any(|&n| n >= t) {
        candle_core::bail!("tree delta rule: {t} nodes, states asked of {state_of:?}");
    }
    let s = tree_solve(inp, parents, initial)?;
    let states = state_of
        .iter()
        .map(|&n| {
            let w = s.decay.narrow(1, n, 1)?; // [Hv, 1, t]: e^{γ_n - γ_j} on n's path
            let kw = s.kt.broadcast_mul(&w)?; // [Hv, dk, t]
            let e_n = s.e_gamma.narrow(1, n, 1)?; // [Hv, 1, 1]
            initial.broadcast_mul(&e_n)? + kw.matmul(&s.u)?
        })
        .collect::<Result<Vec<_>>>()?;
    Ok((s.o.transpose(0, 1)?.contiguous()?, states))
}

/// [`tree`] without any state: every node's output `[t, Hv, dv]` and the value `u_i` it
/// writes into the memory `[t, Hv, dv]` (`S_i = e^{g_i} S_parent + k_i u_iᵀ`). A node's `u`
/// depends only on its own path, so keeping `k`, `u` and `g` of every node is enough to build
/// the state of whichever node is committed later ([`state_along`]).
pub fn tree_writes(
    inp: &DeltaInputs,
    parents: &[Option<usize>],
    initial: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let s = tree_solve(inp, parents, initial)?;
    Ok((
        s.o.transpose(0, 1)?.contiguous()?,
        s.u.transpose(0, 1)?.contiguous()?,
    ))
}

/// The state after a chain of `m` rows from `initial` `[Hv, dk, dv]`, given each row's
/// (value-head expanded) key `k` `[m, Hv, dk]`, written value `u` `[m, Hv, dv]` and log-decay
/// `g` `[m, Hv]`: `S_m = e^{Γ_m} S0 + Σ_j e^{Γ_m - Γ_j} k_j u_jᵀ` with `Γ` the running sum of
/// `g` (every weight is at most 1: `g <= 0`). One matmul per head, no solve.
pub fn state_along(initial: &Tensor, k: &Tensor, u: &Tensor, g: &Tensor) -> Result<Tensor> {
    let m = k.dim(0)?;
    if m == 0 {
        return Ok(initial.clone());
    }
    let cum = g.t()?.contiguous()?.cumsum(1)?; // [Hv, m]
    let total = cum.narrow(1, m - 1, 1)?; // [Hv, 1]
    let w = total.broadcast_sub(&cum)?.exp()?.unsqueeze(1)?; // [Hv, 1, m]
    let kw = k.permute((1, 2, 0))?.broadcast_mul(&w)?; // [Hv, dk, m]
    let u = u.transpose(0, 1)?.contiguous()?; // [Hv, m, dv]
    initial.broadcast_mul(&total.exp()?.unsqueeze(2)?)? + kw.contiguous()?.matmul(&u)?
}

/// The shared part of [`tree`] and [`tree_writes`]: outputs and written values heads-first
/// (`[Hv, t, dv]`), with the path decays, `e^{γ}` and `kᵀ` the states are built from.
struct TreeSolve {
    o: Tensor,
    u: Tensor,
    decay: Tensor,
    e_gamma: Tensor,
    kt: Tensor,
}

fn tree_solve(inp: &DeltaInputs, parents: &[Option<usize>], initial: &Tensor) -> Result<TreeSolve> {
    let dev = inp.q.device();
    let t = parents.len();
    let tq = inp.k.dim(0)?;
    if tq != t {
        candle_core::bail!("tree delta rule: {tq} rows of inputs, {t} parents");
    }
    // on_path[i][j]: j is i or one of its ancestors.
    let mut on_path = vec![0f32; t * t];
    for i in 0..t {
        match parents[i] {
            Some(p) if p < i => {
                let (done, rest) = on_path.split_at_mut(i * t);
                rest[..t].copy_from_slice(&done[p * t..p * t + t]);
            }
            Some(p) => {
                candle_core::bail!("tree delta rule: node {i}'s parent {p} does not precede it")
            }
            None => {}
        }
        on_path[i * t + i] = 1.0;
    }
    let hidden: Vec<f32> = on_path
        .iter()
        .map(|&m| if m > 0.0 { 0.0 } else { f32::NEG_INFINITY })
        .collect();
    let on_path = Tensor::from_vec(on_path, (t, t), dev)?;
    let hidden = Tensor::from_vec(hidden, (t, t), dev)?;
    let heads_first = |x: &Tensor| x.transpose(0, 1)?.contiguous(); // [Hv, t, x]
    let q = heads_first(&inp.q)?;
    let k = heads_first(&inp.k)?;
    let v = heads_first(&inp.v)?;
    let g = inp.g.t()?.contiguous()?; // [Hv, t]
    let beta = inp.beta.t()?.contiguous()?.unsqueeze(2)?; // [Hv, t, 1]
                                                          // γ_i = Σ_{j ∈ path(i)} g_j.
    let gamma = g.matmul(&on_path.t()?.contiguous()?)?; // [Hv, t]
                                                        // decay[i, j] = e^{γ_i - γ_j} on the path, 0 elsewhere.
    let diff = gamma.unsqueeze(2)?.broadcast_sub(&gamma.unsqueeze(1)?)?;
    let decay = diff.broadcast_add(&hidden)?.exp()?; // [Hv, t, t]
    let e_gamma = gamma.exp()?.unsqueeze(2)?; // [Hv, t, 1]
    let kt = k.transpose(1, 2)?.contiguous()?; // [Hv, dk, t]
                                               // Only the strictly lower part is read by the solve; off-path entries are 0 there.
    let a = (k.matmul(&kt)? * &decay)?.broadcast_mul(&beta)?;
    let b = (v - k.matmul(initial)?.broadcast_mul(&e_gamma)?)?.broadcast_mul(&beta)?;
    let u = unit_lower_solve(&a, &b)?; // [Hv, t, dv]
    let o =
        (q.matmul(initial)?.broadcast_mul(&e_gamma)? + (q.matmul(&kt)? * &decay)?.matmul(&u)?)?;
    Ok(TreeSolve {
        o,
        u,
        decay,
        e_gamma,
        kt,
    })
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
        let (order, depth) = f
            .depth_first_walk(&tree, 32, &dev)?
            .expect("a shallow tree");
        assert_eq!(order.to_vec1::<u32>()?, vec![0, 1, 3, 4, 2, 5]);
        assert_eq!(depth.to_vec1::<u32>()?, vec![0, 1, 2, 2, 1, 2]);
        let again = f.depth_first_walk(&tree, 32, &dev)?.expect("kept");
        assert!(std::ptr::eq(
            again,
            f.depth_first_walk(&tree, 32, &dev)?.unwrap()
        ));
        assert!(super::Forest::new(&[&tree], 4, &dev)?
            .depth_first_walk(&tree, 2, &dev)?
            .is_none());
        let two = super::Forest::new(&[&tree, &tree], 4, &dev)?;
        assert!(two.depth_first_walk(&tree, 32, &dev)?.is_none());
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
        let bits = f.ancestor_bits.expect("a 4-node tree has bits");
        assert_eq!(bits.to_vec1::<i64>()?, vec![0b1, 0b11, 0b101, 0b1011]);
        assert!(super::Forest::new(&[&tree, &tree], 4, &dev)?
            .ancestor_bits
            .is_none());
        let long: Vec<Option<usize>> = (0..65).map(|i: usize| i.checked_sub(1)).collect();
        assert!(super::Forest::new(&[&long], 4, &dev)?
            .ancestor_bits
            .is_none());
        assert!(super::Forest::new(&[&[Some(1), None]], 4, &dev)?
            .ancestor_bits
            .is_none());
        Ok(())
    }
}
