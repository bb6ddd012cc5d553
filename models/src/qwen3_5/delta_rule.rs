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

use candle_core::{DType, Result, Tensor, D};

pub use super::forest::{dfs_order, Forest};

pub const CHUNK: usize = 64;

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
