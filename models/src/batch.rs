//! The batch types every target's forward shares (the dense Qwen3 model, the hybrids, their
//! fused CUDA paths and the speculative engine that drives them): one sequence's part of a
//! batched forward ([`SeqForward`]), what a forward returns ([`ForwardOutput`]), the batch laid
//! end to end ([`StackedBatch`]) and the contract every forward checks ([`check_batch`]).

use candle_core::Tensor;

use crate::cache::SequenceCache;
use crate::error::{ModelError, ModelResult};
use crate::layers::attention::AttnPattern;

/// One sequence's part of a batched forward.
pub struct SeqForward<'a> {
    pub cache: &'a mut SequenceCache,
    pub tokens: &'a [u32],
    /// Absolute position of each token (tree nodes at equal depth share one).
    pub positions: &'a [u32],
    pub pattern: &'a AttnPattern,
    /// Indices into `tokens` whose logits are wanted, in output order.
    pub logit_rows: &'a [usize],
}

#[derive(Debug)]
pub struct ForwardOutput {
    /// `[Σ logit_rows, vocab]` in f32, sequences in batch order.
    pub logits: Option<Tensor>,
    /// `[Σ tokens, taps.len() * hidden]`: the requested layers' outputs, concatenated in the
    /// order asked (the layout DFlash's `fc` expects).
    pub taps: Option<Tensor>,
    /// Start of each sequence's tokens in the flattened rows (`len = batch + 1`).
    pub token_offsets: Vec<usize>,
    /// Start of each sequence's logit rows (`len = batch + 1`).
    pub logit_offsets: Vec<usize>,
}

impl ForwardOutput {
    /// Splits the output of a batch into that of its first `k` sequences and that of the
    /// rest, each laid out as if its sequences had been forwarded alone.
    pub fn split_at(self, k: usize) -> ModelResult<(ForwardOutput, ForwardOutput)> {
        let seqs = self.token_offsets.len().saturating_sub(1);
        if k > seqs || self.logit_offsets.len() != seqs + 1 {
            return Err(ModelError::BadInput(format!(
                "split of a forward of {seqs} sequences at {k}"
            )));
        }
        let (t, l) = (self.token_offsets[k], self.logit_offsets[k]);
        let part =
            |x: &Option<Tensor>, at: usize| -> ModelResult<(Option<Tensor>, Option<Tensor>)> {
                let Some(x) = x else { return Ok((None, None)) };
                let rows = x.dim(0)?;
                let head = (at > 0).then(|| x.narrow(0, 0, at)).transpose()?;
                let tail = (at < rows)
                    .then(|| x.narrow(0, at, rows - at))
                    .transpose()?;
                Ok((head, tail))
            };
        let (logits_a, logits_b) = part(&self.logits, l)?;
        let (taps_a, taps_b) = part(&self.taps, t)?;
        let rebase = |xs: &[usize], by: usize| xs.iter().map(|&x| x - by).collect::<Vec<_>>();
        Ok((
            ForwardOutput {
                logits: logits_a,
                taps: taps_a,
                token_offsets: self.token_offsets[..=k].to_vec(),
                logit_offsets: self.logit_offsets[..=k].to_vec(),
            },
            ForwardOutput {
                logits: logits_b,
                taps: taps_b,
                token_offsets: rebase(&self.token_offsets[k..], t),
                logit_offsets: rebase(&self.logit_offsets[k..], l),
            },
        ))
    }
}

/// A batch's sequences laid end to end: the stacked tokens, positions and logit rows, and
/// where each sequence starts (`token_offsets`, `logit_offsets`, one entry more than
/// sequences), as every forward (plain, fused, hybrid) needs them.
pub(crate) struct StackedBatch {
    pub tokens: Vec<u32>,
    pub positions: Vec<u32>,
    /// Logit rows as indices into the stacked tokens.
    pub logit_rows: Vec<u32>,
    pub token_offsets: Vec<usize>,
    pub logit_offsets: Vec<usize>,
}

impl StackedBatch {
    pub(crate) fn new(batch: &[SeqForward<'_>]) -> Self {
        let mut st = StackedBatch {
            tokens: Vec::new(),
            positions: Vec::new(),
            logit_rows: Vec::new(),
            token_offsets: vec![0],
            logit_offsets: vec![0],
        };
        for seq in batch {
            let off = st.tokens.len();
            st.tokens.extend_from_slice(seq.tokens);
            st.positions.extend_from_slice(seq.positions);
            st.logit_rows
                .extend(seq.logit_rows.iter().map(|&r| (off + r) as u32));
            st.token_offsets.push(st.tokens.len());
            st.logit_offsets.push(st.logit_rows.len());
        }
        st
    }
}

/// The forward contract both target families share: non-empty sequences, positions and logit
/// rows in range, causal or tree patterns, room in each cache, tap layers that exist.
pub(crate) fn check_batch(
    batch: &[SeqForward<'_>],
    taps: &[usize],
    num_layers: usize,
    vocab_size: usize,
    max_positions: usize,
) -> ModelResult<()> {
    if batch.is_empty() {
        return Err(ModelError::BadInput("empty batch".into()));
    }
    if let Some(&bad) = taps.iter().find(|&&l| l >= num_layers) {
        return Err(ModelError::BadInput(format!(
            "tap layer {bad} but the model has {} layers",
            num_layers
        )));
    }
    for (s, seq) in batch.iter().enumerate() {
        let t = seq.tokens.len();
        if t == 0 {
            return Err(ModelError::BadInput(format!(
                "sequence {s} has no new tokens"
            )));
        }
        if seq.positions.len() != t {
            return Err(ModelError::BadInput(format!(
                "sequence {s}: {t} tokens but {} positions",
                seq.positions.len()
            )));
        }
        if let Some(&tok) = seq.tokens.iter().find(|&&x| x as usize >= vocab_size) {
            return Err(ModelError::BadInput(format!(
                "token id {tok} is outside the vocabulary ({})",
                vocab_size
            )));
        }
        if let Some(&p) = seq.positions.iter().find(|&&p| p as usize >= max_positions) {
            return Err(ModelError::PositionOutOfRange {
                position: p as usize,
                max: max_positions,
            });
        }
        if let Some(&r) = seq.logit_rows.iter().find(|&&r| r >= t) {
            return Err(ModelError::BadInput(format!(
                "sequence {s}: logit row {r} but only {t} tokens"
            )));
        }
        match seq.pattern {
            AttnPattern::Causal | AttnPattern::Tree { .. } => {}
            other => {
                return Err(ModelError::BadInput(format!(
                    "target attention must be causal or tree, got {other:?}"
                )))
            }
        }
        seq.pattern.validate(t).map_err(ModelError::BadInput)?;
        seq.cache.check_room(t)?;
        if seq.cache.num_layers() != num_layers {
            return Err(ModelError::BadInput(format!(
                "sequence {s}: cache has {} layers, model {}",
                seq.cache.num_layers(),
                num_layers
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn a_split_output_is_each_part_as_if_forwarded_alone() {
        let dev = Device::Cpu;
        // Three sequences of 2, 1 and 3 tokens; logits for 1, 1 and 2 rows.
        let logits = Tensor::arange(0f32, 8., &dev)
            .unwrap()
            .reshape((4, 2))
            .unwrap();
        let taps = Tensor::arange(0f32, 6., &dev)
            .unwrap()
            .reshape((6, 1))
            .unwrap();
        let out = ForwardOutput {
            logits: Some(logits),
            taps: Some(taps),
            token_offsets: vec![0, 2, 3, 6],
            logit_offsets: vec![0, 1, 2, 4],
        };
        let (a, b) = out.split_at(2).unwrap();
        assert_eq!(
            (a.token_offsets, a.logit_offsets),
            (vec![0, 2, 3], vec![0, 1, 2])
        );
        assert_eq!((b.token_offsets, b.logit_offsets), (vec![0, 3], vec![0, 2]));
        let rows = |t: Option<Tensor>| t.unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(rows(a.logits), vec![0., 1., 2., 3.]);
        assert_eq!(rows(b.logits), vec![4., 5., 6., 7.]);
        assert_eq!(rows(a.taps), vec![0., 1., 2.]);
        assert_eq!(rows(b.taps), vec![3., 4., 5.]);
        // At the ends one part is empty: no rows, one offset.
        let out = ForwardOutput {
            logits: None,
            taps: None,
            token_offsets: vec![0, 2],
            logit_offsets: vec![0, 0],
        };
        let (a, b) = out.split_at(1).unwrap();
        assert_eq!((a.token_offsets.len(), b.token_offsets), (2, vec![0]));
        assert!(ForwardOutput {
            logits: None,
            taps: None,
            token_offsets: vec![0, 2],
            logit_offsets: vec![0, 0],
        }
        .split_at(2)
        .is_err());
    }
}
