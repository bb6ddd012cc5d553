//! The engine thread: the only owner of the model. It admits queued requests up to
//! `--max-running-requests`, steps all running sequences together (continuous batching: new
//! sequences join between steps), and sends each sequence's tokens to its request.
//!
//! Cancellation is by channel: when a request's event receiver is dropped (client disconnect,
//! stop string matched), the next step removes the sequence. Nothing here blocks on the async
//! runtime; sends to tokio's unbounded channels never block.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{mpsc as tmpsc, oneshot};

use super::{EngineFinish, EngineInfo, EngineRequest, SeqId, StepEngine};
use crate::metrics::ServerMetrics;

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
    },
    Failed(EngineFailure),
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EngineFailure {
    /// The engine refused the request at admission (HTTP 400).
    #[error("{0}")]
    Rejected(String),
    /// The waiting queue is full (HTTP 503).
    #[error("the server is overloaded: {queued} requests are already waiting (--max-queued-requests); retry later")]
    Overloaded { queued: usize },
    /// Graceful shutdown has begun (HTTP 503).
    #[error("the server is shutting down and accepts no new requests")]
    ShuttingDown,
    /// `/abort_request` named this request (or all); it ends with finish reason `abort`.
    #[error("aborted by /abort_request")]
    Aborted,
    /// The request ran past `--request-timeout`; it ends with finish reason `abort`.
    #[error("the request did not finish within --request-timeout ({} s)", *millis as f64 / 1000.0)]
    TimedOut { millis: u64 },
    /// The request needs more KV-cache tokens than the server has in total.
    #[error("the request needs {needed} KV-cache tokens (prompt + max_new_tokens) but the server holds {capacity} in total (--max-total-tokens); shorten the prompt or max_new_tokens")]
    TooLargeForCache { needed: usize, capacity: usize },
    /// A step failed (HTTP 500).
    #[error("{0}")]
    Internal(String),
}

/// Scheduler limits, from `ServeConfig`.
#[derive(Debug, Clone)]
pub struct SchedulerLimits {
    pub max_running_requests: usize,
    /// KV-cache tokens all running sequences may reserve together (prompt + max_new_tokens
    /// each); a request waits until its reservation fits.
    pub max_total_tokens: usize,
    pub max_queued_requests: usize,
    /// Wall-clock limit per request from submission (`--request-timeout`); `None`: no limit.
    pub request_timeout: Option<Duration>,
    /// Log the decode line every this many steps (SGLang's `--decode-log-interval`).
    pub decode_log_interval: usize,
}

/// Cumulative statistics for `/server_info` and health.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StatsSnapshot {
    pub num_running: usize,
    pub num_waiting: usize,
    /// KV-cache tokens reserved by running sequences.
    pub reserved_tokens: usize,
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

    fn update(&self, f: impl FnOnce(&mut StatsSnapshot)) {
        match self.inner.lock() {
            Ok(mut g) => f(&mut g),
            Err(poisoned) => f(&mut poisoned.into_inner()),
        }
    }
}

enum Command {
    Submit {
        rid: String,
        req: EngineRequest,
        events: tmpsc::UnboundedSender<SeqUpdate>,
        at: Instant,
    },
    /// Replies `true` when nothing is running or waiting (there is no prefix cache to drop yet).
    Flush(oneshot::Sender<bool>),
    /// `/abort_request`: one request id, or every request when `None`.
    Abort(Option<String>),
}

/// The handlers' side of the engine thread. Cheap to clone.
#[derive(Clone)]
pub struct EngineHandle {
    tx: mpsc::Sender<Command>,
    stats: Arc<EngineStats>,
    shutting_down: Arc<AtomicBool>,
    info: EngineInfo,
}

impl std::fmt::Debug for EngineHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineHandle").finish_non_exhaustive()
    }
}

impl EngineHandle {
    /// Queues `req`; its updates (or one `Failed`) arrive on the returned receiver. Dropping the
    /// receiver cancels the request.
    pub fn submit(&self, rid: &str, req: EngineRequest) -> tmpsc::UnboundedReceiver<SeqUpdate> {
        let (events, rx) = tmpsc::unbounded_channel();
        if self.shutting_down.load(Ordering::SeqCst) {
            let _ = events.send(SeqUpdate::Failed(EngineFailure::ShuttingDown));
            return rx;
        }
        let cmd = Command::Submit {
            rid: rid.to_string(),
            req,
            events: events.clone(),
            at: Instant::now(),
        };
        if self.tx.send(cmd).is_err() {
            let _ = events.send(SeqUpdate::Failed(EngineFailure::Internal(
                "the engine thread has stopped; restart the server".into(),
            )));
        }
        rx
    }

    /// True when the engine was idle (and so "flushed").
    pub async fn flush_cache(&self) -> bool {
        let (tx, rx) = oneshot::channel();
        if self.tx.send(Command::Flush(tx)).is_err() {
            return false;
        }
        rx.await.unwrap_or(false)
    }

    /// Ends the running or waiting request `rid` (every request when `None`) with finish reason
    /// `abort`. Unknown ids are ignored, as SGLang does.
    pub fn abort(&self, rid: Option<String>) {
        let _ = self.tx.send(Command::Abort(rid));
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

/// Starts the engine thread. It exits when every [`EngineHandle`] is dropped and no sequence is
/// left.
pub fn spawn_engine_thread<E: StepEngine>(
    engine: E,
    limits: SchedulerLimits,
    metrics: Arc<ServerMetrics>,
) -> std::io::Result<EngineHandle> {
    let (tx, rx) = mpsc::channel();
    let stats = Arc::new(EngineStats::default());
    let info = engine.info();
    stats.update(|s| s.drafts_per_round = info.drafts_per_round);
    let worker = Worker {
        engine,
        limits,
        metrics,
        stats: stats.clone(),
        waiting: VecDeque::new(),
        running: HashMap::new(),
        reserved_tokens: 0,
        window: Window::new(),
    };
    std::thread::Builder::new()
        .name("dflash-engine".into())
        .spawn(move || worker.run(rx))?;
    Ok(EngineHandle {
        tx,
        stats,
        shutting_down: Arc::new(AtomicBool::new(false)),
        info,
    })
}

struct Waiting {
    deadline: Option<Instant>,
    rid: String,
    req: EngineRequest,
    events: tmpsc::UnboundedSender<SeqUpdate>,
    at: Instant,
}

/// Counters over one decode-log window.
struct Window {
    started: Instant,
    steps: usize,
    tokens: u64,
    spec_tokens: u64,
    verify_rounds: u64,
    accepted: u64,
}

impl Window {
    fn new() -> Self {
        Self {
            started: Instant::now(),
            steps: 0,
            tokens: 0,
            spec_tokens: 0,
            verify_rounds: 0,
            accepted: 0,
        }
    }
}

struct Worker<E> {
    engine: E,
    limits: SchedulerLimits,
    metrics: Arc<ServerMetrics>,
    stats: Arc<EngineStats>,
    waiting: VecDeque<Waiting>,
    running: HashMap<SeqId, Running>,
    reserved_tokens: usize,
    window: Window,
}

struct Running {
    deadline: Option<Instant>,
    rid: String,
    events: tmpsc::UnboundedSender<SeqUpdate>,
    /// KV-cache tokens this sequence reserved at admission.
    reserved: usize,
}

/// KV-cache tokens a request may occupy: its prompt plus its whole completion budget.
/// K/V tokens `req` holds while it runs, as `engine` allocates them.
fn reservation<E: StepEngine>(engine: &E, req: &EngineRequest) -> usize {
    engine.reservation(req.prompt.len(), req.max_new_tokens)
}

impl<E: StepEngine> Worker<E> {
    fn run(mut self, rx: mpsc::Receiver<Command>) {
        loop {
            if self.running.is_empty() && self.waiting.is_empty() {
                match rx.recv_timeout(Duration::from_secs(1)) {
                    Ok(cmd) => self.handle(cmd),
                    Err(RecvTimeoutError::Timeout) => continue,
                    Err(RecvTimeoutError::Disconnected) => return,
                }
            }
            while let Ok(cmd) = rx.try_recv() {
                self.handle(cmd);
            }
            self.expire();
            self.admit();
            self.drop_cancelled();
            self.publish_state();
            if !self.running.is_empty() {
                self.step();
                self.publish_state();
            }
        }
    }

    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Submit {
                rid,
                req,
                events,
                at,
            } => {
                let needed = reservation(&self.engine, &req);
                if needed > self.limits.max_total_tokens {
                    let _ = events.send(SeqUpdate::Failed(EngineFailure::TooLargeForCache {
                        needed,
                        capacity: self.limits.max_total_tokens,
                    }));
                    return;
                }
                if self.waiting.len() >= self.limits.max_queued_requests {
                    let _ = events.send(SeqUpdate::Failed(EngineFailure::Overloaded {
                        queued: self.waiting.len(),
                    }));
                    return;
                }
                self.waiting.push_back(Waiting {
                    deadline: self.limits.request_timeout.map(|t| at + t),
                    rid,
                    req,
                    events,
                    at,
                });
            }
            Command::Flush(reply) => {
                let _ = reply.send(self.running.is_empty() && self.waiting.is_empty());
            }
            Command::Abort(rid) => self.abort(rid.as_deref()),
        }
    }

    fn abort(&mut self, rid: Option<&str>) {
        let hit = |r: &str| rid.is_none_or(|want| want == r);
        let ids: Vec<SeqId> = self
            .running
            .iter()
            .filter(|(_, r)| hit(&r.rid))
            .map(|(id, _)| *id)
            .collect();
        for id in ids {
            self.engine.remove(id);
            if let Some(r) = self.release(id) {
                let _ = r.events.send(SeqUpdate::Failed(EngineFailure::Aborted));
            }
        }
        self.waiting.retain(|w| {
            let keep = !hit(&w.rid);
            if !keep {
                let _ = w.events.send(SeqUpdate::Failed(EngineFailure::Aborted));
            }
            keep
        });
    }

    /// Ends requests past their `--request-timeout` deadline, running or still waiting.
    fn expire(&mut self) {
        let Some(limit) = self.limits.request_timeout else {
            return;
        };
        let now = Instant::now();
        let late = |d: &Option<Instant>| d.is_some_and(|d| now >= d);
        let failure = EngineFailure::TimedOut {
            millis: limit.as_millis() as u64,
        };
        let ids: Vec<SeqId> = self
            .running
            .iter()
            .filter(|(_, r)| late(&r.deadline))
            .map(|(id, _)| *id)
            .collect();
        for id in ids {
            self.engine.remove(id);
            if let Some(r) = self.release(id) {
                let _ = r.events.send(SeqUpdate::Failed(failure.clone()));
            }
        }
        self.waiting.retain(|w| {
            let keep = !late(&w.deadline);
            if !keep {
                let _ = w.events.send(SeqUpdate::Failed(failure.clone()));
            }
            keep
        });
    }

    /// Takes `id` out of `running` and returns its KV reservation to the pool.
    fn release(&mut self, id: SeqId) -> Option<Running> {
        let r = self.running.remove(&id)?;
        self.reserved_tokens -= r.reserved;
        Some(r)
    }

    /// First come, first served: the head of the queue waits until both a running slot and its
    /// KV reservation are free, so a long request is never starved by short ones behind it.
    fn admit(&mut self) {
        while self.running.len() < self.limits.max_running_requests {
            let Some(head) = self.waiting.front() else {
                break;
            };
            let needed = reservation(&self.engine, &head.req);
            if !head.events.is_closed()
                && self.reserved_tokens + needed > self.limits.max_total_tokens
            {
                break;
            }
            let Some(w) = self.waiting.pop_front() else {
                break;
            };
            if w.events.is_closed() {
                continue;
            }
            match self.engine.add(w.req) {
                Ok(id) => {
                    let queue_time = w.at.elapsed();
                    self.metrics.queue_time(queue_time);
                    let _ = w.events.send(SeqUpdate::Admitted { queue_time });
                    self.reserved_tokens += needed;
                    self.running.insert(
                        id,
                        Running {
                            deadline: w.deadline,
                            rid: w.rid,
                            events: w.events,
                            reserved: needed,
                        },
                    );
                }
                Err(e) if e.server_fault => {
                    tracing::error!("{} (request {})", e.message, w.rid);
                    let _ = w
                        .events
                        .send(SeqUpdate::Failed(EngineFailure::Internal(e.message)));
                }
                Err(e) => {
                    let _ = w
                        .events
                        .send(SeqUpdate::Failed(EngineFailure::Rejected(e.message)));
                }
            }
        }
    }

    fn drop_cancelled(&mut self) {
        let gone: Vec<SeqId> = self
            .running
            .iter()
            .filter(|(_, r)| r.events.is_closed())
            .map(|(id, _)| *id)
            .collect();
        for id in gone {
            self.engine.remove(id);
            self.release(id);
        }
        self.waiting.retain(|w| !w.events.is_closed());
    }

    fn publish_state(&self) {
        let (running, waiting, reserved) =
            (self.running.len(), self.waiting.len(), self.reserved_tokens);
        self.stats.update(|s| {
            s.num_running = running;
            s.num_waiting = waiting;
            s.reserved_tokens = reserved;
        });
        self.metrics
            .scheduler_state(running, waiting, reserved, self.limits.max_total_tokens);
    }

    fn step(&mut self) {
        let _span = tracing::debug_span!("engine_step", batch = self.running.len()).entered();
        let events = match self.engine.step() {
            Ok(events) => events,
            Err(e) => {
                tracing::error!("{e}; aborting {} running requests", self.running.len());
                for (id, r) in self.running.drain() {
                    self.engine.remove(id);
                    let _ = r
                        .events
                        .send(SeqUpdate::Failed(EngineFailure::Internal(e.to_string())));
                }
                self.reserved_tokens = 0;
                return;
            }
        };
        let (mut tokens, mut spec_tokens, mut rounds, mut accepted) = (0u64, 0u64, 0u64, 0u64);
        for ev in &events {
            let n = ev.tokens.len() as u64;
            tokens += n;
            if ev.verify_rounds > 0 {
                spec_tokens += n;
                rounds += ev.verify_rounds as u64;
                accepted += ev.accepted_drafts as u64;
            }
        }
        // Counters first: a client that reads /metrics right after its last token must see them.
        self.metrics.verify_calls(rounds as usize);
        self.stats.update(|s| {
            s.steps += 1;
            s.generated_tokens += tokens;
            s.spec_tokens += spec_tokens;
            s.verify_rounds += rounds;
            s.accepted_drafts += accepted;
        });
        // Finished sequences leave `running` and the gauges are published before any client
        // hears its last token, so /metrics read right after a response is already current.
        let mut outgoing = Vec::with_capacity(events.len());
        for ev in events {
            let Some(tx) = self.running.get(&ev.id).map(|r| r.events.clone()) else {
                continue;
            };
            if ev.finished.is_some() {
                self.release(ev.id);
            }
            outgoing.push((tx, ev));
        }
        self.publish_state();
        for (tx, ev) in outgoing {
            let (id, finished) = (ev.id, ev.finished.is_some());
            let sent = tx.send(SeqUpdate::Step {
                tokens: ev.tokens,
                finished: ev.finished,
                accepted_drafts: ev.accepted_drafts,
                verify_rounds: ev.verify_rounds,
            });
            if !finished && sent.is_err() {
                self.engine.remove(id);
                self.release(id);
            }
        }
        let w = &mut self.window;
        w.steps += 1;
        w.tokens += tokens;
        w.spec_tokens += spec_tokens;
        w.verify_rounds += rounds;
        w.accepted += accepted;
        if w.steps >= self.limits.decode_log_interval.max(1) {
            self.log_window();
        }
    }

    /// SGLang's periodic decode line, and the gauges it updates.
    fn log_window(&mut self) {
        let w = std::mem::replace(&mut self.window, Window::new());
        let secs = w.started.elapsed().as_secs_f64().max(1e-9);
        let throughput = w.tokens as f64 / secs;
        let drafts = self.stats.snapshot().drafts_per_round;
        let (accept_len, accept_rate) = if w.verify_rounds > 0 {
            let len = w.spec_tokens as f64 / w.verify_rounds as f64;
            let proposed = (w.verify_rounds as usize * drafts).max(1) as f64;
            (Some(len), Some(w.accepted as f64 / proposed))
        } else {
            (None, None)
        };
        self.stats.update(|s| s.last_gen_throughput = throughput);
        self.metrics
            .decode_window(throughput, accept_len, accept_rate);
        let spec = match (accept_len, accept_rate) {
            (Some(l), Some(r)) => format!("accept len: {l:.2}, accept rate: {r:.2}, "),
            _ => String::new(),
        };
        tracing::info!(
            "Decode batch, #running-req: {}, #token: {}, token usage: {:.2}, {spec}cuda graph: False, gen throughput (token/s): {throughput:.2}, #queue-req: {}",
            self.running.len(),
            self.reserved_tokens,
            self.reserved_tokens as f64 / self.limits.max_total_tokens.max(1) as f64,
            self.waiting.len()
        );
    }
}
