//! A step of several sequences of one K/V pool as one CUDA graph: every sequence brings the
//! same number of new tokens (a decode step: one each; a chain or padded-tree verify: the
//! tree's size), and the batch is padded to the next power of two with sequences whose rows
//! go to the pool's scratch page. The graph reads tokens, positions, committed lengths, page
//! tables and tree masks from its own device buffers, written before each replay, so one
//! capture per (padded batch size, tokens, chain or tree, taps) serves every batch of the
//! pool. A decode step's attention is one launch per layer for the whole batch
//! (`cuda::fused_attention` over the page tables); wider steps attend per sequence inside the
//! graph.

use candle_core::{DType, Tensor};

use crate::batch::{ForwardOutput, SeqForward};
use crate::cache::SequenceCache;
use crate::cuda;
use crate::cuda::decoder_stack::{cache_key, capture_graph};
use crate::cuda::graphs::{GraphObject, Key, GRAPH_MAX_TOKENS};
use crate::error::{ModelError, ModelResult};
use crate::layers::attention::AttnPattern;
use crate::qwen3::cuda::{PooledInputs, SeqInputs};
use crate::qwen3::Qwen3Model;

/// Largest padded batch captured (SGLang's `--cuda-graph-max-bs` default on large GPUs).
pub const BATCH_GRAPH_MAX_SEQS: usize = 256;
/// Most rows (sequences x tokens) a batched graph holds logits for.
const BATCH_GRAPH_MAX_ROWS: usize = 4096;

/// The captured batch size for `n` sequences.
pub fn padded_batch(n: usize) -> usize {
    n.next_power_of_two()
}

pub(crate) struct BatchGraph {
    graph: candle_core::cuda_backend::cudarc::driver::CudaGraph,
    /// Padded sequences and new tokens per sequence.
    seqs: usize,
    tokens: usize,
    /// Page-table entries per sequence.
    width: usize,
    /// u32 `[tokens (B t), positions (B t), cache_len (B), page tables (B width)]`.
    inputs: Tensor,
    /// i64 `[B t, ceil(t / 64)]` ancestor bits (tree graphs).
    tree: Option<Tensor>,
    /// f32 `[B t, vocab]`.
    logits: Tensor,
    taps_out: Option<Tensor>,
}

// SAFETY: a BatchGraph holds a CUDA graph and tensors (see `GraphObject`).
unsafe impl GraphObject for BatchGraph {}

/// The tree's parents of sequence `seq` (None: causal).
fn parents<'a>(seq: &'a SeqForward<'_>) -> Option<&'a [Option<usize>]> {
    match seq.pattern {
        AttnPattern::Tree { parents } => Some(parents.as_slice()),
        _ => None,
    }
}

impl Qwen3Model {
    /// Replays `batch` from a batched graph when it qualifies: 2 to [`BATCH_GRAPH_MAX_SEQS`]
    /// sequences paged in one pool, each with the same number `t` (at most
    /// [`GRAPH_MAX_TOKENS`]) of new tokens, all causal or all trees, asking for every row's
    /// logits, with room in their caches. `None`: run the fused forward.
    pub(crate) fn forward_batch_graph(
        &self,
        batch: &mut [SeqForward<'_>],
        taps: &[usize],
    ) -> ModelResult<Option<ForwardOutput>> {
        let Some(graphs) = self.step_graphs().slots() else {
            return Ok(None);
        };
        let n = batch.len();
        if !(2..=BATCH_GRAPH_MAX_SEQS).contains(&n) {
            return Ok(None);
        }
        let t = batch[0].tokens.len();
        // Sparse-MoE step graphs only as wide as they were measured.
        if self.config().moe.is_some()
            && padded_batch(n) * t > crate::cuda::decoder_stack::MOE_GRAPH_MAX_ROWS
        {
            return Ok(None);
        }
        let tree = parents(&batch[0]).is_some();
        let Some(pool) = batch[0].cache.page_table().pool().cloned() else {
            return Ok(None);
        };
        let seqs = padded_batch(n);
        if t == 0 || t > GRAPH_MAX_TOKENS || seqs * t > BATCH_GRAPH_MAX_ROWS {
            return Ok(None);
        }
        let width = self.graph_page_width(batch[0].cache)?;
        for s in batch.iter() {
            let fits = s.tokens.len() == t
                && parents(s).is_some() == tree
                && matches!(s.pattern, AttnPattern::Causal | AttnPattern::Tree { .. })
                && s.logit_rows.len() == t
                && s.logit_rows.iter().enumerate().all(|(i, &r)| r == i)
                && s.cache.len() + t <= s.cache.backed_rows()
                && s.cache.page_table().pages().len() <= width
                && s.cache.page_table().pool().is_some_and(|p| p.same(&pool));
            if !fits {
                return Ok(None);
            }
        }
        let key = Key {
            cache: cache_key(batch[0].cache)?,
            tokens: t,
            seqs,
            tree,
            taps: taps.to_vec(),
        };
        let scratch = pool.scratch_page();
        let out = graphs.with_graph(
            key,
            batch,
            |batch| {
                crate::speculative::profile::timed(self.device(), "target_capture", || {
                    self.capture_batch(batch, seqs, width, scratch, taps)
                })
            },
            |g, batch| g.replay(batch, scratch),
        )?;
        Ok(out)
    }

    /// Captures the step of `batch` padded to `seqs` sequences.
    fn capture_batch(
        &self,
        batch: &[SeqForward<'_>],
        seqs: usize,
        width: usize,
        scratch: u32,
        taps: &[usize],
    ) -> ModelResult<BatchGraph> {
        let dev = self.device().clone();
        let t = batch[0].tokens.len();
        let tree = parents(&batch[0]).is_some();
        let rows = seqs * t;
        let host = batch_inputs(batch, seqs, t, width, scratch);
        let inputs = Tensor::new(host.as_slice(), &dev)?;
        let tree_bits = if tree {
            let words = t.div_ceil(64);
            let chain: Vec<Option<usize>> = (0..t).map(|i| i.checked_sub(1)).collect();
            let bits: Vec<i64> = (0..seqs).flat_map(|_| cuda::tree_bits(&chain)).collect();
            Some(Tensor::from_vec(bits, (rows, words), &dev)?)
        } else {
            None
        };
        let hidden = self.cfg.hidden_size;
        let logits = Tensor::zeros((rows, self.cfg.vocab_size), DType::F32, &dev)?;
        let taps_out = (!taps.is_empty())
            .then(|| Tensor::zeros((rows, taps.len() * hidden), self.dtype(), &dev))
            .transpose()?;
        let (lens_at, pages_at) = (2 * rows, 2 * rows + seqs);
        let mut seq_inputs = Vec::with_capacity(seqs);
        for s in 0..seqs {
            seq_inputs.push(SeqInputs {
                offset: s * t,
                tokens: t,
                cache_len: inputs.narrow(0, lens_at + s, 1)?,
                tree: tree_bits
                    .as_ref()
                    .map(|b| b.narrow(0, s * t, t))
                    .transpose()?,
                pages: Some(
                    inputs
                        .narrow(0, pages_at + s * width, width)?
                        .reshape((1, width))?,
                ),
            });
        }
        // The batch attends in one set of launches per layer.
        let pooled = PooledInputs {
            first: 0,
            seqs,
            cache_len: inputs.narrow(0, lens_at, seqs)?,
            pages: inputs
                .narrow(0, pages_at, seqs * width)?
                .reshape((seqs, width))?,
            tree: tree_bits.clone(),
        };
        // Padding sequences read the pool's buffers like any other: the first cache's.
        let caches: Vec<&SequenceCache> = (0..seqs)
            .map(|s| &*batch[s.min(batch.len() - 1)].cache)
            .collect();
        let ids = inputs.narrow(0, 0, rows)?;
        let positions = inputs.narrow(0, rows, rows)?;
        let body = || -> ModelResult<()> {
            let (h, tapped) = self.run_layers(
                &ids,
                &positions,
                &caches,
                &seq_inputs,
                std::slice::from_ref(&pooled),
                taps,
            )?;
            logits.slice_set(&self.lm_head(&h)?, 0, 0)?;
            if let Some(dst) = &taps_out {
                for (i, part) in tapped.iter().enumerate() {
                    dst.slice_set(part, 1, i * hidden)?;
                }
            }
            Ok(())
        };
        let graph = capture_graph(self.device(), body)?;
        Ok(BatchGraph {
            graph,
            seqs,
            tokens: t,
            width,
            inputs,
            tree: tree_bits,
            logits,
            taps_out,
        })
    }
}

/// The host side of a batched graph's inputs: the batch's tokens, positions, committed
/// lengths and page tables, padding sequences (length 0, token 0 at position 0) on the
/// scratch page, unused page-table entries pointing there too.
fn batch_inputs(
    batch: &[SeqForward<'_>],
    seqs: usize,
    t: usize,
    width: usize,
    scratch: u32,
) -> Vec<u32> {
    let rows = seqs * t;
    let mut host = vec![0u32; 2 * rows + seqs + seqs * width];
    for (s, seq) in batch.iter().enumerate() {
        host[s * t..(s + 1) * t].copy_from_slice(seq.tokens);
        host[rows + s * t..rows + (s + 1) * t].copy_from_slice(seq.positions);
        host[2 * rows + s] = seq.cache.len() as u32;
    }
    let tables = &mut host[2 * rows + seqs..];
    tables.fill(scratch);
    for (row, seq) in tables.chunks_mut(width).zip(batch) {
        seq.cache.page_table().copy_into(row);
    }
    host
}

impl BatchGraph {
    /// Runs the captured step for `batch` (at most the captured size, same tokens per
    /// sequence), appending every sequence's K/V and making it live.
    fn replay(&self, batch: &mut [SeqForward<'_>], scratch: u32) -> ModelResult<ForwardOutput> {
        let (t, n) = (self.tokens, batch.len());
        if n > self.seqs || batch.iter().any(|s| s.tokens.len() != t) {
            return Err(ModelError::BadInput(format!(
                "batched graph of {} x {t} replayed on {n} sequences of other sizes",
                self.seqs
            )));
        }
        if let Some(bits) = &self.tree {
            let mut all: Vec<i64> = Vec::with_capacity(self.seqs * t * t.div_ceil(64));
            for seq in batch.iter() {
                let p = parents(seq).ok_or_else(|| {
                    ModelError::BadInput("tree graph replayed on a causal sequence".into())
                })?;
                all.extend(cuda::tree_bits(p));
            }
            let chain: Vec<Option<usize>> = (0..t).map(|i| i.checked_sub(1)).collect();
            for _ in n..self.seqs {
                all.extend(cuda::tree_bits(&chain));
            }
            cuda::upload_i64(bits, &all)?;
        }
        let host = batch_inputs(batch, self.seqs, t, self.width, scratch);
        cuda::upload_u32(&self.inputs, &host)?;
        self.graph
            .launch()
            .map_err(|e| ModelError::Unsupported(format!("graph launch: {e}")))?;
        for seq in batch.iter_mut() {
            seq.cache.advance(t);
        }
        let rows = n * t;
        let logits = self.logits.narrow(0, 0, rows)?.force_contiguous()?;
        let taps = self
            .taps_out
            .as_ref()
            .map(|x| x.narrow(0, 0, rows).and_then(|x| x.copy()))
            .transpose()?;
        Ok(ForwardOutput {
            logits: Some(logits),
            taps,
            token_offsets: (0..=n).map(|s| s * t).collect(),
            logit_offsets: (0..=n).map(|s| s * t).collect(),
        })
    }
}
