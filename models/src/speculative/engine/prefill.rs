//! The prefill half of a step: new prompts (and retracted sequences' committed tokens) in
//! chunks up to the step's token budget, oldest first, taking their pages as they go; a
//! sequence whose prompt is complete samples its first token and its proposer features
//! accumulate over the chunks.

use candle_core::Tensor;

use super::{commit_tokens, Engine, EngineError, Sequence};
use crate::batch::SeqForward;
use crate::error::ModelError;
use crate::layers::attention::AttnPattern;
use crate::speculative::logprobs;
use crate::speculative::proposer::SeqId;
use crate::speculative::request::{Algorithm, SeqEvent};

impl Engine {
    /// Prefills new prompts: whole, or (with a chunk size) the next chunk of each in order
    /// until the step's token budget is spent. A sequence whose prompt is complete samples its
    /// first token; the proposer's features accumulate over the chunks.
    pub(super) fn prefill(&mut self, events: &mut Vec<SeqEvent>) -> Result<(), EngineError> {
        let taps = self.taps();
        let mut budget = self.prefill_chunk.unwrap_or(usize::MAX);
        let decoding = self.seqs.iter().any(|s| s.prefilled);
        // (sequence index, first prompt token of this chunk, tokens in it), oldest first.
        let mut chunks: Vec<(usize, usize, usize)> = Vec::new();
        for i in self.by_age() {
            if self.seqs[i].prefilled || budget == 0 {
                continue;
            }
            self.resume_on_cached_prefix(i)?;
            let s = &self.seqs[i];
            let mut n = (prefill_target(s) - s.prefill_done).min(budget);
            if decoding {
                if let Some(cap) = self.prefill_while_decoding {
                    // A long prompt goes in pieces while others decode; a short one whole.
                    if n > cap {
                        n = long_prompt_piece(cap, s.prefill_done);
                    }
                }
            }
            // Pages for the chunk, from newer sequences if the pool is short; without them
            // this and every newer prompt wait.
            if !self.reserve_rows(i, s.prefill_done + n)? {
                break;
            }
            budget -= n;
            chunks.push((i, self.seqs[i].prefill_done, n));
        }
        if chunks.is_empty() {
            return Ok(());
        }
        let positions: Vec<Vec<u32>> = chunks
            .iter()
            .map(|&(_, from, n)| (from as u32..(from + n) as u32).collect())
            .collect();
        // Logits for the rows predicting the prompt tokens whose logprobs were asked, and the
        // last row of a chunk that completes its prompt (it samples the first token).
        let logit_rows: Vec<Vec<usize>> = chunks
            .iter()
            .map(|&(i, from, n)| {
                let s = &self.seqs[i];
                let completes = from + n == prefill_target(s) && !s.resumed;
                let mut rows: Vec<usize> = match (s.prompt_logprobs, s.resumed) {
                    (Some((start, _)), false) => {
                        // Row p predicts prompt token p + 1.
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
            })
            .collect();
        let in_chunk = |i: usize| chunks.iter().position(|c| c.0 == i);
        // Nothing in a prompt is ever rolled back: hybrid targets take the chunked delta rule
        // and keep no per-token recurrent state for it.
        let mut saved = Vec::with_capacity(chunks.len());
        for &(i, _, _) in &chunks {
            saved.push(self.seqs[i].cache.set_rollback(0));
        }
        let ids: Vec<SeqId> = chunks.iter().map(|&(i, _, _)| self.seqs[i].id).collect();
        let starts: Vec<usize> = chunks.iter().map(|&(_, from, _)| from).collect();
        let result = {
            let mut batch: Vec<SeqForward<'_>> = Vec::with_capacity(chunks.len());
            for (i, seq) in self.seqs.iter_mut().enumerate() {
                let Some(k) = in_chunk(i) else { continue };
                let (_, from, n) = chunks[k];
                batch.push(SeqForward {
                    cache: &mut seq.cache,
                    tokens: &seq.tokens[from..from + n],
                    positions: &positions[k],
                    pattern: &AttnPattern::Causal,
                    logit_rows: &logit_rows[k],
                });
            }
            super::isolate::forward_isolating(
                &self.target,
                &self.faults,
                &mut batch,
                &ids,
                &starts,
                &taps,
            )
        };
        for (&(i, _, _), &rows) in chunks.iter().zip(&saved) {
            self.seqs[i].cache.set_rollback(rows);
        }
        let (out, failed) = result?;
        let rows = match &out.logits {
            Some(l) => l.to_vec2::<f32>()?,
            None => Vec::new(),
        };
        for (k, &(i, from, n)) in chunks.iter().enumerate() {
            if let Some(error) = &failed[k] {
                events.push(self.seqs[i].failed(error));
                continue;
            }
            let seq = &mut self.seqs[i];
            if let Some((_, top)) = seq.prompt_logprobs.filter(|_| !seq.resumed) {
                // The chunk's rows before its last (sampling) one predict prompt tokens.
                let (a, b) = (out.logit_offsets[k], out.logit_offsets[k + 1]);
                for (j, &r) in logit_rows[k].iter().enumerate() {
                    let p = from + r;
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
            seq.prefill_done = from + n;
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
/// position): `cap` up to 8192 positions, then `cap * 8192 / position`, at least 32. On an
/// H200 (Qwen3-8B) a 256-token piece costs about a decode step at the start of a prompt.
pub(super) fn long_prompt_piece(cap: usize, position: usize) -> usize {
    const FULL_UP_TO: usize = 8192;
    (cap * FULL_UP_TO / position.max(FULL_UP_TO)).clamp(32.min(cap), cap)
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
