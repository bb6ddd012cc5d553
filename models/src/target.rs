//! The verifier a speculative engine drives: a Qwen3 dense target or a hybrid (Qwen3.5 /
//! Qwen3.6 / Qwen3-Next) one. Both take the same batched [`SeqForward`] and return the same
//! [`ForwardOutput`]; they differ in their caches (hybrid caches keep per-row recurrent states
//! for up to `rollback` rows so a verify can be committed or rolled back).

use std::path::Path;

use candle_core::{DType, Device, Tensor};
use dflash_common::HybridConfig;

use crate::batch::{ForwardOutput, SeqForward};
use crate::cache::SequenceCache;
use crate::error::ModelResult;
use crate::layers::ops::OpsMode;
use crate::qwen3::Qwen3Model;
use crate::qwen3_5::Qwen35Model;

#[derive(Debug, Clone)]
pub enum Target {
    Qwen3(Qwen3Model),
    Hybrid(Qwen35Model),
}

impl From<Qwen3Model> for Target {
    fn from(m: Qwen3Model) -> Self {
        Target::Qwen3(m)
    }
}

impl From<Qwen35Model> for Target {
    fn from(m: Qwen35Model) -> Self {
        Target::Hybrid(m)
    }
}

/// What a drafter borrows from its target (embeddings, LM head, shape), for either family.
pub trait DraftTarget {
    fn embed_weight(&self) -> &Tensor;
    fn lm_head_weight(&self) -> &Tensor;
    fn max_positions(&self) -> usize;
    fn dtype(&self) -> DType;
    fn device(&self) -> &Device;
    fn hidden_size(&self) -> usize;
    fn num_layers(&self) -> usize;
    fn vocab_size(&self) -> usize;
}

impl DraftTarget for Qwen3Model {
    fn embed_weight(&self) -> &Tensor {
        Qwen3Model::embed_weight(self)
    }
    fn lm_head_weight(&self) -> &Tensor {
        Qwen3Model::lm_head_weight(self)
    }
    fn max_positions(&self) -> usize {
        self.rope().max_positions()
    }
    fn dtype(&self) -> DType {
        Qwen3Model::dtype(self)
    }
    fn device(&self) -> &Device {
        Qwen3Model::device(self)
    }
    fn hidden_size(&self) -> usize {
        self.config().hidden_size
    }
    fn num_layers(&self) -> usize {
        self.config().num_hidden_layers
    }
    fn vocab_size(&self) -> usize {
        self.config().vocab_size
    }
}

impl DraftTarget for Qwen35Model {
    fn embed_weight(&self) -> &Tensor {
        Qwen35Model::embed_weight(self)
    }
    fn lm_head_weight(&self) -> &Tensor {
        Qwen35Model::lm_head_weight(self)
    }
    fn max_positions(&self) -> usize {
        self.rope().max_positions()
    }
    fn dtype(&self) -> DType {
        Qwen35Model::dtype(self)
    }
    fn device(&self) -> &Device {
        Qwen35Model::device(self)
    }
    fn hidden_size(&self) -> usize {
        self.config().hidden_size
    }
    fn num_layers(&self) -> usize {
        self.config().num_hidden_layers
    }
    fn vocab_size(&self) -> usize {
        self.config().vocab_size
    }
}

macro_rules! both {
    ($self:ident, $m:ident => $e:expr) => {
        match $self {
            Target::Qwen3($m) => $e,
            Target::Hybrid($m) => $e,
        }
    };
}

impl DraftTarget for Target {
    fn embed_weight(&self) -> &Tensor {
        both!(self, m => m.embed_weight())
    }
    fn lm_head_weight(&self) -> &Tensor {
        both!(self, m => m.lm_head_weight())
    }
    fn max_positions(&self) -> usize {
        both!(self, m => m.rope().max_positions())
    }
    fn dtype(&self) -> DType {
        both!(self, m => m.dtype())
    }
    fn device(&self) -> &Device {
        both!(self, m => m.device())
    }
    fn hidden_size(&self) -> usize {
        both!(self, m => m.config().hidden_size)
    }
    fn num_layers(&self) -> usize {
        both!(self, m => m.config().num_hidden_layers)
    }
    fn vocab_size(&self) -> usize {
        both!(self, m => m.config().vocab_size)
    }
}

impl Target {
    /// Loads a checkpoint directory of either family, chosen by its `config.json`
    /// (`qwen3_5`, `qwen3_5_text`, `qwen3_5_moe`, `qwen3_5_moe_text` or `qwen3_next` load as
    /// hybrids, anything else as Qwen3).
    pub fn load(
        dir: &Path,
        dtype: DType,
        device: &Device,
        max_positions: usize,
        mode: OpsMode,
    ) -> ModelResult<Self> {
        if HybridConfig::is_hybrid_file(&dir.join("config.json")) {
            Ok(Target::Hybrid(Qwen35Model::load(
                dir,
                dtype,
                device,
                max_positions,
                mode,
            )?))
        } else {
            Ok(Target::Qwen3(Qwen3Model::load(
                dir,
                dtype,
                device,
                max_positions,
                mode,
            )?))
        }
    }

    pub fn forward(
        &self,
        batch: &mut [SeqForward<'_>],
        taps: &[usize],
    ) -> ModelResult<ForwardOutput> {
        both!(self, m => m.forward(batch, taps))
    }

    /// Forwards replayed from a CUDA graph so far (the hybrid targets capture decode steps
    /// only).
    pub fn graph_replays(&self) -> u64 {
        both!(self, m => m.graph_replays())
    }

    /// The same target with the fused CUDA kernels on or off (the plain candle path is the
    /// reference the fused one is checked against).
    pub fn with_fast_kernels(self, on: bool) -> Self {
        match self {
            Target::Qwen3(m) => Target::Qwen3(m.with_fast_kernels(on)),
            Target::Hybrid(m) => Target::Hybrid(m.with_fast_kernels(on)),
        }
    }

    /// Whether forwards run the fused CUDA kernels.
    pub fn fast_kernels(&self) -> bool {
        both!(self, m => m.fast_kernels())
    }

    /// Whether verify forwards replay captured CUDA graphs, so that padding a short verify up
    /// to its algorithm's full size saves a capture: dense targets with step graphs on. The
    /// hybrid targets capture decode steps only, and padding costs them real work (a
    /// root-only DDTree-64 verify padded to a 65-deep chain is past the GDN tree kernels'
    /// depth and ran the plain form in every GDN layer: ~535 ms instead of ~35 ms on the 27B,
    /// H100).
    pub fn replays_verify_graphs(&self) -> bool {
        match self {
            Target::Qwen3(m) => m.step_graphs_on(),
            Target::Hybrid(_) => false,
        }
    }

    /// The same target with step graphs on or off (dense: decode and verify steps; hybrid:
    /// decode steps); no effect without the fused kernels.
    pub fn with_step_graphs(self, on: bool) -> Self {
        match self {
            Target::Qwen3(m) => Target::Qwen3(m.with_step_graphs(on)),
            Target::Hybrid(m) => Target::Hybrid(m.with_step_graphs(on)),
        }
    }

    /// Whether forwards are captured and replayed as step graphs.
    pub fn step_graphs_on(&self) -> bool {
        both!(self, m => m.step_graphs_on())
    }

    /// Step graphs captured so far (a hybrid's: decode steps).
    pub fn step_graphs_held(&self) -> usize {
        both!(self, m => m.step_graphs_held())
    }

    /// Bytes of K/V one cached row of a sequence takes (attention layers only).
    pub fn kv_bytes_per_row(&self) -> usize {
        match self {
            Target::Qwen3(m) => m.kv_bytes_per_row(),
            Target::Hybrid(m) => m.kv_bytes_per_row(),
        }
    }

    /// A cache for `capacity` positions in which forwards of up to `rollback` tokens can be
    /// rolled back (attention caches can always be truncated; the argument only matters for
    /// recurrent layers).
    pub fn new_cache(&self, capacity: usize, rollback: usize) -> ModelResult<SequenceCache> {
        match self {
            Target::Qwen3(m) => m.new_cache(capacity),
            Target::Hybrid(m) => m.new_cache_with_rollback(capacity, rollback),
        }
    }

    /// A shared K/V pool of `pages` pages ([`crate::cache::KvPool`]).
    pub fn new_kv_pool(&self, pages: usize) -> ModelResult<crate::cache::KvPool> {
        both!(self, m => m.new_kv_pool(pages))
    }

    /// [`Target::new_cache`] with the attention rows in pages of `pool`, holding pages for
    /// `rows` rows for now (`SequenceCache::grow_to` takes more); fails, taking nothing, when
    /// too few pages are free.
    pub fn new_cache_in(
        &self,
        pool: &crate::cache::KvPool,
        capacity: usize,
        rollback: usize,
        rows: usize,
    ) -> ModelResult<SequenceCache> {
        match self {
            Target::Qwen3(m) => m.new_cache_in_rows(pool, capacity, rows),
            Target::Hybrid(m) => m.new_cache_in(pool, capacity, rollback, rows),
        }
    }

    /// Whether sequences can start on a cached prefix of K/V pages ([`Target::new_cache_after`]):
    /// pure-attention targets only (a hybrid's recurrent state at a page boundary is not kept).
    pub fn supports_prefix_cache(&self) -> bool {
        matches!(self, Target::Qwen3(_))
    }

    /// [`Target::new_cache_in`] starting with the cached prefix in the held pages `prefix`
    /// (live from the start). An error for targets without [`Target::supports_prefix_cache`]
    /// when `prefix` is not empty.
    pub fn new_cache_after(
        &self,
        pool: &crate::cache::KvPool,
        capacity: usize,
        rollback: usize,
        prefix: &[u32],
        rows: usize,
    ) -> ModelResult<SequenceCache> {
        match self {
            Target::Qwen3(m) => m.new_cache_after(pool, capacity, prefix, rows),
            Target::Hybrid(_) if !prefix.is_empty() => Err(crate::error::ModelError::BadCacheOp(
                "hybrid (Gated DeltaNet) targets do not start on a cached prefix".into(),
            )),
            Target::Hybrid(m) => m.new_cache_in(pool, capacity, rollback, rows),
        }
    }

    /// The most new tokens each sequence of one batched forward may have without slowing
    /// it down ([`Qwen3Model::batch_tokens_limit`]); None: no bound.
    pub fn batch_tokens_limit(&self) -> Option<usize> {
        match self {
            Target::Qwen3(m) => m.batch_tokens_limit(),
            Target::Hybrid(_) => None,
        }
    }

    /// The Qwen3 model, for callers that only support that family.
    pub fn as_qwen3(&self) -> Option<&Qwen3Model> {
        match self {
            Target::Qwen3(m) => Some(m),
            Target::Hybrid(_) => None,
        }
    }

    pub fn eos_token_ids(&self) -> &[u32] {
        match self {
            Target::Qwen3(m) => &m.config().eos_token_ids,
            Target::Hybrid(m) => &m.config().eos_token_ids,
        }
    }
}
