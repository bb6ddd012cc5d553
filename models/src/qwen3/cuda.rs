//! The fused-kernel forward of [`Qwen3Model`] (CUDA, bf16): the layer stack of
//! `cuda/decoder_stack.rs` (7 launches per layer for up to 64 rows, 10 for wider forwards, instead
//! of about 40; `qwen3_moe` layers run the device MoE block there), chunked prefill and
//! CUDA-graph steps; same contract and outputs as the plain
//! path in `qwen3/mod.rs` (to bf16 rounding), which stays the reference. Small batch-1
//! forwards inside [`Qwen3Model::forward`] replay CUDA graphs ([`StepGraph`], kept in the
//! model's graph cache, `cuda/graphs.rs`), so every caller gets single-launch decode and
//! verify steps without managing graphs.

use candle_core::Tensor;

use crate::batch::{ForwardOutput, SeqForward, StackedBatch};
use crate::cache::SequenceCache;
use crate::cuda;
use crate::cuda::decoder_stack::{
    cache_key, capture_graph, graph_page_width, stacked_page_tables, AttnSeq, PooledBatch, Stack,
};
use crate::cuda::graphs::{GraphObject, Key, GRAPH_MAX_TOKENS};
use crate::error::{ModelError, ModelResult};
use crate::layers::attention::AttnPattern;
use crate::qwen3::Qwen3Model;
use crate::taps::TapCollector;

/// Per-sequence device inputs of one fused forward.
pub(super) struct SeqInputs {
    pub offset: usize,
    pub tokens: usize,
    /// `[1]` u32: committed rows before this forward.
    pub cache_len: Tensor,
    pub tree: Option<Tensor>,
    /// The cache's page table (u32 `[1, pages]`; None: its own buffers, rows in order).
    pub pages: Option<Tensor>,
}

/// The committed lengths, page tables and (trees) ancestor bits of a run of consecutive
/// sequences (`first..first + seqs` of the batch) as one upload each, when they share a pool
/// and a token count (their attention is then one set of launches per layer, see
/// `PooledBatch`).
pub(super) struct PooledInputs {
    pub first: usize,
    pub seqs: usize,
    pub cache_len: Tensor,
    pub pages: Tensor,
    pub tree: Option<Tensor>,
}

impl PooledInputs {
    pub(super) fn batch(&self) -> PooledBatch<'_> {
        PooledBatch {
            first: self.first,
            seqs: self.seqs,
            cache_len: &self.cache_len,
            pages: &self.pages,
            tree: self.tree.as_ref(),
        }
    }
}

/// [`PooledInputs`] for every run of `batch` that qualifies: more than one consecutive
/// sequence, all paged in one pool, the same number of new tokens each, all causal or all
/// trees. A step of decoding sequences plus a prompt's prefill chunk is one run and a single.
fn pooled_inputs(
    batch: &[SeqForward<'_>],
    dev: &candle_core::Device,
) -> ModelResult<Vec<PooledInputs>> {
    let is_tree = |s: &SeqForward<'_>| matches!(s.pattern, AttnPattern::Tree { .. });
    let joins = |a: &SeqForward<'_>, b: &SeqForward<'_>| {
        a.tokens.len() == b.tokens.len()
            && is_tree(a) == is_tree(b)
            && match (a.cache.page_table().pool(), b.cache.page_table().pool()) {
                (Some(p), Some(q)) => p.same(q),
                _ => false,
            }
    };
    let mut runs = Vec::new();
    let mut first = 0;
    while first < batch.len() {
        let mut end = first + 1;
        while end < batch.len() && joins(&batch[first], &batch[end]) {
            end += 1;
        }
        if end - first >= 2 {
            runs.push(pooled_run(&batch[first..end], first, dev)?);
        }
        first = end;
    }
    Ok(runs)
}

/// The [`PooledInputs`] of `run`, the batch's sequences from `first` on.
fn pooled_run(
    run: &[SeqForward<'_>],
    first: usize,
    dev: &candle_core::Device,
) -> ModelResult<PooledInputs> {
    let caches: Vec<&SequenceCache> = run.iter().map(|s| &*s.cache).collect();
    let t = run[0].tokens.len();
    let lens: Vec<u32> = caches.iter().map(|c| c.len() as u32).collect();
    let tree = match run[0].pattern {
        AttnPattern::Tree { .. } => {
            let bits: Vec<i64> = run
                .iter()
                .flat_map(|s| match s.pattern {
                    AttnPattern::Tree { parents } => cuda::tree_bits(parents),
                    _ => Vec::new(),
                })
                .collect();
            Some(Tensor::from_vec(
                bits,
                (caches.len() * t, t.div_ceil(64)),
                dev,
            )?)
        }
        _ => None,
    };
    Ok(PooledInputs {
        first,
        seqs: run.len(),
        cache_len: Tensor::new(lens.as_slice(), dev)?,
        pages: stacked_page_tables(&caches, dev)?,
        tree,
    })
}

impl Qwen3Model {
    pub(crate) fn forward_fast(
        &self,
        batch: &mut [SeqForward<'_>],
        taps: &[usize],
    ) -> ModelResult<ForwardOutput> {
        let dev = self.device().clone();
        let StackedBatch {
            tokens: all_tokens,
            positions: all_positions,
            logit_rows,
            token_offsets,
            logit_offsets,
        } = StackedBatch::new(batch);
        let pooled = pooled_inputs(batch, &dev)?;
        let mut inputs = Vec::with_capacity(batch.len());
        for (s, (seq, &off)) in batch.iter().zip(&token_offsets).enumerate() {
            let t = seq.tokens.len();
            let len = seq.cache.len();
            let tree = match seq.pattern {
                AttnPattern::Causal => None,
                AttnPattern::Tree { parents } => {
                    let bits = cuda::tree_bits(parents);
                    Some(Tensor::from_vec(bits, (t, t.div_ceil(64)), &dev)?)
                }
                other => {
                    return Err(ModelError::BadInput(format!(
                        "fused forward takes causal or tree patterns, got {other:?}"
                    )))
                }
            };
            inputs.push(SeqInputs {
                offset: off,
                tokens: t,
                cache_len: match pooled
                    .iter()
                    .find(|p| (p.first..p.first + p.seqs).contains(&s))
                {
                    Some(p) => p.cache_len.narrow(0, s - p.first, 1)?,
                    None => Tensor::new(&[len as u32], &dev)?,
                },
                tree,
                pages: seq.cache.page_table().device_table().cloned(),
            });
        }
        let positions = Tensor::new(all_positions.as_slice(), &dev)?;
        let ids = Tensor::new(all_tokens.as_slice(), &dev)?;
        let caches: Vec<&SequenceCache> = batch.iter().map(|s| &*s.cache).collect();
        let (h, tapped) = self.run_layers(&ids, &positions, &caches, &inputs, &pooled, taps)?;
        for seq in batch.iter_mut() {
            seq.cache.advance(seq.tokens.len());
        }
        let taps = if tapped.is_empty() {
            None
        } else {
            Some(Tensor::cat(&tapped, 1)?)
        };
        // `h` already holds the final norm of every row.
        let logits = if logit_rows.is_empty() {
            None
        } else if logit_rows.len() == all_tokens.len()
            && logit_rows.iter().enumerate().all(|(i, &r)| r as usize == i)
        {
            Some(self.lm_head(&h)?)
        } else {
            let rows = Tensor::new(logit_rows.as_slice(), &dev)?;
            Some(self.lm_head(&h.index_select(&rows, 0)?)?)
        };
        Ok(ForwardOutput {
            logits,
            taps,
            token_offsets,
            logit_offsets,
        })
    }

    /// A long causal forward of one sequence (a prefill) as consecutive fused forwards of at
    /// most [`Qwen3Model::with_prefill_chunk`] tokens: each chunk attends to the cache the previous
    /// ones filled, which is the causal pattern. Logits and taps are stitched back in order.
    pub(crate) fn forward_chunked(
        &self,
        seq: &mut SeqForward<'_>,
        taps: &[usize],
    ) -> ModelResult<ForwardOutput> {
        let t = seq.tokens.len();
        let chunk = self.prefill_chunk();
        let start_len = seq.cache.len();
        let mut logits = Vec::new();
        let mut tap_parts = Vec::new();
        let mut begin = 0;
        while begin < t {
            let end = (begin + chunk).min(t);
            let rows: Vec<usize> = seq
                .logit_rows
                .iter()
                .filter(|&&r| r >= begin && r < end)
                .map(|&r| r - begin)
                .collect();
            let out = self.forward_fast(
                &mut [SeqForward {
                    cache: &mut *seq.cache,
                    tokens: &seq.tokens[begin..end],
                    positions: &seq.positions[begin..end],
                    pattern: &AttnPattern::Causal,
                    logit_rows: &rows,
                }],
                taps,
            );
            let out = match out {
                Ok(o) => o,
                Err(e) => {
                    // Nothing of a failed forward may stay live.
                    let _ = seq.cache.truncate(start_len);
                    return Err(e);
                }
            };
            if let Some(l) = out.logits {
                logits.push(l);
            }
            if let Some(tp) = out.taps {
                tap_parts.push(tp);
            }
            begin = end;
        }
        // Chunk c returned the requested rows that fall in it, in the order asked; `perm[j]` is
        // where request j landed in the concatenation.
        let logits = if logits.is_empty() {
            None
        } else {
            let mut perm = vec![0u32; seq.logit_rows.len()];
            let mut next = 0u32;
            let mut begin = 0;
            while begin < t {
                let end = (begin + chunk).min(t);
                for (j, &r) in seq.logit_rows.iter().enumerate() {
                    if r >= begin && r < end {
                        perm[j] = next;
                        next += 1;
                    }
                }
                begin = end;
            }
            let parts: Vec<&Tensor> = logits.iter().collect();
            let all = Tensor::cat(&parts, 0)?;
            let idx = Tensor::new(perm.as_slice(), self.device())?;
            Some(all.index_select(&idx, 0)?)
        };
        Ok(ForwardOutput {
            logits,
            taps: if tap_parts.is_empty() {
                None
            } else {
                Some(Tensor::cat(&tap_parts, 0)?)
            },
            token_offsets: vec![0, t],
            logit_offsets: vec![0, seq.logit_rows.len()],
        })
    }

    /// The layers over already-uploaded inputs; writes K/V into the caches but does not
    /// advance them. Returns the final-normed hidden rows and the taps in the order asked
    /// ([`crate::taps`]: a last-layer tap is those normed rows). Makes no host-device copies,
    /// so a CUDA graph can capture it.
    pub(super) fn run_layers(
        &self,
        ids: &Tensor,
        positions: &Tensor,
        caches: &[&SequenceCache],
        inputs: &[SeqInputs],
        pooled: &[PooledInputs],
        taps: &[usize],
    ) -> ModelResult<(Tensor, Vec<Tensor>)> {
        let seqs: Vec<AttnSeq<'_>> = caches
            .iter()
            .zip(inputs)
            .map(|(cache, inp)| AttnSeq {
                cache,
                offset: inp.offset,
                tokens: inp.tokens,
                cache_len: &inp.cache_len,
                tree: inp.tree.as_ref(),
                pages: inp.pages.as_ref(),
            })
            .collect();
        let runs: Vec<PooledBatch<'_>> = pooled.iter().map(PooledInputs::batch).collect();
        let stack = Stack {
            pooled: &runs,
            layers: &self.layers,
            final_norm: &self.norm,
            rope: &self.rope,
            eps: self.cfg.rms_norm_eps,
            mode: self.mode(),
            gemv_rows: self.gemv_rows(),
            tuned_rows: self.tuned_rows(),
            splitk_rows: self.splitk_rows(),
        };
        let x = self.embed_weight().index_select(ids, 0)?;
        let mut tapped = TapCollector::new(taps, self.cfg.num_hidden_layers);
        let h = stack.run(x, positions, &seqs, &mut tapped)?;
        let parts = tapped.parts(Some(&h))?;
        Ok((h, parts))
    }
}

/// One batch-1 forward of a fixed number `t` of new tokens (a decode step when t = 1, a
/// chain or tree verification otherwise) over one [`SequenceCache`], captured as a CUDA graph
/// and replayed with a single launch: the ~370 kernels of a step cost one host call. The graph
/// reads the tokens, positions, cache length and (tree graphs) the ancestor bit rows from
/// device buffers written before each replay, and attends over as many key chunks as the
/// cache can hold (chunks past the live length exit at once), so one capture serves every
/// step of that cache (checked by address). Logits come back for all `t` rows.
pub struct StepGraph {
    graph: candle_core::cuda_backend::cudarc::driver::CudaGraph,
    /// Keeps the weights the graph reads alive (None for graphs the model itself holds).
    _model: Option<Qwen3Model>,
    tokens: usize,
    /// u32 [tokens (t), positions (t), cache_len, page table (a pooled cache's pages)].
    inputs: Tensor,
    /// i64 `[t, ceil(t / 64)]` ancestor bits (tree graphs).
    tree: Option<Tensor>,
    /// f32 `[t, vocab]`, rewritten by every replay.
    logits: Tensor,
    /// The tapped layer outputs `[t, taps * hidden]`, rewritten by every replay.
    taps_out: Option<Tensor>,
    /// [`cache_key`] of the cache the graph was captured for.
    cache_key: u64,
}

impl Qwen3Model {
    /// Captures a forward of `t` tokens for `cache` (whose K/V buffers the graph writes in
    /// place), causal or (with `tree`) under a tree mask given at each replay. Needs the fused
    /// kernels (see [`Qwen3Model::fast_kernels`]).
    pub fn capture_step(
        &self,
        cache: &SequenceCache,
        t: usize,
        tree: bool,
    ) -> ModelResult<StepGraph> {
        self.capture_step_with(cache, t, tree, &[], true)
    }

    /// [`Qwen3Model::capture_step`] that also keeps the outputs of the layers in `taps`
    /// (concatenated, as [`Qwen3Model::forward`] returns them). `own` keeps a clone of the
    /// model (and so its weights) alive in the graph; graphs the model caches itself
    /// (`cuda/graphs.rs`) must not, or model and cache would hold each other.
    pub(crate) fn capture_step_with(
        &self,
        cache: &SequenceCache,
        t: usize,
        tree: bool,
        taps: &[usize],
        own: bool,
    ) -> ModelResult<StepGraph> {
        if !self.fast_kernels() || t == 0 || t > cuda::MAX_FAST_TOKENS {
            return Err(ModelError::Unsupported(format!(
                "step graphs need the fused kernels (CUDA, bf16, head_dim 128) and 1..={} tokens",
                cuda::MAX_FAST_TOKENS
            )));
        }
        cache.check_room(t)?;
        let dev = self.device().clone();
        let len = cache.len() as u32;
        let mut init: Vec<u32> = vec![0; t];
        init.extend((0..t as u32).map(|i| len + i));
        init.push(len);
        // A pooled cache's page table is an input too: the graph serves any cache of the pool
        // with as many pages.
        let pages = self.graph_page_width(cache)?;
        init.extend_from_slice(cache.page_table().pages());
        init.resize(2 * t + 1 + pages, 0);
        let inputs = Tensor::new(init.as_slice(), &dev)?;
        let tree_bits = if tree {
            let chain: Vec<Option<usize>> = (0..t).map(|i| i.checked_sub(1)).collect();
            Some(Tensor::from_vec(
                cuda::tree_bits(&chain),
                (t, t.div_ceil(64)),
                &dev,
            )?)
        } else {
            None
        };
        let logits = Tensor::zeros((t, self.cfg.vocab_size), candle_core::DType::F32, &dev)?;
        let taps_out = if taps.is_empty() {
            None
        } else {
            Some(Tensor::zeros(
                (t, taps.len() * self.cfg.hidden_size),
                self.dtype(),
                &dev,
            )?)
        };
        let seq = SeqInputs {
            offset: 0,
            tokens: t,
            cache_len: inputs.narrow(0, 2 * t, 1)?,
            tree: tree_bits.clone(),
            pages: if cache.page_table().is_contiguous() {
                None
            } else {
                Some(inputs.narrow(0, 2 * t + 1, pages)?.reshape((1, pages))?)
            },
        };
        let ids = inputs.narrow(0, 0, t)?;
        let positions = inputs.narrow(0, t, t)?;
        let body = || -> ModelResult<()> {
            let (h, tapped) = self.run_layers(
                &ids,
                &positions,
                &[cache],
                std::slice::from_ref(&seq),
                &[],
                taps,
            )?;
            let out = self.lm_head(&h)?;
            logits.slice_set(&out, 0, 0)?;
            if let Some(dst) = &taps_out {
                for (i, part) in tapped.iter().enumerate() {
                    dst.slice_set(part, 1, i * self.cfg.hidden_size)?;
                }
            }
            Ok(())
        };
        let graph = capture_graph(self.device(), body)?;
        Ok(StepGraph {
            graph,
            _model: own.then(|| self.clone()),
            tokens: t,
            inputs,
            tree: tree_bits,
            logits,
            taps_out,
            cache_key: cache_key(cache)?,
        })
    }
}

impl Qwen3Model {
    /// Page-table entries a step graph of `cache` reads: none for a cache in buffers of its
    /// own; for a pooled one, enough for any sequence the model can hold (every graph of the
    /// pool then has the same width, whatever the capacity of the cache it was captured on).
    pub(super) fn graph_page_width(&self, cache: &SequenceCache) -> ModelResult<usize> {
        graph_page_width(cache, self.rope.max_positions() + cuda::MAX_FAST_TOKENS)
    }
}

impl StepGraph {
    /// New tokens per replay.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    pub fn is_tree(&self) -> bool {
        self.tree.is_some()
    }

    /// Runs the captured forward for `tokens` at `positions` (and, for a tree graph, the tree
    /// given by `parents`), appending their K/V to `cache` (the one the graph was captured
    /// for). Returns the logits `[t, vocab]` (f32; a copy, so later replays do not overwrite
    /// it).
    pub fn step(
        &self,
        cache: &mut SequenceCache,
        tokens: &[u32],
        positions: &[u32],
        parents: Option<&[Option<usize>]>,
    ) -> ModelResult<Tensor> {
        if cache_key(cache)? != self.cache_key {
            return Err(ModelError::BadInput(
                "step graph replayed on a cache it was not captured for".into(),
            ));
        }
        Ok(self.replay(cache, tokens, positions, parents)?.0)
    }

    /// As [`StepGraph::step`], also returning the tapped layer outputs (copies), for a
    /// caller that has already matched the cache (the model's graph cache keys on it).
    pub(crate) fn replay(
        &self,
        cache: &mut SequenceCache,
        tokens: &[u32],
        positions: &[u32],
        parents: Option<&[Option<usize>]>,
    ) -> ModelResult<(Tensor, Option<Tensor>)> {
        let t = self.tokens;
        if tokens.len() != t || positions.len() != t {
            return Err(ModelError::BadInput(format!(
                "step graph for {t} tokens got {} tokens, {} positions",
                tokens.len(),
                positions.len()
            )));
        }
        cache.check_room(t)?;
        match (&self.tree, parents) {
            (Some(bits), Some(p)) if p.len() == t => {
                cuda::upload_i64(bits, &cuda::tree_bits(p))?;
            }
            (None, None) => {}
            _ => {
                return Err(ModelError::BadInput(
                    "tree graphs need the parents of every token; chain graphs none".into(),
                ))
            }
        }
        let pages = cache.page_table().pages();
        let width = self.inputs.elem_count() - (2 * t + 1);
        if pages.len() > width {
            return Err(ModelError::BadInput(format!(
                "step graph for page tables of {width} pages replayed on a cache of {}",
                pages.len()
            )));
        }
        let mut host: Vec<u32> = Vec::with_capacity(2 * t + 1 + width);
        host.extend_from_slice(tokens);
        host.extend_from_slice(positions);
        host.push(cache.len() as u32);
        host.extend_from_slice(pages);
        host.resize(2 * t + 1 + width, 0);
        cuda::upload_u32(&self.inputs, &host)?;
        self.graph
            .launch()
            .map_err(|e| ModelError::Unsupported(format!("graph launch: {e}")))?;
        cache.advance(t);
        let taps = self.taps_out.as_ref().map(Tensor::copy).transpose()?;
        Ok((self.logits.force_contiguous()?, taps))
    }
}

// SAFETY: a StepGraph holds a CUDA graph and tensors (see `GraphObject`).
unsafe impl GraphObject for StepGraph {}

impl Qwen3Model {
    /// Replays `batch` from a captured graph when it qualifies: one sequence with at most
    /// [`GRAPH_MAX_TOKENS`] new tokens, causal or tree, asking for the logits of every row. The
    /// graph is keyed by (cache memory, tokens, chain or tree, taps) in the model's
    /// [`crate::cuda::graphs::GraphCache`]; it runs the fused forward's kernels with the
    /// attention split over the cache's whole capacity (the fused forward splits the live
    /// length), so the two agree to f32 summation order, and a graph is deterministic. `None`
    /// means "run the fused forward".
    pub(crate) fn forward_graph(
        &self,
        batch: &mut [SeqForward<'_>],
        taps: &[usize],
    ) -> ModelResult<Option<ForwardOutput>> {
        let Some(graphs) = self.step_graphs().slots() else {
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
        if t == 0
            || t > GRAPH_MAX_TOKENS
            || !all_rows
            || seq.cache.len() + t > seq.cache.backed_rows()
        {
            return Ok(None);
        }
        let tree = parents.is_some();
        let key = Key {
            cache: cache_key(seq.cache)?,
            tokens: t,
            seqs: 1,
            tree,
            taps: taps.to_vec(),
        };
        let result = graphs.with_graph(
            key,
            &mut *seq.cache,
            |cache| {
                crate::speculative::profile::timed(self.device(), "target_capture", || {
                    self.capture_step_with(cache, t, tree, taps, false)
                })
            },
            |g, cache| g.replay(cache, seq.tokens, seq.positions, parents),
        )?;
        let Some((logits, taps)) = result else {
            return Ok(None);
        };
        Ok(Some(ForwardOutput {
            logits: Some(logits),
            taps,
            token_offsets: vec![0, t],
            logit_offsets: vec![0, t],
        }))
    }
}
