//! The engine thread: the only owner of the model. It admits queued requests up to
//! `--max-running-requests`, steps all running sequences together (continuous batching: new
//! sequences join between steps), and sends each sequence's tokens to its request.
//!
//! Admission is fair between requests: the next sequence admitted belongs to the waiting request
//! with the fewest sequences running, so one large batch cannot hold every slot while another
//! client's single prompt waits behind all of it. Within a request, sequences go in order.
//!
//! Cancellation is by channel: when a request's event receiver is dropped (client disconnect,
//! stop string matched), the next step removes the sequence. Nothing here blocks on the async
//! runtime; sends to tokio's unbounded channels never block.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::AtomicBool;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{mpsc as tmpsc, oneshot, watch};

use super::admission::NewTokenRatio;
use super::handle::{Command, Submission};
pub use super::handle::{
    EngineFailure, EngineHandle, EngineStats, SchedulerLimits, SeqUpdate, StatsSnapshot,
};
use super::steplog::StepClock;
use super::{EngineRequest, EngineSampling, SeqId, StepEngine, StepEvent};
use crate::memory::Trimmer;
use crate::metrics::ServerMetrics;

mod ending;

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
    let trim_wanted = Arc::new(AtomicBool::new(false));
    let (steps_tx, steps) = watch::channel(0u64);
    let ratio = NewTokenRatio::new(limits.schedule_conservativeness);
    let worker = Worker {
        engine,
        limits,
        metrics,
        stats: stats.clone(),
        waiting: VecDeque::new(),
        running: HashMap::new(),
        running_per_group: HashMap::new(),
        next_group: 0,
        reserved_tokens: 0,
        ratio,
        window: Window::new(),
        probes: Vec::new(),
        trimmer: Trimmer::new(trim_wanted.clone()),
        steps_tx,
        graph_replays: 0,
        last_step_graph: false,
        clock: StepClock::default(),
    };
    std::thread::Builder::new()
        .name("dflash-engine".into())
        .spawn(move || worker.run(rx))?;
    Ok(EngineHandle {
        tx,
        stats,
        shutting_down: Arc::new(AtomicBool::new(false)),
        trim_wanted,
        steps,
        info,
    })
}

/// Identifies the HTTP request a sequence came from, for fair admission.
type GroupId = u64;

struct Waiting {
    group: GroupId,
    deadline: Option<Instant>,
    queue_deadline: Option<Instant>,
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
    running_per_group: HashMap<GroupId, usize>,
    next_group: GroupId,
    reserved_tokens: usize,
    /// Admission's estimate of the tokens a request still generates ([`NewTokenRatio`]).
    ratio: NewTokenRatio,
    window: Window,
    /// `/health` probes waiting for the next completed step.
    probes: Vec<oneshot::Sender<()>>,
    trimmer: Trimmer,
    steps_tx: watch::Sender<u64>,
    /// The engine's graph replays after the last step, and whether that step replayed one.
    graph_replays: u64,
    last_step_graph: bool,
    clock: StepClock,
}

struct Running {
    group: GroupId,
    deadline: Option<Instant>,
    rid: String,
    events: tmpsc::UnboundedSender<SeqUpdate>,
    /// KV-cache tokens this sequence reserved at admission.
    reserved: usize,
    /// Retractions the engine reported for it so far.
    retractions: usize,
    /// A health probe's own receiver, kept so the probe is not mistaken for a gone client.
    _probe_rx: Option<tmpsc::UnboundedReceiver<SeqUpdate>>,
}

/// K/V tokens `req` holds while it runs, as `engine` allocates them.
fn reservation<E: StepEngine>(engine: &E, req: &EngineRequest) -> usize {
    engine.reservation(req.prompt.len(), req.max_new_tokens)
}

/// SGLang's health probe: one greedy token from token id 0.
fn probe_request() -> EngineRequest {
    EngineRequest {
        prompt: vec![0],
        max_new_tokens: 1,
        sampling: EngineSampling::greedy(),
        stop_token_ids: Vec::new(),
        ignore_eos: true,
        logprobs: None,
        grammar: None,
        prompt_logprobs: None,
    }
}

impl<E: StepEngine> Worker<E> {
    fn run(mut self, rx: mpsc::Receiver<Command>) {
        loop {
            if self.running.is_empty() && self.waiting.is_empty() {
                // Idle: memory the last requests freed goes back to the OS now, not at the next
                // burst (glibc keeps freed arenas otherwise, and RSS only ratchets up).
                self.trimmer.on_idle();
                match rx.recv_timeout(Duration::from_millis(500)) {
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
            self.trimmer.after_step();
        }
    }

    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Submit { seqs, at } => self.enqueue(seqs, at),
            Command::Flush(reply) => {
                // SGLang's rule: only an idle server flushes.
                let idle = self.running.is_empty() && self.waiting.is_empty();
                if idle {
                    self.engine.flush_cache();
                }
                let _ = reply.send(idle);
            }
            Command::Abort(rid) => self.abort(rid.as_deref()),
            Command::Probe(reply) => self.probe(reply),
        }
    }

    fn enqueue(&mut self, seqs: Vec<Submission>, at: Instant) {
        let fail_all = |seqs: Vec<Submission>, f: EngineFailure| {
            for s in seqs {
                let _ = s.events.send(SeqUpdate::Failed(f.clone()));
            }
        };
        if let Some(needed) = seqs
            .iter()
            .map(|s| reservation(&self.engine, &s.req))
            .find(|&n| n > self.limits.max_total_tokens)
        {
            let capacity = self.limits.max_total_tokens;
            return fail_all(seqs, EngineFailure::TooLargeForCache { needed, capacity });
        }
        let limit = self.limits.max_queued_sequences;
        if self.waiting.len() + seqs.len() > limit {
            let f = EngineFailure::Overloaded {
                queued: self.waiting.len(),
                adding: seqs.len(),
                limit,
            };
            return fail_all(seqs, f);
        }
        let group = self.next_group;
        self.next_group += 1;
        for s in seqs {
            self.waiting.push_back(Waiting {
                group,
                deadline: self.limits.request_timeout.map(|t| at + t),
                queue_deadline: self.limits.queue_timeout.map(|t| at + t),
                rid: s.rid,
                req: s.req,
                events: s.events,
                at,
            });
        }
    }

    /// A busy engine answers after its next step; an idle one runs the probe itself, ahead of
    /// anything queued (there is nothing running, so it takes no slot from a user).
    fn probe(&mut self, reply: oneshot::Sender<()>) {
        self.probes.push(reply);
        if !self.running.is_empty() {
            return;
        }
        let req = probe_request();
        let reserved = reservation(&self.engine, &req);
        match self.engine.add(req) {
            Ok(id) => {
                let (events, rx) = tmpsc::unbounded_channel();
                self.reserved_tokens += reserved;
                let group = self.next_group;
                self.next_group += 1;
                *self.running_per_group.entry(group).or_default() += 1;
                self.running.insert(
                    id,
                    Running {
                        group,
                        deadline: None,
                        rid: "HEALTH_CHECK".into(),
                        events,
                        reserved,
                        retractions: 0,
                        _probe_rx: Some(rx),
                    },
                );
            }
            Err(e) => {
                tracing::error!("the health probe was refused by the engine: {e}");
                self.probes.clear();
            }
        }
    }

    /// Takes `id` out of `running` and returns its KV reservation to the pool.
    fn release(&mut self, id: SeqId) -> Option<Running> {
        let r = self.running.remove(&id)?;
        self.reserved_tokens -= r.reserved;
        if let Some(n) = self.running_per_group.get_mut(&r.group) {
            *n -= 1;
            if *n == 0 {
                self.running_per_group.remove(&r.group);
            }
        }
        self.trimmer.released();
        Some(r)
    }

    /// The waiting sequence to admit next: the first one of the request with the fewest
    /// sequences running (ties go to the earliest), so requests share the slots.
    fn next_candidate(&self) -> Option<usize> {
        let mut best: Option<(usize, usize)> = None;
        let mut seen: Vec<GroupId> = Vec::new();
        for (i, w) in self.waiting.iter().enumerate() {
            if seen.contains(&w.group) {
                continue;
            }
            seen.push(w.group);
            let running = self.running_per_group.get(&w.group).copied().unwrap_or(0);
            if best.is_none_or(|(_, r)| running < r) {
                best = Some((i, running));
                if running == 0 {
                    break;
                }
            }
        }
        best.map(|(i, _)| i)
    }

    /// The chosen candidate waits until both a running slot and its KV reservation are free,
    /// so a long request is never starved by short ones behind it.
    fn admit(&mut self) {
        while self.running.len() < self.limits.max_running_requests {
            let Some(i) = self.next_candidate() else {
                break;
            };
            let head = &self.waiting[i];
            let needed = self.admission_reservation(&head.req);
            if !head.events.is_closed()
                && self.reserved_tokens + needed > self.limits.max_total_tokens
            {
                break;
            }
            let Some(w) = self.waiting.remove(i) else {
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
                    *self.running_per_group.entry(w.group).or_default() += 1;
                    self.running.insert(
                        id,
                        Running {
                            group: w.group,
                            deadline: w.deadline,
                            rid: w.rid,
                            events: w.events,
                            reserved: needed,
                            retractions: 0,
                            _probe_rx: None,
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

    /// K/V tokens admission reserves for `req`: its prompt and the tokens it is expected to
    /// generate when the engine retracts sequences that run short, else all it may take.
    fn admission_reservation(&self, req: &EngineRequest) -> usize {
        if self.engine.retracts() {
            let expected = self.ratio.expected_new_tokens(req.max_new_tokens);
            self.engine.reservation(req.prompt.len(), expected)
        } else {
            reservation(&self.engine, req)
        }
    }

    /// A step that retracted a sequence resets the new-token ratio; any other decays it.
    fn track_retractions(&mut self, events: &[StepEvent]) {
        let mut retracted = false;
        for ev in events {
            if let Some(r) = self.running.get_mut(&ev.id) {
                if ev.retractions > r.retractions {
                    r.retractions = ev.retractions;
                    retracted = true;
                }
            }
        }
        if retracted {
            tracing::info!(
                "a running request was retracted for K/V pages; admission expects whole max_new_tokens again (new_token_ratio {:.3} -> 1)",
                self.ratio.ratio()
            );
            self.ratio.retracted();
        } else {
            self.ratio.step();
        }
    }

    fn publish_state(&self) {
        let (running, waiting, reserved) =
            (self.running.len(), self.waiting.len(), self.reserved_tokens);
        let waiting_tokens = self.waiting.iter().map(|w| w.req.prompt.len()).sum();
        self.stats.update(|s| {
            s.num_running = running;
            s.num_waiting = waiting;
            s.reserved_tokens = reserved;
            s.waiting_tokens = waiting_tokens;
        });
        self.metrics
            .scheduler_state(running, waiting, reserved, self.limits.max_total_tokens);
    }

    fn step(&mut self) {
        let _span = tracing::debug_span!("engine_step", batch = self.running.len()).entered();
        self.clock.begin();
        let stepped = self.engine.step();
        self.clock.engine_done();
        let events = match stepped {
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
                self.running_per_group.clear();
                // Dropping the probes' senders answers /health with 503.
                self.probes.clear();
                self.trimmer.released();
                return;
            }
        };

        let replays = self.engine.graph_replays();
        self.last_step_graph = replays > self.graph_replays;
        self.graph_replays = replays;
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
        self.track_retractions(&events);
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
            if ev.finished.is_some() || ev.error.is_some() {
                self.release(ev.id);
            }
            outgoing.push((tx, ev));
        }
        self.publish_state();
        // After the gauges, so a health answer never shows its own probe still running.
        for probe in self.probes.drain(..) {
            let _ = probe.send(());
        }
        self.steps_tx.send_modify(|n| *n += 1);
        for (tx, ev) in outgoing {
            if let Some(error) = ev.error {
                // The engine dropped it; the others in the step go on.
                tracing::error!("request failed in the engine: {error}");
                let _ = tx.send(SeqUpdate::Failed(EngineFailure::Internal(error)));
                continue;
            }
            let (id, finished) = (ev.id, ev.finished.is_some());
            let sent = tx.send(SeqUpdate::Step {
                tokens: ev.tokens,
                finished: ev.finished,
                accepted_drafts: ev.accepted_drafts,
                verify_rounds: ev.verify_rounds,
                logprobs: ev.logprobs,
                cached_tokens: ev.cached_tokens,
                retractions: ev.retractions,
                prompt_logprobs: ev.prompt_logprobs,
            });
            if !finished && sent.is_err() {
                self.engine.remove(id);
                self.release(id);
            }
        }
        let engine = &self.engine;
        self.clock.end(|| engine.last_step());
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
            "Decode batch, #running-req: {}, #token: {}, token usage: {:.2}, {spec}cuda graph: {}, gen throughput (token/s): {throughput:.2}, #queue-req: {}",
            self.running.len(),
            self.reserved_tokens,
            self.reserved_tokens as f64 / self.limits.max_total_tokens.max(1) as f64,
            if self.last_step_graph { "True" } else { "False" },
            self.waiting.len()
        );
    }
}
