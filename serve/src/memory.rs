//! Giving freed heap memory back to the OS.
//!
//! glibc's malloc keeps the pages of freed allocations in its arenas (one per thread that ever
//! allocated, so the tokio workers, blocking tokenizer threads and the engine thread each hold
//! their own). After a burst of long requests the resident size therefore stays at its peak and
//! the next burst adds to it: RSS only ratchets up. `malloc_trim(0)` walks every arena and
//! returns whole free pages; the engine thread asks for it after steps that released sequences
//! (at most once per [`MIN_TRIM_INTERVAL`]) and does it whenever it goes idle with a trim
//! pending. A trim while requests run happens on a helper thread: it walks every arena (0.4-2.8
//! ms in a Qwen3-8B CUDA server, h200-2026-12-06-s16-interf), and on the engine thread that
//! time was added to a step every running stream waits for.
//!
//! Measured on the demo model (serve/tests/binary_limits.rs, `rss_returns_near_idle_after_a_burst`:
//! a warm-up burst sets the idle level, then two bursts of 64 streaming requests with a few
//! 600 KB /tokenize bodies): without trimming RSS went from 661 MiB idle to 1,828 MiB (+177%);
//! with it, from 475 MiB to 534 MiB (+12%). From a settled idle level (15 s after the warm-up
//! burst, prefix cache off), a trim on going idle alone left 160 -> 323 MiB: the tokenizer's
//! blocking threads free their caches only when they exit 10 s later, hence [`LATE_IDLE_TRIM`].
//! jemalloc was not measured: it is not in the dependency tree (no `tikv-jemallocator` in
//! Cargo.lock) and the CI machine builds offline.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

/// The shortest gap between two trims while the engine is busy.
pub const MIN_TRIM_INTERVAL: Duration = Duration::from_millis(500);

/// One more trim this long into an idle spell: tokio's blocking threads (the tokenizer's)
/// outlive their last task by 10 s and free their thread caches into the arenas only when they
/// exit, after the trim on going idle; without this their pages stayed resident until the next
/// request (RSS settled at 160 MiB after one burst, then stayed at 323 MiB after two).
pub const LATE_IDLE_TRIM: Duration = Duration::from_secs(12);

/// Returns free heap pages in every malloc arena to the OS (a no-op off glibc).
pub fn release_free_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: malloc_trim only walks glibc's own arenas under their locks; it takes no
        // pointers from us and is safe to call from any thread at any time.
        unsafe {
            libc::malloc_trim(0);
        }
    }
}

/// Decides when the engine thread trims: after sequences were released (rate-limited), or on
/// going idle when anything (a released sequence, a handler that dropped a large body) asked.
#[derive(Debug)]
pub struct Trimmer {
    pending: bool,
    wanted: Arc<AtomicBool>,
    last: Instant,
    /// The helper thread that trims while the engine is busy (started on the first such trim).
    helper: Option<mpsc::Sender<()>>,
    /// When the current idle spell began, and whether its late trim ran.
    idle_since: Option<Instant>,
    late_done: bool,
}

impl Trimmer {
    /// `wanted` is the flag handlers set through `EngineHandle::request_trim`.
    pub fn new(wanted: Arc<AtomicBool>) -> Self {
        Self {
            pending: false,
            wanted,
            last: Instant::now(),
            helper: None,
            idle_since: None,
            late_done: true,
        }
    }

    /// A sequence left the engine, so its KV cache and buffers were freed.
    pub fn released(&mut self) {
        self.pending = true;
    }

    fn take_pending(&mut self) -> bool {
        let wanted = self.wanted.swap(false, Ordering::Relaxed);
        std::mem::take(&mut self.pending) | wanted
    }

    /// After a step: trim if something was released and the last trim is not too recent,
    /// on the helper thread (the engine goes on with its next step).
    pub fn after_step(&mut self) {
        // Busy again: the next idle spell gets its late trim.
        self.idle_since = None;
        self.late_done = false;
        if (self.pending || self.wanted.load(Ordering::Relaxed))
            && self.last.elapsed() >= MIN_TRIM_INTERVAL
            && self.take_pending()
        {
            self.last = Instant::now();
            if !self.send_to_helper() {
                self.trim();
            }
        }
    }

    /// Asks the helper thread for a trim (a trim it has not started yet covers this one too);
    /// false when there is no helper thread and none can be started.
    fn send_to_helper(&mut self) -> bool {
        if self.helper.is_none() {
            let (tx, rx) = mpsc::channel::<()>();
            let spawned = std::thread::Builder::new()
                .name("dflash-trim".into())
                .spawn(move || {
                    while rx.recv().is_ok() {
                        while rx.try_recv().is_ok() {}
                        let t = Instant::now();
                        release_free_memory();
                        tracing::debug!(target: "dflash_serve::steps", "malloc_trim took {:.2} ms (helper thread)", t.elapsed().as_secs_f64() * 1e3);
                    }
                });
            if spawned.is_err() {
                return false;
            }
            self.helper = Some(tx);
        }
        self.helper.as_ref().is_some_and(|h| h.send(()).is_ok())
    }

    /// The engine has nothing to run (called every idle tick): trim now if anything asked,
    /// and once more [`LATE_IDLE_TRIM`] into the idle spell after a busy one.
    pub fn on_idle(&mut self) {
        let since = *self.idle_since.get_or_insert_with(Instant::now);
        if self.take_pending() {
            self.trim();
        } else if !self.late_done && since.elapsed() >= LATE_IDLE_TRIM {
            self.late_done = true;
            self.trim();
        }
    }

    fn trim(&mut self) {
        let t = Instant::now();
        release_free_memory();
        tracing::debug!(target: "dflash_serve::steps", "malloc_trim took {:.2} ms (engine thread)", t.elapsed().as_secs_f64() * 1e3);
        self.last = Instant::now();
    }
}
