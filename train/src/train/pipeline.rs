//! The concurrent stages: a dispatcher walks the batch plan, target workers (one thread per
//! target device) compute the tapped hidden states of each batch with the frozen target, and a
//! bounded host-RAM buffer hands the batches to the trainer in plan order.
//!
//! Backpressure: the dispatcher takes one credit per sequence before it hands a batch to a
//! worker and the trainer gives them back when it takes the batch, so at most `max_depth`
//! sequences are in flight or waiting (features in the target's dtype: on the host, or on the
//! GPU when the worker shares the drafter's device, so they never make a round trip).
//! Workers finish batches out of order; the buffer reorders them by batch index, which keeps a
//! run deterministic whatever the number of workers.
//!
//! [`Depth::Serialized`] holds a taken batch's credits until the trainer asks for the next one
//! (its step is done), with room for one batch: the target then never runs beside the drafter,
//! so each side's time is measured alone (profiling; the batches and results are the same).

use std::collections::BTreeMap;
use std::sync::mpsc::{self, Receiver, Sender, SyncSender};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use candle_core::{Device, Tensor};
use dflash_models::Qwen3Model;

use super::dataset::Example;
use super::error::{TrainError, TrainResult};

/// One sequence of a computed batch.
pub struct SeqFeatures {
    pub example: usize,
    /// Its rows of the batch's [`ComputedBatch::features`].
    pub rows: std::ops::Range<usize>,
}

pub struct ComputedBatch {
    pub index: usize,
    pub seqs: Vec<SeqFeatures>,
    /// `[Σ len, taps * hidden]`, every sequence's rows in order: on the host, or on the
    /// drafter's device when the worker shares it (complete: the worker synchronised).
    /// One tensor, so the trainer uploads a batch once (`to_device` of a narrowed view
    /// copies the whole storage).
    pub features: Tensor,
    /// Seconds the worker spent in the target forward.
    pub target_s: f64,
}

/// Counting semaphore with a close switch (so a stopped trainer releases the dispatcher).
struct Credits {
    state: Mutex<(usize, bool)>,
    cond: Condvar,
}

impl Credits {
    fn acquire(&self, n: usize) -> bool {
        let mut g = self.state.lock().expect("credits lock");
        while g.0 < n && !g.1 {
            g = self.cond.wait(g).expect("credits lock");
        }
        if g.1 {
            return false;
        }
        g.0 -= n;
        true
    }
    fn release(&self, n: usize) {
        self.state.lock().expect("credits lock").0 += n;
        self.cond.notify_all();
    }
    fn close(&self) {
        self.state.lock().expect("credits lock").1 = true;
        self.cond.notify_all();
    }
    fn available(&self) -> usize {
        self.state.lock().expect("credits lock").0
    }
}

/// How much the target workers may compute ahead of the trainer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Depth {
    /// Up to this many sequences computed or in flight beside the trainer's step.
    Overlapped(usize),
    /// One batch of this many sequences, computed only while the trainer waits for it.
    Serialized(usize),
}

pub struct Pipeline {
    results: Option<Receiver<TrainResult<ComputedBatch>>>,
    pending: BTreeMap<usize, ComputedBatch>,
    next: usize,
    credits: Arc<Credits>,
    max_depth: usize,
    /// Credits of the batch the trainer is working on ([`Depth::Serialized`] only).
    held: Option<usize>,
    threads: Vec<JoinHandle<()>>,
    /// A worker error seen while draining for metrics, returned by the next `next_batch`.
    failed: Option<TrainError>,
}

/// A target model and the device name for messages.
pub struct TargetWorker {
    pub device: String,
    pub model: Qwen3Model,
    /// Leave the features on the model's device (it is the drafter's), instead of copying
    /// them to the host.
    pub keep_on_device: bool,
}

fn compute(
    w: &TargetWorker,
    examples: &[Example],
    ids: &[usize],
    taps: &[usize],
) -> TrainResult<(Tensor, Vec<SeqFeatures>)> {
    let model = &w.model;
    // Whole sequences from position 0, taps only: the cache-less packed forward (one
    // attention launch per layer for the batch on CUDA, nothing past the deepest tap).
    let seqs: Vec<&[u32]> = ids.iter().map(|&i| examples[i].tokens.as_slice()).collect();
    let out = model.forward_taps(&seqs, taps)?;
    let taps = if w.keep_on_device {
        // The trainer reads them on its own thread's stream: finish this one's work first.
        model.device().synchronize()?;
        out.features
    } else {
        out.features.to_device(&Device::Cpu)?
    };
    let seqs = ids
        .iter()
        .enumerate()
        .map(|(s, &example)| SeqFeatures {
            example,
            rows: out.offsets[s]..out.offsets[s + 1],
        })
        .collect();
    Ok((taps, seqs))
}

impl Pipeline {
    /// Starts the dispatcher over `batches` (already advanced past trained batches, numbered
    /// from `first_index`) and one thread per worker.
    pub fn start(
        examples: Arc<Vec<Example>>,
        batches: Box<dyn Iterator<Item = Vec<usize>> + Send>,
        first_index: usize,
        workers: Vec<TargetWorker>,
        taps: Vec<usize>,
        depth: Depth,
    ) -> Self {
        let (max_depth, held) = match depth {
            Depth::Overlapped(n) => (n, None),
            Depth::Serialized(n) => (n, Some(0)),
        };
        let credits = Arc::new(Credits {
            state: Mutex::new((max_depth, false)),
            cond: Condvar::new(),
        });
        let (res_tx, res_rx) = mpsc::channel::<TrainResult<ComputedBatch>>();
        let (job_tx, job_rx) = mpsc::sync_channel::<(usize, Vec<usize>)>(workers.len());
        let job_rx = Arc::new(Mutex::new(job_rx));
        let mut threads = Vec::new();
        for w in workers {
            let (job_rx, res_tx, examples, taps) = (
                job_rx.clone(),
                res_tx.clone(),
                examples.clone(),
                taps.clone(),
            );
            threads.push(std::thread::spawn(move || {
                worker_loop(w, &job_rx, &res_tx, &examples, &taps)
            }));
        }
        let dispatch_credits = credits.clone();
        threads.push(std::thread::spawn(move || {
            dispatch(batches, first_index, job_tx, &dispatch_credits, max_depth)
        }));
        Self {
            results: Some(res_rx),
            pending: BTreeMap::new(),
            next: first_index,
            credits,
            max_depth,
            held,
            threads,
            failed: None,
        }
    }

    /// The next batch in plan order (`None` when the plan is exhausted), and how long the
    /// trainer waited for it.
    pub fn next_batch(&mut self) -> TrainResult<(Option<ComputedBatch>, Duration)> {
        let t0 = Instant::now();
        if let Some(e) = self.failed.take() {
            return Err(e);
        }
        // Serialized: asking for the next batch means the last one's step is done.
        if let Some(held) = self.held.as_mut() {
            self.credits.release(std::mem::take(held));
        }
        loop {
            if let Some(b) = self.pending.remove(&self.next) {
                self.next += 1;
                match self.held.as_mut() {
                    Some(held) => *held = b.seqs.len(),
                    None => self.credits.release(b.seqs.len()),
                }
                return Ok((Some(b), t0.elapsed()));
            }
            let Some(rx) = &self.results else {
                return Ok((None, t0.elapsed()));
            };
            match rx.recv() {
                Ok(Ok(b)) => {
                    self.pending.insert(b.index, b);
                }
                Ok(Err(e)) => return Err(e),
                // Every sender is gone: the plan is exhausted and all batches were delivered.
                Err(_) => self.results = None,
            }
        }
    }

    /// Sequences computed or being computed but not yet taken by the trainer.
    pub fn depth(&self) -> usize {
        self.max_depth - self.credits.available()
    }

    /// Computed sequences waiting in host RAM, per length bucket (`len / bucket_width`), after
    /// taking in what the workers have finished (never blocks).
    pub fn ready_by_bucket(
        &mut self,
        bucket_width: usize,
        lens: impl Fn(usize) -> usize,
    ) -> BTreeMap<usize, usize> {
        if let Some(rx) = &self.results {
            while let Ok(r) = rx.try_recv() {
                match r {
                    Ok(b) => {
                        self.pending.insert(b.index, b);
                    }
                    Err(e) => {
                        self.failed.get_or_insert(e);
                    }
                }
            }
        }
        let mut out = BTreeMap::new();
        for b in self.pending.values() {
            for s in &b.seqs {
                *out.entry(lens(s.example) / bucket_width.max(1))
                    .or_insert(0) += 1;
            }
        }
        out
    }
}

impl Drop for Pipeline {
    fn drop(&mut self) {
        self.credits.close();
        self.results = None;
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn dispatch(
    batches: Box<dyn Iterator<Item = Vec<usize>> + Send>,
    first_index: usize,
    jobs: SyncSender<(usize, Vec<usize>)>,
    credits: &Credits,
    max_depth: usize,
) {
    for (i, batch) in batches.enumerate() {
        if !credits.acquire(batch.len().min(max_depth)) {
            return;
        }
        if jobs.send((first_index + i, batch)).is_err() {
            return;
        }
    }
}

fn worker_loop(
    w: TargetWorker,
    jobs: &Mutex<Receiver<(usize, Vec<usize>)>>,
    results: &Sender<TrainResult<ComputedBatch>>,
    examples: &[Example],
    taps: &[usize],
) {
    loop {
        let job = jobs.lock().expect("job lock").recv();
        let Ok((index, ids)) = job else { return };
        let t0 = Instant::now();
        let out = compute(&w, examples, &ids, taps)
            .map(|(features, seqs)| ComputedBatch {
                index,
                seqs,
                features,
                target_s: t0.elapsed().as_secs_f64(),
            })
            .map_err(|e| TrainError::Worker {
                device: w.device.clone(),
                message: e.to_string(),
            });
        let failed = out.is_err();
        if results.send(out).is_err() || failed {
            return;
        }
    }
}
