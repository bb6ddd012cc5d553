//! Mixed steps: a prompt's prefill chunk in the same target forward as the running
//! sequences' decode or verify rows (SGLang's mixed chunk). A separate prefill forward reads
//! every weight a second time and runs uncaptured, so even a 64-token piece of a long prompt
//! stretched every running stream's step by ~10 ms on the H200 (Qwen3-8B shape); in one
//! forward the piece costs only its own compute. Outputs do not change: each sequence's rows
//! attend to its own cache only, whatever else shares the forward.

use std::time::Instant;

use super::piece::StepReport;
use super::{isolate, Engine, EngineError, Sequence};
use crate::speculative::request::SeqEvent;

impl Engine {
    /// Runs prefill chunks in the round's forward when both have work (see the module
    /// docs); on by default. `false`: a step prefills in a forward of its own, then verifies.
    pub fn set_mixed_prefill(&mut self, on: bool) {
        self.mixed_prefill = on;
    }

    /// Steps so far whose target forward held both prefill chunks and a round.
    pub fn mixed_steps(&self) -> u64 {
        self.mixed_steps
    }

    /// Whether this step can mix: sequences decoding and others waiting for their prefill.
    pub(super) fn mixes(&self) -> bool {
        self.mixed_prefill
            && self.seqs.iter().any(|s| s.prefilled)
            && self.seqs.iter().any(|s| !s.prefilled)
    }

    /// One step whose target forward holds the round's rows and the prefill chunks. The
    /// decoding sequences' verify rows get pages first; the chunks take what is left (or a
    /// newer sequence's pages, as a prefill of its own would).
    pub(super) fn mixed_step(&mut self, events: &mut Vec<SeqEvent>) -> Result<(), EngineError> {
        self.make_room()?;
        let prefill = self.plan_prefill()?;
        let limit = self.target.batch_tokens_limit().unwrap_or(usize::MAX);
        let (ready, mut waiting): (Vec<Sequence>, Vec<Sequence>) = std::mem::take(&mut self.seqs)
            .into_iter()
            .partition(|s| s.prefilled);
        self.seqs = ready;
        let prefill = match prefill {
            // A chunk too long for one batched pass, or nobody left decoding (all retracted
            // for the chunks' pages): the prefill runs alone, then the round as usual.
            Some(plan) if plan.chunks.iter().all(|c| c.n <= limit) && !self.seqs.is_empty() => plan,
            plan => {
                self.seqs.extend(waiting);
                return self.separate_step(plan, events);
            }
        };
        let round = match self.plan_round() {
            Ok(r) => r,
            Err(e) => {
                self.seqs.extend(waiting);
                return Err(e);
            }
        };
        self.mixed_steps += 1;
        self.last_step.mixed = true;
        let taps = self.taps();
        let t_verify = Instant::now();
        let ids: Vec<_> = round.ids.iter().copied().chain(prefill.ids()).collect();
        let starts: Vec<usize> = round
            .starts
            .iter()
            .copied()
            .chain(prefill.starts())
            .collect();
        let mut saved = Vec::new();
        let result = round_and_chunks(&round, &mut self.seqs, &prefill, &mut waiting, &mut saved)
            .and_then(|mut batch| {
                Ok(isolate::forward_isolating(
                    &self.target,
                    &self.faults,
                    &mut batch,
                    &ids,
                    &starts,
                    &taps,
                )?)
            });
        prefill.restore_rollback(&mut waiting, &saved);
        let split = result.and_then(|(out, failed)| {
            let r = round.ids.len();
            let (round_out, prefill_out) = out.split_at(r)?;
            Ok((round_out, prefill_out, failed))
        });
        let (round_out, prefill_out, failed) = match split {
            Ok(x) => x,
            Err(e) => {
                self.seqs.extend(waiting);
                return Err(e);
            }
        };
        let (round_failed, prefill_failed) = failed.split_at(round.ids.len());
        let committed = self.finish_round(&round, &round_out, round_failed, t_verify, events);
        self.seqs.extend(waiting);
        committed?;
        self.finish_prefill(&prefill, &prefill_out, prefill_failed, events)
    }

    /// A step whose prefill (already planned: `plan`) runs in a forward of its own before the
    /// round of the sequences decoding after it.
    fn separate_step(
        &mut self,
        plan: Option<super::prefill::PrefillPlan>,
        events: &mut Vec<SeqEvent>,
    ) -> Result<(), EngineError> {
        if let Some(plan) = plan {
            self.run_prefill(&plan, events)?;
        }
        self.make_room()?;
        self.round_of_ready(events)
    }
}

/// The mixed forward's batch: the round's sequences (`ready`, in plan order), then the
/// chunks' (from `waiting`).
fn round_and_chunks<'a>(
    round: &'a super::round::RoundPlan,
    ready: &'a mut [Sequence],
    prefill: &'a super::prefill::PrefillPlan,
    waiting: &'a mut [Sequence],
    saved: &mut Vec<usize>,
) -> Result<Vec<crate::batch::SeqForward<'a>>, EngineError> {
    let mut batch = round.forwards(ready);
    batch.extend(prefill.forwards(waiting, saved)?);
    Ok(batch)
}

impl Engine {
    /// The step's report before it runs: the decoding batch as it stands.
    pub(super) fn start_report(&mut self) {
        let mut r = StepReport::default();
        for s in self.seqs.iter().filter(|s| s.prefilled) {
            r.decode_seqs += 1;
            r.decode_rows += self.verify_width(s.req.algorithm);
            r.cached += s.cache.len();
        }
        let scale = self.calibration.unwrap_or_default().decode;
        r.decode_estimate = scale * self.cost.decode(r.decode_rows, r.cached);
        self.last_step = r;
    }

    /// Seconds the step's pieces may cost, and the scale of their estimates: None when the
    /// pieces are not sized by cost (no budget, or nothing decoding).
    pub(super) fn piece_budget(&self) -> Option<(f64, f64)> {
        let budget = self.step_budget?;
        if self.last_step.decode_rows == 0 {
            return None;
        }
        let scale = self.calibration.unwrap_or_default().piece;
        let left =
            (budget - 1.0) * self.last_step.decode_estimate - scale * self.cost.mixed_fixed();
        Some((left, scale))
    }

    /// The step's estimate, and the calibration from its measured time.
    pub(super) fn finish_report(&mut self) {
        let cost = self.cost;
        let r = &mut self.last_step;
        let pieces: f64 = r
            .chunks
            .iter()
            .map(|&(n, from)| cost.piece(n, from))
            .sum::<f64>()
            + if r.chunks.is_empty() {
                0.0
            } else {
                cost.mixed_fixed()
            };
        let decode = cost.decode(r.decode_rows, r.cached);
        let Some(cal) = self.calibration.as_mut() else {
            r.estimate = r.decode_estimate + pieces;
            return;
        };
        r.estimate = r.decode_estimate + cal.piece * pieces;
        if r.decode_rows > 0 && r.chunks.is_empty() {
            cal.observe_decode(r.seconds, decode);
        } else if r.mixed {
            cal.observe_mixed(r.seconds, decode, pieces);
        }
    }
}
