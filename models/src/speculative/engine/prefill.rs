//! The prefill half of a step: new prompts (and retracted sequences' committed tokens) in
//! chunks up to the step's token budget, oldest first, taking their pages as they go; a
//! sequence whose prompt is complete samples its first token and its proposer features
//! accumulate over the chunks. A step plans its chunks ([`Engine::plan_prefill`]), runs them
//! in a forward of their own ([`Engine::prefill`]) or in the round's forward
//! (`engine/mixed.rs`), then takes their rows ([`Engine::finish_prefill`]).

use candle_core::Tensor;

use super::piece::{self, MIN_PIECE};
use super::{commit_tokens, Engine, EngineError, Sequence};
use crate::batch::{ForwardOutput, SeqForward};
use crate::error::ModelError;
use crate::layers::attention::AttnPattern;
use crate::speculative::logprobs;
use crate::speculative::proposer::SeqId;
use crate::speculative::request::{Algorithm, SeqEvent};

/// One sequence's chunk of a step's prefill: prompt tokens `from..from + n`, their
/// positions and the chunk rows whose logits it needs.
pub(super) struct Chunk {
    pub id: SeqId,
    pub from: usize,
    pub n: usize,
    positions: Vec<u32>,
    logit_rows: Vec<usize>,
}

/// The chunks a step prefills, oldest sequence first.
pub(super) struct PrefillPlan {
    pub chunks: Vec<Chunk>,
}

impl PrefillPlan {
    pub fn ids(&self) -> Vec<SeqId> {
        self.chunks.iter().map(|c| c.id).collect()
    }

    pub fn starts(&self) -> Vec<usize> {
        self.chunks.iter().map(|c| c.from).collect()
    }

    /// The chunks' forwards, in plan order, over the sequences of `seqs` they belong to
    /// (every planned sequence must be there). Nothing in a prompt is ever rolled back, so
    /// hybrid targets take the chunked delta rule and keep no per-token recurrent state for
    /// it: each cache's rollback window is set to 0 for the forward and `saved` holds what to
    /// restore ([`PrefillPlan::restore_rollback`]).
    pub fn forwards<'a>(
        &'a self,
        seqs: &'a mut [Sequence],
        saved: &mut Vec<usize>,
    ) -> Result<Vec<SeqForward<'a>>, EngineError> {
        let mut slots: Vec<Option<&'a mut Sequence>> = Vec::new();
        slots.resize_with(self.chunks.len(), || None);
        for seq in seqs.iter_mut() {
            if let Some(k) = self.chunks.iter().position(|c| c.id == seq.id) {
                slots[k] = Some(seq);
            }
        }
        let mut batch = Vec::with_capacity(self.chunks.len());
        saved.clear();
        for (k, slot) in slots.into_iter().enumerate() {
            let seq = slot.ok_or(EngineError::UnknownSequence(self.chunks[k].id))?;
            let c = &self.chunks[k];
            saved.push(seq.cache.set_rollback(0));
            batch.push(SeqForward {
                cache: &mut seq.cache,
                tokens: &seq.tokens[c.from..c.from + c.n],
                positions: &c.positions,
                pattern: &AttnPattern::Causal,
                logit_rows: &c.logit_rows,
            });
        }
        Ok(batch)
    }

    /// Restores the rollback windows [`PrefillPlan::forwards`] set to 0.
    pub fn restore_rollback(&self, seqs: &mut [Sequence], saved: &[usize]) {
        for (c, &rows) in self.chunks.iter().zip(saved) {
            if let Some(seq) = seqs.iter_mut().find(|s| s.id == c.id) {
                seq.cache.set_rollback(rows);
            }
        }
    }
}

impl Engine {
    /// Prefills new prompts in a forward of their own: whole, or (with a chunk size) the next
    /// chunk of each in order until the step's token budget is spent.
    pub(super) fn prefill(&mut self, events: &mut Vec<SeqEvent>) -> Result<(), EngineError> {
        match self.plan_prefill()? {
            Some(plan) => self.run_prefill(&plan, events),
            None => Ok(()),
        }
    }

    /// Runs `plan`'s chunks in a forward of their own and takes their rows.
    pub(super) fn run_prefill(
        &mut self,
        plan: &PrefillPlan,
        events: &mut Vec<SeqEvent>,
    ) -> Result<(), EngineError> {
        let taps = self.taps();
        let (ids, starts) = (plan.ids(), plan.starts());
        let mut saved = Vec::new();
        let result = plan
            .forwards(&mut self.seqs, &mut saved)
            .and_then(|mut batch| {
                Ok(super::isolate::forward_isolating(
                    &self.target,
                    &self.faults,
                    &mut batch,
                    &ids,
                    &starts,
                    &taps,
                )?)
            });
        plan.restore_rollback(&mut self.seqs, &saved);
        let (out, failed) = result?;
        self.finish_prefill(plan, &out, &failed, events)
    }

    /// The step's prefill chunks: oldest sequence first, each the rest of its prompt (a long
    /// one in pieces while others decode) up to the step's token budget, its pages taken
    /// (from newer sequences if the pool is short; without them this and every newer prompt
    /// wait). None: nothing to prefill this step.
    pub(super) fn plan_prefill(&mut self) -> Result<Option<PrefillPlan>, EngineError> {
        let mut budget = self.prefill_chunk.unwrap_or(usize::MAX);
        let running = self.seqs.iter().filter(|s| s.prefilled).count();
        let decoding = running > 0;
        // Seconds the pieces may cost beside the decoding sequences (`engine/piece.rs`), unless
        // a burst of prompts waits (`is_burst`): then the chunk size bounds the step.
        let waiting = self.seqs.len() - running;
        let mut seconds = self
            .piece_budget()
            .filter(|_| decoding && !is_burst(waiting, running));
        let cost = self.cost;
        let mut chunks: Vec<Chunk> = Vec::new();
        for i in self.by_age() {
            if self.seqs[i].prefilled || budget == 0 {
                continue;
            }
            self.resume_on_cached_prefix(i)?;
            let s = &self.seqs[i];
            let from = s.prefill_done;
            let mut n = (prefill_target(s) - from).min(budget);
            if decoding {
                match (self.prefill_while_decoding, seconds) {
                    // The bound caps every piece; the cost budget sizes it.
                    (Some(cap), Some(_)) => n = n.min(cap),
                    // A long prompt goes in fixed pieces while others decode; a short one whole.
                    (Some(cap), None) if n > cap => n = long_prompt_piece(cap, from),
                    _ => {}
                }
            }
            if let Some((left, scale)) = seconds.as_mut() {
                // The step's first piece always moves; later ones only within the budget.
                let floor = if chunks.is_empty() { MIN_PIECE } else { 0 };
                let rest = n;
                n = cost.piece_within(*scale, from, n, *left, floor);
                if n == 0 {
                    break;
                }
                if n < prefill_target(s) - from {
                    // Few row counts per server (`piece::ROW_QUANTUM`); a prompt's last piece
                    // is what is left.
                    let rows =
                        self.last_step.decode_rows + chunks.iter().map(|c| c.n).sum::<usize>();
                    n = piece::aligned(n, rows, floor.min(rest));
                }
                *left -= *scale * cost.piece(n, from);
            }
            if !self.reserve_rows(i, from + n)? {
                break;
            }
            budget -= n;
            self.last_step.chunks.push((n, from));
            let s = &self.seqs[i];
            // Pages for a chunk only ever come from newer sequences, which are planned after
            // it (oldest first): no planned chunk loses its pages to a later one.
            chunks.push(Chunk {
                id: s.id,
                from: s.prefill_done,
                n,
                positions: (s.prefill_done as u32..(s.prefill_done + n) as u32).collect(),
                logit_rows: chunk_logit_rows(s, s.prefill_done, n),
            });
        }
        Ok((!chunks.is_empty()).then_some(PrefillPlan { chunks }))
    }

    /// Takes a prefill forward's rows (`out` and `failed` laid out as `plan`'s chunks): the
    /// prompt logprobs and proposer features each chunk adds; a sequence whose prompt is now
    /// complete caches its full pages and samples its first token.
    pub(super) fn finish_prefill(
        &mut self,
        plan: &PrefillPlan,
        out: &ForwardOutput,
        failed: &[Option<String>],
        events: &mut Vec<SeqEvent>,
    ) -> Result<(), EngineError> {
        let rows = match &out.logits {
            // The prefill's rows of a mixed forward's logits: a view (see `greedy::host_rows`).
            Some(l) => crate::speculative::greedy::host_rows(l)?,
            None => Vec::new(),
        };
        for (k, c) in plan.chunks.iter().enumerate() {
            let Some(i) = self.seqs.iter().position(|s| s.id == c.id) else {
                return Err(EngineError::UnknownSequence(c.id));
            };
            if let Some(error) = &failed[k] {
                events.push(self.seqs[i].failed(error));
                continue;
            }
            let seq = &mut self.seqs[i];
            if let Some((_, top)) = seq.prompt_logprobs.filter(|_| !seq.resumed) {
                // The chunk's rows before its last (sampling) one predict prompt tokens.
                let (a, b) = (out.logit_offsets[k], out.logit_offsets[k + 1]);
                for (j, &r) in c.logit_rows.iter().enumerate() {
                    let p = c.from + r;
                    if let (Some(row), Some(&t)) = (rows.get(a + j), seq.req.prompt.get(p + 1)) {
                        if a + j < b {
                            seq.prompt_lps.push(logprobs::token_logprob(row, t, top));
                        }
                    }
                }
            }
            if seq.req.algorithm != Algorithm::Plain {
                if let Some(t) = &out.taps {
                    let (a, b) = (out.token_offsets[k], out.token_offsets[k + 1]);
                    let part = t.narrow(0, a, b - a)?;
                    seq.pending_features = Some(match seq.pending_features.take() {
                        Some(prev) => Tensor::cat(&[&prev, &part], 0)?,
                        None => part,
                    });
                }
            }
            seq.prefill_done = c.from + c.n;
            if seq.prefill_done < prefill_target(seq) {
                continue;
            }
            // Its full pages (and their features) for later sequences with the same prefix.
            self.cache_rows(i);
            let seq = &mut self.seqs[i];
            if seq.resumed {
                // Back where it was retracted: the bonus token waits for the next round.
                seq.prefilled = true;
                seq.resumed = false;
                continue;
            }
            let mut row = out.logit_offsets[k + 1]
                .checked_sub(1)
                .and_then(|last| rows.get(last))
                .ok_or_else(|| ModelError::BadInput("prefill returned no logits".into()))?
                .clone();
            seq.prefilled = true;
            seq.penalise(&[], &mut row);
            let token = seq.sampler.sample(&row);
            let (emitted, finished) = commit_tokens(seq, &[token], &self.config.eos_token_ids);
            seq.record(&emitted);
            let logprobs = match seq.logprobs {
                Some(n) => vec![logprobs::token_logprob(&row, token, n)],
                None => Vec::new(),
            };
            events.push(SeqEvent {
                id: seq.id,
                tokens: emitted,
                finished,
                round: None,
                stats: seq.stats.clone(),
                logprobs,
                error: None,
                prompt_logprobs: std::mem::take(&mut seq.prompt_lps),
            });
        }
        self.reap(events);
        Ok(())
    }
}

/// The rows of a chunk of `s`'s prompt (tokens `from..from + n`) whose logits a prefill
/// needs: those predicting the prompt tokens whose logprobs were asked (row p predicts
/// token p + 1), and the last row of a chunk that completes the prompt (it samples the first
/// token).
fn chunk_logit_rows(s: &Sequence, from: usize, n: usize) -> Vec<usize> {
    let completes = from + n == prefill_target(s) && !s.resumed;
    let mut rows: Vec<usize> = match (s.prompt_logprobs, s.resumed) {
        (Some((start, _)), false) => {
            let first = start.max(1) - 1;
            let end = (from + n).min(s.req.prompt.len() - 1);
            (first.max(from)..end.max(first.max(from)))
                .map(|p| p - from)
                .collect()
        }
        _ => Vec::new(),
    };
    if completes {
        rows.push(n - 1);
    }
    rows
}

impl Engine {
    /// A retracted sequence about to be prefilled again starts on the cached prefix of its
    /// tokens, if any (its old pages may still be cached).
    fn resume_on_cached_prefix(&mut self, i: usize) -> Result<(), EngineError> {
        let s = &self.seqs[i];
        if !s.resumed || s.prefill_done > 0 || self.prefix.is_none() {
            return Ok(());
        }
        let tokens = s.tokens.clone();
        let (target, algorithm, capacity) = (prefill_target(s), s.req.algorithm, s.capacity);
        let opened = self.open_cache(&tokens, target, algorithm, capacity)?;
        let seq = &mut self.seqs[i];
        seq.cache = opened.cache;
        seq.prefill_done = opened.cached;
        seq.pending_features = opened.features;
        Ok(())
    }
}

/// The piece of a long prompt prefilled in a step while others decode, from `cap` tokens
/// per step at the start to fewer further in (the piece's attention reads every earlier
/// position): `cap` up to 4096 positions, then `cap * 4096 / position`, at least 32, so that
/// a piece of the default 256 attends to about 1M (query, key) pairs wherever it lies. On an
/// H200 (Qwen3-8B, deploy/bench/results/h200-2026-12-03-scale2) a piece's attention runs at
/// ~100 TFLOP/s, 6.5 ms per step for 1M pairs: pieces of 2M pairs (the 8192 this was before)
/// held 16 decoding streams at 3.6x their steady inter-token latency (p50) through a 32K
/// prompt, 1M pairs at 2.65x.
pub(super) fn long_prompt_piece(cap: usize, position: usize) -> usize {
    const FULL_UP_TO: usize = 4096;
    (cap * FULL_UP_TO / position.max(FULL_UP_TO)).clamp(32.min(cap), cap)
}

/// Whether `waiting` prompts beside `running` decoding sequences are a burst of arrivals (at
/// least two, and at least half as many as decode): their time to first token then outweighs a
/// slower step of the running streams, so the step takes them at the chunk size (long prompts
/// in fixed pieces), as SGLang schedules every arrival. A prompt or two arriving among many
/// streams (steady load, or one long prompt) keeps the cost budget. Cost-sized pieces alone
/// prefilled 16 waiting 512-token prompts beside 16 streams at ~180 tokens a step (H200,
/// Qwen3-8B: c=32 plain 2693 tok/s, chain 2056, TTFT p50 0.8 / 1.8 s; fixed pieces 3318 / 5246).
pub(crate) fn is_burst(waiting: usize, running: usize) -> bool {
    waiting >= 2 && 2 * waiting >= running
}

/// Tokens a prefill puts in the cache: the prompt, or (after a retraction) every committed
/// token but the bonus one.
pub(super) fn prefill_target(s: &Sequence) -> usize {
    if s.resumed {
        s.tokens.len() - 1
    } else {
        s.tokens.len()
    }
}
