//! The gated delta rule (HF `torch_recurrent_gated_delta_rule` / `torch_chunk_gated_delta_rule`,
//! FLA's kernels): per value head a `[key_dim, value_dim]` f32 memory S, for each token
//! `S <- exp(g) S;  S <- S + k (beta (v - Sᵀk))ᵀ;  o = Sᵀ q`.
//!
//! Two forms with equal outputs up to rounding:
//! - [`recurrent`] walks a forest of tokens by depth. Each token starts from its parent's state
//!   (a chain is the one-path forest), all tokens of one depth run together, and the state after
//!   every token is returned: what chain and tree verification need to commit any accepted node.
//! - [`chunked`] is the prefill form: 64-token chunks, the intra-chunk updates condensed by the
//!   UT transform (a unit lower-triangular solve), one sequential step per chunk; it returns only
//!   the final state.

use candle_core::{DType, Result, Tensor, D};

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

/// Depth of every node and the nodes of each depth (parents precede children).
pub fn levels(parents: &[Option<usize>]) -> (Vec<usize>, Vec<Vec<usize>>) {
    let mut depth = vec![0usize; parents.len()];
    let mut levels: Vec<Vec<usize>> = Vec::new();
    for (i, p) in parents.iter().enumerate() {
        depth[i] = p.map_or(0, |p| depth[p] + 1);
        if levels.len() <= depth[i] {
            levels.resize(depth[i] + 1, Vec::new());
        }
        levels[depth[i]].push(i);
    }
    (depth, levels)
}

fn idx(rows: &[usize], dev: &candle_core::Device) -> Result<Tensor> {
    let v: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
    Tensor::new(v.as_slice(), dev)
}

/// Token-by-token recurrence over the forest `parents` starting from `initial` `[Hv, dk, dv]`.
/// Returns the outputs `[t, Hv, dv]` and the state after each token (`[Hv, dk, dv]` views).
pub fn recurrent(
    inp: &DeltaInputs,
    parents: &[Option<usize>],
    initial: &Tensor,
) -> Result<(Tensor, Vec<Tensor>)> {
    let dev = inp.q.device();
    let t = parents.len();
    let (depth, levels) = levels(parents);
    let mut pos_in_level = vec![0usize; t];
    for lvl in &levels {
        for (j, &i) in lvl.iter().enumerate() {
            pos_in_level[i] = j;
        }
    }
    let mut level_states: Vec<Tensor> = Vec::with_capacity(levels.len());
    let mut outs: Vec<Tensor> = Vec::with_capacity(levels.len());
    for (d, lvl) in levels.iter().enumerate() {
        let n = lvl.len();
        let rows = idx(lvl, dev)?;
        let s_prev = if d == 0 {
            initial.unsqueeze(0)?.repeat((n, 1, 1, 1))?
        } else {
            let from: Vec<usize> = lvl
                .iter()
                .map(|&i| pos_in_level[parents[i].expect("non-root node has a parent")])
                .collect();
            level_states[d - 1].index_select(&idx(&from, dev)?, 0)?
        };
        let (q, k, v) = (
            inp.q.index_select(&rows, 0)?,
            inp.k.index_select(&rows, 0)?,
            inp.v.index_select(&rows, 0)?,
        );
        let decay = inp.g.index_select(&rows, 0)?.exp()?.unsqueeze(2)?.unsqueeze(3)?;
        let beta = inp.beta.index_select(&rows, 0)?.unsqueeze(2)?.unsqueeze(3)?;
        let s = s_prev.broadcast_mul(&decay)?;
        let k_row = k.unsqueeze(2)?; // [n, Hv, 1, dk]
        let remembered = k_row.matmul(&s)?; // [n, Hv, 1, dv]
        let delta = (v.unsqueeze(2)? - remembered)?.broadcast_mul(&beta)?;
        let s = (s + k.unsqueeze(3)?.matmul(&delta)?)?;
        outs.push(q.unsqueeze(2)?.matmul(&s)?.squeeze(2)?);
        level_states.push(s);
    }
    let order: Vec<usize> = levels.iter().flatten().copied().collect();
    let mut inverse = vec![0usize; t];
    for (j, &i) in order.iter().enumerate() {
        inverse[i] = j;
    }
    let out = Tensor::cat(&outs, 0)?.index_select(&idx(&inverse, dev)?, 0)?;
    let states = (0..t)
        .map(|i| level_states[depth[i]].get(pos_in_level[i]))
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
    for i in 0..nc {
        let at = |x: &Tensor| x.narrow(1, i, 1).and_then(|y| y.squeeze(1));
        let v_new = (at(&new_values)? - at(&k_cumdecay)?.contiguous()?.matmul(&s)?)?;
        let inter = at(&q_dec)?.contiguous()?.matmul(&s)?;
        outs.push((inter + at(&intra)?.contiguous()?.matmul(&v_new)?)?);
        let kd = at(&k_dec)?.transpose(1, 2)?.contiguous()?;
        s = (s.broadcast_mul(&at(&chunk_decay)?)? + kd.matmul(&v_new)?)?;
    }
    let out = Tensor::cat(&outs, 1)?.narrow(1, 0, t)?; // [Hv, t, dv]
    Ok((out.transpose(0, 1)?.contiguous()?, s))
}
