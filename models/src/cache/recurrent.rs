//! Recurrent (Gated DeltaNet) layer state and the row bookkeeping that lets it roll back.
//!
//! A GDN layer's state after row r depends on every row before it and is overwritten by each
//! new token, so it cannot be truncated like K/V. A forward that may be rolled back (a chain
//! or tree verify, at most `rollback` rows) therefore stages, per layer, what the state of any
//! of its rows can be rebuilt from, and `truncate` / `compact` / `settle` rebuild only the
//! state of the row that survives; `compact` (the engine's commit) folds it into the settled
//! base state and frees the rest, so rejected branches neither leak into the state nor stay in
//! memory. Forwards longer than `rollback` (prefill) keep only their final state and settle at
//! once.
//!
//! **Compact staging (the plain path).** Along the path to a row n the delta rule is a chain,
//! `S_j = e^{g_j} S_parent(j) + k_j u_jᵀ`, where `u_j` (the value row j writes) depends only on
//! j's own ancestors. So with `Γ` the log-decay summed along the path from the base,
//! `S_n = e^{Γ_n} S_base + Σ_{j ∈ path(n)} e^{Γ_n - Γ_j} k_j u_jᵀ`: one matmul per head, no
//! solve. The verify computes every row's output through the ancestor mask
//! (`delta_rule::tree_writes`; long chains `delta_rule::chunked_writes`), never a state per
//! row, and stages [`RowInputs`]: per row its pre-conv q|k|v row (the conv window after row n
//! is the last K-1 of them along n's path, after the base window), its L2-normalised key per
//! key head, its `u` per value head and its log-decay. The tree's parents live in
//! [`RowTracker`]; the commit hands each layer the accepted path, which it replays
//! (`delta_rule::state_along`). A forward continuing uncommitted rows (an oracle rollout) asks
//! [`RecurrentLayer::last`], which builds the tip state once on demand.
//!
//! Memory at the Qwen3.6-27B shape (48 GDN layers, Hk 16, Hv 48, heads of 128, conv_dim
//! 10240, bf16 rows): 53,440 bytes per row per layer, 2.56 MB per verified row, **164 MB for a
//! 64-node tree per sequence** (`HybridConfig::staged_bytes_per_verified_row`), against 147 MiB
//! per row (9.4 GB per 64-node tree) with a full state per row. The tree form adds O(t²) per
//! head while a layer runs (`[Hv, t, t]` f32: 0.8 MB at t = 64), freed after the layer; the
//! commit builds one state per layer.
//!
//! The fused CUDA chain forward (`qwen3_5/cuda.rs`) stages [`RowInputs`] too on its default
//! verify path (`GdnPath::SplitInputs`: its scan writes each row's `u`, no state); on CUDA the
//! replay is one kernel per layer (`gdn_state_along`), which repeats the scan's operations and
//! so rebuilds its state bit for bit.
//!
//! **Full per-row states** ([`StagedState::Rows`]) remain for the fused forward's other paths
//! (`GdnPath::Chain`, `SplitStates`), whose kernels write every row's state into one buffer:
//! those rows are views into it, and a path replays from the last full state on it (settling
//! on one copies it out of the buffer). A decode step's one row is a buffer of its own
//! ([`StagedState::OwnRows`]): settling on it keeps it as it is (no copy: the commit of a
//! decode step launches nothing).

use std::sync::{Arc, OnceLock};

use candle_core::{DType, Device, Result, Tensor};

use crate::error::{ModelError, ModelResult};
use crate::qwen3_5::delta_rule::state_along;

/// One GDN layer's state at one position.
#[derive(Debug, Clone)]
pub struct GdnState {
    /// The last `K - 1` pre-convolution rows of the q|k|v projection: `[K - 1, conv_dim]`.
    pub conv: Tensor,
    /// The delta-rule memory, kept in f32: `[value_heads, key_dim, value_dim]`.
    pub ssm: Tensor,
}

impl GdnState {
    pub fn zeros(
        conv_rows: usize,
        conv_dim: usize,
        shape: (usize, usize, usize),
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        Ok(Self {
            conv: Tensor::zeros((conv_rows, conv_dim), dtype, device)?,
            ssm: Tensor::zeros(shape, DType::F32, device)?,
        })
    }
}

/// One forward's rows of one GDN layer in the compact staging: what the state after any of
/// them can be rebuilt from (see the module doc), instead of a full state per row.
#[derive(Debug, Clone)]
pub struct RowInputs {
    /// The rows' pre-convolution q|k|v projections `[t, conv_dim]` (model dtype): the conv
    /// window after a row is the last `K - 1` of them along its path.
    pub pre_conv: Tensor,
    /// L2-normalised keys per key head `[t, Hk, dk]` (f32; value head j reads key head
    /// `j / (Hv / Hk)`).
    pub k: Tensor,
    /// The value each row wrote into the memory, `u` in `S <- e^g S_parent + k uᵀ`
    /// `[t, Hv, dv]` (f32).
    pub writes: Tensor,
    /// Log-decays `[t, Hv]` (f32).
    pub g: Tensor,
}

impl RowInputs {
    pub fn len(&self) -> usize {
        self.g.dims().first().copied().unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes held for these rows.
    pub fn bytes(&self) -> usize {
        [&self.pre_conv, &self.k, &self.writes, &self.g]
            .iter()
            .map(|t| t.elem_count() * t.dtype().size_in_bytes())
            .sum()
    }

    /// Rows `[from, from + n)` of every field.
    fn narrow(&self, from: usize, n: usize) -> Result<Self> {
        Ok(Self {
            pre_conv: self.pre_conv.narrow(0, from, n)?,
            k: self.k.narrow(0, from, n)?,
            writes: self.writes.narrow(0, from, n)?,
            g: self.g.narrow(0, from, n)?,
        })
    }
}

/// What a forward leaves for one recurrent layer, applied only once every layer succeeded.
#[derive(Debug)]
pub enum StagedState {
    /// The state after each new row (rows may be rolled back later): the fused CUDA chain's
    /// views into its kernel's state buffer.
    Rows(Vec<GdnState>),
    /// As [`StagedState::Rows`], every tensor a buffer of its own that no one writes again (a
    /// decode step's one row): settling on one keeps it without a copy.
    OwnRows(Vec<GdnState>),
    /// Only the state after the last new row (the forward settles the cache).
    Final(GdnState),
    /// The new rows' [`RowInputs`] (rows may be rolled back later): the plain path's verify.
    Inputs(RowInputs),
}

/// One unsettled row of a layer.
#[derive(Debug, Clone)]
enum StagedRow {
    /// The full state after the row; whether its tensors are buffers of their own (else views
    /// into a forward's buffer of many rows, copied out when settled on).
    State(GdnState, bool),
    /// Row `i` of one forward's inputs (shared by that forward's rows).
    Inputs(Arc<RowInputs>, usize),
}

#[derive(Debug, Clone)]
pub struct RecurrentLayer {
    /// State after the first `settled` rows of the sequence.
    base: GdnState,
    /// What each row in `[settled, len)` left.
    rows: Vec<StagedRow>,
    /// Whether `rows` form one path from the base (false after an uncompacted tree).
    path: bool,
    /// The state after the last row, once built (rows staged as inputs build it on demand).
    tip: OnceLock<GdnState>,
}

impl RecurrentLayer {
    pub fn new(base: GdnState) -> Self {
        Self {
            base,
            rows: Vec::new(),
            path: true,
            tip: OnceLock::new(),
        }
    }

    /// The state after the last live row (what a forward continues from); built from the
    /// staged inputs the first time it is asked after a rollback-able forward. Fails while the
    /// live rows hold an uncommitted tree (no single "last" state).
    pub fn last(&self) -> ModelResult<&GdnState> {
        match self.rows.last() {
            None => Ok(&self.base),
            Some(_) if !self.path => Err(ModelError::BadCacheOp(
                "the live recurrent rows hold an uncommitted tree: compact the accepted path first"
                    .into(),
            )),
            Some(StagedRow::State(s, _)) => Ok(s),
            Some(StagedRow::Inputs(..)) => {
                if let Some(s) = self.tip.get() {
                    return Ok(s);
                }
                let all: Vec<usize> = (0..self.rows.len()).collect();
                let s = self.state_along(&all)?;
                Ok(self.tip.get_or_init(|| s))
            }
        }
    }

    pub fn base(&self) -> &GdnState {
        &self.base
    }

    /// Unsettled rows (each a full state or a row of staged inputs).
    pub fn staged_rows(&self) -> usize {
        self.rows.len()
    }

    /// How many unsettled rows hold a full state (the fused CUDA chain's staging).
    pub fn staged_full_states(&self) -> usize {
        self.rows
            .iter()
            .filter(|r| matches!(r, StagedRow::State(..)))
            .count()
    }

    /// Bytes the unsettled rows hold: full states, and each forward's inputs once (not the
    /// lazily built tip).
    pub fn staged_bytes(&self) -> usize {
        let bytes = |t: &Tensor| t.elem_count() * t.dtype().size_in_bytes();
        let mut seen: Vec<*const RowInputs> = Vec::new();
        let mut total = 0;
        for r in &self.rows {
            match r {
                StagedRow::State(s, _) => total += bytes(&s.conv) + bytes(&s.ssm),
                StagedRow::Inputs(b, _) => {
                    let p = Arc::as_ptr(b);
                    if !seen.contains(&p) {
                        seen.push(p);
                        total += b.bytes();
                    }
                }
            }
        }
        total
    }

    /// Applies a forward's staging; `path`: whether the live unsettled rows form one path
    /// from the base afterwards.
    pub(crate) fn apply(&mut self, staged: StagedState, path: bool) {
        self.tip = OnceLock::new();
        match staged {
            StagedState::Rows(r) => self
                .rows
                .extend(r.into_iter().map(|s| StagedRow::State(s, false))),
            StagedState::OwnRows(r) => self
                .rows
                .extend(r.into_iter().map(|s| StagedRow::State(s, true))),
            StagedState::Inputs(inputs) => {
                let n = inputs.len();
                let inputs = Arc::new(inputs);
                self.rows
                    .extend((0..n).map(|i| StagedRow::Inputs(inputs.clone(), i)));
            }
            StagedState::Final(s) => {
                self.base = s;
                self.rows.clear();
            }
        }
        self.path = path || self.rows.is_empty();
    }

    /// The state after the last row of `path` (rows relative to the settled row, one path
    /// from the base): from the last full state on it (or the base), the staged inputs of
    /// the rows after it run as a chain (the delta rule's [`state_along`], the conv window
    /// from their pre-conv rows). Always a tensor of its own, never a view into a forward's
    /// buffer: a full state staged as views is copied, one staged as its own buffer kept.
    fn state_along(&self, path: &[usize]) -> Result<GdnState> {
        let (mut start, mut rest) = (&self.base, path);
        for (j, &r) in path.iter().enumerate().rev() {
            if let StagedRow::State(s, own) = &self.rows[r] {
                if *own && j + 1 == path.len() {
                    return Ok(s.clone());
                }
                (start, rest) = (s, &path[j + 1..]);
                break;
            }
        }
        if rest.is_empty() {
            return Ok(GdnState {
                conv: start.conv.force_contiguous()?,
                ssm: start.ssm.force_contiguous()?,
            });
        }
        // Runs of consecutive rows of one forward, one narrow each.
        let mut runs: Vec<RowInputs> = Vec::new();
        let mut i = 0;
        while i < rest.len() {
            let StagedRow::Inputs(block, first) = &self.rows[rest[i]] else {
                candle_core::bail!("a full state after the last one on the path");
            };
            let mut n = 1;
            while i + n < rest.len() {
                match &self.rows[rest[i + n]] {
                    StagedRow::Inputs(b, r) if Arc::ptr_eq(b, block) && *r == first + n => n += 1,
                    _ => break,
                }
            }
            runs.push(block.narrow(*first, n)?);
            i += n;
        }
        let cat = |f: fn(&RowInputs) -> &Tensor| -> Result<Tensor> {
            let parts: Vec<&Tensor> = runs.iter().map(f).collect();
            Tensor::cat(&parts, 0)
        };
        let (pre, k, u, g) = (
            cat(|r| &r.pre_conv)?,
            cat(|r| &r.k)?,
            cat(|r| &r.writes)?,
            cat(|r| &r.g)?,
        );
        let ssm = rebuild_state(&start.ssm, &k, &u, &g)?;
        // The conv window after the path: its last w pre-conv rows, reaching back into the
        // start's window only when the path is shorter (one copy of w rows in the common case:
        // a commit is a launch or two per layer, and its host time adds up over 48 layers).
        let (w, n) = (start.conv.dim(0)?, pre.dim(0)?);
        let conv = if n >= w {
            pre.narrow(0, n - w, w)?.force_contiguous()?
        } else {
            let window = Tensor::cat(&[&start.conv, &pre], 0)?;
            window
                .narrow(0, window.dim(0)? - w, w)?
                .force_contiguous()?
        };
        Ok(GdnState { conv, ssm })
    }

    /// Settles on the last row of `path` (rows relative to the settled row, one path from the
    /// base; empty: keep the base) and frees every unsettled row. The state is a tensor of its
    /// own: full per-row states are views into a whole verify's buffer, which must not stay
    /// alive for one row.
    pub(crate) fn settle_on(&mut self, path: &[usize]) -> Result<()> {
        if !path.is_empty() {
            self.base = self.state_along(path)?;
        }
        self.rows.clear();
        self.path = true;
        self.tip = OnceLock::new();
        Ok(())
    }

    /// Settles every layer of `layers` on `path` in one batch on CUDA
    /// ([`crate::cuda::gdn_settle_layers`], which the caller chose:
    /// [`crate::cuda::batched_gdn_settle`]) where each layer's path is staged inputs of one
    /// forward, at the same rows for every layer (a `SplitInputs` verify), in shapes the kernels
    /// take; false (nothing changed) otherwise: the caller settles them one by one
    /// ([`Self::settle_on`]), which gives the same states.
    #[cfg(feature = "cuda")]
    pub(crate) fn settle_batched(layers: &mut [&mut Self], path: &[usize]) -> Result<bool> {
        if path.is_empty() || layers.is_empty() {
            return Ok(false);
        }
        let mut rows: Option<Vec<u32>> = None;
        let mut blocks: Vec<&RowInputs> = Vec::with_capacity(layers.len());
        for layer in layers.iter() {
            if !layer.base.ssm.device().is_cuda() {
                return Ok(false);
            }
            let mut block: Option<&Arc<RowInputs>> = None;
            let mut at = Vec::with_capacity(path.len());
            for &r in path {
                match layer.rows.get(r) {
                    Some(StagedRow::Inputs(b, i)) if block.is_none_or(|x| Arc::ptr_eq(x, b)) => {
                        block = Some(b);
                        at.push(*i as u32);
                    }
                    _ => return Ok(false),
                }
            }
            match (&rows, block) {
                (None, Some(b)) => {
                    rows = Some(at);
                    blocks.push(b.as_ref());
                }
                (Some(r), Some(b)) if *r == at => blocks.push(b.as_ref()),
                _ => return Ok(false),
            }
        }
        let Some(rows) = rows else { return Ok(false) };
        let inputs: Vec<crate::cuda::SettleLayer<'_>> = layers
            .iter()
            .zip(&blocks)
            .map(|(l, b)| crate::cuda::SettleLayer {
                ssm: &l.base.ssm,
                conv: &l.base.conv,
                k: &b.k,
                writes: &b.writes,
                g: &b.g,
                pre_conv: &b.pre_conv,
            })
            .collect();
        // Shapes, dtypes or layouts the kernels do not take settle layer by layer.
        let Some(settled) = crate::cuda::gdn_settle_layers(&inputs, &rows)? else {
            return Ok(false);
        };
        drop(inputs);
        for (layer, (conv, ssm)) in layers.iter_mut().zip(settled) {
            layer.base = GdnState { conv, ssm };
            layer.rows.clear();
            layer.path = true;
            layer.tip = OnceLock::new();
        }
        Ok(true)
    }

    /// Keeps the first `n` unsettled rows (the caller checked that they form one path).
    pub(crate) fn truncate_rows(&mut self, n: usize) {
        if n < self.rows.len() {
            self.rows.truncate(n);
            self.tip = OnceLock::new();
        }
        self.path = true;
    }
}

/// The delta-rule state after a chain of rows from `initial` (`[Hv, dk, dv]` f32), given their
/// keys per key head `k` `[m, Hk, dk]`, written values `u` `[m, Hv, dv]` and log-decays `g`
/// `[m, Hv]`. On CUDA one kernel (`gdn_state_along`: the state read and written once, the
/// fused scan's own operations, so it rebuilds that scan's states bit for bit); elsewhere the
/// matmul form [`state_along`].
fn rebuild_state(initial: &Tensor, k: &Tensor, u: &Tensor, g: &Tensor) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if initial.device().is_cuda() && [initial, k, u, g].iter().all(|t| t.dtype() == DType::F32) {
        return crate::cuda::gdn_state_along(
            &initial.contiguous()?,
            &k.contiguous()?,
            &u.contiguous()?,
            &g.contiguous()?,
        );
    }
    let (m, hk, dk) = k.dims3()?;
    let hv = u.dim(1)?;
    let k = k
        .unsqueeze(2)?
        .broadcast_as((m, hk, hv / hk, dk))?
        .reshape((m, hv, dk))?;
    state_along(initial, &k, u, g)
}

/// Which rows of a hybrid sequence can still be rolled back, and what each one's parent is.
#[derive(Debug, Clone)]
pub struct RowTracker {
    /// Largest forward (in rows) that keeps per-row states.
    pub rollback: usize,
    /// Rows `[0, settled)` are folded into the recurrent layers' base states.
    pub settled: usize,
    /// For rows `[settled, len)`: the absolute parent row, `None` for "the settled base".
    parents: Vec<Option<usize>>,
}

impl RowTracker {
    pub fn new(rollback: usize) -> Self {
        Self {
            rollback,
            settled: 0,
            parents: Vec::new(),
        }
    }

    /// The parent a row appended directly after `rows` would have.
    fn tail_parent(&self, rows: &[usize]) -> Option<usize> {
        rows.last().copied()
    }

    /// Whether `rows` (absolute, in order, all `>= settled`) form one path from the base.
    fn is_path(&self, rows: &[usize]) -> bool {
        rows.iter().enumerate().all(|(j, &r)| {
            let expected = if j == 0 { None } else { Some(rows[j - 1]) };
            self.parents[r - self.settled] == expected
        })
    }

    /// Fails unless the live unsettled rows form one path, so that the state after the last
    /// row is the state of the whole live sequence (false after an uncompacted tree forward).
    pub fn check_extendable(&self, len: usize) -> ModelResult<()> {
        let rows: Vec<usize> = (self.settled..len).collect();
        if self.is_path(&rows) {
            Ok(())
        } else {
            Err(ModelError::BadCacheOp(format!(
                "rows {}..{len} hold an uncommitted tree; compact the accepted path before the next forward",
                self.settled
            )))
        }
    }

    /// Records `t` new rows starting at `len`; `parents` are relative to the new rows (`None`
    /// for a root, which continues from row `len - 1`). Without parents the rows settle.
    pub(crate) fn record(&mut self, len: usize, t: usize, parents: Option<&[Option<usize>]>) {
        match parents {
            Some(ps) => {
                let tail = self.tail_parent(&(self.settled..len).collect::<Vec<_>>());
                self.parents
                    .extend(ps.iter().map(|p| p.map(|p| len + p).or(tail)));
            }
            None => {
                self.settled = len + t;
                self.parents.clear();
            }
        }
    }

    /// Checks that truncating to `len` keeps one path; returns how many unsettled rows stay.
    pub(crate) fn truncate(&mut self, len: usize) -> ModelResult<usize> {
        if len < self.settled {
            return Err(ModelError::BadCacheOp(format!(
                "cannot roll recurrent state back to row {len}: rows before {} were committed (or came from a forward longer than the rollback window of {} rows)",
                self.settled, self.rollback
            )));
        }
        let rows: Vec<usize> = (self.settled..len).collect();
        if !self.is_path(&rows) {
            return Err(ModelError::BadCacheOp(format!(
                "truncate to {len} cuts through a tree; use compact with the accepted path"
            )));
        }
        self.parents.truncate(len - self.settled);
        Ok(len - self.settled)
    }

    /// Checks that `[settled, start) ++ keep` is one path; returns it relative to the settled
    /// row (empty when nothing stays), and settles at `start + keep.len()`.
    pub(crate) fn compact(&mut self, start: usize, keep: &[usize]) -> ModelResult<Vec<usize>> {
        if start < self.settled {
            return Err(ModelError::BadCacheOp(format!(
                "compact from row {start}: recurrent rows before {} are already committed",
                self.settled
            )));
        }
        let path: Vec<usize> = (self.settled..start).chain(keep.iter().copied()).collect();
        if !self.is_path(&path) {
            return Err(ModelError::BadCacheOp(format!(
                "compact(start={start}, keep={keep:?}) is not one root-to-node path of the last forward"
            )));
        }
        let relative = path.iter().map(|&r| r - self.settled).collect();
        self.settled = start + keep.len();
        self.parents.clear();
        Ok(relative)
    }

    /// Whether the live rows `[settled, len)` form one path from the base.
    pub(crate) fn live_rows_are_a_path(&self, len: usize) -> bool {
        self.is_path(&(self.settled..len).collect::<Vec<_>>())
    }

    /// Settles every live row (nothing before `len` can be rolled back afterwards); returns
    /// the path from the base to the last live row, relative to the old settled row (the
    /// state the recurrent layers settle on).
    pub(crate) fn settle_all(&mut self, len: usize) -> Vec<usize> {
        let mut path = Vec::new();
        let mut node = (len > self.settled).then(|| len - 1);
        while let Some(r) = node {
            path.push(r - self.settled);
            node = self.parents[r - self.settled];
        }
        path.reverse();
        self.settled = len;
        self.parents.clear();
        path
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(v: f32) -> Result<GdnState> {
        let dev = Device::Cpu;
        Ok(GdnState {
            conv: Tensor::full(v, (3, 8), &dev)?,
            ssm: Tensor::full(v, (2, 4, 4), &dev)?,
        })
    }

    /// Settling on a staged row of its own keeps that very tensor (a decode step's commit
    /// copies nothing); a row staged as a view into a forward's buffer is copied out, equal.
    #[test]
    fn settling_keeps_own_rows_and_copies_views() -> Result<()> {
        for own in [true, false] {
            let mut layer = RecurrentLayer::new(state(0.0)?);
            let row = state(1.0)?;
            let staged = if own {
                StagedState::OwnRows(vec![row.clone()])
            } else {
                StagedState::Rows(vec![row.clone()])
            };
            layer.apply(staged, true);
            assert_eq!(
                layer.last().map_err(candle_core::Error::wrap)?.ssm.id(),
                row.ssm.id()
            );
            layer.settle_on(&[0])?;
            let base = layer.base();
            assert_eq!(base.ssm.id() == row.ssm.id(), own, "own {own}: ssm kept");
            assert_eq!(base.conv.id() == row.conv.id(), own, "own {own}: conv kept");
            let diff = (&base.ssm - &row.ssm)?
                .abs()?
                .sum_all()?
                .to_scalar::<f32>()?;
            assert_eq!(diff, 0.0);
            assert_eq!(layer.staged_rows(), 0);
        }
        Ok(())
    }

    /// A rollback to the first of two own rows settles on that row's very tensors.
    #[test]
    fn rollback_to_an_earlier_own_row_keeps_it() -> Result<()> {
        let mut layer = RecurrentLayer::new(state(0.0)?);
        let first = state(1.0)?;
        layer.apply(StagedState::OwnRows(vec![first.clone()]), true);
        layer.apply(StagedState::OwnRows(vec![state(2.0)?]), true);
        layer.settle_on(&[0])?;
        assert_eq!(layer.base().ssm.id(), first.ssm.id());
        let v = layer.base().ssm.flatten_all()?.to_vec1::<f32>()?;
        assert!(v.iter().all(|&x| x == 1.0));
        Ok(())
    }
}
