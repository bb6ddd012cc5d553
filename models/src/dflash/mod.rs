//! The DFlash block-diffusion drafter in the z-lab format (z-lab `dflash/model.py`,
//! `DFlashDraftModel`). This folder: the drafter and its plain forward, the reference on
//! every device (`mod.rs`); its fused CUDA block and draft-round graphs (`cuda.rs`); the
//! training forward over every anchor's block of a sequence (`train.rs`).
//!
//! Context conditioning is "KV injection": the target's tapped hidden states of each committed
//! position go through `fc` and `hidden_norm`, and every draft layer's own `k_proj`/`k_norm`/RoPE
//! and `v_proj` turn them into K/V rows. Those rows depend only on the committed token, so they
//! are computed once and cached; the cache only ever holds committed context. A draft writes the
//! block's K/V into the rows just past the context, attends, and leaves `len` unchanged, so the
//! next round overwrites them (no crop needed). Embeddings and `lm_head` are the target's.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use dflash_common::{DFlashConfig, LayerType, WeightFiles};

use crate::cache::SequenceCache;
use crate::cuda::graphs::GraphCache;
use crate::error::{ModelError, ModelResult};
use crate::layers::attention::{attend, AttnPattern};
use crate::layers::decoder_layer::{linear, DecoderLayer};
use crate::layers::ops::{rms_norm, OpsMode};
use crate::layers::rope::RotaryEmbedding;
use crate::random::WeightRng;
use crate::target::DraftTarget;

mod cache;
#[cfg(feature = "cuda")]
mod cuda;
pub mod train;
pub mod train_explicit;

#[cfg(feature = "cuda")]
pub use cuda::DraftGraph;
pub use train::{TrainAttention, TrainSequence};

/// One sequence's draft request.
pub struct DraftInput<'a> {
    pub cache: &'a mut SequenceCache,
    /// Target features `[n_new, taps * hidden]` of the positions committed since the last draft
    /// (they occupy positions `cache.len() ..`). `None` when nothing new was committed.
    pub context: Option<&'a Tensor>,
    /// `[bonus, mask, ..., mask]`, `block_size` tokens, at positions starting right after the
    /// context.
    pub block: &'a [u32],
}

/// The frozen target weights a drafter borrows (SpecForge `TargetEmbeddingsAndHead`): the
/// token embedding, the LM head, and how many positions the target's rotary table covers. A
/// trainer keeps these on the drafter's device, which need not be the target's.
#[derive(Debug, Clone)]
pub struct TargetEmbeddingsAndHead {
    pub embed_tokens: Tensor,
    pub lm_head: Tensor,
    pub max_positions: usize,
}

impl TargetEmbeddingsAndHead {
    pub fn of(target: &impl DraftTarget) -> Self {
        Self {
            embed_tokens: target.embed_weight().clone(),
            lm_head: target.lm_head_weight().clone(),
            max_positions: target.max_positions(),
        }
    }
}

#[derive(Debug, Clone)]
pub struct DFlashDrafter {
    cfg: DFlashConfig,
    fc: Tensor,
    hidden_norm: Tensor,
    layers: Vec<DecoderLayer>,
    norm: Tensor,
    rope: RotaryEmbedding,
    embed_tokens: Tensor,
    lm_head: Tensor,
    dtype: DType,
    device: Device,
    mode: OpsMode,
    /// Draft blocks through the fused CUDA kernels (on by default where they apply).
    fast: bool,
    /// Most rows a fused forward runs through the skinny GEMMs (see `cuda/decoder_stack.rs`).
    gemv_rows: usize,
    /// Most rows whose wide-path GEMMs take the timed cuBLASLt choice (`cuda/lt_gemm.rs`).
    tuned_rows: usize,
    /// Most rows whose wide-path GEMMs take the split-K kernels (`cuda/splitk.rs`).
    splitk_rows: usize,
    /// CUDA graphs of batch-1 draft rounds (`dflash/cuda.rs`).
    graphs: GraphCache,
}

impl DFlashDrafter {
    /// Loads a z-lab drafter directory for `target` (embeddings and `lm_head` are borrowed).
    pub fn load(dir: &Path, target: &impl DraftTarget, mode: OpsMode) -> ModelResult<Self> {
        let config_path = dir.join("config.json");
        let cfg = DFlashConfig::from_file(&config_path)?;
        cfg.check_against_shape(
            &config_path,
            target.hidden_size(),
            target.num_layers(),
            target.vocab_size(),
        )?;
        let weights = WeightFiles::open_dir(dir)?;
        Self::from_weights(cfg, &weights, target, mode)
    }

    pub fn from_weights(
        cfg: DFlashConfig,
        w: &WeightFiles,
        target: &impl DraftTarget,
        mode: OpsMode,
    ) -> ModelResult<Self> {
        let (dtype, device) = (target.dtype(), target.device().clone());
        let h = cfg.layers.hidden_size;
        let f = cfg.target_layer_ids.len();
        // Some exports prefix the drafter tensors with `model.`; z-lab's do not.
        let prefix = if w.contains("fc.weight") || !w.contains("model.fc.weight") {
            ""
        } else {
            "model."
        };
        let t = |name: &str, shape: &[usize]| {
            w.tensor(&format!("{prefix}{name}"), shape, dtype, &device)
        };
        let fc = t("fc.weight", &[h, f * h])?;
        let hidden_norm = t("hidden_norm.weight", &[h])?;
        let norm = t("norm.weight", &[h])?;
        let layers = (0..cfg.layers.num_hidden_layers)
            .map(|i| {
                DecoderLayer::load(
                    w,
                    &format!("{prefix}layers.{i}"),
                    i,
                    &cfg.layers,
                    dtype,
                    &device,
                    mode,
                )
            })
            .collect::<ModelResult<Vec<_>>>()?;
        Self::assemble(
            cfg,
            [fc, hidden_norm, norm],
            layers,
            &TargetEmbeddingsAndHead::of(target),
            mode,
        )
    }

    /// A freshly initialised drafter of `cfg`'s shape for `target` (seeded random weights).
    pub fn random(
        cfg: DFlashConfig,
        target: &impl DraftTarget,
        seed: u64,
        mode: OpsMode,
    ) -> ModelResult<Self> {
        Self::random_with(cfg, target, &mut WeightRng::new(seed), mode)
    }

    /// As [`Self::random`], drawing from `rng`.
    pub fn random_with(
        cfg: DFlashConfig,
        target: &impl DraftTarget,
        rng: &mut WeightRng,
        mode: OpsMode,
    ) -> ModelResult<Self> {
        let (dtype, device) = (target.dtype(), target.device().clone());
        let h = cfg.layers.hidden_size;
        let fc = rng.linear(h, cfg.target_layer_ids.len() * h, dtype, &device)?;
        let hidden_norm = rng.norm(h, dtype, &device)?;
        let layers = (0..cfg.layers.num_hidden_layers)
            .map(|i| DecoderLayer::random(rng, &cfg.layers, i, dtype, &device, mode))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let norm = rng.norm(h, dtype, &device)?;
        Self::assemble(
            cfg,
            [fc, hidden_norm, norm],
            layers,
            &TargetEmbeddingsAndHead::of(target),
            mode,
        )
    }

    /// The z-lab names and shapes of every drafter-owned tensor (no embedding, no LM head), in
    /// checkpoint order: `fc.weight`, `hidden_norm.weight`, `layers.{i}.*`, `norm.weight`.
    pub fn parameter_shapes(cfg: &DFlashConfig) -> Vec<(String, Vec<usize>)> {
        let h = cfg.layers.hidden_size;
        let mut out = vec![
            (
                "fc.weight".to_string(),
                vec![h, cfg.target_layer_ids.len() * h],
            ),
            ("hidden_norm.weight".to_string(), vec![h]),
        ];
        for i in 0..cfg.layers.num_hidden_layers {
            let shapes = DecoderLayer::tensor_shapes(&cfg.layers);
            for (name, shape) in DecoderLayer::TENSOR_NAMES.iter().zip(shapes) {
                out.push((format!("layers.{i}.{name}"), shape));
            }
        }
        out.push(("norm.weight".to_string(), vec![h]));
        out
    }

    /// A drafter from named tensors in z-lab naming (see [`Self::parameter_shapes`]); the
    /// tensors are used as given (no copy), so a trainer's `Var`s stay attached to the graph.
    /// The drafter's dtype and device are those of `fc.weight`; the target's embedding and head
    /// are converted to them.
    pub fn from_tensors(
        cfg: DFlashConfig,
        tensors: &HashMap<String, Tensor>,
        target: &TargetEmbeddingsAndHead,
        mode: OpsMode,
    ) -> ModelResult<Self> {
        let get = |name: &str, shape: &[usize]| -> ModelResult<Tensor> {
            let t = tensors.get(name).ok_or_else(|| {
                ModelError::BadInput(format!("drafter tensor `{name}` is missing"))
            })?;
            if t.dims() != shape {
                return Err(ModelError::BadInput(format!(
                    "drafter tensor `{name}` has shape {:?}, the config implies {shape:?}",
                    t.dims()
                )));
            }
            Ok(t.clone())
        };
        let h = cfg.layers.hidden_size;
        let fc = get("fc.weight", &[h, cfg.target_layer_ids.len() * h])?;
        let hidden_norm = get("hidden_norm.weight", &[h])?;
        let norm = get("norm.weight", &[h])?;
        let layers = (0..cfg.layers.num_hidden_layers)
            .map(|i| {
                DecoderLayer::from_tensors(&cfg.layers, mode, |name, shape| {
                    get(&format!("layers.{i}.{name}"), shape)
                })
            })
            .collect::<ModelResult<Vec<_>>>()?;
        Self::assemble(cfg, [fc, hidden_norm, norm], layers, target, mode)
    }

    /// The one place a drafter is put together, whatever its weights came from: the rotary
    /// table and the target's embeddings and head, moved to the drafter's device and dtype
    /// (taken from `fc`).
    fn assemble(
        cfg: DFlashConfig,
        [fc, hidden_norm, norm]: [Tensor; 3],
        layers: Vec<DecoderLayer>,
        target: &TargetEmbeddingsAndHead,
        mode: OpsMode,
    ) -> ModelResult<Self> {
        let (dtype, device) = (fc.dtype(), fc.device().clone());
        let rope =
            RotaryEmbedding::new(&cfg.layers, target.max_positions + cfg.block_size, &device)?;
        let to_here = |t: &Tensor| t.to_device(&device)?.to_dtype(dtype);
        let mut drafter = Self {
            embed_tokens: to_here(&target.embed_tokens)?,
            lm_head: to_here(&target.lm_head)?,
            cfg,
            fc,
            hidden_norm,
            layers,
            norm,
            rope,
            dtype,
            device,
            mode,
            fast: false,
            gemv_rows: crate::cuda::GEMV_DEFAULT_ROWS,
            tuned_rows: crate::cuda::TUNED_DEFAULT_ROWS,
            splitk_rows: crate::cuda::SPLITK_DEFAULT_ROWS,
            graphs: GraphCache::new(false),
        };
        if drafter.fast_kernels_available() {
            for l in &mut drafter.layers {
                l.fuse_projections()?;
            }
            drafter.fast = true;
            drafter.graphs = GraphCache::new(true);
        }
        Ok(drafter)
    }

    /// Whether the fused CUDA kernels can draft blocks of this drafter (CUDA, bf16, head_dim
    /// 128, inference mode, full-attention layers only, blocks of at most 64 tokens).
    pub fn fast_kernels_available(&self) -> bool {
        crate::cuda::available(
            &self.device,
            self.dtype,
            self.cfg.layers.head_dim,
            self.mode,
        ) && self.cfg.block_size <= 64
            && self
                .cfg
                .layers
                .layer_types
                .iter()
                .all(|t| *t == LayerType::FullAttention)
    }

    pub fn fast_kernels(&self) -> bool {
        self.fast
    }

    /// Turns the fused kernels on or off (off: the plain candle path, for comparisons).
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

    /// Turns the replay of batch-1 draft rounds ([`DFlashDrafter::draft_logits`] with new
    /// context) from CUDA graphs on or off (on by default with the fused kernels; a round
    /// shape is captured on its second use). No effect without the fused kernels.
    pub fn with_step_graphs(mut self, on: bool) -> Self {
        self.graphs = GraphCache::new(on && self.fast);
        self
    }

    /// Draft-round graphs held (0 with graphs off).
    pub fn step_graphs_held(&self) -> usize {
        self.graphs.held()
    }

    /// Graphs captured under other settings must not be replayed.
    fn fresh_graphs(mut self) -> Self {
        self.graphs = self.graphs.fresh();
        self
    }

    #[cfg(feature = "cuda")]
    pub(crate) fn round_graphs(&self) -> Option<&crate::cuda::graphs::GraphSlots> {
        self.graphs.slots()
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

    /// Every drafter-owned tensor with its z-lab name, in [`Self::parameter_shapes`] order.
    pub fn named_tensors(&self) -> Vec<(String, Tensor)> {
        let mut out = vec![
            ("fc.weight".to_string(), self.fc.clone()),
            ("hidden_norm.weight".to_string(), self.hidden_norm.clone()),
        ];
        for (i, layer) in self.layers.iter().enumerate() {
            for (name, t) in layer.named_tensors() {
                out.push((format!("layers.{i}.{name}"), t.clone()));
            }
        }
        out.push(("norm.weight".to_string(), self.norm.clone()));
        out
    }

    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn embed_weight(&self) -> &Tensor {
        &self.embed_tokens
    }
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn final_norm_weight(&self) -> &Tensor {
        &self.norm
    }
    pub(crate) fn layers(&self) -> &[DecoderLayer] {
        &self.layers
    }
    pub(crate) fn rotary(&self) -> &RotaryEmbedding {
        &self.rope
    }
    pub(crate) fn final_norm(&self, h: &Tensor) -> ModelResult<Tensor> {
        Ok(rms_norm(
            h,
            &self.norm,
            self.cfg.layers.rms_norm_eps,
            self.mode,
        )?)
    }
    pub(crate) fn embed(&self, tokens: &[u32]) -> ModelResult<Tensor> {
        let ids = Tensor::new(tokens, &self.device)?;
        Ok(self.embed_tokens.index_select(&ids, 0)?)
    }
    pub fn device(&self) -> &Device {
        &self.device
    }
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    pub fn mode(&self) -> OpsMode {
        self.mode
    }

    pub fn config(&self) -> &DFlashConfig {
        &self.cfg
    }
    pub fn block_size(&self) -> usize {
        self.cfg.block_size
    }
    pub fn mask_token_id(&self) -> u32 {
        self.cfg.mask_token_id
    }
    pub fn target_layer_ids(&self) -> &[usize] {
        &self.cfg.target_layer_ids
    }

    /// `hidden_norm(fc(features))`: the fused context feature of each committed position.
    pub fn context_features(&self, features: &Tensor) -> ModelResult<Tensor> {
        let x = linear(&features.to_dtype(self.dtype)?, &self.fc)?;
        Ok(rms_norm(
            &x,
            &self.hidden_norm,
            self.cfg.layers.rms_norm_eps,
            self.mode,
        )?)
    }

    fn check(&self, batch: &[DraftInput<'_>]) -> ModelResult<()> {
        let b = self.cfg.block_size;
        let width = self.cfg.target_layer_ids.len() * self.cfg.layers.hidden_size;
        for (s, item) in batch.iter().enumerate() {
            if item.block.len() != b {
                return Err(ModelError::BadInput(format!(
                    "sequence {s}: block of {} tokens, block_size is {b}",
                    item.block.len()
                )));
            }
            let n_new = match item.context {
                Some(c) => {
                    let (n, w) = c.dims2()?;
                    if w != width {
                        return Err(ModelError::BadInput(format!(
                            "sequence {s}: context features are {w} wide, expected {width}"
                        )));
                    }
                    n
                }
                None => 0,
            };
            if item.cache.len() + n_new == 0 {
                return Err(ModelError::BadInput(format!(
                    "sequence {s}: a draft needs at least one context position"
                )));
            }
            item.cache.check_room(n_new + b)?;
        }
        Ok(())
    }

    /// Appends each sequence's new context, then drafts its block. Returns the drafter's final
    /// normed hidden states for all block slots, `[batch * block_size, hidden]`.
    pub fn forward(&self, batch: &mut [DraftInput<'_>]) -> ModelResult<Tensor> {
        self.check(batch)?;
        self.append_context(batch)?;
        let b = self.cfg.block_size;
        let mut tokens = Vec::with_capacity(batch.len() * b);
        let mut positions = Vec::with_capacity(batch.len() * b);
        for item in batch.iter() {
            tokens.extend_from_slice(item.block);
            let start = item.cache.len();
            positions.extend((start..start + b).map(|p| p as u32));
        }
        let ids = Tensor::new(tokens.as_slice(), &self.device)?;
        let pos = Tensor::new(positions.as_slice(), &self.device)?;
        #[cfg(feature = "cuda")]
        if self.fast {
            return self.block_fast(batch, &ids, &pos);
        }
        let mut h = self.embed_tokens.index_select(&ids, 0)?;
        let (cos, sin) = self.rope.gather(&pos)?;
        for (li, layer) in self.layers.iter().enumerate() {
            let x = layer.input_norm(&h)?;
            let (q, k, v) = layer.qkv(&x, &cos, &sin)?;
            let mut outs = Vec::with_capacity(batch.len());
            for (s, item) in batch.iter().enumerate() {
                let len = item.cache.len();
                // Block rows are written past the committed context and never made live.
                item.cache
                    .write_kv(li, len, &k.narrow(1, s * b, b)?, &v.narrow(1, s * b, b)?)?;
                let (kc, vc) = item.cache.view_kv(li, len + b)?;
                let pattern = match self.cfg.layers.layer_types[li] {
                    LayerType::FullAttention => AttnPattern::Full,
                    LayerType::SlidingAttention => AttnPattern::Sliding {
                        window: self.cfg.layers.sliding_window.unwrap_or(usize::MAX),
                        first_position: len,
                    },
                };
                let mask = pattern.mask(len, b, &self.device)?;
                outs.push(attend(
                    &q.narrow(1, s * b, b)?,
                    &kc,
                    &vc,
                    mask.as_ref(),
                    self.mode,
                )?);
            }
            let attn = Tensor::cat(&outs, 0)?;
            h = layer.finish(&h, &attn)?;
        }
        Ok(rms_norm(
            &h,
            &self.norm,
            self.cfg.layers.rms_norm_eps,
            self.mode,
        )?)
    }

    /// Draft logits for block slots `1..block_size` of every sequence:
    /// `[batch * (block_size - 1), vocab]`, f32.
    pub fn draft_logits(&self, batch: &mut [DraftInput<'_>]) -> ModelResult<Tensor> {
        #[cfg(feature = "cuda")]
        if self.fast {
            self.check(batch)?;
            if let Some(logits) = self.draft_logits_graph(batch)? {
                return Ok(logits);
            }
            crate::speculative::profile::count("drafter_round_uncaptured");
        }
        let n = batch.len();
        let b = self.cfg.block_size;
        let hidden = self.forward(batch)?;
        let rows: Vec<u32> = (0..n)
            .flat_map(|s| (1..b).map(move |k| (s * b + k) as u32))
            .collect();
        let rows = Tensor::new(rows.as_slice(), &self.device)?;
        self.lm_head(&hidden.index_select(&rows, 0)?)
    }

    /// Rows of the (target's) LM head: the vocabulary the drafter scores.
    #[cfg(feature = "cuda")]
    pub(crate) fn lm_head_rows(&self) -> usize {
        self.lm_head.dims().first().copied().unwrap_or(0)
    }

    /// The target's `lm_head` on drafter hidden states, in f32.
    pub fn lm_head(&self, hidden: &Tensor) -> ModelResult<Tensor> {
        #[cfg(feature = "cuda")]
        if self.fast {
            return Ok(crate::cuda::project(hidden, &self.lm_head, self.gemv_rows)?
                .to_dtype(DType::F32)?);
        }
        Ok(linear(hidden, &self.lm_head)?.to_dtype(DType::F32)?)
    }

    fn append_context(&self, batch: &mut [DraftInput<'_>]) -> ModelResult<()> {
        let parts: Vec<&Tensor> = batch.iter().filter_map(|i| i.context).collect();
        if parts.is_empty() {
            return Ok(());
        }
        let features = Tensor::cat(&parts, 0)?;
        let ctx = self.context_features(&features)?;
        let mut positions = Vec::new();
        for item in batch.iter() {
            let n = item.context.map(|c| c.dim(0)).transpose()?.unwrap_or(0);
            let start = item.cache.len();
            positions.extend((start..start + n).map(|p| p as u32));
        }
        let last = positions.iter().copied().max().unwrap_or(0) as usize;
        if last >= self.rope.max_positions() {
            return Err(ModelError::PositionOutOfRange {
                position: last,
                max: self.rope.max_positions(),
            });
        }
        let pos = Tensor::new(positions.as_slice(), &self.device)?;
        #[cfg(feature = "cuda")]
        if self.fast {
            return self.append_context_fast(batch, &ctx, &pos);
        }
        let (cos, sin) = self.rope.gather(&pos)?;
        for (li, layer) in self.layers.iter().enumerate() {
            let (k, v) = layer.kv(&ctx, &cos, &sin)?;
            let mut off = 0;
            for item in batch.iter() {
                let Some(c) = item.context else { continue };
                let n = c.dim(0)?;
                item.cache.write_kv(
                    li,
                    item.cache.len(),
                    &k.narrow(1, off, n)?,
                    &v.narrow(1, off, n)?,
                )?;
                off += n;
            }
        }
        for item in batch.iter_mut() {
            if let Some(c) = item.context {
                let n = c.dim(0)?;
                item.cache.advance(n);
            }
        }
        Ok(())
    }
}
