//! Per-step timing on the engine thread, logged at debug level under the target
//! `dflash_serve::steps` (`RUST_LOG=info,dflash_serve::steps=debug`): how long the engine's
//! step took, what it held (the engine's own report: decoding rows, prefill pieces, its cost
//! estimate), how long handing its tokens to the streams took, and how long the thread spent
//! between steps (commands, admission, trims). An inter-token gap that a client sees and no
//! step or gap here explains happened outside the engine thread.

use std::time::Instant;

pub const TARGET: &str = "dflash_serve::steps";

#[derive(Debug, Default)]
pub struct StepClock {
    /// When the previous step's events were handed out.
    last_end: Option<Instant>,
    started: Option<Instant>,
    engine_done: Option<Instant>,
    steps: u64,
}

fn ms(a: Instant, b: Instant) -> f64 {
    b.saturating_duration_since(a).as_secs_f64() * 1e3
}

impl StepClock {
    pub fn enabled() -> bool {
        tracing::enabled!(target: TARGET, tracing::Level::DEBUG)
    }

    pub fn begin(&mut self) {
        self.started = Some(Instant::now());
        self.engine_done = None;
    }

    pub fn engine_done(&mut self) {
        self.engine_done = Some(Instant::now());
    }

    /// The step's events are out: logs the step (when enabled) with `report` (what the
    /// engine says the step held).
    pub fn end(&mut self, report: impl FnOnce() -> Option<String>) {
        let now = Instant::now();
        self.steps += 1;
        if let (true, Some(start), Some(done)) = (Self::enabled(), self.started, self.engine_done) {
            let between = self.last_end.map_or(0.0, |t| ms(t, start));
            tracing::debug!(
                target: TARGET,
                "step {}: engine {:.2} ms, events {:.2} ms, before it {:.2} ms; {}",
                self.steps,
                ms(start, done),
                ms(done, now),
                between,
                report().unwrap_or_default()
            );
        }
        self.last_end = Some(now);
    }
}
