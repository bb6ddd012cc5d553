//! Diagnostic phase timing of speculative rounds, off by default.
//!
//! The engine's own stats (`RoundStats`) time phases on the host only: device work launched in
//! one phase and finished in the next (the commit's cache compaction, say) is charged to the
//! phase that waits for it. With profiling on, every [`mark`] first waits for the device, so a
//! phase's time is the host and device work it launched, and [`timed`] spans (graph captures)
//! are measured the same way. The waits slow the round down, so `dflash-serve bench` reports
//! these phases from a separate, profiled run. Off, a mark costs one relaxed atomic load: the
//! shipped engine adds no device synchronisation for it.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use candle_core::Device;

static ON: AtomicBool = AtomicBool::new(false);
static STATE: Mutex<State> = Mutex::new(State {
    last: None,
    phases: BTreeMap::new(),
});

struct State {
    /// When the current phase began (the previous mark).
    last: Option<Instant>,
    phases: BTreeMap<&'static str, PhaseTime>,
}

/// Totals of one phase (or span, or counted event) since profiling was switched on.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PhaseTime {
    pub count: u64,
    pub total: Duration,
    pub max: Duration,
}

impl PhaseTime {
    fn add(&mut self, d: Duration) {
        self.count += 1;
        self.total += d;
        self.max = self.max.max(d);
    }

    /// Mean milliseconds per occurrence (0 when none).
    pub fn mean_ms(&self) -> f64 {
        if self.count == 0 {
            0.0
        } else {
            self.total.as_secs_f64() * 1e3 / self.count as f64
        }
    }
}

/// Switches profiling on or off; either way the totals start again from empty.
pub fn enable(on: bool) {
    let mut s = STATE.lock().unwrap_or_else(|e| e.into_inner());
    s.last = None;
    s.phases.clear();
    ON.store(on, Ordering::Relaxed);
}

pub fn is_on() -> bool {
    ON.load(Ordering::Relaxed)
}

/// Waits for `dev`; errors are ignored (a failed wait only blurs a diagnostic figure, and the
/// next real device call reports the error).
fn wait(dev: &Device) {
    let _ = dev.synchronize();
}

/// Ends the current phase: waits for the device and charges the time since the previous mark
/// to `name`. The first mark after [`enable`] or [`begin`] only starts the clock.
pub fn mark(dev: &Device, name: &'static str) {
    if !is_on() {
        return;
    }
    wait(dev);
    let now = Instant::now();
    let mut s = STATE.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(last) = s.last.replace(now) {
        s.phases.entry(name).or_default().add(now - last);
    }
}

/// Starts the clock without charging anything (the caller's idle time before a round).
pub fn begin(dev: &Device) {
    if !is_on() {
        return;
    }
    wait(dev);
    STATE.lock().unwrap_or_else(|e| e.into_inner()).last = Some(Instant::now());
}

/// Runs `f` and, when profiling, charges its time (device waited for before and after) to
/// `name` as well; the enclosing phase still includes it.
pub fn timed<R>(dev: &Device, name: &'static str, f: impl FnOnce() -> R) -> R {
    if !is_on() {
        return f();
    }
    wait(dev);
    let t = Instant::now();
    let r = f();
    wait(dev);
    let d = t.elapsed();
    with_phase(name, |p| p.add(d));
    r
}

/// Applies `f` to the totals of `name` (created empty on first use).
fn with_phase(name: &'static str, f: impl FnOnce(&mut PhaseTime)) {
    f(STATE
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .phases
        .entry(name)
        .or_default());
}

/// Counts an event under `name` (its time stays zero).
pub fn count(name: &'static str) {
    if !is_on() {
        return;
    }
    with_phase(name, |p| p.count += 1);
}

/// The totals so far, by name.
pub fn snapshot() -> BTreeMap<&'static str, PhaseTime> {
    STATE
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .phases
        .clone()
}

#[cfg(test)]
mod tests {
    use super::*;

    // One test: profiling state is global, and parallel tests would share it.
    #[test]
    fn marks_charge_the_time_between_them_and_cost_nothing_when_off() {
        let dev = Device::Cpu;
        enable(false);
        mark(&dev, "a");
        count("c");
        assert_eq!(timed(&dev, "t", || 7), 7);
        assert!(snapshot().is_empty(), "off: nothing is recorded");

        enable(true);
        mark(&dev, "a"); // starts the clock only
        assert!(snapshot().is_empty());
        std::thread::sleep(Duration::from_millis(3));
        mark(&dev, "a");
        timed(&dev, "t", || std::thread::sleep(Duration::from_millis(2)));
        mark(&dev, "b");
        count("c");
        count("c");
        let s = snapshot();
        assert_eq!(s["a"].count, 1);
        assert!(s["a"].total >= Duration::from_millis(3));
        assert_eq!(s["t"].count, 1);
        assert!(s["t"].max >= Duration::from_millis(2));
        assert!(
            s["b"].total >= s["t"].total,
            "the enclosing phase includes the span"
        );
        assert_eq!((s["c"].count, s["c"].total), (2, Duration::ZERO));
        assert!(s["a"].mean_ms() >= 3.0);

        begin(&dev);
        mark(&dev, "d");
        assert_eq!(snapshot()["d"].count, 1, "begin restarts the clock");
        enable(false);
        assert!(snapshot().is_empty());
    }
}
