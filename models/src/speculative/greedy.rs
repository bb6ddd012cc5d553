//! Greedy selection over logit rows: each row's argmax (the first column among equal maxima,
//! as [`crate::speculative::argmax`] on the host) and its log-probability, for the engine's greedy
//! verification and the chain's drafts. On CUDA one kernel pair does it (`cuda::argmax_logprob`,
//! ~100x faster than candle's one-block-per-row argmax on a 151,936-column row) and one packed
//! copy brings every row's pair to the host; elsewhere the rows are copied and scanned.

use candle_core::{DType, Tensor};

use crate::error::ModelResult;
use crate::speculative::sampling::argmax;

/// `logits: [rows, vocab]` (a view of a bigger tensor, often) as f32 host rows, copying only
/// the view's rows. candle's `to_vec*` on a CUDA tensor brings the whole underlying buffer to
/// the host and picks the view's elements there (and `copy()` clones the whole buffer): the
/// one row sampling a finished prompt's first token, narrowed out of a mixed step's
/// [641, 151936] f32 logits, copied all 390 MB, ~300 ms a step on an H100 VM (s18-server,
/// `callE-h100`). `force_contiguous` copies the view alone on the device first.
pub fn host_rows(logits: &Tensor) -> ModelResult<Vec<Vec<f32>>> {
    Ok(view_f32(logits)?.to_vec2::<f32>()?)
}

/// One row `[vocab]` (a view, often) on the host: [`host_rows`] for a vector.
pub fn host_row_f32(row: &Tensor) -> ModelResult<Vec<f32>> {
    Ok(view_f32(row)?.to_vec1::<f32>()?)
}

/// `t` in f32 in a storage of its own size (on CUDA; the CPU reads views in place).
fn view_f32(t: &Tensor) -> ModelResult<Tensor> {
    let own = if t.device().is_cpu() {
        t.clone()
    } else {
        t.force_contiguous()?
    };
    Ok(own.to_dtype(DType::F32)?)
}

/// The argmax column of each row of `logits: [rows, vocab]` (0 for a row without a finite
/// entry, as [`argmax`]).
pub fn row_argmax(logits: &Tensor) -> ModelResult<Vec<u32>> {
    if logits.device().is_cpu() {
        // The host needs no log-sum-exp pass for the column alone.
        let rows = logits.to_dtype(DType::F32)?.to_vec2::<f32>()?;
        return Ok(rows.iter().map(|r| argmax(r)).collect());
    }
    Ok(row_argmax_logprob(logits)?
        .into_iter()
        .map(|p| p.0)
        .collect())
}

/// `(column, log-prob)` of each row of `logits: [rows, vocab]`. A row without a finite entry
/// gives column 0 (as [`argmax`]) and log-prob -inf.
pub fn row_argmax_logprob(logits: &Tensor) -> ModelResult<Vec<(u32, f32)>> {
    if logits.dim(0)? == 0 {
        return Ok(Vec::new());
    }
    #[cfg(feature = "cuda")]
    if logits.device().is_cuda() {
        // bf16 logits are read as they are (no f32 copy of the whole matrix).
        let x = match logits.dtype() {
            DType::F32 | DType::BF16 => logits.contiguous()?,
            _ => logits.to_dtype(DType::F32)?.contiguous()?,
        };
        let packed = crate::cuda::argmax_logprob(&x)?
            .flatten_all()?
            .to_vec1::<u32>()?;
        return Ok(packed
            .chunks_exact(2)
            .map(|p| {
                let col = if p[0] == u32::MAX { 0 } else { p[0] };
                (col, f32::from_bits(p[1]))
            })
            .collect());
    }
    let rows = logits.to_dtype(DType::F32)?.to_vec2::<f32>()?;
    Ok(rows.iter().map(|r| host_row(r)).collect())
}

/// The host's pair for one row: [`argmax`] and `x[col] - logsumexp(x)` (f64 sum).
fn host_row(row: &[f32]) -> (u32, f32) {
    let col = argmax(row);
    let max = row.get(col as usize).copied().unwrap_or(f32::NEG_INFINITY);
    // NaN or -inf: nothing finite in the row.
    if max.is_nan() || max == f32::NEG_INFINITY {
        return (col, f32::NEG_INFINITY);
    }
    let sum: f64 = row
        .iter()
        .filter(|x| **x > f32::NEG_INFINITY)
        .map(|&x| f64::from((x - max).exp()))
        .sum();
    (col, (-sum.ln()) as f32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn first_maximum_wins_and_its_log_prob_matches_log_softmax() {
        let rows = vec![
            vec![0.5f32, 2.0, -1.0, 2.0],           // tie: the first 2.0
            vec![f32::NEG_INFINITY, 1.0, 1.0, 0.0], // -inf has probability 0
            vec![3.0, f32::NAN, 1.0, 2.0],          // NaN is skipped, as by argmax()
            vec![f32::NEG_INFINITY; 4],             // nothing finite
        ];
        let flat: Vec<f32> = rows.concat();
        let t = Tensor::from_vec(flat, (4, 4), &Device::Cpu).unwrap();
        let got = row_argmax_logprob(&t).unwrap();
        assert_eq!(
            got.iter().map(|p| p.0).collect::<Vec<_>>(),
            vec![1, 1, 0, 0]
        );
        assert_eq!(row_argmax(&t).unwrap(), vec![1, 1, 0, 0]);
        let lse = |r: &[f32], m: f32| {
            m + r
                .iter()
                .filter(|x| x.is_finite())
                .map(|x| (x - m).exp())
                .sum::<f32>()
                .ln()
        };
        assert!((got[0].1 - (2.0 - lse(&rows[0], 2.0))).abs() < 1e-6);
        assert!((got[1].1 - (1.0 - lse(&rows[1], 1.0))).abs() < 1e-6);
        assert!((got[2].1 - (3.0 - lse(&rows[2], 3.0))).abs() < 1e-6);
        assert_eq!(got[3].1, f32::NEG_INFINITY);
    }

    #[test]
    fn bf16_logits_are_read_as_f32() {
        let t = Tensor::new(&[[1.0f32, 4.0, 4.0], [9.0, 0.0, 1.0]], &Device::Cpu)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap();
        assert_eq!(row_argmax_logprob(&t).unwrap()[0].0, 1);
        assert_eq!(row_argmax(&t).unwrap(), vec![1, 0]);
    }
}
