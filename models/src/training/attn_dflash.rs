//! DFlash block-sparse attention for training (flash-style): each block's queries against the
//! context strictly before its anchor plus its own block (bidirectional; for a sliding layer
//! the windowed context and a causal block), the visibility of
//! [`crate::dflash::train::training_mask`], without any score-sized tensor.
//!
//! [`dflash_attention`] is the differentiable form the trainer uses
//! (`--train-attention fused`): a candle custom op over `(q, [kc | kb], [vc | vb])` whose
//! forward saves the log-sum-exp of every query row and whose backward recomputes the
//! probabilities from it (CUDA kernels in `cuda/attn_dflash.cu`; on the CPU the f32 reference
//! of [`super::attn_dflash_ref`]). [`crate::dflash::train::composed_attention`] is the candle
//! composition (`attend` under `training_mask`, one group per sequence, as `dflash/train.rs`
//! runs it): the reference the op is checked against by the tests and `gpu_check --train`.

use std::sync::Mutex;

use candle_core::{bail, CpuStorage, CustomOp3, DType, Device, Layout, Result, Shape, Tensor};

pub use super::attn_dflash_ref::BlockSpan;
use super::attn_dflash_ref::{self as reference, AttnDims};

fn span_tensor(blocks: &[BlockSpan], device: &Device) -> Result<Tensor> {
    let flat: Vec<u32> = blocks
        .iter()
        .flat_map(|b| [b.ctx_offset, b.anchor])
        .collect();
    Tensor::from_vec(flat, (blocks.len(), 2), device)
}

/// `(out [R, H * D], lse f32 [H, R])` for the block rows' queries `q: [H, R, D]`, keys and
/// values `kb, vb: [KV, R, D]` (R = blocks x `block_size`, in block order), the context's
/// `kc, vc: [KV, C, D]`, one [`BlockSpan`] per block and `window` (`Some(W)` for a sliding
/// layer). No gradient; CUDA only (bf16 or f32, head_dim 64 or 128).
#[allow(clippy::too_many_arguments)]
pub fn dflash_attention_forward(
    q: &Tensor,
    kc: &Tensor,
    vc: &Tensor,
    kb: &Tensor,
    vb: &Tensor,
    blocks: &[BlockSpan],
    block_size: usize,
    window: Option<usize>,
) -> Result<(Tensor, Tensor)> {
    let spans = span_tensor(blocks, q.device())?;
    #[cfg(feature = "cuda")]
    if q.device().is_cuda() {
        return crate::cuda::dflash_attention_fwd(
            q,
            kc,
            vc,
            kb,
            vb,
            &spans,
            block_size,
            window.unwrap_or(0),
        );
    }
    let _ = (kc, vc, kb, vb, spans, block_size, window);
    bail!("dflash_attention_forward runs on CUDA only (the CPU trains through dflash/train.rs)")
}

/// The attention output `[R, H * D]` (layouts as [`dflash_attention_forward`]), differentiable
/// with respect to all five inputs: candle's autograd runs the fused backward. CUDA (bf16 or
/// f32, head_dim 64 or 128) or CPU (the f32 reference, for tests).
#[allow(clippy::too_many_arguments)]
pub fn dflash_attention(
    q: &Tensor,
    kc: &Tensor,
    vc: &Tensor,
    kb: &Tensor,
    vb: &Tensor,
    blocks: &[BlockSpan],
    block_size: usize,
    window: Option<usize>,
) -> Result<Tensor> {
    let ctx = kc.dim(1)?;
    let op = DFlashAttnOp::new(blocks, ctx, block_size, window, q.device())?;
    let k = Tensor::cat(&[kc, kb], 1)?.contiguous()?;
    let v = Tensor::cat(&[vc, vb], 1)?.contiguous()?;
    q.contiguous()?.apply_op3(&k, &v, op)
}

/// The DFlash attention for the explicit engine (`explicit_attn.rs`): the forward without
/// autograd (it keeps its log-sum-exp) and the backward called directly, with the context and
/// block parts of the key / value gradients split apart.
pub struct DFlashAttention {
    op: DFlashAttnOp,
}

impl DFlashAttention {
    /// `ctx` context rows in all; layouts as [`dflash_attention_forward`].
    pub fn new(
        blocks: &[BlockSpan],
        ctx: usize,
        block_size: usize,
        window: Option<usize>,
        device: &Device,
    ) -> Result<Self> {
        Ok(Self {
            op: DFlashAttnOp::new(blocks, ctx, block_size, window, device)?,
        })
    }

    /// `(out [R, H * D], k, v)`, `k` / `v` the packed `[KV, ctx + R, D]` the backward reads.
    pub fn forward(
        &self,
        q: &Tensor,
        kc: &Tensor,
        vc: &Tensor,
        kb: &Tensor,
        vb: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let k = Tensor::cat(&[kc, kb], 1)?.contiguous()?;
        let v = Tensor::cat(&[vc, vb], 1)?.contiguous()?;
        let out = q.contiguous()?.apply_op3_no_bwd(&k, &v, &self.op)?;
        Ok((out, k, v))
    }

    /// `(dq, dkc, dvc, dkb, dvb)` from `dout: [R, H * D]` (the last forward's log-sum-exp).
    pub fn backward(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        dout: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor, Tensor, Tensor)> {
        let q = q.contiguous()?;
        let (dq, dk, dv) = match self.op.bwd(&q, k, v, out, dout)? {
            (Some(dq), Some(dk), Some(dv)) => (dq, dk, dv),
            _ => bail!("dflash attention: the backward returned no gradient"),
        };
        let (c, r) = (self.op.ctx, q.dim(1)?);
        Ok((
            dq,
            dk.narrow(1, 0, c)?,
            dv.narrow(1, 0, c)?,
            dk.narrow(1, c, r)?,
            dv.narrow(1, c, r)?,
        ))
    }
}

/// Per sequence (a run of blocks with one context offset): `(context offset, first block,
/// end block)`, and for each of the `ctx` context rows the sequence it belongs to (u32::MAX
/// for rows before the first sequence's).
fn seq_tables(blocks: &[BlockSpan], ctx: usize) -> Result<(Vec<u32>, Vec<u32>)> {
    let mut seqs: Vec<[u32; 3]> = Vec::new();
    for (i, s) in blocks.iter().enumerate() {
        match seqs.last_mut() {
            Some(last) if last[0] == s.ctx_offset => last[2] = i as u32 + 1,
            _ => {
                if seqs.iter().any(|q| q[0] == s.ctx_offset) {
                    bail!("dflash attention: the blocks of one sequence must be consecutive")
                }
                seqs.push([s.ctx_offset, i as u32, i as u32 + 1]);
            }
        }
        if (s.ctx_offset + s.anchor) as usize > ctx {
            bail!("dflash attention: block {i} {s:?} reads past the {ctx} context rows")
        }
    }
    let mut order: Vec<usize> = (0..seqs.len()).collect();
    order.sort_by_key(|&i| seqs[i][0]);
    let mut ctx_seq = vec![u32::MAX; ctx];
    for (n, &i) in order.iter().enumerate() {
        let lo = seqs[i][0] as usize;
        let hi = order
            .get(n + 1)
            .map_or(ctx, |&j| seqs[j][0] as usize)
            .min(ctx);
        ctx_seq[lo..hi].fill(i as u32);
    }
    Ok((seqs.into_iter().flatten().collect(), ctx_seq))
}

/// The custom op over `(q [H, R, D], k [KV, ctx + R, D], v)` (context rows, then block rows,
/// per head). The forward keeps its log-sum-exp here for the backward.
struct DFlashAttnOp {
    blocks: Vec<BlockSpan>,
    ctx: usize,
    block_size: usize,
    window: Option<usize>,
    /// On the device: the spans, the sequence table and each context row's sequence.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    tables: Option<(Tensor, Tensor, Tensor)>,
    lse: Mutex<Option<Tensor>>,
}

impl DFlashAttnOp {
    fn new(
        blocks: &[BlockSpan],
        ctx: usize,
        block_size: usize,
        window: Option<usize>,
        device: &Device,
    ) -> Result<Self> {
        if block_size == 0 || blocks.is_empty() {
            bail!("dflash attention: no blocks (block size {block_size})")
        }
        let (seqs, ctx_seq) = seq_tables(blocks, ctx)?;
        let tables = if device.is_cuda() {
            let n = seqs.len() / 3;
            let ctx_seq = if ctx == 0 { vec![u32::MAX] } else { ctx_seq };
            Some((
                span_tensor(blocks, device)?,
                Tensor::from_vec(seqs, (n, 3), device)?,
                Tensor::new(ctx_seq.as_slice(), device)?,
            ))
        } else {
            None
        };
        Ok(Self {
            blocks: blocks.to_vec(),
            ctx,
            block_size,
            window,
            tables,
            lse: Mutex::new(None),
        })
    }

    fn dims(&self, q: &Shape, k: &Shape) -> Result<AttnDims> {
        let (heads, rows, head_dim) = q.dims3()?;
        let (kv_heads, krows, d2) = k.dims3()?;
        if d2 != head_dim || krows != self.ctx + rows || rows != self.blocks.len() * self.block_size
        {
            bail!(
                "dflash attention: q {q:?}, k {k:?} do not fit {} blocks of {} over {} context rows",
                self.blocks.len(),
                self.block_size,
                self.ctx
            )
        }
        if kv_heads == 0 || heads % kv_heads != 0 {
            bail!("dflash attention: {heads} heads over {kv_heads} kv heads")
        }
        Ok(AttnDims {
            heads,
            kv_heads,
            rows,
            ctx: self.ctx,
            head_dim,
            block_size: self.block_size,
            window: self.window,
        })
    }

    /// The forward's log-sum-exp (kept, so the graph can be differentiated more than once).
    fn saved_lse(&self) -> Result<Tensor> {
        match self.lse.lock().expect("lse lock").clone() {
            Some(l) => Ok(l),
            None => bail!("dflash attention: backward without its forward's log-sum-exp"),
        }
    }
}

fn cpu_f32(s: &CpuStorage, l: &Layout) -> Result<Vec<f32>> {
    let Some((a, b)) = l.contiguous_offsets() else {
        bail!("dflash attention: non-contiguous input")
    };
    Ok(match s {
        CpuStorage::F32(v) => v[a..b].to_vec(),
        CpuStorage::BF16(v) => v[a..b].iter().map(|x| x.to_f32()).collect(),
        _ => bail!("dflash attention: f32 or bf16 inputs"),
    })
}

/// Splits a packed `[KV, ctx + R, D]` buffer into its context and block parts.
fn unpack(x: &[f32], d: &AttnDims) -> (Vec<f32>, Vec<f32>) {
    let per = (d.ctx + d.rows) * d.head_dim;
    let cut = d.ctx * d.head_dim;
    let (mut c, mut b) = (Vec::new(), Vec::new());
    for h in x.chunks(per) {
        c.extend_from_slice(&h[..cut]);
        b.extend_from_slice(&h[cut..]);
    }
    (c, b)
}

fn pack(c: &[f32], b: &[f32], d: &AttnDims) -> Vec<f32> {
    let (cn, bn) = (d.ctx * d.head_dim, d.rows * d.head_dim);
    let mut out = Vec::with_capacity(c.len() + b.len());
    for h in 0..d.kv_heads {
        out.extend_from_slice(&c[h * cn..(h + 1) * cn]);
        out.extend_from_slice(&b[h * bn..(h + 1) * bn]);
    }
    out
}

fn flat_f32(t: &Tensor) -> Result<Vec<f32>> {
    t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()
}

impl CustomOp3 for DFlashAttnOp {
    fn name(&self) -> &'static str {
        "dflash-attention"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let d = self.dims(l1.shape(), l2.shape())?;
        let q = cpu_f32(s1, l1)?;
        let (kc, kb) = unpack(&cpu_f32(s2, l2)?, &d);
        let (vc, vb) = unpack(&cpu_f32(s3, l3)?, &d);
        let (out, lse) = reference::forward(d, &q, &kc, &vc, &kb, &vb, &self.blocks);
        *self.lse.lock().expect("lse lock") =
            Some(Tensor::from_vec(lse, (d.heads, d.rows), &Device::Cpu)?);
        let shape = Shape::from((d.rows, d.heads * d.head_dim));
        Ok(match s1 {
            CpuStorage::BF16(_) => (
                CpuStorage::BF16(out.into_iter().map(half::bf16::from_f32).collect()),
                shape,
            ),
            _ => (CpuStorage::F32(out), shape),
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let d = self.dims(l1.shape(), l2.shape())?;
        let Some((spans, _, _)) = &self.tables else {
            bail!("dflash attention: op built for the CPU ran on CUDA")
        };
        let (out, lse) = crate::cuda::dflash_attention_fwd_packed(
            (s1, l1),
            (s2, l2),
            (s3, l3),
            spans,
            self.ctx,
            self.block_size,
            self.window.unwrap_or(0),
        )?;
        *self.lse.lock().expect("lse lock") = Some(lse);
        Ok((out, Shape::from((d.rows, d.heads * d.head_dim))))
    }

    fn bwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        dout: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let d = self.dims(q.shape(), k.shape())?;
        let lse = self.saved_lse()?;
        let dout = dout.to_dtype(q.dtype())?.contiguous()?;
        #[cfg(feature = "cuda")]
        if let Some((spans, seqs, ctx_seq)) = &self.tables {
            let (dq, dk, dv) = crate::cuda::dflash_attention_bwd_packed(
                q,
                k,
                v,
                &out.contiguous()?,
                &dout,
                &lse,
                spans,
                seqs,
                ctx_seq,
                self.ctx,
                self.block_size,
                self.window.unwrap_or(0),
            )?;
            return Ok((Some(dq), Some(dk), Some(dv)));
        }
        let (kc, kb) = unpack(&flat_f32(k)?, &d);
        let (vc, vb) = unpack(&flat_f32(v)?, &d);
        let g = reference::backward(
            d,
            &flat_f32(q)?,
            &kc,
            &vc,
            &kb,
            &vb,
            &self.blocks,
            &flat_f32(out)?,
            &flat_f32(&dout)?,
            &flat_f32(&lse)?,
        );
        let dev = q.device();
        let dq = Tensor::from_vec(g.dq, q.shape().clone(), dev)?.to_dtype(q.dtype())?;
        let dk = Tensor::from_vec(pack(&g.dkc, &g.dkb, &d), k.shape().clone(), dev)?
            .to_dtype(k.dtype())?;
        let dv = Tensor::from_vec(pack(&g.dvc, &g.dvb, &d), v.shape().clone(), dev)?
            .to_dtype(v.dtype())?;
        Ok((Some(dq), Some(dk), Some(dv)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sequence_tables_cover_each_context_row_once() {
        let spans = [(0, 3), (0, 5), (5, 2), (5, 7), (12, 1)].map(|(o, a)| BlockSpan {
            ctx_offset: o,
            anchor: a,
        });
        let (seqs, ctx_seq) = seq_tables(&spans, 14).unwrap();
        assert_eq!(seqs, vec![0, 0, 2, 5, 2, 4, 12, 4, 5]);
        let want: Vec<u32> = [vec![0; 5], vec![1; 7], vec![2; 2]].concat();
        assert_eq!(ctx_seq, want);
        let split = [(0, 3), (5, 2), (0, 4)].map(|(o, a)| BlockSpan {
            ctx_offset: o,
            anchor: a,
        });
        assert!(seq_tables(&split, 14).is_err());
    }
}
