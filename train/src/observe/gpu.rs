//! GPU power, utilisation, memory and temperature through NVML, sampled by a background thread
//! so the training loop never waits on it. No GPU or no libnvidia-ml: one info line, no samples.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use nvml_wrapper::enum_wrappers::device::TemperatureSensor;
use nvml_wrapper::Nvml;

/// Window averages of one GPU (since the last [`GpuMonitor::take`]).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct GpuStats {
    /// CUDA ordinal as the run names it.
    pub index: usize,
    pub samples: usize,
    pub power_w: f64,
    pub util_pct: f64,
    pub mem_util_pct: f64,
    /// Latest used / total memory, GiB.
    pub mem_used_gib: f64,
    pub mem_total_gib: f64,
    pub temp_c: f64,
}

#[derive(Default)]
struct Acc {
    stats: Vec<GpuStats>,
}

pub struct GpuMonitor {
    acc: Arc<Mutex<Acc>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

/// NVML numbers GPUs by the physical order; CUDA ordinals follow `CUDA_VISIBLE_DEVICES`.
fn nvml_index(cuda: usize) -> u32 {
    std::env::var("CUDA_VISIBLE_DEVICES")
        .ok()
        .and_then(|v| v.split(',').nth(cuda)?.trim().parse().ok())
        .unwrap_or(cuda as u32)
}

impl GpuMonitor {
    /// Samples the CUDA devices `cuda` every `every`; `None` (after one info log) when there
    /// is nothing to sample.
    pub fn start(cuda: &[usize], every: Duration) -> Option<Self> {
        if cuda.is_empty() {
            return None;
        }
        let nvml = match Nvml::init() {
            Ok(n) => n,
            Err(e) => {
                tracing::info!("GPU telemetry off: NVML unavailable ({e})");
                return None;
            }
        };
        let acc = Arc::new(Mutex::new(Acc {
            stats: cuda
                .iter()
                .map(|&index| GpuStats {
                    index,
                    ..Default::default()
                })
                .collect(),
        }));
        let stop = Arc::new(AtomicBool::new(false));
        let (acc2, stop2, cuda) = (acc.clone(), stop.clone(), cuda.to_vec());
        let thread = std::thread::spawn(move || {
            while !stop2.load(Ordering::Relaxed) {
                for (slot, &c) in cuda.iter().enumerate() {
                    let Ok(d) = nvml.device_by_index(nvml_index(c)) else {
                        continue;
                    };
                    let power = d
                        .power_usage()
                        .map(|mw| mw as f64 / 1e3)
                        .unwrap_or(f64::NAN);
                    let util = d.utilization_rates().ok();
                    let mem = d.memory_info().ok();
                    let temp = d
                        .temperature(TemperatureSensor::Gpu)
                        .map_or(f64::NAN, f64::from);
                    let mut a = acc2.lock().expect("gpu stats lock");
                    let s = &mut a.stats[slot];
                    let n = s.samples as f64;
                    let avg = |old: f64, new: f64| (old * n + new) / (n + 1.0);
                    s.power_w = avg(s.power_w, power);
                    if let Some(u) = util {
                        s.util_pct = avg(s.util_pct, u.gpu as f64);
                        s.mem_util_pct = avg(s.mem_util_pct, u.memory as f64);
                    }
                    s.temp_c = avg(s.temp_c, temp);
                    if let Some(m) = mem {
                        s.mem_used_gib = m.used as f64 / (1u64 << 30) as f64;
                        s.mem_total_gib = m.total as f64 / (1u64 << 30) as f64;
                    }
                    s.samples += 1;
                }
                std::thread::sleep(every);
            }
        });
        Some(Self {
            acc,
            stop,
            thread: Some(thread),
        })
    }

    /// The averages since the last call (GPUs without samples left out), and a fresh window.
    pub fn take(&self) -> Vec<GpuStats> {
        let mut a = self.acc.lock().expect("gpu stats lock");
        let out: Vec<GpuStats> = a.stats.iter().filter(|s| s.samples > 0).cloned().collect();
        for s in &mut a.stats {
            *s = GpuStats {
                index: s.index,
                mem_used_gib: s.mem_used_gib,
                mem_total_gib: s.mem_total_gib,
                ..Default::default()
            };
        }
        out
    }
}

impl Drop for GpuMonitor {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
