//! Fused linear + cross-entropy over a frozen head: `CE(hidden · headᵀ, labels)` per row,
//! with the argmax, without the full `[rows, vocab]` logits tensor and without a gradient for
//! the head.
//!
//! The rows go in chunks of at most [`CHUNK_ELEMENTS`] logits. Per chunk: one GEMM to the
//! logits (in the head's dtype, f32 accumulation), one row pass that computes the
//! log-sum-exp, the cross-entropy and the argmax and turns the logits into their gradient
//! `softmax - onehot(label)` in place (`cuda/linear_ce.cu` on the GPU; [`ce_rows_host`], the
//! reference, on the CPU), and one GEMM `dlogits · head` to the per-row gradient of the
//! hidden states. Only that `[rows, hidden]` gradient is kept for backward; the loss weights
//! (`w_r / Σw` of the decayed objective, or anything else) arrive as the backward's incoming
//! gradient and scale it row by row, so nothing is recomputed and the head gets no gradient
//! by construction (candle's `Matmul` backward would compute the head's, ~9.6 TFLOP per step at
//! the recipe's 512 anchors).
//!
//! Gradient precision: with bf16 compute the gradient of the logits is rounded to bf16
//! before the second GEMM, as candle's composition rounds it (there after the loss weight,
//! here before it; the weight is a per-row scale, so the two differ by bf16 rounding only).

use candle_core::{CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};

/// Most logits one chunk holds (128 M: 256 MB in bf16, ~880 rows of a 151,936 vocabulary).
pub const CHUNK_ELEMENTS: usize = 1 << 27;

/// Per-row results of [`linear_cross_entropy`].
#[derive(Debug, Clone)]
pub struct LinearCe {
    /// f32 `[rows]`: `logsumexp(logits_r) - logits_r[label_r]`, differentiable with respect
    /// to `hidden` (not to the head).
    pub loss: Tensor,
    /// u32 `[rows]`: the argmax of each row's logits (the lowest column among equal maxima).
    pub argmax: Tensor,
}

/// The cross-entropy of `logits = hidden · headᵀ` against u32 `labels` per row, for
/// `hidden: [rows, h]` and a frozen `head: [vocab, h]` of the same dtype (bf16 or f32). The
/// gradient of the hidden states is computed here when `hidden` is tracked by autograd.
pub fn linear_cross_entropy(hidden: &Tensor, head: &Tensor, labels: &Tensor) -> Result<LinearCe> {
    let vocab = head.dims2()?.0.max(1);
    linear_cross_entropy_in_chunks(hidden, head, labels, (CHUNK_ELEMENTS / vocab).max(1))
}

/// [`linear_cross_entropy`] with at most `chunk` rows per chunk.
pub fn linear_cross_entropy_in_chunks(
    hidden: &Tensor,
    head: &Tensor,
    labels: &Tensor,
    chunk: usize,
) -> Result<LinearCe> {
    let (rows, h) = hidden.dims2()?;
    let h2 = head.dims2()?.1;
    if h != h2 || hidden.dtype() != head.dtype() || labels.dims1()? != rows {
        candle_core::bail!(
            "linear_cross_entropy: hidden {:?} {:?}, head {:?} {:?}, labels {:?} do not fit",
            hidden.dtype(),
            hidden.shape(),
            head.dtype(),
            head.shape(),
            labels.shape()
        )
    }
    if rows == 0 {
        let dev = hidden.device();
        return Ok(LinearCe {
            loss: Tensor::zeros(0, DType::F32, dev)?,
            argmax: Tensor::zeros(0, DType::U32, dev)?,
        });
    }
    let labels = labels.to_dtype(DType::U32)?.contiguous()?;
    let with_grad = hidden.track_op();
    let x = hidden.detach();
    let head_t = head.t()?;
    let chunk = chunk.max(1);
    let mut stats = Vec::with_capacity(rows.div_ceil(chunk));
    let mut grads = Vec::new();
    for r0 in (0..rows).step_by(chunk) {
        let n = chunk.min(rows - r0);
        let logits = x.narrow(0, r0, n)?.matmul(&head_t)?.contiguous()?;
        let lab = labels.narrow(0, r0, n)?;
        let (st, dlogits) = ce_rows(logits, &lab)?;
        if with_grad {
            grads.push(dlogits.matmul(head)?);
        }
        stats.push(st);
    }
    let stats = if stats.len() == 1 {
        stats.pop().expect("one chunk")
    } else {
        Tensor::cat(&stats, 0)?
    };
    let out = if with_grad {
        let grad = if grads.len() == 1 {
            grads.pop().expect("one chunk")
        } else {
            Tensor::cat(&grads, 0)?
        };
        hidden.apply_op1(AttachGrad {
            value: stats.clone(),
            grad,
        })?
    } else {
        stats.clone()
    };
    Ok(LinearCe {
        loss: out.narrow(1, 0, 1)?.squeeze(1)?,
        argmax: stats.narrow(1, 1, 1)?.squeeze(1)?.to_dtype(DType::U32)?,
    })
}

/// The row pass of one chunk: `([n, 2]` f32 (cross-entropy, argmax), the gradient of the
/// logits`)`. On CUDA the logits buffer becomes the gradient.
fn ce_rows(logits: Tensor, labels: &Tensor) -> Result<(Tensor, Tensor)> {
    #[cfg(feature = "cuda")]
    if logits.device().is_cuda() {
        let stats = crate::cuda::ce_rows_in_place(&logits, labels)?;
        return Ok((stats, logits));
    }
    let (n, vocab) = logits.dims2()?;
    let dtype = logits.dtype();
    let mut x = logits
        .to_dtype(DType::F32)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    let lab = labels.to_vec1::<u32>()?;
    let stats = ce_rows_host(&mut x, vocab, &lab);
    let dev = logits.device();
    Ok((
        Tensor::from_vec(stats, (n, 2), dev)?,
        Tensor::from_vec(x, (n, vocab), dev)?.to_dtype(dtype)?,
    ))
}

/// The reference row pass: for each row of `x` (`vocab` wide) returns `lse - x[label]` and
/// the argmax (as f32), and overwrites the row with `softmax - onehot(label)`. f32 throughout,
/// the max-subtracted log-sum-exp summed in order.
pub fn ce_rows_host(x: &mut [f32], vocab: usize, labels: &[u32]) -> Vec<f32> {
    let mut stats = Vec::with_capacity(labels.len() * 2);
    for (row, &label) in x.chunks_mut(vocab).zip(labels) {
        let (mut m, mut arg) = (f32::NEG_INFINITY, 0usize);
        for (j, &v) in row.iter().enumerate() {
            if v > m || v.is_nan() && !m.is_nan() {
                m = v;
                arg = j;
            }
        }
        let s: f32 = row.iter().map(|&v| (v - m).exp()).sum();
        let lse = m + s.ln();
        let picked = row.get(label as usize).copied().unwrap_or(f32::NAN);
        stats.push(lse - picked);
        stats.push(arg as f32);
        for (j, v) in row.iter_mut().enumerate() {
            let p = (*v - lse).exp();
            *v = if j == label as usize { p - 1.0 } else { p };
        }
    }
    stats
}

/// Gives the precomputed `[rows, 2]` results a backward: the incoming gradient's first column
/// (the weight of each row's cross-entropy) scales the precomputed gradient of that row.
struct AttachGrad {
    value: Tensor,
    /// `[rows, h]`: d CE_r / d hidden_r, unscaled.
    grad: Tensor,
}

impl CustomOp1 for AttachGrad {
    fn name(&self) -> &'static str {
        "linear-cross-entropy"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        let v = self.value.flatten_all()?.to_vec1::<f32>()?;
        Ok((CpuStorage::F32(v), self.value.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let (st, layout) = self.value.storage_and_layout();
        let candle_core::Storage::Cuda(cs) = &*st else {
            candle_core::bail!("linear-cross-entropy: results are not on the GPU")
        };
        Ok((cs.try_clone(layout)?, self.value.shape().clone()))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad_res: &Tensor) -> Result<Option<Tensor>> {
        let scale = grad_res.narrow(1, 0, 1)?.to_dtype(DType::F32)?;
        let g = self.grad.to_dtype(DType::F32)?.broadcast_mul(&scale)?;
        Ok(Some(g.to_dtype(arg.dtype())?))
    }
}

#[cfg(test)]
mod tests;
