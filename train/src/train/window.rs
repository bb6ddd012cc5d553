//! What a logging window accumulates, and the scalars it turns into: loss and acceptance,
//! throughput, per-stage times, model FLOP utilisation.
//!
//! Stage times come from the window's *timed* steps (its last step), which synchronise the
//! drafter device at each stage boundary; the other steps run without extra synchronisation,
//! so these are samples, reported as seconds per step. Queue wait and target-forward time are
//! measured on every step (the wait is host time; a target worker's time ends with its copy of
//! the features to the host, which waits for the device anyway).

use std::time::Instant;

use candle_core::Device;

use super::loss::Hits;

#[derive(Default)]
pub struct Window {
    pub loss: f64,
    /// Steps with a finite loss.
    pub steps: usize,
    /// All steps, skipped ones included.
    pub all_steps: usize,
    pub hits: Hits,
    pub tokens: usize,
    /// Wall seconds of the steps (everything in the loop but logging, eval and checkpoints).
    pub step_s: f64,
    pub wait_s: f64,
    /// Target-worker seconds of the batches consumed (summed over workers).
    pub target_s: f64,
    pub drafter_flops: f64,
    pub target_flops: f64,
    pub timed: Timed,
}

/// Seconds per stage over the window's timed steps.
#[derive(Default, Clone, Copy)]
pub struct Timed {
    pub steps: usize,
    /// Features host -> drafter device.
    pub h2d_s: f64,
    /// Drafter forward and loss.
    pub forward_s: f64,
    /// Backward and gradient accumulation.
    pub backward_s: f64,
    /// Loss/hit read-back (the step's one host synchronisation).
    pub readback_s: f64,
    /// Gradient norm, clipping and AdamW.
    pub optimizer_s: f64,
}

/// How MFU is counted: peak per device, and how many devices each side uses.
pub struct MfuBasis {
    pub peak_tflops: Option<f64>,
    pub target_devices: usize,
    /// Distinct devices of the whole run (a shared target/drafter GPU counts once).
    pub devices: usize,
}

impl Window {
    /// The window's scalars (JSONL keys and TensorBoard tags).
    pub fn scalars(&self, basis: &MfuBasis) -> Vec<(String, f64)> {
        let wall = self.step_s.max(1e-9);
        let n = self.steps.max(1) as f64;
        let steps = self.all_steps.max(1) as f64;
        let mut v = vec![
            ("loss".to_string(), self.loss / n),
            ("accuracy".into(), self.hits.accuracy()),
            ("tau_estimate".into(), self.hits.tau()),
            ("tokens_per_s".into(), self.tokens as f64 / wall),
            ("step_s".into(), wall / steps),
            ("queue_wait_s".into(), self.wait_s / steps),
            ("queue_wait_frac".into(), self.wait_s / wall),
            ("target_forward_s".into(), self.target_s / steps),
            (
                "target_busy_frac".into(),
                self.target_s / (wall * basis.target_devices.max(1) as f64),
            ),
            ("drafter_tflops".into(), self.drafter_flops / wall / 1e12),
            ("target_tflops".into(), self.target_flops / wall / 1e12),
        ];
        if self.timed.steps > 0 {
            let t = self.timed;
            let k = t.steps as f64;
            v.extend([
                ("stage_h2d_s".to_string(), t.h2d_s / k),
                ("stage_drafter_forward_s".into(), t.forward_s / k),
                ("stage_drafter_backward_s".into(), t.backward_s / k),
                ("stage_readback_s".into(), t.readback_s / k),
                ("stage_optimizer_s".into(), t.optimizer_s / k),
            ]);
        }
        if let Some(peak) = basis.peak_tflops {
            let p = peak * 1e12;
            v.extend([
                ("mfu_drafter".to_string(), self.drafter_flops / wall / p),
                (
                    "mfu_target".into(),
                    self.target_flops / wall / (p * basis.target_devices.max(1) as f64),
                ),
                (
                    "mfu".into(),
                    (self.drafter_flops + self.target_flops)
                        / wall
                        / (p * basis.devices.max(1) as f64),
                ),
            ]);
        }
        v
    }
}

/// A compact `3.2K` style number for log lines.
pub fn human(x: f64) -> String {
    match x.abs() {
        a if a >= 1e6 => format!("{:.2}M", x / 1e6),
        a if a >= 1e4 => format!("{:.1}K", x / 1e3),
        _ => format!("{x:.0}"),
    }
}

/// The log-line / progress-bar summary of a window's scalars.
pub fn describe(s: &[(String, f64)]) -> String {
    let get = |k: &str| s.iter().find(|(n, _)| n == k).map(|(_, v)| *v);
    let mut out = format!(
        "loss {:.4} acc {:.3} tau~{:.2} | {} tok/s, step {:.3}s (wait {:.0}%, target {:.3}s)",
        get("loss").unwrap_or(f64::NAN),
        get("accuracy").unwrap_or(f64::NAN),
        get("tau_estimate").unwrap_or(f64::NAN),
        human(get("tokens_per_s").unwrap_or(0.0)),
        get("step_s").unwrap_or(0.0),
        100.0 * get("queue_wait_frac").unwrap_or(0.0),
        get("target_forward_s").unwrap_or(0.0),
    );
    if let (Some(f), Some(b), Some(o)) = (
        get("stage_drafter_forward_s"),
        get("stage_drafter_backward_s"),
        get("stage_optimizer_s"),
    ) {
        out += &format!(" | fwd {f:.3}s bwd {b:.3}s opt {o:.3}s");
    }
    if let Some(m) = get("mfu") {
        out += &format!(
            " | MFU {:.1}% (drafter {:.1}%, target {:.1}%)",
            100.0 * m,
            100.0 * get("mfu_drafter").unwrap_or(0.0),
            100.0 * get("mfu_target").unwrap_or(0.0)
        );
    } else {
        out += &format!(
            " | {:.2} TFLOP/s",
            get("drafter_tflops").unwrap_or(0.0) + get("target_tflops").unwrap_or(0.0)
        );
    }
    // NVML averages, one group per GPU (`gpuN_util_pct`, ...).
    for (k, util) in s
        .iter()
        .filter(|(k, _)| k.ends_with("_util_pct") && !k.contains("mem"))
    {
        let gpu = k.trim_end_matches("_util_pct");
        let f = |suffix: &str| get(&format!("{gpu}_{suffix}")).unwrap_or(f64::NAN);
        out += &format!(
            " | {gpu} {util:.0}% {:.0}W {:.1}GiB {:.0}C",
            f("power_w"),
            f("mem_used_gib"),
            f("temp_c")
        );
    }
    out
}

#[derive(Clone, Copy)]
pub enum Stage {
    H2d,
    Forward,
    Backward,
    Readback,
    Optimizer,
}

/// Stage times of a timed step: each lap synchronises the device first, so the time is the
/// device's, not the launch queue's. An untimed step's laps cost nothing.
pub struct StageClock<'a> {
    timed: bool,
    device: &'a Device,
    at: Instant,
    t: Timed,
}

impl<'a> StageClock<'a> {
    pub fn new(timed: bool, device: &'a Device) -> Self {
        Self {
            timed,
            device,
            at: Instant::now(),
            t: Default::default(),
        }
    }
    pub fn restart(&mut self) {
        self.at = Instant::now();
    }
    pub fn lap(&mut self, stage: Stage) -> candle_core::Result<()> {
        if !self.timed {
            return Ok(());
        }
        self.device.synchronize()?;
        let now = Instant::now();
        let dt = (now - self.at).as_secs_f64();
        self.at = now;
        let t = &mut self.t;
        *match stage {
            Stage::H2d => &mut t.h2d_s,
            Stage::Forward => &mut t.forward_s,
            Stage::Backward => &mut t.backward_s,
            Stage::Readback => &mut t.readback_s,
            Stage::Optimizer => &mut t.optimizer_s,
        } += dt;
        Ok(())
    }
    pub fn add_to(&self, w: &mut Timed) {
        if self.timed {
            w.steps += 1;
            w.h2d_s += self.t.h2d_s;
            w.forward_s += self.t.forward_s;
            w.backward_s += self.t.backward_s;
            w.readback_s += self.t.readback_s;
            w.optimizer_s += self.t.optimizer_s;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stage_times_and_mfu_appear_only_when_measured() {
        let mut w = Window {
            loss: 6.0,
            steps: 2,
            all_steps: 2,
            tokens: 1000,
            step_s: 2.0,
            drafter_flops: 3e12,
            target_flops: 1e12,
            ..Default::default()
        };
        let basis = |peak| MfuBasis {
            peak_tflops: peak,
            target_devices: 1,
            devices: 1,
        };
        let s = w.scalars(&basis(None));
        let get = |s: &[(String, f64)], k: &str| s.iter().find(|(n, _)| n == k).map(|x| x.1);
        assert_eq!(get(&s, "tokens_per_s"), Some(500.0));
        assert_eq!(get(&s, "drafter_tflops"), Some(1.5));
        assert_eq!(get(&s, "mfu"), None);
        assert_eq!(get(&s, "stage_drafter_forward_s"), None);
        w.timed = Timed {
            steps: 1,
            forward_s: 0.25,
            ..Default::default()
        };
        let s = w.scalars(&basis(Some(4.0)));
        // (3 + 1) TFLOP in 2 s on one 4 TFLOP/s device.
        assert_eq!(get(&s, "mfu"), Some(0.5));
        assert_eq!(get(&s, "stage_drafter_forward_s"), Some(0.25));
        let mut s = s;
        s.extend([
            ("gpu0_util_pct".to_string(), 97.0),
            ("gpu0_mem_util_pct".to_string(), 40.0),
            ("gpu0_power_w".to_string(), 650.0),
            ("gpu0_mem_used_gib".to_string(), 80.0),
            ("gpu0_temp_c".to_string(), 61.0),
        ]);
        let line = describe(&s);
        assert!(line.contains("MFU 50.0%"), "{line}");
        assert!(line.contains("gpu0 97% 650W 80.0GiB 61C"), "{line}");
    }
}
