//! What shapes a sequence's logits rows before a token is chosen from them, and what it
//! reports about them: penalties ([`crate::speculative::penalties`]) and a grammar
//! ([`crate::speculative::constraint`]) at every tree node, and the committed tokens'
//! logprobs ([`crate::speculative::logprobs`]).

use super::{Engine, EngineError, Sequence};
use crate::speculative::constraint::Constraint;
use crate::speculative::penalties::{Penalties, PenaltyState};
use crate::speculative::proposer::SeqId;
use crate::target::DraftTarget;

impl Sequence {
    /// Whether this sequence's rows must come to the host (sampling, logprobs, penalties).
    pub(super) fn needs_host_rows(&self) -> bool {
        !self.sampler.params().is_greedy() || self.logprobs.is_some() || self.shapes_rows()
    }

    /// Whether penalties or a grammar change this sequence's rows.
    pub(super) fn shapes_rows(&self) -> bool {
        self.penalties.is_some() || self.constraint.is_some()
    }

    /// Penalises and masks the row predicting the token after the committed tokens and `path`.
    pub(super) fn penalise(&mut self, path: &[u32], row: &mut [f32]) {
        if let Some(p) = &self.penalties {
            p.apply(path, row);
        }
        if let Some(c) = self.constraint.as_mut() {
            c.mask(path, row);
        }
    }

    /// Records committed tokens in the penalties' counts and the grammar's state.
    pub(super) fn record(&mut self, tokens: &[u32]) {
        if let Some(p) = self.penalties.as_mut() {
            p.commit(tokens);
        }
        if let Some(c) = self.constraint.as_mut() {
            c.commit(tokens);
        }
    }
}

impl Engine {
    /// Reports the logprobs of sequence `id`'s committed tokens from now on (`Some(top_n)`),
    /// or stops (`None`). See [`crate::speculative::logprobs`].
    pub fn set_logprobs(&mut self, id: SeqId, top_n: Option<usize>) -> Result<(), EngineError> {
        let seq = self
            .seqs
            .iter_mut()
            .find(|s| s.id == id)
            .ok_or(EngineError::UnknownSequence(id))?;
        seq.logprobs = top_n;
        Ok(())
    }

    /// Reports the logprobs of sequence `id`'s prompt tokens from position `start` on (the
    /// first prompt token has no logprob, so position 0 starts at the second one), with the
    /// `top_n` best entries of each row, on its first token's event; before its prefill.
    pub fn set_prompt_logprobs(
        &mut self,
        id: SeqId,
        start: usize,
        top_n: usize,
    ) -> Result<(), EngineError> {
        let seq = self.shaped_sequence(id)?;
        if seq.prefilled || seq.prefill_done > seq.stats.cached_tokens {
            return Err(EngineError::AlreadyGenerating(id));
        }
        seq.prompt_logprobs = Some((start, top_n));
        // Prompt logprobs come from the prefill's rows: none may be skipped.
        self.forget_cached_prefix(id)?;
        Ok(())
    }

    /// Applies `penalties` to sequence `id`'s rows (see [`crate::speculative::penalties`]),
    /// before it generates its first token; inactive penalties are dropped. Logprobs then
    /// report the penalised distribution, which is the one tokens are chosen from.
    pub fn set_penalties(&mut self, id: SeqId, penalties: Penalties) -> Result<(), EngineError> {
        penalties.validate(self.target.vocab_size())?;
        let eos = self.config.eos_token_ids.clone();
        let seq = self.shaped_sequence(id)?;
        seq.penalties = penalties.is_active().then(|| {
            let mut stops = seq.req.stop_token_ids.clone();
            if !seq.req.ignore_eos {
                for &t in &eos {
                    if !stops.contains(&t) {
                        stops.push(t);
                    }
                }
            }
            PenaltyState::new(penalties, &seq.req.prompt, stops)
        });
        Ok(())
    }

    /// Constrains sequence `id` to `constraint` (see [`crate::speculative::constraint`]),
    /// before it generates its first token.
    pub fn set_constraint(
        &mut self,
        id: SeqId,
        constraint: Box<dyn Constraint>,
    ) -> Result<(), EngineError> {
        self.shaped_sequence(id)?.constraint = Some(constraint);
        Ok(())
    }

    /// An active sequence that has not generated yet.
    fn shaped_sequence(&mut self, id: SeqId) -> Result<&mut Sequence, EngineError> {
        let seq = self
            .seqs
            .iter_mut()
            .find(|s| s.id == id)
            .ok_or(EngineError::UnknownSequence(id))?;
        if seq.generated > 0 {
            return Err(EngineError::AlreadyGenerating(id));
        }
        Ok(seq)
    }
}
