//! Recurrent (Gated DeltaNet) layer state and the row bookkeeping that lets it roll back.
//!
//! A GDN layer's state after row r depends on every row before it and is overwritten by each
//! new token, so it cannot be truncated like K/V. Instead a forward that may be rolled back (a
//! chain or tree verify, at most `rollback` rows) keeps the state *after every new row*,
//! computed from that row's parent (tree nodes start from their parent's state, not from the
//! previous node in flattened order). Those per-row states are views into the forward's own
//! buffers, so keeping them costs no copy. `truncate` and `compact` then pick the state of the
//! last surviving row; `compact` (the engine's commit) folds it into the settled base state and
//! frees the rest, so rejected branches neither leak into the state nor stay in memory.
//! Forwards longer than `rollback` (prefill) keep only their final state and settle at once.

use candle_core::{DType, Device, Result, Tensor};

use crate::error::{ModelError, ModelResult};

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

/// What a forward leaves for one recurrent layer, applied only once every layer succeeded.
#[derive(Debug)]
pub enum StagedState {
    /// The state after each new row (rows may be rolled back later).
    Rows(Vec<GdnState>),
    /// Only the state after the last new row (the forward settles the cache).
    Final(GdnState),
}

#[derive(Debug, Clone)]
pub struct RecurrentLayer {
    /// State after the first `settled` rows of the sequence.
    base: GdnState,
    /// State after each row in `[settled, len)`.
    rows: Vec<GdnState>,
}

impl RecurrentLayer {
    pub fn new(base: GdnState) -> Self {
        Self {
            base,
            rows: Vec::new(),
        }
    }

    /// The state after the last live row (what a forward continues from).
    pub fn last(&self) -> &GdnState {
        self.rows.last().unwrap_or(&self.base)
    }

    pub fn base(&self) -> &GdnState {
        &self.base
    }

    pub(crate) fn apply(&mut self, staged: StagedState) {
        match staged {
            StagedState::Rows(r) => self.rows.extend(r),
            StagedState::Final(s) => {
                self.base = s;
                self.rows.clear();
            }
        }
    }

    /// Settles on `rows[i]` (relative to the settled row), or keeps the base for `None`. The
    /// state is copied out: the per-row states are views into a whole verify level's buffer,
    /// which must not stay alive for one row.
    pub(crate) fn settle_on(&mut self, keep_last: Option<usize>) -> Result<()> {
        if let Some(i) = keep_last {
            let row = &self.rows[i];
            self.base = GdnState {
                conv: row.conv.copy()?,
                ssm: row.ssm.copy()?,
            };
        }
        self.rows.clear();
        Ok(())
    }

    pub(crate) fn truncate_rows(&mut self, n: usize) {
        self.rows.truncate(n);
    }
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

    /// Checks that `[settled, start) ++ keep` is one path; returns the relative index of its
    /// last row (`None` when the path is empty), and settles at `start + keep.len()`.
    pub(crate) fn compact(&mut self, start: usize, keep: &[usize]) -> ModelResult<Option<usize>> {
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
        let last = path.last().map(|&r| r - self.settled);
        self.settled = start + keep.len();
        self.parents.clear();
        Ok(last)
    }

    /// Settles every live row (nothing before `len` can be rolled back afterwards).
    pub(crate) fn settle_all(&mut self, len: usize) -> Option<usize> {
        let last = (len > self.settled).then(|| len - 1 - self.settled);
        self.settled = len;
        self.parents.clear();
        last
    }
}
