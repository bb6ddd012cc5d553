//! One generation from the client's point of view: engine updates in, text chunks out.
//!
//! Tokens are detokenized and checked for stop strings one at a time, even when a speculative
//! step commits a whole block, so a stop string early in the block ends the output there and
//! the tokens after it never reach the client (SGLang #23802, #31599). Dropping a
//! [`Generation`] drops its event receiver, which is how the engine learns to stop.

use std::sync::Arc;
use std::time::{Duration, Instant};

use dflash_common::detokenize::{IncrementalDecoder, StopMatcher};
use dflash_common::tokenizer::Tokenizer;
use serde_json::{json, Map, Value};
use tokio::sync::mpsc::UnboundedReceiver;

use super::reasoning::{reasoning_token_count, ReasoningParser, ReasoningParserKind};
use super::{Finish, PreparedRequest};
use crate::engine::{EngineFailure, EngineFinish, SeqUpdate, TokenLogprob};
use crate::error::ApiError;
use crate::metrics::{FinishedRequest, ServerMetrics};
use crate::state::AppState;

/// Text and ids one engine update made visible.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Chunk {
    /// New answer text (with reasoning separation: the content part only).
    pub delta: String,
    /// New reasoning text; always empty without reasoning separation.
    pub reasoning_delta: String,
    pub new_ids: Vec<u32>,
    /// The logprobs of `new_ids` when the request asked for them.
    pub new_logprobs: Vec<TokenLogprob>,
    pub finish: Option<Finish>,
}

/// Per-request speculative counters (SGLang's `spec_*` meta fields).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SpecCounters {
    pub verify_ct: usize,
    pub correct_drafts: usize,
    /// Index k: verify rounds that accepted k drafts.
    pub histogram: Vec<usize>,
}

pub struct Generation {
    req: PreparedRequest,
    rx: Option<UnboundedReceiver<SeqUpdate>>,
    tokenizer: Arc<Tokenizer>,
    metrics: Arc<ServerMetrics>,
    drafts_per_round: usize,
    decoder: IncrementalDecoder,
    stops: StopMatcher,
    text: String,
    output_ids: Vec<u32>,
    /// One per output id when the request asked for logprobs.
    logprobs: Vec<TokenLogprob>,
    /// The prompt tokens' logprobs when the request asked for them.
    prompt_logprobs: Vec<TokenLogprob>,
    finish: Option<Finish>,
    spec: SpecCounters,
    reasoning: Option<(ReasoningParserKind, ReasoningParser)>,
    started: Instant,
    first_token: Option<Instant>,
    last_chunk: Instant,
    queue_time: Option<Duration>,
    /// Prompt tokens the engine found in its prefix cache.
    cached_tokens: usize,
    /// Times the engine retracted the sequence for lack of K/V pages.
    retractions: usize,
    /// `--enable-cache-report`.
    cache_report: bool,
    reported: bool,
    /// Ended before its first token (aborted while queued): streams still owe the client one
    /// chunk carrying the finish reason.
    final_chunk_pending: bool,
}

impl Generation {
    /// Submits every request of one HTTP request to the engine together, so they are queued
    /// or refused as one.
    pub fn start_all(state: &AppState, reqs: Vec<PreparedRequest>) -> Vec<Self> {
        let submit: Vec<(String, crate::engine::EngineRequest)> = reqs
            .iter()
            .filter(|r| r.max_new_tokens > 0)
            .map(|r| (r.rid.clone(), r.engine_request()))
            .collect();
        let mut rxs = state.engine.submit_all(submit).into_iter();
        reqs.into_iter()
            .map(|req| {
                let rx = if req.max_new_tokens == 0 {
                    None
                } else {
                    rxs.next()
                };
                Self::with_receiver(state, req, rx)
            })
            .collect()
    }

    fn with_receiver(
        state: &AppState,
        req: PreparedRequest,
        rx: Option<UnboundedReceiver<SeqUpdate>>,
    ) -> Self {
        state
            .metrics
            .request_received(req.prompt_ids.len(), req.stream);
        let now = Instant::now();
        let mut g = Self {
            decoder: IncrementalDecoder::new(req.skip_special_tokens),
            stops: StopMatcher::new(req.stop_strings.clone(), req.no_stop_trim),
            req,
            rx,
            tokenizer: state.model.tokenizer.clone(),
            metrics: state.metrics.clone(),
            drafts_per_round: state.engine.info().drafts_per_round,
            text: String::new(),
            output_ids: Vec::new(),
            logprobs: Vec::new(),
            prompt_logprobs: Vec::new(),
            finish: None,
            spec: SpecCounters::default(),
            reasoning: None,
            started: now,
            first_token: None,
            last_chunk: now,
            queue_time: None,
            cached_tokens: 0,
            retractions: 0,
            cache_report: state.config.enable_cache_report,
            reported: false,
            final_chunk_pending: false,
        };
        if g.rx.is_none() {
            g.set_finish(Finish::Length { length: 0 });
        }
        g
    }

    /// Splits the streamed text into reasoning and content (chat with `--reasoning-parser`).
    pub fn separate_reasoning(&mut self, kind: ReasoningParserKind) {
        self.reasoning = Some((kind, ReasoningParser::new(kind)));
    }

    pub fn reasoning_kind(&self) -> Option<ReasoningParserKind> {
        self.reasoning.as_ref().map(|(k, _)| *k)
    }

    /// Output tokens spent reasoning (0 without reasoning separation).
    pub fn reasoning_tokens(&self) -> usize {
        let Some((kind, _)) = &self.reasoning else {
            return 0;
        };
        reasoning_token_count(
            *kind,
            &self.output_ids,
            self.tokenizer.token_to_id("<think>"),
            self.tokenizer.token_to_id("</think>"),
        )
    }

    pub fn rid(&self) -> &str {
        &self.req.rid
    }

    /// Prompt tokens found in the prefix cache, when usage reports them
    /// (`--enable-cache-report`).
    pub fn reported_cached_tokens(&self) -> Option<usize> {
        self.cache_report.then_some(self.cached_tokens)
    }

    pub fn prompt_tokens(&self) -> usize {
        self.req.prompt_ids.len()
    }

    pub fn completion_tokens(&self) -> usize {
        self.output_ids.len()
    }

    pub fn text(&self) -> &str {
        &self.text
    }

    /// One per output id when the request asked for logprobs, else empty.
    pub fn logprobs(&self) -> &[TokenLogprob] {
        &self.logprobs
    }

    /// The prompt's ids.
    pub fn prompt_ids(&self) -> &[u32] {
        &self.req.prompt_ids
    }

    /// `Some(start)` when the request asked for the prompt's logprobs from `start` on.
    pub fn prompt_logprob_start(&self) -> Option<usize> {
        self.req.prompt_logprobs.map(|(start, _)| start)
    }

    /// The prompt tokens' logprobs from the asked start (empty unless asked).
    pub fn prompt_logprobs(&self) -> &[TokenLogprob] {
        &self.prompt_logprobs
    }

    /// `Some(top_n)` when the request asked for logprobs.
    pub fn logprobs_requested(&self) -> Option<usize> {
        self.req.logprobs
    }

    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    pub fn output_ids(&self) -> &[u32] {
        &self.output_ids
    }

    pub fn finish(&self) -> Option<&Finish> {
        self.finish.as_ref()
    }

    pub fn spec(&self) -> &SpecCounters {
        &self.spec
    }

    /// Waits until the engine has accepted the request, so that admission errors (context
    /// length, overload) become a normal error response before a stream's `200`.
    pub async fn admitted(&mut self) -> Result<(), ApiError> {
        let Some(rx) = self.rx.as_mut() else {
            return Ok(());
        };
        match rx.recv().await {
            Some(SeqUpdate::Admitted { queue_time }) => {
                self.queue_time = Some(queue_time);
                Ok(())
            }
            // Aborted (or timed out) while still queued: a normal end with no output and
            // finish reason `abort`, the same answer a running request gets.
            Some(SeqUpdate::Failed(f)) if f.is_abort() => {
                self.abort(&f);
                self.final_chunk_pending = true;
                Ok(())
            }
            Some(SeqUpdate::Failed(f)) => {
                self.abort(&f);
                Err(ApiError::Engine(f))
            }
            Some(SeqUpdate::Step { .. }) | None => Err(ApiError::Internal(
                "the engine sent tokens before admitting the request".into(),
            )),
        }
    }

    /// The next chunk, or `None` once finished.
    pub async fn next_chunk(&mut self) -> Option<Result<Chunk, ApiError>> {
        if std::mem::take(&mut self.final_chunk_pending) {
            return Some(Ok(Chunk {
                finish: self.finish.clone(),
                ..Chunk::default()
            }));
        }
        if self.finish.is_some() {
            return None;
        }
        loop {
            let update = match self.rx.as_mut() {
                Some(rx) => rx.recv().await,
                None => None,
            };
            match update {
                Some(SeqUpdate::Admitted { queue_time }) => self.queue_time = Some(queue_time),
                Some(SeqUpdate::Step {
                    tokens,
                    finished,
                    accepted_drafts,
                    verify_rounds,
                    logprobs,
                    cached_tokens,
                    retractions,
                    prompt_logprobs,
                }) => {
                    self.count_spec(accepted_drafts, verify_rounds);
                    self.cached_tokens = cached_tokens;
                    self.retractions = retractions;
                    self.prompt_logprobs.extend(prompt_logprobs);
                    return Some(self.absorb(&tokens, &logprobs, finished));
                }
                Some(SeqUpdate::Failed(f)) if f.is_abort() => {
                    // Ended by /abort_request or the timeout: a normal end with what was
                    // generated so far and finish reason `abort`.
                    let mut chunk = Chunk {
                        delta: self.stops.flush(),
                        ..Chunk::default()
                    };
                    self.text.push_str(&chunk.delta);
                    if let Some((_, parser)) = self.reasoning.as_mut() {
                        let mut split = parser.push(&chunk.delta);
                        let rest = parser.finish();
                        split.reasoning.push_str(&rest.reasoning);
                        split.content.push_str(&rest.content);
                        chunk.reasoning_delta = split.reasoning;
                        chunk.delta = split.content;
                    }
                    self.abort(&f);
                    chunk.finish = self.finish.clone();
                    return Some(Ok(chunk));
                }
                Some(SeqUpdate::Failed(f)) => {
                    self.abort(&f);
                    return Some(Err(ApiError::Engine(f)));
                }
                None => {
                    let f = EngineFailure::Internal("the engine dropped the request".into());
                    self.abort(&f);
                    return Some(Err(ApiError::Engine(f)));
                }
            }
        }
    }

    /// Runs to the end (non-streaming requests).
    pub async fn run_to_end(&mut self) -> Result<(), ApiError> {
        while let Some(chunk) = self.next_chunk().await {
            chunk?;
        }
        Ok(())
    }

    fn count_spec(&mut self, accepted: usize, rounds: usize) {
        if rounds == 0 {
            return;
        }
        self.spec.verify_ct += rounds;
        self.spec.correct_drafts += accepted;
        let per_round = (accepted + rounds / 2) / rounds;
        if self.spec.histogram.len() <= per_round {
            self.spec.histogram.resize(per_round + 1, 0);
        }
        self.spec.histogram[per_round] += rounds;
    }

    fn absorb(
        &mut self,
        tokens: &[u32],
        logprobs: &[TokenLogprob],
        finished: Option<EngineFinish>,
    ) -> Result<Chunk, ApiError> {
        let now = Instant::now();
        if self.first_token.is_none() && !tokens.is_empty() {
            self.first_token = Some(now);
        } else {
            self.metrics
                .inter_token_latency(now.duration_since(self.last_chunk), tokens.len());
        }
        self.last_chunk = now;
        let mut chunk = Chunk::default();
        let last = tokens.len().saturating_sub(1);
        for (i, &tok) in tokens.iter().enumerate() {
            self.output_ids.push(tok);
            chunk.new_ids.push(tok);
            if let Some(lp) = logprobs.get(i) {
                self.logprobs.push(lp.clone());
                chunk.new_logprobs.push(lp.clone());
            }
            let is_stop_token =
                i == last && matches!(finished, Some(EngineFinish::Stop(t)) if t == tok);
            if is_stop_token && !self.req.no_stop_trim {
                continue;
            }
            let delta = self.decoder.push(&*self.tokenizer, &[tok])?;
            let scan = self.stops.push(&delta);
            chunk.delta.push_str(&scan.released);
            if let Some(m) = scan.matched {
                self.rx = None;
                self.set_finish(Finish::StopString(m.stop));
                break;
            }
        }
        if self.finish.is_none() {
            if let Some(engine_finish) = finished {
                let tail = self.decoder.finish(&*self.tokenizer)?;
                let scan = self.stops.push(&tail);
                chunk.delta.push_str(&scan.released);
                match scan.matched {
                    Some(m) => self.set_finish(Finish::StopString(m.stop)),
                    None => {
                        chunk.delta.push_str(&self.stops.flush());
                        self.set_finish(match engine_finish {
                            EngineFinish::Length => Finish::Length {
                                length: self.output_ids.len(),
                            },
                            EngineFinish::Stop(t) => Finish::StopToken(t),
                        });
                    }
                }
            }
        }
        self.text.push_str(&chunk.delta);
        if let Some((_, parser)) = self.reasoning.as_mut() {
            let mut split = parser.push(&chunk.delta);
            if self.finish.is_some() {
                let rest = parser.finish();
                split.reasoning.push_str(&rest.reasoning);
                split.content.push_str(&rest.content);
            }
            chunk.reasoning_delta = split.reasoning;
            chunk.delta = split.content;
        }
        chunk.finish = self.finish.clone();
        Ok(chunk)
    }

    fn abort(&mut self, f: &EngineFailure) {
        let status = ApiError::Engine(f.clone()).status().as_u16();
        self.rx = None;
        self.set_finish(Finish::Abort {
            message: f.to_string(),
            status,
        });
    }

    fn set_finish(&mut self, finish: Finish) {
        let aborted = matches!(finish, Finish::Abort { .. });
        self.finish = Some(finish);
        self.report(aborted);
    }

    fn report(&mut self, aborted: bool) {
        if self.reported {
            return;
        }
        self.reported = true;
        self.metrics.request_finished(FinishedRequest {
            prompt_tokens: self.prompt_tokens(),
            cached_tokens: self.cached_tokens,
            completion_tokens: self.output_ids.len(),
            e2e: self.started.elapsed(),
            ttft: self.first_token.map(|t| t.duration_since(self.started)),
            aborted,
            streaming: self.req.stream,
        });
    }

    /// SGLang's `meta_info`; the speculative fields and `e2e_latency` only once finished.
    pub fn meta_info(&self) -> Value {
        let mut m = Map::new();
        m.insert("id".into(), json!(self.req.rid));
        m.insert(
            "finish_reason".into(),
            self.finish
                .as_ref()
                .map(Finish::native)
                .unwrap_or(Value::Null),
        );
        m.insert("prompt_tokens".into(), json!(self.prompt_tokens()));
        m.insert("completion_tokens".into(), json!(self.completion_tokens()));
        m.insert("cached_tokens".into(), json!(self.cached_tokens));
        m.insert("reasoning_tokens".into(), json!(self.reasoning_tokens()));
        m.insert("weight_version".into(), json!("default"));
        m.insert("num_retractions".into(), json!(self.retractions));
        if self.finish.is_some() {
            m.insert(
                "e2e_latency".into(),
                json!(self.started.elapsed().as_secs_f64()),
            );
            if let Some(q) = self.queue_time {
                m.insert("queue_time".into(), json!(q.as_secs_f64()));
            }
            if self.spec.verify_ct > 0 {
                for (k, v) in
                    spec_fields(&self.spec, self.completion_tokens(), self.drafts_per_round)
                {
                    m.insert(k.into(), v);
                }
            }
        }
        Value::Object(m)
    }
}

impl Generation {
    /// SGLang's `sglext.spec_tokens_details` (`return_spec_tokens_details`): the per-request
    /// speculative counters under their current names.
    pub fn spec_tokens_details(&self) -> Value {
        let fields = spec_fields(&self.spec, self.completion_tokens(), self.drafts_per_round);
        Value::Object(
            fields
                .into_iter()
                .filter(|(k, _)| CURRENT_SPEC_FIELDS.contains(k))
                .map(|(k, v)| (k.to_string(), v))
                .collect(),
        )
    }
}

/// The SGLang 0.5.23 names among [`spec_fields`] (the rest are legacy aliases).
const CURRENT_SPEC_FIELDS: &[&str] = &[
    "spec_verify_ct",
    "spec_accept_length",
    "spec_accept_rate",
    "spec_num_correct_drafts",
    "spec_num_proposed_drafts",
    "spec_correct_drafts_histogram",
];

impl Drop for Generation {
    fn drop(&mut self) {
        // A client that went away before the end counts as an aborted request.
        self.report(true);
    }
}

/// The per-request speculative fields under SGLang 0.5.23 names and the legacy aliases that
/// third-party harnesses still read (SGLANG_API.md section 1.5).
pub fn spec_fields(
    s: &SpecCounters,
    completion_tokens: usize,
    drafts_per_round: usize,
) -> Vec<(&'static str, Value)> {
    let proposed = s.verify_ct * drafts_per_round;
    let accept_length = completion_tokens as f64 / s.verify_ct.max(1) as f64;
    let accept_rate = if proposed == 0 {
        0.0
    } else {
        s.correct_drafts as f64 / proposed as f64
    };
    vec![
        ("spec_verify_ct", json!(s.verify_ct)),
        ("spec_accept_length", json!(accept_length)),
        ("spec_accept_rate", json!(accept_rate)),
        ("spec_num_correct_drafts", json!(s.correct_drafts)),
        ("spec_num_proposed_drafts", json!(proposed)),
        ("spec_correct_drafts_histogram", json!(s.histogram)),
        ("spec_accept_token_num", json!(s.correct_drafts)),
        ("spec_draft_token_num", json!(proposed)),
        ("spec_accepted_drafts", json!(s.correct_drafts)),
        ("spec_proposed_drafts", json!(proposed)),
        ("spec_accept_histogram", json!(s.histogram)),
    ]
}
