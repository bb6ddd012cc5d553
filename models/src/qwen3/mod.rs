//! Qwen3 target (HF `Qwen3ForCausalLM`, and `Qwen3MoeForCausalLM`: the same attention with a
//! dense or sparse-MoE MLP per layer, `layers/moe.rs`), built for speculative decoding. This folder:
//! the model and its plain forward, the reference on every device (`mod.rs`), and its fused
//! CUDA forward with chunked prefill and CUDA-graph steps (`cuda.rs`).
//!
//! One forward takes a batch of sequences, each with its own cache, new tokens, absolute
//! positions and attention pattern. All tokens are flattened into one `[tokens, hidden]` matrix
//! so every projection is one GEMM; only attention runs per sequence. It returns logits only
//! for the rows asked for and the taps of the layers asked for, HF `hidden_states[i + 1]` as
//! [`crate::taps`] defines them (raw decoder-layer outputs, the last layer's after the final
//! norm).

use std::path::Path;

use candle_core::{DType, Device, Tensor};
use dflash_common::{Qwen3Config, WeightFiles};

use crate::batch::{check_batch, ForwardOutput, SeqForward, StackedBatch};
use crate::cache::SequenceCache;
use crate::cuda::graphs::GraphCache;
use crate::error::{ModelError, ModelResult};
use crate::layers::attention::attend;
#[cfg(feature = "cuda")]
use crate::layers::attention::AttnPattern;
use crate::layers::decoder_layer::{linear, DecoderLayer};
use crate::layers::ops::{rms_norm, OpsMode};
use crate::layers::rope::RotaryEmbedding;
use crate::random::WeightRng;
use crate::taps::TapCollector;

#[cfg(feature = "cuda")]
mod batch_graph;
#[cfg(feature = "cuda")]
mod cuda;
mod taps_forward;

pub use taps_forward::TapsOutput;

#[cfg(feature = "cuda")]
pub use cuda::StepGraph;

#[derive(Debug, Clone)]
pub struct Qwen3Model {
    pub(crate) cfg: Qwen3Config,
    embed_tokens: Tensor,
    pub(crate) layers: Vec<DecoderLayer>,
    pub(crate) norm: Tensor,
    lm_head: Tensor,
    pub(crate) rope: RotaryEmbedding,
    dtype: DType,
    device: Device,
    mode: OpsMode,
    /// Use the fused CUDA kernels where they apply (on by default when available).
    fast: bool,
    /// Most rows a fused forward runs through the skinny GEMMs (see `cuda/decoder_stack.rs`).
    gemv_rows: usize,
    /// Most rows whose wide-path GEMMs take the timed cuBLASLt choice (`cuda/lt_gemm.rs`).
    tuned_rows: usize,
    /// Most rows whose wide-path GEMMs take the split-K kernels (`cuda/splitk.rs`).
    splitk_rows: usize,
    /// Piece length of a fused prefill.
    prefill_chunk: usize,
    /// CUDA graphs of small batch-1 forwards (`qwen3/cuda.rs`, kept in a `cuda/graphs.rs` cache).
    graphs: GraphCache,
}

impl Qwen3Model {
    /// Loads a Hugging Face Qwen3 checkpoint directory. `max_positions` bounds the rotary table
    /// (and therefore every sequence's length).
    pub fn load(
        dir: &Path,
        dtype: DType,
        device: &Device,
        max_positions: usize,
        mode: OpsMode,
    ) -> ModelResult<Self> {
        let cfg = Qwen3Config::from_file(dir.join("config.json"))?;
        let weights = WeightFiles::open_dir(dir)?;
        Self::from_weights(cfg, &weights, dtype, device, max_positions, mode)
    }

    pub fn from_weights(
        cfg: Qwen3Config,
        w: &WeightFiles,
        dtype: DType,
        device: &Device,
        max_positions: usize,
        mode: OpsMode,
    ) -> ModelResult<Self> {
        if !matches!(dtype, DType::F32 | DType::BF16 | DType::F16) {
            return Err(ModelError::Unsupported(format!(
                "dtype {dtype:?}; use f32, bf16 or f16"
            )));
        }
        let (v, h) = (cfg.vocab_size, cfg.hidden_size);
        let embed_tokens = w.tensor("model.embed_tokens.weight", &[v, h], dtype, device)?;
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| {
                DecoderLayer::load(
                    w,
                    &format!("model.layers.{i}"),
                    i,
                    &cfg,
                    dtype,
                    device,
                    mode,
                )
            })
            .collect::<ModelResult<Vec<_>>>()?;
        let norm = w.tensor("model.norm.weight", &[h], dtype, device)?;
        // Tied checkpoints (Qwen3-4B, tiny-coder-demo) store no lm_head; some still ship a copy.
        let lm_head = if cfg.tie_word_embeddings && !w.contains("lm_head.weight") {
            embed_tokens.clone()
        } else {
            w.tensor("lm_head.weight", &[v, h], dtype, device)?
        };
        let rope = RotaryEmbedding::new(&cfg, max_positions, device)?;
        Self {
            cfg,
            embed_tokens,
            layers,
            norm,
            lm_head,
            rope,
            dtype,
            device: device.clone(),
            mode,
            fast: false,
            gemv_rows: crate::cuda::GEMV_DEFAULT_ROWS,
            tuned_rows: crate::cuda::TUNED_DEFAULT_ROWS,
            splitk_rows: crate::cuda::SPLITK_DEFAULT_ROWS,
            prefill_chunk: crate::cuda::PREFILL_CHUNK,
            graphs: GraphCache::new(false),
        }
        .prepare_fast()
    }

    /// A model of `cfg`'s shape with seeded random weights (benchmarks; no checkpoint needed).
    pub fn random(
        cfg: Qwen3Config,
        seed: u64,
        dtype: DType,
        device: &Device,
        max_positions: usize,
        mode: OpsMode,
    ) -> ModelResult<Self> {
        Self::random_with(
            cfg,
            &mut WeightRng::new(seed),
            dtype,
            device,
            max_positions,
            mode,
        )
    }

    /// As [`Self::random`], drawing from `rng` ([`WeightRng::on_device`] for 8B shapes).
    pub fn random_with(
        cfg: Qwen3Config,
        rng: &mut WeightRng,
        dtype: DType,
        device: &Device,
        max_positions: usize,
        mode: OpsMode,
    ) -> ModelResult<Self> {
        let (v, h) = (cfg.vocab_size, cfg.hidden_size);
        let embed_tokens = rng.normal(&[v, h], 0.0, 1.0, dtype, device)?;
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| DecoderLayer::random(rng, &cfg, i, dtype, device, mode))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let norm = rng.norm(h, dtype, device)?;
        let lm_head = if cfg.tie_word_embeddings {
            embed_tokens.clone()
        } else {
            rng.linear(v, h, dtype, device)?
        };
        let rope = RotaryEmbedding::new(&cfg, max_positions, device)?;
        Self {
            cfg,
            embed_tokens,
            layers,
            norm,
            lm_head,
            rope,
            dtype,
            device: device.clone(),
            mode,
            fast: false,
            gemv_rows: crate::cuda::GEMV_DEFAULT_ROWS,
            tuned_rows: crate::cuda::TUNED_DEFAULT_ROWS,
            splitk_rows: crate::cuda::SPLITK_DEFAULT_ROWS,
            prefill_chunk: crate::cuda::PREFILL_CHUNK,
            graphs: GraphCache::new(false),
        }
        .prepare_fast()
    }

    /// Where the fused kernels apply (CUDA, bf16, head_dim 128, inference mode), stacks the
    /// projections they use and turns them on.
    fn prepare_fast(mut self) -> ModelResult<Self> {
        if self.fast_kernels_available() {
            for l in &mut self.layers {
                l.fuse_projections()?;
            }
            self.fast = true;
            self.graphs = GraphCache::new(true);
        }
        Ok(self)
    }

    /// The model cut after decoder layer `last` (0-based): forwards run layers `0..=last`
    /// only, for a consumer of taps at or below `last` (the trainer's target: the recipe taps
    /// layer 33 of Qwen3-8B's 36, so three layers would be computed and thrown away). Taps
    /// keep their meaning ([`crate::taps`]: a tap on layer `last` is its raw output unless
    /// `last` is the model's true last layer), caches hold the kept layers, and a forward
    /// asking for logits is refused.
    pub fn stop_after_layer(mut self, last: usize) -> ModelResult<Self> {
        if last >= self.cfg.num_hidden_layers {
            return Err(ModelError::BadInput(format!(
                "cannot stop after layer {last}: the model has {} layers",
                self.cfg.num_hidden_layers
            )));
        }
        self.layers.truncate(last + 1);
        Ok(self.fresh_graphs())
    }

    /// Whether [`crate::cuda`]'s fused kernels can run this model: sparse-MoE layers
    /// (`qwen3_moe`) where the device MoE kernels take the block's shape (every published one;
    /// a shared expert, which `qwen3_moe` never has, is not run there).
    pub fn fast_kernels_available(&self) -> bool {
        let moe_fits = self.cfg.moe.as_ref().map(|m| &m.block).is_none_or(|m| {
            m.shared_expert_intermediate_size.is_none()
                && crate::cuda::moe_shape_fits(
                    m.num_experts,
                    self.cfg.hidden_size,
                    m.moe_intermediate_size,
                    m.num_experts_per_tok,
                )
        });
        moe_fits && crate::cuda::available(&self.device, self.dtype, self.cfg.head_dim, self.mode)
    }

    /// Turns the fused kernels on or off (off: the plain candle path, for comparisons). Has
    /// no effect where they are not available.
    pub fn with_fast_kernels(mut self, on: bool) -> Self {
        self.fast =
            on && self.fast_kernels_available() && self.layers.iter().all(|l| l.fused().is_some());
        self.fresh_graphs()
    }

    /// Caps the rows whose wide-path GEMMs take the timed cuBLASLt choice (`cuda/lt_gemm.rs`);
    /// 0 keeps them on cuBLAS's default. For comparisons; the default is the measured best.
    pub fn with_tuned_rows(mut self, rows: usize) -> Self {
        self.tuned_rows = rows.min(crate::cuda::TUNED_MAX_ROWS);
        self.fresh_graphs()
    }

    /// Caps the rows whose wide-path GEMMs take the split-K kernels (`cuda/splitk.rs`; ahead
    /// of the cuBLASLt choice); 0 turns them off. For comparisons.
    pub fn with_splitk_rows(mut self, rows: usize) -> Self {
        self.splitk_rows = rows.min(crate::cuda::TUNED_MAX_ROWS);
        self.fresh_graphs()
    }

    /// Caps the rows a fused forward sends through the skinny GEMMs (wider ones use cuBLAS);
    /// 0 keeps every forward on cuBLAS. For comparisons; the default is the measured best.
    pub fn with_gemv_rows(mut self, rows: usize) -> Self {
        self.gemv_rows = rows.min(crate::cuda::GEMV_MAX_ROWS);
        self.fresh_graphs()
    }

    /// Turns the replay of small batch-1 forwards from CUDA graphs on or off (on by default
    /// with the fused kernels; see `qwen3/cuda.rs`). No effect without the fused kernels.
    pub fn with_step_graphs(mut self, on: bool) -> Self {
        self.graphs = GraphCache::new(on && self.fast);
        self
    }

    /// Whether forwards are captured and replayed as step graphs (the fused kernels with
    /// [`Self::with_step_graphs`] on).
    pub fn step_graphs_on(&self) -> bool {
        self.graphs.is_on()
    }

    /// Step graphs held (0 with graphs off).
    pub fn step_graphs_held(&self) -> usize {
        self.graphs.held()
    }

    /// Forwards replayed from a step graph so far (shared by the model's clones).
    pub fn graph_replays(&self) -> u64 {
        self.graphs.replays()
    }

    /// Graphs captured under other settings must not be replayed.
    fn fresh_graphs(mut self) -> Self {
        self.graphs = self.graphs.fresh();
        self
    }

    #[cfg(feature = "cuda")]
    pub(crate) fn step_graphs(&self) -> &GraphCache {
        &self.graphs
    }

    /// Sets the piece length of fused prefills (1 ..= `cuda::MAX_FAST_TOKENS`): longer
    /// pieces give cuBLAS larger products, shorter ones smaller temporaries.
    pub fn with_prefill_chunk(mut self, tokens: usize) -> Self {
        self.prefill_chunk = tokens.clamp(1, crate::cuda::MAX_FAST_TOKENS);
        self.fresh_graphs()
    }

    /// The most new tokens each sequence of a batched forward may have for the forward to
    /// stay one pass through the fused kernels (a longer causal one alone runs in pieces; in
    /// a batch it would take the plain path). None: no bound (the plain path is the only one).
    pub fn batch_tokens_limit(&self) -> Option<usize> {
        self.fast.then_some(self.prefill_chunk)
    }

    #[cfg(feature = "cuda")]
    pub(crate) fn prefill_chunk(&self) -> usize {
        self.prefill_chunk
    }

    #[cfg(feature = "cuda")]
    pub(crate) fn gemv_rows(&self) -> usize {
        self.gemv_rows
    }

    /// Most rows whose wide-path GEMMs take the timed cuBLASLt choice.
    pub fn tuned_rows(&self) -> usize {
        self.tuned_rows
    }

    /// Most rows whose wide-path GEMMs take the split-K kernels.
    pub fn splitk_rows(&self) -> usize {
        self.splitk_rows
    }

    pub fn mode(&self) -> OpsMode {
        self.mode
    }

    pub fn fast_kernels(&self) -> bool {
        self.fast
    }

    pub fn config(&self) -> &Qwen3Config {
        &self.cfg
    }
    pub fn device(&self) -> &Device {
        &self.device
    }
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    pub fn rope(&self) -> &RotaryEmbedding {
        &self.rope
    }
    pub fn embed_weight(&self) -> &Tensor {
        &self.embed_tokens
    }
    pub fn lm_head_weight(&self) -> &Tensor {
        &self.lm_head
    }

    /// A cache for one sequence holding up to `capacity` positions.
    /// Bytes of K/V one cached row takes across every layer (what a cache of `capacity` rows
    /// allocates per row), for sizing a K/V budget from device memory.
    pub fn kv_bytes_per_row(&self) -> usize {
        self.layers.len()
            * 2
            * self.cfg.num_key_value_heads
            * self.cfg.head_dim
            * self.dtype.size_in_bytes()
    }

    /// A K/V pool of `pages` pages of [`crate::cache::PAGE_SIZE`] rows for every layer.
    pub fn new_kv_pool(&self, pages: usize) -> ModelResult<crate::cache::KvPool> {
        Ok(crate::cache::KvPool::new(
            self.layers.len(),
            self.cfg.num_key_value_heads,
            self.cfg.head_dim,
            pages,
            self.dtype,
            &self.device,
        )?)
    }

    /// A cache for `capacity` positions in pages of `pool` (made by [`Self::new_kv_pool`]).
    pub fn new_cache_in(
        &self,
        pool: &crate::cache::KvPool,
        capacity: usize,
    ) -> ModelResult<SequenceCache> {
        self.new_cache_in_rows(pool, capacity, capacity)
    }

    /// [`Self::new_cache_in`] holding pages for `rows` rows for now (it grows on demand).
    pub fn new_cache_in_rows(
        &self,
        pool: &crate::cache::KvPool,
        capacity: usize,
        rows: usize,
    ) -> ModelResult<SequenceCache> {
        self.new_cache_after(pool, capacity, &[], rows)
    }

    /// [`Self::new_cache_in_rows`] starting with the cached prefix in the held pages `prefix`
    /// (live from the start; see `SequenceCache::new_paged_after`).
    pub fn new_cache_after(
        &self,
        pool: &crate::cache::KvPool,
        capacity: usize,
        prefix: &[u32],
        rows: usize,
    ) -> ModelResult<SequenceCache> {
        let kinds = vec![None; self.layers.len()];
        SequenceCache::new_paged_after(pool, kinds, capacity, 0, prefix, rows)
    }

    pub fn new_cache(&self, capacity: usize) -> ModelResult<SequenceCache> {
        Ok(SequenceCache::new_attention(
            self.layers.len(),
            self.cfg.num_key_value_heads,
            self.cfg.head_dim,
            capacity,
            self.dtype,
            &self.device,
        )?)
    }

    /// Token embeddings `[n, hidden]`.
    pub fn embed(&self, tokens: &[u32]) -> ModelResult<Tensor> {
        let ids = Tensor::new(tokens, &self.device)?;
        Ok(self.embed_tokens.index_select(&ids, 0)?)
    }

    /// `lm_head(x)` in f32 for already-normed rows (the drafter applies its own norm).
    pub fn lm_head(&self, x: &Tensor) -> ModelResult<Tensor> {
        #[cfg(feature = "cuda")]
        if self.fast {
            let rows = x.dim(0)?;
            // A batched decode step's logit rows: the timed cuBLASLt choice (1.2 GB of
            // Qwen3-8B's head is 8% of the step's weight bytes).
            if rows > 1
                && rows <= self.tuned_rows
                && x.is_contiguous()
                && self.lm_head.is_contiguous()
                && x.dtype() == DType::BF16
                && self.lm_head.dtype() == DType::BF16
            {
                let y = crate::cuda::linear_lt(x, &self.lm_head, None, crate::cuda::LtMode::Tuned)?;
                return Ok(y.to_dtype(DType::F32)?);
            }
            return Ok(
                crate::cuda::project(x, &self.lm_head, self.gemv_rows)?.to_dtype(DType::F32)?
            );
        }
        Ok(linear(x, &self.lm_head)?.to_dtype(DType::F32)?)
    }

    fn check(&self, batch: &[SeqForward<'_>], taps: &[usize]) -> ModelResult<()> {
        if self.layers.len() < self.cfg.num_hidden_layers
            && batch.iter().any(|s| !s.logit_rows.is_empty())
        {
            return Err(ModelError::BadInput(format!(
                "this target stops after layer {} of {} (taps only): it has no logits",
                self.layers.len() - 1,
                self.cfg.num_hidden_layers
            )));
        }
        check_batch(
            batch,
            taps,
            self.layers.len(),
            self.cfg.vocab_size,
            self.rope.max_positions(),
        )
    }

    /// Runs the new tokens of every sequence through the model, appending their K/V to each
    /// sequence's cache. On error nothing becomes live in any cache.
    pub fn forward(
        &self,
        batch: &mut [SeqForward<'_>],
        taps: &[usize],
    ) -> ModelResult<ForwardOutput> {
        self.check(batch, taps)?;
        #[cfg(feature = "cuda")]
        if self.fast {
            if let Some(out) = self.forward_batch_graph(batch, taps)? {
                return Ok(out);
            }
            if let Some(out) = self.forward_graph(batch, taps)? {
                return Ok(out);
            }
            crate::speculative::profile::count("target_forward_uncaptured");
        }
        #[cfg(feature = "cuda")]
        if self.fast && batch.iter().all(|s| s.tokens.len() <= self.prefill_chunk) {
            return self.forward_fast(batch, taps);
        }
        #[cfg(feature = "cuda")]
        if self.fast && batch.len() == 1 && *batch[0].pattern == AttnPattern::Causal {
            return self.forward_chunked(&mut batch[0], taps);
        }
        let StackedBatch {
            tokens: all_tokens,
            positions: all_positions,
            logit_rows,
            token_offsets,
            logit_offsets,
        } = StackedBatch::new(batch);
        let masks = batch
            .iter()
            .map(|s| s.pattern.mask(s.cache.len(), s.tokens.len(), &self.device))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let positions = Tensor::new(all_positions.as_slice(), &self.device)?;
        // Cast once per forward, not once per layer and projection.
        let (cos, sin) = self.rope.gather(&positions)?;
        let (cos, sin) = (cos.to_dtype(self.dtype)?, sin.to_dtype(self.dtype)?);
        let mut x = self.embed(&all_tokens)?;
        let mut tapped = TapCollector::new(taps, self.cfg.num_hidden_layers);
        for (li, layer) in self.layers.iter().enumerate() {
            let h = layer.input_norm(&x)?;
            let (q, k, v) = layer.qkv(&h, &cos, &sin)?;
            let mut outs = Vec::with_capacity(batch.len());
            for (s, seq) in batch.iter().enumerate() {
                let (off, t) = (token_offsets[s], seq.tokens.len());
                let len = seq.cache.len();
                seq.cache
                    .write_kv(li, len, &k.narrow(1, off, t)?, &v.narrow(1, off, t)?)?;
                let (kc, vc) = seq.cache.view_kv(li, len + t)?;
                outs.push(attend(
                    &q.narrow(1, off, t)?,
                    &kc,
                    &vc,
                    masks[s].as_ref(),
                    self.mode,
                )?);
            }
            let attn = if outs.len() == 1 {
                outs.pop().expect("one output")
            } else {
                Tensor::cat(&outs, 0)?
            };
            x = layer.finish(&x, &attn)?;
            tapped.layer_output(li, &x);
        }
        for seq in batch.iter_mut() {
            seq.cache.advance(seq.tokens.len());
        }
        // A tap on the last layer takes the final norm of every row; the logit rows are then
        // read from it (the norm is row-wise, so the values are the same).
        let normed = tapped
            .wants_final_norm()
            .then(|| self.final_norm(&x))
            .transpose()?;
        let taps = tapped.finish(normed.as_ref())?;
        let logits = if logit_rows.is_empty() {
            None
        } else {
            let rows = Tensor::new(logit_rows.as_slice(), &self.device)?;
            let h = match &normed {
                Some(n) => n.index_select(&rows, 0)?,
                None => self.final_norm(&x.index_select(&rows, 0)?)?,
            };
            Some(self.lm_head(&h)?)
        };
        Ok(ForwardOutput {
            logits,
            taps,
            token_offsets,
            logit_offsets,
        })
    }

    /// The final norm (HF puts `norm(h_last)` in the last `hidden_states` slot).
    pub fn final_norm(&self, x: &Tensor) -> ModelResult<Tensor> {
        Ok(rms_norm(x, &self.norm, self.cfg.rms_norm_eps, self.mode)?)
    }
}

#[cfg(test)]
mod tests;
