//! A failed forward ends only the sequences it fails for. The target forward of a step runs
//! every sequence in one batch; when it fails (a device or allocation error), each sequence
//! is rolled back to where the step found it and run alone, and only those whose own forward
//! fails again leave the engine, with an error event (the server answers them with a 500);
//! the rest commit as if nothing happened (their forward alone computes the same rows).
//!
//! Tests inject a failure into the forward of chosen sequences
//! ([`Engine::inject_forward_failure`]) to show that.

use std::collections::HashSet;

use candle_core::Tensor;

use super::Engine;
use crate::batch::{ForwardOutput, SeqForward};
use crate::error::{ModelError, ModelResult};
use crate::speculative::proposer::SeqId;
use crate::target::{DraftTarget, Target};

/// Sequences whose target forwards fail on purpose (tests of failure handling).
#[derive(Debug, Default)]
pub(super) struct InjectedFaults {
    seqs: HashSet<SeqId>,
}

impl InjectedFaults {
    fn check(&self, ids: &[SeqId]) -> ModelResult<()> {
        match ids.iter().find(|id| self.seqs.contains(id)) {
            Some(id) => Err(ModelError::Candle(candle_core::Error::Msg(format!(
                "injected device fault in the forward of sequence {id}"
            )))),
            None => Ok(()),
        }
    }
}

impl Engine {
    /// Makes every target forward that includes sequence `id` fail with a device error from
    /// now on, as an allocation or kernel failure would: for tests of failure handling.
    pub fn inject_forward_failure(&mut self, id: SeqId) {
        self.faults.seqs.insert(id);
    }
}

/// The step's forward of `batch` (sequences `ids`, whose caches held `starts` rows before
/// it): one batched forward, or after a failure one forward per sequence. Returns the output
/// laid out as the batched one (a failed sequence has no rows) and, per sequence, the error
/// that ended it. Errors only where laying out the output fails.
pub(super) fn forward_isolating(
    target: &Target,
    faults: &InjectedFaults,
    batch: &mut [SeqForward<'_>],
    ids: &[SeqId],
    starts: &[usize],
    taps: &[usize],
) -> ModelResult<(ForwardOutput, Vec<Option<String>>)> {
    let batched = faults.check(ids).and_then(|()| target.forward(batch, taps));
    let error = match batched {
        Ok(out) => return Ok((out, vec![None; batch.len()])),
        Err(e) => e,
    };
    tracing::error!(
        "a forward of {} sequences failed ({error}); running them one by one",
        batch.len()
    );
    let mut failed: Vec<Option<String>> = Vec::with_capacity(batch.len());
    let mut logits: Vec<Tensor> = Vec::new();
    let mut tapped: Vec<Tensor> = Vec::new();
    let (mut token_offsets, mut logit_offsets) = (vec![0], vec![0]);
    for (k, seq) in batch.iter_mut().enumerate() {
        let alone = rewind(seq, starts[k])
            .and_then(|()| faults.check(&ids[k..=k]))
            .and_then(|()| target.forward(std::slice::from_mut(seq), taps));
        let (mut t, mut l) = (0, 0);
        match alone {
            Ok(out) => {
                if let Some(x) = out.logits {
                    l = x.dim(0)?;
                    logits.push(x);
                }
                if let Some(x) = out.taps {
                    t = x.dim(0)?;
                    tapped.push(x);
                }
                failed.push(None);
            }
            Err(e) => {
                tracing::error!("sequence {}: forward failed: {e}", ids[k]);
                // Whatever it wrote is dropped with it; rows past `starts[k]` are not live.
                let _ = rewind(seq, starts[k]);
                failed.push(Some(format!("the model forward failed on the device: {e}")));
            }
        }
        token_offsets.push(token_offsets[k] + t);
        logit_offsets.push(logit_offsets[k] + l);
    }
    // Even when every sequence fails alone (the device itself may be gone) the engine goes
    // on: each ends with its error, and the next step finds out again.
    let device = target.device().clone();
    let cat = |xs: &[Tensor]| -> ModelResult<Option<Tensor>> {
        Ok(match xs.len() {
            0 => None,
            _ => Some(Tensor::cat(xs, 0)?.to_device(&device)?),
        })
    };
    Ok((
        ForwardOutput {
            logits: cat(&logits)?,
            taps: cat(&tapped)?,
            token_offsets,
            logit_offsets,
        },
        failed,
    ))
}

/// Drops the rows a failed forward may have made live.
fn rewind(seq: &mut SeqForward<'_>, start: usize) -> ModelResult<()> {
    if seq.cache.len() > start {
        seq.cache.truncate(start)?;
    }
    Ok(())
}
