//! CUDA-graph capture and replay of small forwards, generic over the forward a graph records:
//! a model keeps a [`GraphCache`] and asks it for the graph of a [`Key`] (cache memory, new
//! tokens, chain or tree, taps); the graph is captured on the second use of a key (a one-off
//! shape never pays for a capture), the [`GRAPH_SLOTS`] most recently used graphs are kept,
//! and a key whose capture failed runs uncaptured from then on. What a graph holds and how it
//! is captured and replayed is the model's (`qwen3/cuda.rs`: the target's decode and verify
//! steps; `dflash/cuda.rs`: the drafter's rounds); this module names no model.

// The cache policy is CUDA-free and tested on every machine; only the models' graphs need the
// `cuda` feature, so without it the cache is never turned on.
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

use std::any::Any;
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex};

use crate::error::{ModelError, ModelResult};

/// Widest forward replayed from a graph (each graph keeps `[tokens, vocab]` f32 logits).
pub const GRAPH_MAX_TOKENS: usize = 128;
/// Graphs kept per model (least recently used dropped first).
pub const GRAPH_SLOTS: usize = 24;

/// FNV-1a over little-endian `u64`s: the graph keys' identity of a cache's buffers (the
/// dense `decoder_stack::cache_key`, the hybrid `qwen3_5/graph.rs` key).
pub(crate) struct Fnv1a(u64);

impl Fnv1a {
    pub fn new() -> Self {
        Self(0xcbf29ce484222325)
    }

    pub fn eat(&mut self, v: u64) {
        for b in v.to_le_bytes() {
            self.0 ^= b as u64;
            self.0 = self.0.wrapping_mul(0x100000001b3);
        }
    }

    pub fn finish(&self) -> u64 {
        self.0
    }
}

/// What a graph was captured for.
#[derive(Clone, PartialEq, Eq, Hash)]
pub(crate) struct Key {
    /// [`cache_key`] of the sequence cache.
    pub cache: u64,
    /// New tokens per sequence (drafter: new context rows).
    pub tokens: usize,
    /// Sequences in the batch (a batched graph's padded size; 1 otherwise).
    pub seqs: usize,
    pub tree: bool,
    pub taps: Vec<usize>,
}

struct Slots {
    /// Each value is the [`GraphObject`] type its model captures.
    graphs: VecDeque<(Key, Box<dyn Any>)>,
    /// Forwards seen per key not yet captured.
    seen: HashMap<Key, u32>,
    /// Keys whose capture failed: never retried.
    failed: HashSet<Key>,
    /// Forwards run from a graph so far (a server's log says whether a step replayed one).
    replays: u64,
}

/// Marks the graph types a [`GraphSlots`] may hold and move between threads.
///
/// # Safety
/// Implementors hold CUDA graphs (and tensors) only: every use of them goes through the
/// `GraphSlots` mutex, which serialises the driver calls on a graph object as the CUDA docs
/// require, and cudarc's launch and drop bind the stream's context to the calling thread.
pub(crate) unsafe trait GraphObject {}

// SAFETY: every value in `graphs` is a `GraphObject` (`with_graph` inserts only those); see
// `GraphObject`. cudarc leaves `CudaGraph` !Send only because it holds raw driver handles.
unsafe impl Send for Slots {}

/// A model's graph cache, shared by its clones (a model built with other settings gets its
/// own): the [`GRAPH_SLOTS`] most recently used graphs, captured on a key's second use.
#[derive(Clone)]
pub struct GraphSlots(Arc<Mutex<Slots>>);

impl Default for GraphSlots {
    fn default() -> Self {
        Self(Arc::new(Mutex::new(Slots {
            graphs: VecDeque::new(),
            seen: HashMap::new(),
            failed: HashSet::new(),
            replays: 0,
        })))
    }
}

impl std::fmt::Debug for GraphSlots {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "GraphSlots({} graphs)", self.len())
    }
}

impl GraphSlots {
    /// Number of graphs held.
    pub fn len(&self) -> usize {
        self.0.lock().map(|s| s.graphs.len()).unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Forwards run from a graph so far.
    pub fn replays(&self) -> u64 {
        self.0.lock().map(|s| s.replays).unwrap_or(0)
    }

    /// Runs `run` on the graph of `key` (with `state`, e.g. the cache it writes), capturing
    /// it with `capture` on the key's second use; `None` (run uncaptured) on a first use or
    /// after a failed capture.
    pub(crate) fn with_graph<G: GraphObject + 'static, S: ?Sized, R>(
        &self,
        key: Key,
        state: &mut S,
        capture: impl FnOnce(&S) -> ModelResult<G>,
        run: impl FnOnce(&mut G, &mut S) -> ModelResult<R>,
    ) -> ModelResult<Option<R>> {
        let mut slots = self
            .0
            .lock()
            .map_err(|_| ModelError::Unsupported("graph cache poisoned".into()))?;
        let at = match slots.graphs.iter().position(|(k, _)| *k == key) {
            Some(i) => i,
            None => {
                if slots.failed.contains(&key) {
                    return Ok(None);
                }
                let seen = slots.seen.entry(key.clone()).or_insert(0);
                *seen += 1;
                if *seen < 2 {
                    if slots.seen.len() > 1024 {
                        slots.seen.clear();
                    }
                    return Ok(None);
                }
                slots.seen.remove(&key);
                let started = std::time::Instant::now();
                let captured = capture(state);
                // A capture is ~20 ms (8B shape); a slow one is a step's stall worth seeing in
                // a server log (s18: one-off steps of seconds not yet explained).
                let ms = started.elapsed().as_secs_f64() * 1e3;
                let what = format!(
                    "{} tokens x {} sequences{}",
                    key.tokens,
                    key.seqs,
                    if key.tree { ", tree" } else { "" }
                );
                if ms > 200.0 {
                    tracing::info!("CUDA graph capture of {what} took {ms:.0} ms");
                } else {
                    tracing::debug!("CUDA graph capture of {what} took {ms:.1} ms");
                }
                match captured {
                    Ok(g) => {
                        if slots.graphs.len() >= GRAPH_SLOTS {
                            slots.graphs.pop_back();
                        }
                        slots.graphs.push_front((key, Box::new(g)));
                        0
                    }
                    Err(e) => {
                        tracing::warn!("graph capture failed, running uncaptured: {e}");
                        slots.failed.insert(key);
                        return Ok(None);
                    }
                }
            }
        };
        let mut entry = slots
            .graphs
            .remove(at)
            .ok_or_else(|| ModelError::Unsupported("graph slot vanished".into()))?;
        let result = match entry.1.downcast_mut::<G>() {
            Some(g) => {
                slots.replays += 1;
                run(g, state)
            }
            None => Err(ModelError::Unsupported(
                "graph cache holds another graph type under this key".into(),
            )),
        };
        slots.graphs.push_front(entry);
        result.map(Some)
    }
}

/// A model's graph setting: off, or on with its own [`GraphSlots`]. Settings that change
/// what a forward computes take [`GraphCache::fresh`], so graphs captured under other
/// settings are never replayed.
#[derive(Clone)]
pub(crate) struct GraphCache(Option<GraphSlots>);

impl std::fmt::Debug for GraphCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.0 {
            Some(slots) => slots.fmt(f),
            None => f.write_str("GraphCache(off)"),
        }
    }
}

impl GraphCache {
    /// An empty cache when `on`, else off.
    pub fn new(on: bool) -> Self {
        Self(on.then(GraphSlots::default))
    }

    /// Empty again, on or off as before.
    pub fn fresh(&self) -> Self {
        Self::new(self.0.is_some())
    }

    /// Whether graphs are captured and replayed.
    pub fn is_on(&self) -> bool {
        self.0.is_some()
    }

    /// Graphs held (0 when off).
    pub fn held(&self) -> usize {
        self.0.as_ref().map_or(0, GraphSlots::len)
    }

    /// Forwards run from a graph so far (0 when off).
    pub fn replays(&self) -> u64 {
        self.0.as_ref().map_or(0, GraphSlots::replays)
    }

    /// The slots when on.
    pub fn slots(&self) -> Option<&GraphSlots> {
        self.0.as_ref()
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use super::*;

    /// Stands in for a graph: its capture number.
    struct Fake(usize);
    // SAFETY: plain data.
    unsafe impl GraphObject for Fake {}

    fn key(tokens: usize) -> Key {
        Key {
            cache: 7,
            tokens,
            seqs: 1,
            tree: false,
            taps: vec![1, 2],
        }
    }

    /// Runs key `t` through `slots`: Some(capture number of the graph replayed), or None
    /// (run uncaptured). `captures` counts capture calls.
    fn use_key(slots: &GraphSlots, t: usize, captures: &mut Cell<usize>) -> Option<usize> {
        slots
            .with_graph(
                key(t),
                captures,
                |c| {
                    c.set(c.get() + 1);
                    Ok(Fake(c.get() - 1))
                },
                |g, _| Ok(g.0),
            )
            .unwrap()
    }

    #[test]
    fn a_graph_is_captured_on_a_keys_second_use_and_replayed_after() {
        let slots = GraphSlots::default();
        let mut captures = Cell::new(0);
        assert_eq!(
            use_key(&slots, 16, &mut captures),
            None,
            "first use runs uncaptured"
        );
        assert!(slots.is_empty());
        assert_eq!(
            use_key(&slots, 16, &mut captures),
            Some(0),
            "second use captures"
        );
        assert_eq!(
            use_key(&slots, 16, &mut captures),
            Some(0),
            "then replays that graph"
        );
        assert_eq!((slots.len(), captures.get()), (1, 1));
        // Another shape of the same cache is another key.
        assert_eq!(use_key(&slots, 1, &mut captures), None);
        assert_eq!(use_key(&slots, 1, &mut captures), Some(1));
        assert_eq!(use_key(&slots, 16, &mut captures), Some(0));
    }

    #[test]
    fn the_least_recently_used_graph_is_dropped_past_the_slots() {
        let slots = GraphSlots::default();
        let mut captures = Cell::new(0);
        for t in 0..=GRAPH_SLOTS {
            assert_eq!(use_key(&slots, t, &mut captures), None);
            assert!(use_key(&slots, t, &mut captures).is_some());
            if t == GRAPH_SLOTS - 1 {
                // Key 0 used again: key 1 is the oldest when key GRAPH_SLOTS arrives.
                assert!(use_key(&slots, 0, &mut captures).is_some());
            }
        }
        assert_eq!(slots.len(), GRAPH_SLOTS);
        assert_eq!(
            use_key(&slots, 0, &mut captures),
            Some(0),
            "recently used key 0 kept"
        );
        assert_eq!(
            use_key(&slots, 1, &mut captures),
            None,
            "oldest key 1 dropped"
        );
    }

    #[test]
    fn a_failed_capture_is_not_retried_and_runs_uncaptured() {
        let slots = GraphSlots::default();
        let mut tries = Cell::new(0);
        for _ in 0..4 {
            let r = slots
                .with_graph(
                    key(3),
                    &mut tries,
                    |c| {
                        c.set(c.get() + 1);
                        Err(ModelError::Unsupported("no capture here".into()))
                    },
                    |g: &mut Fake, _| Ok(g.0),
                )
                .unwrap();
            assert_eq!(r, None);
        }
        assert_eq!(
            tries.get(),
            1,
            "captured once, on the second use, never again"
        );
        assert!(slots.is_empty());
    }
}
