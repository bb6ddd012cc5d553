//! CPU reference of the DFlash training attention, forward and backward, in f32 with the
//! layouts of the CUDA kernels (`cuda/attn_dflash.cu`): q `[H, R, D]`, the block rows' keys and
//! values `kb, vb: [KV, R, D]`, the context's `kc, vc: [KV, C, D]`, out `[R, H * D]`, the
//! log-sum-exp `[H, R]`. Query `(b, k)` (row `b * B + k`) sees the context rows
//! `lo .. anchor` of its sequence (`lo = 0`, or `anchor + k + 1 - W` clamped at 0 in a sliding
//! layer of window `W`) and its own block's rows `0 ..= last` (`last = B - 1`, or `k` in a
//! sliding layer): [`crate::dflash::train::training_mask`]'s visibility. Heads
//! `kv * (H / KV) .. (kv + 1) * (H / KV)` share KV head `kv`.
//!
//! The backward recomputes the probabilities from the saved log-sum-exp, as the kernels do:
//! `p = exp(s - lse)`, `dp = dout . v`, `ds = p (dp - Δ)` with `Δ = rowsum(dout * out)`;
//! `dq = scale Σ ds k`, `dk = scale Σ ds q`, `dv = Σ p dout`, the sums over every query row
//! (and every head of the group) that sees the key. Used by the tests here, by the CPU side of
//! [`super::attn_dflash::dflash_attention`] and as the reference of `gpu_check --train`.

/// One block of the batch: where its sequence's context rows start in the context buffer,
/// and its anchor (the context rows it sees are `ctx_offset .. ctx_offset + anchor`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockSpan {
    pub ctx_offset: u32,
    pub anchor: u32,
}

/// Sizes of one attention call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttnDims {
    pub heads: usize,
    pub kv_heads: usize,
    /// Block rows, `blocks * block_size`.
    pub rows: usize,
    /// Context rows of every sequence together.
    pub ctx: usize,
    pub head_dim: usize,
    pub block_size: usize,
    /// `Some(W)` for a sliding layer.
    pub window: Option<usize>,
}

/// Gradients of the five inputs, in their layouts.
#[derive(Debug, Clone, PartialEq)]
pub struct AttnGrads {
    pub dq: Vec<f32>,
    pub dkc: Vec<f32>,
    pub dvc: Vec<f32>,
    pub dkb: Vec<f32>,
    pub dvb: Vec<f32>,
}

/// A key row that a query sees: a context row or a block row (indices into the buffers).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Key {
    Ctx(usize),
    Block(usize),
}

impl AttnDims {
    fn scale(&self) -> f32 {
        1.0 / (self.head_dim as f32).sqrt()
    }

    /// The keys query row `row` sees, in the kernels' order.
    fn keys(&self, blocks: &[BlockSpan], row: usize) -> Vec<Key> {
        let (b, k) = (row / self.block_size, row % self.block_size);
        let s = blocks[b];
        let (off, a) = (s.ctx_offset as usize, s.anchor as usize);
        let lo = match self.window {
            Some(w) => (a + k + 1).saturating_sub(w),
            None => 0,
        };
        let last = if self.window.is_some() {
            k
        } else {
            self.block_size - 1
        };
        let ctx = (lo..a).map(|j| Key::Ctx(off + j));
        let blk = (0..=last).map(|j| Key::Block(b * self.block_size + j));
        ctx.chain(blk).collect()
    }

    fn check(&self, blocks: &[BlockSpan], lens: [usize; 5]) {
        let (h, kv, r, c, d) = (
            self.heads,
            self.kv_heads,
            self.rows,
            self.ctx,
            self.head_dim,
        );
        assert!(kv > 0 && h % kv == 0, "heads {h} over kv heads {kv}");
        assert_eq!(r, blocks.len() * self.block_size, "rows vs blocks");
        assert_eq!(
            lens,
            [h * r * d, kv * c * d, kv * c * d, kv * r * d, kv * r * d]
        );
        for s in blocks {
            assert!(
                (s.ctx_offset + s.anchor) as usize <= c,
                "block {s:?} past the context"
            );
        }
    }
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Slices of one head's row in the five inputs.
struct Inputs<'a> {
    dims: AttnDims,
    q: &'a [f32],
    kc: &'a [f32],
    vc: &'a [f32],
    kb: &'a [f32],
    vb: &'a [f32],
}

impl Inputs<'_> {
    fn q(&self, h: usize, row: usize) -> &[f32] {
        let d = self.dims.head_dim;
        &self.q[(h * self.dims.rows + row) * d..][..d]
    }

    /// (key, value) rows of `key` for KV head `kv`.
    fn kv(&self, kv: usize, key: Key) -> (&[f32], &[f32]) {
        let d = self.dims.head_dim;
        let (k, v, i) = match key {
            Key::Ctx(j) => (self.kc, self.vc, kv * self.dims.ctx + j),
            Key::Block(j) => (self.kb, self.vb, kv * self.dims.rows + j),
        };
        (&k[i * d..][..d], &v[i * d..][..d])
    }
}

/// `(out [R, H * D], lse [H, R])`.
#[allow(clippy::too_many_arguments)]
pub fn forward(
    dims: AttnDims,
    q: &[f32],
    kc: &[f32],
    vc: &[f32],
    kb: &[f32],
    vb: &[f32],
    blocks: &[BlockSpan],
) -> (Vec<f32>, Vec<f32>) {
    dims.check(blocks, [q.len(), kc.len(), vc.len(), kb.len(), vb.len()]);
    let x = Inputs {
        dims,
        q,
        kc,
        vc,
        kb,
        vb,
    };
    let (h_n, r_n, d) = (dims.heads, dims.rows, dims.head_dim);
    let groups = h_n / dims.kv_heads;
    let scale = dims.scale();
    let mut out = vec![0f32; r_n * h_n * d];
    let mut lse = vec![0f32; h_n * r_n];
    for row in 0..r_n {
        let keys = dims.keys(blocks, row);
        for h in 0..h_n {
            let qr = x.q(h, row);
            let s: Vec<f32> = keys
                .iter()
                .map(|&key| dot(qr, x.kv(h / groups, key).0) * scale)
                .collect();
            let m = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let l: f32 = s.iter().map(|&v| (v - m).exp()).sum();
            let o = &mut out[row * h_n * d + h * d..][..d];
            for (&key, &sv) in keys.iter().zip(&s) {
                let p = (sv - m).exp() / l;
                for (oe, ve) in o.iter_mut().zip(x.kv(h / groups, key).1) {
                    *oe += p * ve;
                }
            }
            lse[h * r_n + row] = m + l.ln();
        }
    }
    (out, lse)
}

/// The gradients of the five inputs for the output gradient `dout [R, H * D]`, given the
/// forward's `out` and `lse`.
#[allow(clippy::too_many_arguments)]
pub fn backward(
    dims: AttnDims,
    q: &[f32],
    kc: &[f32],
    vc: &[f32],
    kb: &[f32],
    vb: &[f32],
    blocks: &[BlockSpan],
    out: &[f32],
    dout: &[f32],
    lse: &[f32],
) -> AttnGrads {
    dims.check(blocks, [q.len(), kc.len(), vc.len(), kb.len(), vb.len()]);
    let x = Inputs {
        dims,
        q,
        kc,
        vc,
        kb,
        vb,
    };
    let (h_n, r_n, d) = (dims.heads, dims.rows, dims.head_dim);
    let groups = h_n / dims.kv_heads;
    let scale = dims.scale();
    let mut g = AttnGrads {
        dq: vec![0f32; q.len()],
        dkc: vec![0f32; kc.len()],
        dvc: vec![0f32; vc.len()],
        dkb: vec![0f32; kb.len()],
        dvb: vec![0f32; vb.len()],
    };
    for row in 0..r_n {
        let keys = dims.keys(blocks, row);
        for h in 0..h_n {
            let kv = h / groups;
            let qr = x.q(h, row);
            let dor = &dout[row * h_n * d + h * d..][..d];
            let delta = dot(dor, &out[row * h_n * d + h * d..][..d]);
            let l = lse[h * r_n + row];
            let mut dq = vec![0f32; d];
            for &key in &keys {
                let (kr, vr) = x.kv(kv, key);
                let p = (dot(qr, kr) * scale - l).exp();
                let ds = p * (dot(dor, vr) - delta);
                let (dk, dv) = match key {
                    Key::Ctx(j) => {
                        let i = (kv * dims.ctx + j) * d;
                        (&mut g.dkc[i..i + d], &mut g.dvc[i..i + d])
                    }
                    Key::Block(j) => {
                        let i = (kv * r_n + j) * d;
                        (&mut g.dkb[i..i + d], &mut g.dvb[i..i + d])
                    }
                };
                for e in 0..d {
                    dq[e] += ds * kr[e] * scale;
                    dk[e] += ds * qr[e] * scale;
                    dv[e] += p * dor[e];
                }
            }
            g.dq[(h * r_n + row) * d..][..d].copy_from_slice(&dq);
        }
    }
    g
}

#[cfg(test)]
mod tests;
