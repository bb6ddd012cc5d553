//! The DFlash drafter's block forward through the fused CUDA kernels (see `qwen3/cuda.rs`):
//! the block's K/V go into the rows just past the committed context, every block token sees
//! the whole context and the whole block (the Full pattern as all-ones bit rows), and `len`
//! stays unchanged, exactly as the plain path in `dflash/mod.rs`.

use candle_core::Tensor;

use crate::cache::SequenceCache;
use crate::cuda;
use crate::cuda::decoder_stack::{
    cache_key, capture_graph, graph_page_width, stacked_page_tables, AttnSeq, PooledBatch, Stack,
};
use crate::cuda::graphs::Key;
use crate::dflash::cache::{batched_append_rows, one_pool};
use crate::dflash::{DFlashDrafter, DraftInput};
use crate::error::{ModelError, ModelResult};
use crate::taps::TapCollector;

impl DFlashDrafter {
    /// Final-normed hidden states of every block slot, `[batch * block_size, hidden]`, for
    /// already-appended context; `ids`/`pos` hold the blocks' tokens and positions.
    pub(crate) fn block_fast(
        &self,
        batch: &[DraftInput<'_>],
        ids: &Tensor,
        pos: &Tensor,
    ) -> ModelResult<Tensor> {
        let dev = self.device().clone();
        let full = self.full_block_bits()?;
        let caches: Vec<&SequenceCache> = batch.iter().map(|i| &*i.cache).collect();
        let pooled = self.pooled_blocks(&caches)?;
        // One upload of every committed length, narrowed per sequence.
        let all = match &pooled {
            Some(p) => p.cache_len.clone(),
            None => {
                let lens: Vec<u32> = caches.iter().map(|c| c.len() as u32).collect();
                Tensor::new(lens.as_slice(), &dev)?
            }
        };
        let lens = (0..caches.len())
            .map(|s| all.narrow(0, s, 1))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let pages: Vec<Option<&Tensor>> = caches
            .iter()
            .map(|c| c.page_table().device_table())
            .collect();
        let runs: Vec<PooledBatch<'_>> = pooled.iter().map(PooledBlocks::batch).collect();
        self.block_layers(ids, pos, &caches, &lens, &pages, &full, &runs)
    }

    /// The blocks of a batch whose drafter caches all live in one pool, as one pooled run:
    /// their attention is then one set of launches per layer (every block has the same
    /// `block_size` rows). None for a single cache or caches of their own.
    fn pooled_blocks(&self, caches: &[&SequenceCache]) -> ModelResult<Option<PooledBlocks>> {
        if caches.len() < 2 || one_pool(caches).is_none() {
            return Ok(None);
        }
        let dev = self.device();
        let b = self.config().block_size;
        let lens: Vec<u32> = caches.iter().map(|c| c.len() as u32).collect();
        let full: Vec<i64> = vec![(u64::MAX >> (64 - b)) as i64; caches.len() * b];
        Ok(Some(PooledBlocks {
            seqs: caches.len(),
            cache_len: Tensor::new(lens.as_slice(), dev)?,
            pages: stacked_page_tables(caches, dev)?,
            full: Tensor::from_vec(full, (caches.len() * b, 1), dev)?,
        }))
    }

    /// Every block token sees the whole block: all-ones bit rows `[b, 1]`.
    fn full_block_bits(&self) -> ModelResult<Tensor> {
        let b = self.config().block_size;
        let full: Vec<i64> = vec![(u64::MAX >> (64 - b)) as i64; b];
        Ok(Tensor::from_vec(full, (b, 1), self.device())?)
    }

    /// The block's layers over already-uploaded inputs (no host-device copies, so a CUDA
    /// graph can capture it): sequence s's block is rows `s * b ..`, its committed length is
    /// `lens[s]` (a `[1]` u32 tensor) and its page table `pages[s]` (None: a cache of its
    /// own); `pooled` holds the runs whose attention is batched.
    #[allow(clippy::too_many_arguments)]
    fn block_layers(
        &self,
        ids: &Tensor,
        pos: &Tensor,
        caches: &[&SequenceCache],
        lens: &[Tensor],
        pages: &[Option<&Tensor>],
        full: &Tensor,
        pooled: &[PooledBatch<'_>],
    ) -> ModelResult<Tensor> {
        let b = self.config().block_size;
        let seqs: Vec<AttnSeq<'_>> = caches
            .iter()
            .enumerate()
            .map(|(s, cache)| AttnSeq {
                cache,
                offset: s * b,
                tokens: b,
                cache_len: &lens[s],
                tree: Some(full),
                pages: pages.get(s).copied().flatten(),
            })
            .collect();
        let stack = Stack {
            pooled,
            layers: self.layers(),
            final_norm: self.final_norm_weight(),
            rope: self.rotary(),
            eps: self.config().layers.rms_norm_eps,
            mode: self.mode(),
            gemv_rows: self.gemv_rows(),
            tuned_rows: self.tuned_rows(),
            splitk_rows: self.splitk_rows(),
        };
        let x = self.embed_weight().index_select(ids, 0)?;
        // The drafter's own stack: no taps.
        stack.run(x, pos, &seqs, &mut TapCollector::new(&[], 0))
    }

    /// The context path fused: per layer one q/k/v GEMM over the new context rows and the
    /// norm + RoPE + cache-write kernel (its q output is dropped: context rows only provide
    /// K/V), then every cache advances past its new rows. `ctx` holds the fused features of
    /// all sequences' new rows in batch order, `pos` their positions.
    pub(crate) fn append_context_fast(
        &self,
        batch: &mut [DraftInput<'_>],
        ctx: &Tensor,
        pos: &Tensor,
    ) -> ModelResult<()> {
        let dev = self.device().clone();
        let lens: Vec<u32> = batch.iter().map(|i| i.cache.len() as u32).collect();
        let lens = Tensor::new(lens.as_slice(), &dev)?;
        let mut spans = Vec::with_capacity(batch.len());
        let mut off = 0;
        for (s, item) in batch.iter().enumerate() {
            let n = item.context.map(|c| c.dim(0)).transpose()?.unwrap_or(0);
            spans.push((off, n, lens.narrow(0, s, 1)?));
            off += n;
        }
        let caches: Vec<&SequenceCache> = batch.iter().map(|i| &*i.cache).collect();
        let pages: Vec<Option<&Tensor>> = caches
            .iter()
            .map(|c| c.page_table().device_table())
            .collect();
        self.context_layers(ctx, pos, &caches, &spans, &pages)?;
        for (item, (_, n, _)) in batch.iter_mut().zip(&spans) {
            item.cache.advance(*n);
        }
        Ok(())
    }

    /// The context path's device work (no host-device copies, so a graph can capture it):
    /// cache s takes rows `spans[s] = (offset, rows, committed length as a [1] u32)` of `ctx`,
    /// through its page table `pages[s]` (None: rows in order in its own buffers).
    fn context_layers(
        &self,
        ctx: &Tensor,
        pos: &Tensor,
        caches: &[&SequenceCache],
        spans: &[(usize, usize, Tensor)],
        pages: &[Option<&Tensor>],
    ) -> ModelResult<()> {
        let eps = self.config().layers.rms_norm_eps;
        let layers = self.layers();
        let (nh, nkv, d) = layers[0].heads();
        let (cos, sin) = self.rotary().tables();
        let per_row = self.context_rows_batched(caches, spans, ctx.device())?;
        for (li, layer) in layers.iter().enumerate() {
            let fused = layer
                .fused()
                .ok_or_else(|| ModelError::BadInput("fused draft on unfused weights".into()))?;
            let (_, _, q_norm, k_norm) = layer.norm_weights();
            // Context rows only provide K/V: the K and V rows of the fused weight alone
            // (a third of its bytes).
            let kv_w = fused.qkv.narrow(0, nh * d, 2 * nkv * d)?;
            let kv_rows = cuda::linear(ctx, &kv_w)?;
            if let Some((row_lens, row_pages)) = &per_row {
                // Every cache of the batch writes into the pool's buffers of this layer.
                let kv = caches[0].layer(li).attention()?;
                let (kc, vc) = kv.buffers();
                cuda::kv_norm_rope_cache(&cuda::QkvRows {
                    qkv: &kv_rows,
                    q_norm,
                    k_norm,
                    cos,
                    sin,
                    positions: pos,
                    cache_len: row_lens,
                    kc,
                    vc,
                    pages: Some(row_pages),
                    heads: (nh, nkv, d),
                    eps,
                })?;
                continue;
            }
            for (s, (cache, (off, n, len))) in caches.iter().zip(spans).enumerate() {
                if *n == 0 {
                    continue;
                }
                let kv = cache.layer(li).attention()?;
                let (kc, vc) = kv.buffers();
                cuda::kv_norm_rope_cache(&cuda::QkvRows {
                    qkv: &kv_rows.narrow(0, *off, *n)?,
                    q_norm,
                    k_norm,
                    cos,
                    sin,
                    positions: &pos.narrow(0, *off, *n)?,
                    cache_len: len,
                    kc,
                    vc,
                    pages: pages.get(s).copied().flatten(),
                    heads: (nh, nkv, d),
                    eps,
                })?;
            }
        }
        Ok(())
    }

    /// The per-row inputs of one launch per layer for the context rows of the whole batch
    /// (see [`crate::cuda::batched_context_append`]): each row is its own "sequence" of one
    /// row to the cache-write kernel, with its cache's committed length plus its index among
    /// that cache's new rows (u32 `[rows]`) and its cache's page table (u32 `[rows, width]`).
    /// None where the switch is off, fewer than two caches have new rows, or the caches are
    /// not all in one pool (their buffers differ): one launch per cache then.
    fn context_rows_batched(
        &self,
        caches: &[&SequenceCache],
        spans: &[(usize, usize, Tensor)],
        dev: &candle_core::Device,
    ) -> ModelResult<Option<(Tensor, Tensor)>> {
        if !crate::cuda::batched_context_append() {
            return Ok(None);
        }
        let new_rows: Vec<usize> = spans.iter().map(|(_, n, _)| *n).collect();
        let Some((lens, pages, width)) = batched_append_rows(caches, &new_rows) else {
            return Ok(None);
        };
        let rows = lens.len();
        Ok(Some((
            Tensor::new(lens.as_slice(), dev)?,
            Tensor::from_vec(pages, (rows, width), dev)?,
        )))
    }

    /// [`DFlashDrafter::draft_logits`] of one sequence replayed from a [`RoundGraph`] when
    /// the drafter's graphs are on and the round qualifies (new context of 1 to
    /// [`crate::cuda::graphs::GRAPH_MAX_TOKENS`] rows); `None`: run it uncaptured.
    pub(crate) fn draft_logits_graph(
        &self,
        batch: &mut [DraftInput<'_>],
    ) -> ModelResult<Option<Tensor>> {
        let Some(graphs) = self.round_graphs() else {
            return Ok(None);
        };
        let [item] = batch else { return Ok(None) };
        let Some(features) = item.context else {
            return Ok(None);
        };
        let n = features.dim(0)?;
        let b = self.config().block_size;
        if n == 0
            || n > crate::cuda::graphs::GRAPH_MAX_TOKENS
            || item.cache.len() + n + b > item.cache.backed_rows()
            || item.cache.len() + n + b > self.rotary().max_positions()
        {
            return Ok(None);
        }
        let key = Key {
            cache: cache_key(item.cache)?,
            tokens: n,
            seqs: 1,
            tree: false,
            taps: Vec::new(),
        };
        graphs.with_graph(
            key,
            &mut *item.cache,
            |cache| {
                crate::speculative::profile::timed(self.device(), "drafter_capture", || {
                    self.capture_round(cache, n)
                })
            },
            |g, cache| g.replay(cache, features, item.block),
        )
    }

    /// Captures a draft round for `cache`: `n` new context rows, then the block after them
    /// and the LM head of its draft slots.
    fn capture_round(&self, cache: &SequenceCache, n: usize) -> ModelResult<RoundGraph> {
        let b = self.config().block_size;
        cache.check_room(n + b)?;
        let dev = self.device().clone();
        let cfg = self.config();
        let width = cfg.target_layer_ids.len() * cfg.layers.hidden_size;
        let features = Tensor::zeros((n, width), self.dtype(), &dev)?;
        let len = cache.len() as u32;
        let width = self.round_page_width(cache)?;
        let inputs = Tensor::new(
            round_inputs(
                self.mask_token_id(),
                b,
                n,
                len,
                width,
                cache.page_table().pages(),
            )
            .as_slice(),
            &dev,
        )?;
        let vocab = self.lm_head_rows();
        let logits = Tensor::zeros((b - 1, vocab), candle_core::DType::F32, &dev)?;
        let full = self.full_block_bits()?;
        let ids = inputs.narrow(0, 0, b)?;
        let pos = inputs.narrow(0, b, b)?;
        let ctx_pos = inputs.narrow(0, 2 * b, n)?;
        let spans = [(0, n, inputs.narrow(0, 2 * b + n, 1)?)];
        let block_len = [inputs.narrow(0, 2 * b + n + 1, 1)?];
        // A pooled cache's page table is an input too: the graph serves any cache of the pool.
        let table = match width {
            0 => None,
            w => Some(inputs.narrow(0, 2 * b + n + 2, w)?.reshape((1, w))?),
        };
        let pages = [table.as_ref()];
        let body = || -> ModelResult<()> {
            let ctx = self.context_features(&features)?;
            self.context_layers(&ctx, &ctx_pos, &[cache], &spans, &pages)?;
            let h = self.block_layers(&ids, &pos, &[cache], &block_len, &pages, &full, &[])?;
            let out = self.lm_head(&h.narrow(0, 1, b - 1)?)?;
            logits.slice_set(&out, 0, 0)?;
            Ok(())
        };
        let graph = capture_graph(self.device(), body)?;
        Ok(RoundGraph {
            graph,
            features,
            inputs,
            _full: full,
            logits,
            mask: self.mask_token_id(),
            width,
        })
    }

    /// Page-table entries a round graph of `cache` reads: none for a cache of its own; for a
    /// pooled one, enough for any cache the drafter's positions allow (every round graph of
    /// the pool has this width, whatever the capacity of the cache it was captured on).
    fn round_page_width(&self, cache: &SequenceCache) -> ModelResult<usize> {
        graph_page_width(
            cache,
            self.rotary().max_positions() + self.config().block_size,
        )
    }
}

/// A batch's drafter caches in one pool (see [`DFlashDrafter::pooled_blocks`]): committed
/// lengths (u32 `[seqs]`), page tables (u32 `[seqs, stride]`) and the full-block bits of
/// every block row (i64 `[seqs * b, 1]`).
struct PooledBlocks {
    seqs: usize,
    cache_len: Tensor,
    pages: Tensor,
    full: Tensor,
}

impl PooledBlocks {
    fn batch(&self) -> PooledBatch<'_> {
        PooledBatch {
            first: 0,
            seqs: self.seqs,
            cache_len: &self.cache_len,
            pages: &self.pages,
            tree: Some(&self.full),
        }
    }
}

/// u32 inputs of a round graph: block tokens (b), block positions (b), context positions
/// (n), committed length, committed length after the context, then (pooled caches) the page
/// table padded to `width` entries.
fn round_inputs(mask: u32, b: usize, n: usize, len: u32, width: usize, table: &[u32]) -> Vec<u32> {
    let start = len + n as u32;
    let mut v = vec![mask; b];
    v.extend((0..b as u32).map(|i| start + i));
    v.extend((0..n as u32).map(|i| len + i));
    v.push(len);
    v.push(start);
    let at = v.len();
    v.extend_from_slice(&table[..table.len().min(width)]);
    v.resize(at + width, 0);
    v
}

/// One batch-1 draft round (append `n` context rows to the drafter cache, draft a block
/// after them, the LM head of its draft slots) as a CUDA graph; the drafter keeps these in
/// its own cache (`cuda/graphs.rs`), keyed on the drafter cache it was captured for, so it
/// does not hold the drafter and is only replayed on that cache.
pub(crate) struct RoundGraph {
    graph: candle_core::cuda_backend::cudarc::driver::CudaGraph,
    /// `[n, taps * hidden]` context features, written before each replay.
    features: Tensor,
    /// u32, see [`round_inputs`].
    inputs: Tensor,
    _full: Tensor,
    /// f32 `[b - 1, vocab]`, rewritten by every replay.
    logits: Tensor,
    mask: u32,
    /// Page-table entries in `inputs` (0: a cache of its own).
    width: usize,
}

// SAFETY: a RoundGraph holds a CUDA graph and tensors (see `GraphObject`).
unsafe impl crate::cuda::graphs::GraphObject for RoundGraph {}

impl RoundGraph {
    /// Appends `features` to `cache` and drafts `block` after them: the logits of the draft
    /// slots `[b - 1, vocab]` (a copy), as [`DFlashDrafter::draft_logits`] returns them.
    fn replay(
        &self,
        cache: &mut SequenceCache,
        features: &Tensor,
        block: &[u32],
    ) -> ModelResult<Tensor> {
        let n = self.features.dim(0)?;
        let b = self.logits.dim(0)? + 1;
        if features.dim(0)? != n || block.len() != b {
            return Err(ModelError::BadInput(
                "round graph replayed on another shape".into(),
            ));
        }
        cache.check_room(n + b)?;
        let pages = cache.page_table().pages();
        if cache.len() + n + b > cache.backed_rows() || pages.len() > self.width {
            return Err(ModelError::BadCacheOp(format!(
                "round graph of {} page entries replayed on a cache of {} pages backing {} rows ({} needed)",
                self.width,
                pages.len(),
                cache.backed_rows(),
                cache.len() + n + b
            )));
        }
        self.features
            .slice_set(&features.to_dtype(self.features.dtype())?, 0, 0)?;
        let mut host = round_inputs(self.mask, b, n, cache.len() as u32, self.width, pages);
        host[..b].copy_from_slice(block);
        cuda::upload_u32(&self.inputs, &host)?;
        self.graph
            .launch()
            .map_err(|e| ModelError::Unsupported(format!("graph launch: {e}")))?;
        cache.advance(n);
        Ok(self.logits.force_contiguous()?)
    }
}

/// Drafting one block over one sequence's drafter cache, captured as a CUDA graph and replayed
/// with one launch (see [`crate::StepGraph`]): block tokens, positions and the committed length
/// come from a device buffer written before each replay; attention covers every key chunk the
/// cache can hold. Holds the drafter (its weights stay alive); the cache is checked by address.
pub struct DraftGraph {
    graph: candle_core::cuda_backend::cudarc::driver::CudaGraph,
    _drafter: DFlashDrafter,
    /// u32 [block (b), positions (b), cache_len].
    inputs: Tensor,
    _full: Tensor,
    /// `[b, hidden]` final-normed hidden states, rewritten by every replay.
    hidden: Tensor,
    cache_key: u64,
}

impl DFlashDrafter {
    /// Captures the block forward for `cache`. The graph drafts over whatever context the
    /// cache holds at replay time; new context is appended outside it (a
    /// [`DFlashDrafter::forward`] with `context`, which also drafts).
    pub fn capture_block(&self, cache: &SequenceCache) -> ModelResult<DraftGraph> {
        if !self.fast_kernels() {
            return Err(ModelError::Unsupported(
                "draft graphs need the fused kernels (CUDA, bf16, head_dim 128)".into(),
            ));
        }
        if !cache.page_table().is_contiguous() {
            return Err(ModelError::Unsupported(
                "draft graphs are captured on drafter caches of their own, not pooled ones".into(),
            ));
        }
        let b = self.config().block_size;
        cache.check_room(b)?;
        let dev = self.device().clone();
        let len = cache.len() as u32;
        let mut init = vec![self.mask_token_id(); b];
        init.extend((0..b as u32).map(|i| len + i));
        init.push(len);
        let inputs = Tensor::new(init.as_slice(), &dev)?;
        let full = self.full_block_bits()?;
        let hidden = Tensor::zeros((b, self.config().layers.hidden_size), self.dtype(), &dev)?;
        let lens = [inputs.narrow(0, 2 * b, 1)?];
        let ids = inputs.narrow(0, 0, b)?;
        let pos = inputs.narrow(0, b, b)?;
        let body = || -> ModelResult<()> {
            let h = self.block_layers(&ids, &pos, &[cache], &lens, &[None], &full, &[])?;
            hidden.slice_set(&h, 0, 0)?;
            Ok(())
        };
        let graph = capture_graph(self.device(), body)?;
        Ok(DraftGraph {
            graph,
            _drafter: self.clone(),
            inputs,
            _full: full,
            hidden,
            cache_key: cache_key(cache)?,
        })
    }
}

impl DraftGraph {
    /// Drafts `block` (`[bonus, mask, ...]`) after the context already in `cache` (the one the
    /// graph was captured for); returns the block's final-normed hidden states `[b, hidden]`
    /// (a copy). Like [`DFlashDrafter::forward`], the cache length does not change.
    pub fn draft(&self, cache: &SequenceCache, block: &[u32]) -> ModelResult<Tensor> {
        let b = self.hidden.dim(0)?;
        if block.len() != b {
            return Err(ModelError::BadInput(format!(
                "draft graph for blocks of {b} got {} tokens",
                block.len()
            )));
        }
        if cache_key(cache)? != self.cache_key {
            return Err(ModelError::BadInput(
                "draft graph replayed on a cache it was not captured for".into(),
            ));
        }
        cache.check_room(b)?;
        let len = cache.len() as u32;
        let mut host: Vec<u32> = block.to_vec();
        host.extend((0..b as u32).map(|i| len + i));
        host.push(len);
        cuda::upload_u32(&self.inputs, &host)?;
        self.graph
            .launch()
            .map_err(|e| ModelError::Unsupported(format!("graph launch: {e}")))?;
        Ok(self.hidden.force_contiguous()?)
    }
}
