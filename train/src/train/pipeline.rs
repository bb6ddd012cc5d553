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
//! With data-parallel drafter replicas ([`Routing`]), a batch goes to a worker on the device of
//! the rank that will train it when there is one, so its features stay on that GPU (the
//! N x (target + drafter) layout); batches of ranks without a worker on their device go to any
//! worker. Which worker computes a batch never changes its contents.
//!
//! [`Depth::Serialized`] holds a taken batch's credits until the trainer asks for the next one
//! (its step is done), with room for one batch: the target then never runs beside the drafter,
//! so each side's time is measured alone (profiling; the batches and results are the same).

use std::collections::{BTreeMap, VecDeque};
use std::sync::mpsc::{self, Receiver, Sender};
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
    /// Closed on drop, so a dispatcher waiting for room and idle workers stop.
    board: Arc<JobBoard>,
    /// A worker error seen while draining for metrics, returned by the next `next_batch`.
    failed: Option<TrainError>,
}

/// Which data-parallel rank trains a batch: a step's `grad_accum` batches (numbered from a
/// multiple of it) are cut into one contiguous run per rank, as the trainer cuts them.
#[derive(Clone)]
pub struct Routing {
    pub grad_accum: usize,
    /// The drafter replicas' devices, in rank order.
    pub rank_devices: Vec<Device>,
}

impl Routing {
    fn rank_of(&self, index: usize) -> usize {
        let per_rank = (self.grad_accum / self.rank_devices.len().max(1)).max(1);
        ((index % self.grad_accum.max(1)) / per_rank).min(self.rank_devices.len() - 1)
    }
}

/// A batch to compute, for one worker group (the workers on one rank's GPU) or for any worker.
struct Job {
    index: usize,
    ids: Vec<usize>,
    group: Option<usize>,
}

/// The dispatcher's queue of jobs, bounded; a worker takes the oldest job for its group or
/// for any worker.
struct JobBoard {
    state: Mutex<(VecDeque<Job>, bool)>,
    cond: Condvar,
    cap: usize,
}

impl JobBoard {
    /// Waits for room; false once closed.
    fn push(&self, job: Job) -> bool {
        let mut g = self.state.lock().expect("job board lock");
        while g.0.len() >= self.cap && !g.1 {
            g = self.cond.wait(g).expect("job board lock");
        }
        if g.1 {
            return false;
        }
        g.0.push_back(job);
        self.cond.notify_all();
        true
    }
    /// The oldest job `group` may take, waiting for one; `None` once closed with none left.
    fn take(&self, group: Option<usize>) -> Option<Job> {
        let mut g = self.state.lock().expect("job board lock");
        loop {
            if let Some(i) =
                g.0.iter()
                    .position(|j| j.group.is_none() || j.group == group)
            {
                let job = g.0.remove(i);
                self.cond.notify_all();
                return job;
            }
            if g.1 {
                return None;
            }
            g = self.cond.wait(g).expect("job board lock");
        }
    }
    fn close(&self) {
        self.state.lock().expect("job board lock").1 = true;
        self.cond.notify_all();
    }
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
        routing: Option<Routing>,
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
        let board = Arc::new(JobBoard {
            state: Mutex::new((VecDeque::new(), false)),
            cond: Condvar::new(),
            cap: workers.len().max(1),
        });
        // A worker's group: the first rank on its GPU (none on the CPU, where every device is
        // one). A rank's batches go to its group when the group has a worker.
        let group_of = |device: &Device| {
            routing.as_ref().and_then(|r| {
                r.rank_devices
                    .iter()
                    .position(|d| !d.is_cpu() && d.same_device(device))
            })
        };
        let worker_groups: Vec<Option<usize>> =
            workers.iter().map(|w| group_of(w.model.device())).collect();
        let rank_group: Vec<Option<usize>> = routing.as_ref().map_or(Vec::new(), |r| {
            r.rank_devices
                .iter()
                .map(|d| group_of(d).filter(|g| worker_groups.contains(&Some(*g))))
                .collect()
        });
        let mut threads = Vec::new();
        for (w, group) in workers.into_iter().zip(worker_groups) {
            let (board, res_tx, examples, taps) = (
                board.clone(),
                res_tx.clone(),
                examples.clone(),
                taps.clone(),
            );
            threads.push(std::thread::spawn(move || {
                worker_loop(w, group, &board, &res_tx, &examples, &taps)
            }));
        }
        let dispatch_credits = credits.clone();
        let route = move |index: usize| {
            let r = routing.as_ref()?;
            rank_group.get(r.rank_of(index)).copied().flatten()
        };
        let dispatch_board = board.clone();
        threads.push(std::thread::spawn(move || {
            let board = dispatch_board;
            dispatch(
                batches,
                first_index,
                &board,
                &dispatch_credits,
                max_depth,
                route,
            );
            // Workers drain what is queued, then stop.
            board.close();
        }));
        Self {
            results: Some(res_rx),
            pending: BTreeMap::new(),
            next: first_index,
            credits,
            max_depth,
            held,
            threads,
            board,
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
        self.board.close();
        self.results = None;
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn dispatch(
    batches: Box<dyn Iterator<Item = Vec<usize>> + Send>,
    first_index: usize,
    jobs: &JobBoard,
    credits: &Credits,
    max_depth: usize,
    route: impl Fn(usize) -> Option<usize>,
) {
    for (i, ids) in batches.enumerate() {
        if !credits.acquire(ids.len().min(max_depth)) {
            return;
        }
        let index = first_index + i;
        let group = route(index);
        if !jobs.push(Job { index, ids, group }) {
            return;
        }
    }
}

fn worker_loop(
    w: TargetWorker,
    group: Option<usize>,
    jobs: &JobBoard,
    results: &Sender<TrainResult<ComputedBatch>>,
    examples: &[Example],
    taps: &[usize],
) {
    while let Some(Job { index, ids, .. }) = jobs.take(group) {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_step_is_cut_into_one_contiguous_run_per_rank_as_the_trainer_cuts_it() {
        let r = Routing {
            grad_accum: 4,
            rank_devices: vec![Device::Cpu, Device::Cpu],
        };
        let ranks: Vec<usize> = (8..16).map(|i| r.rank_of(i)).collect();
        assert_eq!(ranks, [0, 0, 1, 1, 0, 0, 1, 1]);
    }

    #[test]
    fn a_worker_takes_the_oldest_job_of_its_group_or_for_anyone_and_drains_after_close() {
        let board = JobBoard {
            state: Mutex::new((VecDeque::new(), false)),
            cond: Condvar::new(),
            cap: 8,
        };
        for (index, group) in [(0, Some(1)), (1, Some(0)), (2, None), (3, Some(1))] {
            assert!(board.push(Job {
                index,
                ids: vec![index],
                group,
            }));
        }
        let take = |g| board.take(g).map(|j| j.index);
        assert_eq!(take(Some(0)), Some(1));
        assert_eq!(take(Some(0)), Some(2));
        board.close();
        assert!(!board.push(Job {
            index: 4,
            ids: vec![],
            group: None
        }));
        // Closed: group 0 has nothing left and stops; group 1 still drains its two jobs.
        assert_eq!(take(Some(0)), None);
        assert_eq!(take(Some(1)), Some(0));
        assert_eq!(take(Some(1)), Some(3));
        assert_eq!(take(Some(1)), None);
    }
}
