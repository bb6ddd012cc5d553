//! Training observability that stays off the hot path: a progress bar on a terminal (log lines
//! otherwise), metrics to `metrics.jsonl` and TensorBoard event files, GPU telemetry from a
//! background NVML thread. Every value reaching here is already on the host.

pub mod gpu;
pub mod jsonl;
pub mod tfevents;

use std::fs::File;
use std::io::{IsTerminal, Write};
use std::path::Path;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde_json::{Map, Value};

pub use gpu::{GpuMonitor, GpuStats};
pub use tfevents::EventWriter;

/// Named scalars of one record (JSONL keys; TensorBoard tags under a prefix).
pub type Scalars = Vec<(String, f64)>;

pub struct Reporter {
    jsonl: File,
    events: Option<EventWriter>,
    bar: ProgressBar,
    gpus: Option<GpuMonitor>,
    /// The bar's message parts: the last window's summary and the last eval's taus.
    window_msg: String,
    eval_msg: String,
}

impl Reporter {
    /// Opens `dir/metrics.jsonl`, cut back to the records of steps up to `start` and appended
    /// from there (`jsonl.rs`: one record per step across resumes), and `dir/tensorboard/`.
    /// The bar spans `total` steps and starts at `start`; it draws only on a terminal.
    pub fn new(
        dir: &Path,
        total: usize,
        start: usize,
        cuda: &[usize],
        gpu_every: Duration,
    ) -> std::io::Result<Self> {
        let jsonl = jsonl::open_from_step(&dir.join("metrics.jsonl"), start)?;
        let events = match EventWriter::create(&dir.join("tensorboard")) {
            Ok(w) => Some(w),
            Err(e) => {
                tracing::warn!("TensorBoard events off: {e}");
                None
            }
        };
        let bar = if std::io::stderr().is_terminal() {
            let b = ProgressBar::with_draw_target(Some(total as u64), ProgressDrawTarget::stderr());
            b.set_style(
                ProgressStyle::with_template(
                    "{bar:30} {pos}/{len} steps [{elapsed_precise} < {eta_precise}] {msg}",
                )
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
            );
            b.set_position(start as u64);
            b
        } else {
            ProgressBar::hidden()
        };
        Ok(Self {
            jsonl,
            events,
            bar,
            gpus: GpuMonitor::start(cuda, gpu_every),
            window_msg: String::new(),
            eval_msg: String::new(),
        })
    }

    /// Whether a bar is drawn (log lines are then printed above it).
    pub fn bar_visible(&self) -> bool {
        !self.bar.is_hidden()
    }

    /// Appends one JSON object (`kind` tags step, window and eval records).
    pub fn jsonl(&mut self, kind: &str, step: usize, fields: &Scalars, extra: Map<String, Value>) {
        let mut m = Map::new();
        m.insert("kind".into(), kind.into());
        m.insert("step".into(), step.into());
        for (k, v) in fields {
            m.insert(k.clone(), json_f64(*v));
        }
        m.extend(extra);
        // One write per record: a crash tears at most the last line, which a resume drops.
        let _ = self
            .jsonl
            .write_all(format!("{}\n", Value::Object(m)).as_bytes());
    }

    /// Scalars to TensorBoard as `prefix/name`.
    pub fn tensorboard(&mut self, prefix: &str, step: usize, fields: &Scalars) {
        if let Some(w) = &mut self.events {
            let tagged: Vec<(String, f64)> = fields
                .iter()
                .filter(|(_, v)| v.is_finite())
                .map(|(k, v)| (format!("{prefix}/{k}"), *v))
                .collect();
            let refs: Vec<(&str, f64)> = tagged.iter().map(|(k, v)| (k.as_str(), *v)).collect();
            if let Err(e) = w.scalars(step as i64, &refs) {
                tracing::warn!("TensorBoard events off: {e}");
                self.events = None;
            }
        }
    }

    /// GPU averages since the last call, as scalars `gpuN_power_w`, ... (empty without NVML).
    pub fn gpu_scalars(&self) -> Scalars {
        let Some(m) = &self.gpus else {
            return Vec::new();
        };
        m.take()
            .into_iter()
            .flat_map(|g| {
                let p = format!("gpu{}", g.index);
                [
                    (format!("{p}_power_w"), g.power_w),
                    (format!("{p}_util_pct"), g.util_pct),
                    (format!("{p}_mem_util_pct"), g.mem_util_pct),
                    (format!("{p}_mem_used_gib"), g.mem_used_gib),
                    (format!("{p}_temp_c"), g.temp_c),
                ]
            })
            .collect()
    }

    pub fn window_summary(&mut self, text: String) {
        self.window_msg = text;
    }

    pub fn eval_summary(&mut self, text: String) {
        self.eval_msg = format!(" | eval tau {text}");
    }

    pub fn set_position(&self, step: usize) {
        self.bar.set_position(step as u64);
        self.bar
            .set_message(format!("{}{}", self.window_msg, self.eval_msg));
    }

    /// A log line that does not tear the bar.
    pub fn log(&self, line: &str) {
        self.bar.suspend(|| tracing::info!("{line}"));
    }

    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

fn json_f64(v: f64) -> Value {
    serde_json::Number::from_f64(v).map_or(Value::Null, Value::Number)
}
