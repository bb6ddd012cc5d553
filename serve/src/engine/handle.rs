//! The handlers' side of the engine thread: what a request hears back ([`SeqUpdate`]), why it
//! failed ([`EngineFailure`]), the scheduler's limits and statistics, and [`EngineHandle`], the
//! cheap-to-clone sender every handler holds.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{mpsc as tmpsc, oneshot, watch};

use super::{EngineFinish, EngineInfo, EngineRequest};

/// What a request hears from the engine.
#[derive(Debug, Clone, PartialEq)]
pub enum SeqUpdate {
    /// The request left the queue and the engine accepted it.
    Admitted {
        queue_time: Duration,
    },
    Step {
        tokens: Vec<u32>,
        finished: Option<EngineFinish>,
        accepted_drafts: usize,
        verify_rounds: usize,
        /// One per token when the request asked for logprobs.
        logprobs: Vec<super::TokenLogprob>,
        /// Prompt tokens found in the prefix cache (SGLang's `cached_tokens`).
        cached_tokens: usize,
        /// Retractions so far (SGLang's `num_retractions`).
        retractions: usize,
        /// With the first token when asked: the prompt tokens' logprobs.
        prompt_logprobs: Vec<super::TokenLogprob>,
    },
    Failed(EngineFailure),
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EngineFailure {
    /// The engine refused the request at admission (HTTP 400).
    #[error("{0}")]
    Rejected(String),
    /// The waiting queue is full (HTTP 503); a request that could never fit is refused earlier,
    /// with a 400 naming the per-request limit.
    #[error("the server is overloaded: {queued} sequences are already waiting and this request adds {adding} (--max-queued-requests {limit} counts sequences); retry later")]
    Overloaded {
        queued: usize,
        adding: usize,
        limit: usize,
    },
    /// Graceful shutdown has begun (HTTP 503).
    #[error("the server is shutting down and accepts no new requests")]
    ShuttingDown,
    /// `/abort_request` named this request (or all); it ends with finish reason `abort`.
    #[error("aborted by /abort_request")]
    Aborted,
    /// The request ran past `--request-timeout`; it ends with finish reason `abort`.
    #[error("the request did not finish within --request-timeout ({} s)", *millis as f64 / 1000.0)]
    TimedOut { millis: u64 },
    /// The request waited longer than `--queued-request-timeout` for a running slot; it ends
    /// with finish reason `abort` and no output, like any other abort.
    #[error("the request waited in the queue longer than --queued-request-timeout ({} s); retry later", *millis as f64 / 1000.0)]
    QueueTimedOut { millis: u64 },
    /// The request needs more KV-cache tokens than the server has in total.
    #[error("the request needs {needed} KV-cache tokens (prompt + max_new_tokens) but the server holds {capacity} in total (--max-total-tokens); shorten the prompt or max_new_tokens")]
    TooLargeForCache { needed: usize, capacity: usize },
    /// A step failed (HTTP 500).
    #[error("{0}")]
    Internal(String),
}

impl EngineFailure {
    /// Failures that end a request normally with finish reason `abort` (SGLang answers these
    /// with the partial output, HTTP 200), whether it was running or still queued.
    pub fn is_abort(&self) -> bool {
        matches!(
            self,
            EngineFailure::Aborted
                | EngineFailure::TimedOut { .. }
                | EngineFailure::QueueTimedOut { .. }
        )
    }
}

/// Scheduler limits, from `ServeConfig`.
#[derive(Debug, Clone)]
pub struct SchedulerLimits {
    pub max_running_requests: usize,
    /// KV-cache tokens all running sequences may reserve together (prompt + max_new_tokens
    /// each); a request waits until its reservation fits.
    pub max_total_tokens: usize,
    /// Sequences (a batch of 4 prompts with n = 2 is 8) allowed to wait for a slot.
    pub max_queued_sequences: usize,
    /// Wall-clock limit per request from submission (`--request-timeout`); `None`: no limit.
    pub request_timeout: Option<Duration>,
    /// Limit on the time spent waiting for a slot (`--queued-request-timeout`); `None`: none.
    pub queue_timeout: Option<Duration>,
    /// Log the decode line every this many steps (SGLang's `--decode-log-interval`).
    pub decode_log_interval: usize,
    /// `--schedule-conservativeness`: scales the new-token ratio admission starts from.
    pub schedule_conservativeness: f64,
}

/// Cumulative statistics for `/server_info` and health.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StatsSnapshot {
    pub num_running: usize,
    pub num_waiting: usize,
    /// KV-cache tokens reserved by running sequences.
    pub reserved_tokens: usize,
    /// Prompt tokens of the sequences still waiting for admission.
    pub waiting_tokens: usize,
    pub steps: u64,
    pub generated_tokens: u64,
    /// Tokens committed by steps that verified drafts, and those verify rounds (for accept length).
    pub spec_tokens: u64,
    pub verify_rounds: u64,
    pub accepted_drafts: u64,
    pub last_gen_throughput: f64,
    pub drafts_per_round: usize,
}

impl StatsSnapshot {
    /// Tokens per verify round, bonus included (1.0 when nothing was verified yet).
    pub fn avg_spec_accept_length(&self) -> f64 {
        if self.verify_rounds == 0 {
            1.0
        } else {
            self.spec_tokens as f64 / self.verify_rounds as f64
        }
    }
}

#[derive(Debug, Default)]
pub struct EngineStats {
    inner: Mutex<StatsSnapshot>,
}

impl EngineStats {
    pub fn snapshot(&self) -> StatsSnapshot {
        match self.inner.lock() {
            Ok(g) => g.clone(),
            Err(poisoned) => poisoned.into_inner().clone(),
        }
    }

    pub(super) fn update(&self, f: impl FnOnce(&mut StatsSnapshot)) {
        match self.inner.lock() {
            Ok(mut g) => f(&mut g),
            Err(poisoned) => f(&mut poisoned.into_inner()),
        }
    }
}

/// One sequence of a submission.
pub(super) struct Submission {
    pub rid: String,
    pub req: EngineRequest,
    pub events: tmpsc::UnboundedSender<SeqUpdate>,
}

pub(super) enum Command {
    /// Every sequence of one HTTP request (a batch, `n` samples): queued together or refused
    /// together, so a request is never half admitted.
    Submit { seqs: Vec<Submission>, at: Instant },
    /// Replies `true` when nothing is running or waiting (there is no prefix cache to drop yet).
    Flush(oneshot::Sender<bool>),
    /// `/abort_request`: one request id, or every request when `None`.
    Abort(Option<String>),
    /// `/health`: answered after the next completed step; an idle engine runs a one-token
    /// probe ahead of any queue so the answer proves the model still steps.
    Probe(oneshot::Sender<()>),
}

/// The handlers' side of the engine thread. Cheap to clone.
#[derive(Clone)]
pub struct EngineHandle {
    pub(super) tx: mpsc::Sender<Command>,
    pub(super) stats: Arc<EngineStats>,
    pub(super) shutting_down: Arc<AtomicBool>,
    /// Set by handlers that freed a large buffer; the engine thread returns the memory to the
    /// OS when it next has a moment (see `crate::memory`).
    pub(super) trim_wanted: Arc<AtomicBool>,
    /// Steps completed so far, so a probe can see a step finish after it began.
    pub(super) steps: watch::Receiver<u64>,
    pub(super) info: EngineInfo,
}

impl std::fmt::Debug for EngineHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineHandle").finish_non_exhaustive()
    }
}

impl EngineHandle {
    /// Queues one sequence; see [`EngineHandle::submit_all`].
    pub fn submit(&self, rid: &str, req: EngineRequest) -> tmpsc::UnboundedReceiver<SeqUpdate> {
        let mut rxs = self.submit_all(vec![(rid.to_string(), req)]);
        match rxs.pop() {
            Some(rx) => rx,
            None => {
                let (tx, rx) = tmpsc::unbounded_channel();
                let _ = tx.send(SeqUpdate::Failed(EngineFailure::Internal(
                    "no receiver for a submitted sequence".into(),
                )));
                rx
            }
        }
    }

    /// Queues every sequence of one request; each one's updates (or one `Failed`) arrive on its
    /// receiver, in the order given. Dropping a receiver cancels that sequence.
    pub fn submit_all(
        &self,
        seqs: Vec<(String, EngineRequest)>,
    ) -> Vec<tmpsc::UnboundedReceiver<SeqUpdate>> {
        let mut rxs = Vec::with_capacity(seqs.len());
        let mut subs = Vec::with_capacity(seqs.len());
        for (rid, req) in seqs {
            let (events, rx) = tmpsc::unbounded_channel();
            rxs.push(rx);
            subs.push(Submission { rid, req, events });
        }
        let fail_all = |subs: &[Submission], f: EngineFailure| {
            for s in subs {
                let _ = s.events.send(SeqUpdate::Failed(f.clone()));
            }
        };
        if self.shutting_down.load(Ordering::SeqCst) {
            fail_all(&subs, EngineFailure::ShuttingDown);
            return rxs;
        }
        let cmd = Command::Submit {
            seqs: subs,
            at: Instant::now(),
        };
        if let Err(mpsc::SendError(Command::Submit { seqs, .. })) = self.tx.send(cmd) {
            fail_all(
                &seqs,
                EngineFailure::Internal("the engine thread has stopped; restart the server".into()),
            );
        }
        rxs
    }

    /// True when the engine was idle (and so "flushed").
    pub async fn flush_cache(&self) -> bool {
        let (tx, rx) = oneshot::channel();
        if self.tx.send(Command::Flush(tx)).is_err() {
            return false;
        }
        rx.await.unwrap_or(false)
    }

    /// Resolves once the engine has completed a step after this call (a busy engine's next
    /// step, or an idle engine's one-token probe). An error means the engine thread is gone or
    /// the step failed.
    pub async fn probe(&self) -> Result<(), EngineFailure> {
        let mut steps = self.steps.clone();
        steps.borrow_and_update();
        let (tx, rx) = oneshot::channel();
        self.tx
            .send(Command::Probe(tx))
            .map_err(|_| EngineFailure::Internal("the engine thread has stopped".into()))?;
        // The step in progress when the probe arrived counts too (SGLang: any scheduler output
        // after the probe began); the engine only reads the probe after that step.
        tokio::select! {
            answer = rx => answer
                .map_err(|_| EngineFailure::Internal("the engine step failed".into())),
            changed = steps.changed() => changed
                .map_err(|_| EngineFailure::Internal("the engine thread has stopped".into())),
        }
    }

    /// Ends the running or waiting request `rid` (every request when `None`) with finish reason
    /// `abort`. Unknown ids are ignored, as SGLang does.
    pub fn abort(&self, rid: Option<String>) {
        let _ = self.tx.send(Command::Abort(rid));
    }

    /// Asks the engine thread to hand freed heap memory back to the OS soon.
    pub fn request_trim(&self) {
        self.trim_wanted.store(true, Ordering::Relaxed);
    }

    /// Resolves once nothing is running or waiting (for the graceful-shutdown drain).
    pub async fn idle(&self) {
        loop {
            let s = self.stats.snapshot();
            if s.num_running == 0 && s.num_waiting == 0 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub fn stats(&self) -> StatsSnapshot {
        self.stats.snapshot()
    }

    pub fn info(&self) -> &EngineInfo {
        &self.info
    }

    /// Refuse new requests from now on; running ones finish.
    pub fn begin_shutdown(&self) {
        self.shutting_down.store(true, Ordering::SeqCst);
    }

    pub fn is_shutting_down(&self) -> bool {
        self.shutting_down.load(Ordering::SeqCst)
    }
}
