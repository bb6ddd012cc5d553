//! CUDA-graph replay of small batch-1 forwards inside [`Qwen3Model::forward`], so every
//! caller (the speculative engine, the server) gets the single-launch decode and verify steps
//! of [`crate::StepGraph`] without managing graphs. A forward of one sequence with at most
//! [`GRAPH_MAX_TOKENS`] new tokens, causal or tree, asking for the logits of every row, is
//! replayed from a graph keyed by (cache memory, tokens, chain or tree, taps); the graph is
//! captured on the second forward of a key (a one-off shape never pays for a capture) and the
//! [`GRAPH_SLOTS`] most recently used graphs are kept. A graph runs the fused forward's
//! kernels, its attention split over the cache's whole capacity (the fused forward splits the
//! live length), so the two agree to f32 summation order; a graph is deterministic.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex};

use crate::attention::AttnPattern;
use crate::error::{ModelError, ModelResult};
use crate::fast_decoder::cache_key;
use crate::qwen3::{ForwardOutput, Qwen3Model, SeqForward};
use crate::qwen3_fast::StepGraph;

/// Widest forward replayed from a graph (each graph keeps `[tokens, vocab]` f32 logits).
pub const GRAPH_MAX_TOKENS: usize = 128;
/// Graphs kept per model (least recently used dropped first).
pub const GRAPH_SLOTS: usize = 8;

#[derive(Clone, PartialEq, Eq, Hash)]
struct Key {
    cache: u64,
    tokens: usize,
    tree: bool,
    taps: Vec<usize>,
}

#[derive(Default)]
struct Slots {
    graphs: VecDeque<(Key, StepGraph)>,
    /// Forwards seen per key not yet captured.
    seen: HashMap<Key, u32>,
    /// Keys whose capture failed: never retried.
    failed: HashSet<Key>,
}

// SAFETY: the graphs are only used under the mutex of `StepGraphs`, which serialises every
// driver call on them as the CUDA docs require of graph objects, and cudarc's launch and
// drop bind the stream's context to the calling thread, so moving them between threads is
// sound. (cudarc leaves `CudaGraph` !Send because it holds raw driver handles.)
unsafe impl Send for Slots {}

/// The model's graph cache (shared by clones of one model; a model built with other
/// settings gets its own).
#[derive(Clone, Default)]
pub struct StepGraphs(Arc<Mutex<Slots>>);

impl std::fmt::Debug for StepGraphs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.0.lock().map(|s| s.graphs.len()).unwrap_or(0);
        write!(f, "StepGraphs({n} graphs)")
    }
}

impl StepGraphs {
    /// Number of graphs held.
    pub fn len(&self) -> usize {
        self.0.lock().map(|s| s.graphs.len()).unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Qwen3Model {
    /// Replays `batch` from a captured graph when it qualifies (see the module docs); `None`
    /// means "run the fused forward".
    pub(crate) fn forward_graph(
        &self,
        batch: &mut [SeqForward<'_>],
        taps: &[usize],
    ) -> ModelResult<Option<ForwardOutput>> {
        let Some(graphs) = self.step_graphs() else {
            return Ok(None);
        };
        let [seq] = batch else { return Ok(None) };
        let t = seq.tokens.len();
        let all_rows =
            seq.logit_rows.len() == t && seq.logit_rows.iter().enumerate().all(|(i, &r)| r == i);
        let parents = match seq.pattern {
            AttnPattern::Causal => None,
            AttnPattern::Tree { parents } => Some(parents.as_slice()),
            _ => return Ok(None),
        };
        if t == 0 || t > GRAPH_MAX_TOKENS || !all_rows || seq.cache.len() + t > seq.cache.capacity()
        {
            return Ok(None);
        }
        let key = Key {
            cache: cache_key(seq.cache)?,
            tokens: t,
            tree: parents.is_some(),
            taps: taps.to_vec(),
        };
        let mut slots = graphs
            .0
            .lock()
            .map_err(|_| ModelError::Unsupported("step graph cache poisoned".into()))?;
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
                match self.capture_step_with(seq.cache, t, key.tree, taps, false) {
                    Ok(g) => {
                        if slots.graphs.len() >= GRAPH_SLOTS {
                            slots.graphs.pop_back();
                        }
                        slots.graphs.push_front((key, g));
                        0
                    }
                    Err(e) => {
                        tracing::warn!(
                            "step graph capture for {t} tokens failed, running uncaptured: {e}"
                        );
                        slots.failed.insert(key);
                        return Ok(None);
                    }
                }
            }
        };
        let entry = slots
            .graphs
            .remove(at)
            .ok_or_else(|| ModelError::Unsupported("step graph slot vanished".into()))?;
        let result = entry
            .1
            .replay(seq.cache, seq.tokens, seq.positions, parents);
        slots.graphs.push_front(entry);
        let (logits, taps) = result?;
        Ok(Some(ForwardOutput {
            logits: Some(logits),
            taps,
            token_offsets: vec![0, t],
            logit_offsets: vec![0, t],
        }))
    }
}
