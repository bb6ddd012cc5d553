//! Qwen3.5 / Qwen3.6 / Qwen3-Next hybrid text model (HF `Qwen3_5ForCausalLM`,
//! `Qwen3_5MoeForCausalLM`, `Qwen3NextForCausalLM`; sparse-MoE MLPs in [`moe`]), built for
//! speculative decoding like [`Qwen3Model`]: one forward over a batch of sequences with
//! per-token positions, causal or tree patterns, logits for the rows asked and taps of any
//! layer, recurrent ones included (HF `hidden_states[i + 1]` as [`crate::taps`] defines them:
//! the last layer's after the final norm). This folder: the model (`mod.rs`), its plain
//! forward (`forward.rs`), the Gated DeltaNet layer (`gdn.rs`) and its chunked / recurrent
//! delta rule (`delta_rule.rs`), gated full attention (`gated_attention.rs`), the MTP head
//! (`mtp.rs`), the fused CUDA forward of short causal chains (`cuda.rs`), when it applies
//! (`fast.rs`) and its decode step as a CUDA graph (`graph.rs`); the dense and sparse-MoE MLPs
//! are the shared `layers/mlp.rs` and `layers/moe.rs`.
//!
//! Layers are Gated DeltaNet (`linear_attention`, recurrent state in the cache) or gated full
//! attention (K/V rows), per `layer_types`; every ordinary norm is zero-centred (`1 + w`). A
//! verify forward computes every row's output from the committed state through the ancestor
//! mask and stages, instead of a state per row, the rows' delta-rule inputs; compaction builds
//! the accepted path's state from them (see [`crate::cache::recurrent`]).
//!
//! [`Qwen3Model`]: crate::qwen3::Qwen3Model

#[cfg(feature = "cuda")]
mod cuda;
pub mod delta_rule;
mod fast;
mod forest;
mod forward;
pub mod gated_attention;
pub mod gdn;
#[cfg(feature = "cuda")]
mod graph;
pub mod mtp;

use std::path::Path;

use candle_core::{DType, Device, Tensor};
use dflash_common::{HybridConfig, HybridLayerType, WeightFiles};

use crate::cache::{KvBuffer, LayerCache, SequenceCache};
use crate::cuda::graphs::GraphCache;
use crate::error::{ModelError, ModelResult};
use crate::layers::decoder_layer::linear;
pub use crate::layers::mlp::Mlp;
pub use crate::layers::moe::{FeedForward, SparseMoe};
use crate::layers::ops::{rms_norm, OpsMode};
use crate::layers::rope::RotaryEmbedding;
use crate::random::WeightRng;
pub use fast::{GdnPath, GdnPaths, MoeKernels};
pub use gated_attention::{one_plus, GatedAttention};
pub use gdn::{DeltaForm, GatedDeltaNet};
#[cfg(feature = "cuda")]
pub use graph::HybridDecodeGraph;
pub use mtp::MtpHead;

#[derive(Debug, Clone)]
pub enum Mixer {
    Linear(GatedDeltaNet),
    Full(GatedAttention),
}

#[derive(Debug, Clone)]
pub struct HybridLayer {
    /// Zero-centred norms, stored as `1 + w`.
    input_norm: Tensor,
    post_norm: Tensor,
    pub mixer: Mixer,
    mlp: FeedForward,
    /// `[gate; up]` stacked for the fused CUDA path (the dense MLP's two re-pointed at views).
    gate_up: Option<Tensor>,
    /// A sparse layer's block stacked for the device path (`fast.rs`).
    moe: Option<fast::MoeKernels>,
}

#[derive(Debug, Clone)]
pub struct Qwen35Model {
    cfg: HybridConfig,
    embed_tokens: Tensor,
    layers: Vec<HybridLayer>,
    norm: Tensor,
    lm_head: Tensor,
    rope: RotaryEmbedding,
    dtype: DType,
    device: Device,
    mode: OpsMode,
    form: DeltaForm,
    /// Short causal chains of one sequence take the fused CUDA forward (`cuda.rs`).
    fast: bool,
    /// Which fused GDN mixer that forward runs for a decode step and for a chain verify.
    gdn_paths: GdnPaths,
    /// Captured decode steps (`graph.rs`), shared by the model's clones; with the fused
    /// kernels, on where `cuda::hybrid_decode_graphs` says.
    step_graphs: GraphCache,
}

/// Where the text weights sit: `model.language_model.` in the released multimodal checkpoints,
/// `model.` in text-only ones and in Qwen3-Next.
fn text_prefix(w: &WeightFiles) -> &'static str {
    if w.contains("model.language_model.embed_tokens.weight") {
        "model.language_model."
    } else {
        "model."
    }
}

impl Qwen35Model {
    pub fn load(
        dir: &Path,
        dtype: DType,
        device: &Device,
        max_positions: usize,
        mode: OpsMode,
    ) -> ModelResult<Self> {
        let cfg = HybridConfig::from_file(dir.join("config.json"))?;
        let weights = WeightFiles::open_dir(dir)?;
        Self::from_weights(cfg, &weights, dtype, device, max_positions, mode)
    }

    pub fn from_weights(
        cfg: HybridConfig,
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
        let pre = text_prefix(w);
        let (v, h) = (cfg.vocab_size, cfg.hidden_size);
        let embed_tokens =
            w.tensor(&format!("{pre}embed_tokens.weight"), &[v, h], dtype, device)?;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for (i, kind) in cfg.layer_types.iter().enumerate() {
            let p = format!("{pre}layers.{i}");
            let mixer = match kind {
                HybridLayerType::LinearAttention => Mixer::Linear(GatedDeltaNet::load(
                    w,
                    &format!("{p}.linear_attn"),
                    &cfg,
                    dtype,
                    device,
                )?),
                HybridLayerType::FullAttention => {
                    if w.contains(&format!("{p}.linear_attn.A_log")) {
                        return Err(ModelError::Inconsistent(format!(
                            "{}: config.json says layer {i} is full_attention, but the checkpoint has Gated DeltaNet weights (`{p}.linear_attn.*`) there: layer_types does not match the weights",
                            w.dir().display()
                        )));
                    }
                    Mixer::Full(GatedAttention::load(
                        w,
                        &format!("{p}.self_attn"),
                        &cfg,
                        dtype,
                        device,
                        mode,
                    )?)
                }
            };
            let norm = |n: &str| -> ModelResult<Tensor> {
                Ok(one_plus(&w.tensor(
                    &format!("{p}.{n}.weight"),
                    &[h],
                    dtype,
                    device,
                )?)?)
            };
            layers.push(HybridLayer {
                input_norm: norm("input_layernorm")?,
                post_norm: norm("post_attention_layernorm")?,
                mixer,
                mlp: FeedForward::load(
                    w,
                    &format!("{p}.mlp"),
                    h,
                    cfg.intermediate_size,
                    cfg.moe.as_ref().filter(|_| cfg.sparse_layers[i]),
                    dtype,
                    device,
                )?,
                gate_up: None,
                moe: None,
            });
        }
        let norm = one_plus(&w.tensor(&format!("{pre}norm.weight"), &[h], dtype, device)?)?;
        let lm_head = if cfg.tie_word_embeddings && !w.contains("lm_head.weight") {
            embed_tokens.clone()
        } else {
            w.tensor("lm_head.weight", &[v, h], dtype, device)?
        };
        Self::assemble(
            cfg,
            embed_tokens,
            layers,
            norm,
            lm_head,
            dtype,
            device,
            max_positions,
            mode,
        )
    }

    /// Seeded random weights of `cfg`'s shape (tests, benchmarks).
    pub fn random(
        cfg: HybridConfig,
        rng: &mut WeightRng,
        dtype: DType,
        device: &Device,
        max_positions: usize,
        mode: OpsMode,
    ) -> ModelResult<Self> {
        let (v, h) = (cfg.vocab_size, cfg.hidden_size);
        let embed_tokens = rng.normal(&[v, h], 0.0, 1.0, dtype, device)?;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for (i, kind) in cfg.layer_types.iter().enumerate() {
            let mixer = match kind {
                HybridLayerType::LinearAttention => {
                    Mixer::Linear(GatedDeltaNet::random(rng, &cfg, dtype, device)?)
                }
                HybridLayerType::FullAttention => {
                    Mixer::Full(GatedAttention::random(rng, &cfg, dtype, device, mode)?)
                }
            };
            layers.push(HybridLayer {
                input_norm: rng.norm(h, dtype, device)?,
                post_norm: rng.norm(h, dtype, device)?,
                mixer,
                mlp: FeedForward::random(
                    rng,
                    h,
                    cfg.intermediate_size,
                    cfg.moe.as_ref().filter(|_| cfg.sparse_layers[i]),
                    dtype,
                    device,
                )?,
                gate_up: None,
                moe: None,
            });
        }
        let norm = rng.norm(h, dtype, device)?;
        let lm_head = if cfg.tie_word_embeddings {
            embed_tokens.clone()
        } else {
            rng.linear(v, h, dtype, device)?
        };
        Self::assemble(
            cfg,
            embed_tokens,
            layers,
            norm,
            lm_head,
            dtype,
            device,
            max_positions,
            mode,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn assemble(
        cfg: HybridConfig,
        embed_tokens: Tensor,
        layers: Vec<HybridLayer>,
        norm: Tensor,
        lm_head: Tensor,
        dtype: DType,
        device: &Device,
        max_positions: usize,
        mode: OpsMode,
    ) -> ModelResult<Self> {
        let rope = RotaryEmbedding::from_params(
            cfg.rotary_dim,
            cfg.rope_theta,
            &cfg.rope_scaling,
            max_positions,
            device,
        )?;
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
            form: DeltaForm::Auto,
            fast: false,
            gdn_paths: GdnPaths::default(),
            step_graphs: GraphCache::new(false),
        }
        .prepare_fast()
    }

    /// Pins the delta-rule form (tests compare the chunked and the recurrent form).
    pub fn with_delta_form(mut self, form: DeltaForm) -> Self {
        self.form = form;
        self
    }

    pub fn config(&self) -> &HybridConfig {
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
    pub fn layers(&self) -> &[HybridLayer] {
        &self.layers
    }

    /// A cache whose forwards settle at once (no rollback): prefill and plain decoding.
    /// Bytes of K/V one cached row takes across the full-attention layers (the Gated DeltaNet
    /// layers keep a fixed-size state per sequence instead, see `new_cache_with_rollback`).
    pub fn kv_bytes_per_row(&self) -> usize {
        let full = self
            .layers
            .iter()
            .filter(|l| matches!(l.mixer, Mixer::Full(_)))
            .count();
        full * 2 * self.cfg.num_key_value_heads * self.cfg.head_dim * self.dtype.size_in_bytes()
    }

    /// A K/V pool of `pages` pages for the full-attention layers (the Gated DeltaNet layers
    /// keep per-sequence recurrent states instead).
    pub fn new_kv_pool(&self, pages: usize) -> ModelResult<crate::cache::KvPool> {
        let attention = self
            .layers
            .iter()
            .filter(|l| matches!(l.mixer, Mixer::Full(_)))
            .count();
        Ok(crate::cache::KvPool::new(
            attention,
            self.cfg.num_key_value_heads,
            self.cfg.head_dim,
            pages,
            self.dtype,
            &self.device,
        )?)
    }

    /// [`Self::new_cache_with_rollback`] with the attention rows in pages of `pool`, holding
    /// pages for `rows` rows for now (it grows on demand).
    pub fn new_cache_in(
        &self,
        pool: &crate::cache::KvPool,
        capacity: usize,
        rollback: usize,
        rows: usize,
    ) -> ModelResult<SequenceCache> {
        let kinds = self
            .layers
            .iter()
            .map(|l| match &l.mixer {
                Mixer::Linear(g) => Ok(Some(crate::cache::RecurrentLayer::new(
                    g.zero_state(self.dtype, &self.device)?,
                ))),
                Mixer::Full(_) => Ok(None),
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        SequenceCache::new_paged_with(pool, kinds, capacity, rollback, rows)
    }

    pub fn new_cache(&self, capacity: usize) -> ModelResult<SequenceCache> {
        self.new_cache_with_rollback(capacity, 0)
    }

    /// A cache in which forwards of up to `rollback` tokens keep per-token recurrent states,
    /// so that they can be truncated or compacted (the verify width of a speculative engine).
    pub fn new_cache_with_rollback(
        &self,
        capacity: usize,
        rollback: usize,
    ) -> ModelResult<SequenceCache> {
        let layers = self
            .layers
            .iter()
            .map(|l| match &l.mixer {
                Mixer::Linear(g) => Ok(LayerCache::Recurrent(crate::cache::RecurrentLayer::new(
                    g.zero_state(self.dtype, &self.device)?,
                ))),
                Mixer::Full(_) => Ok(LayerCache::Attention(KvBuffer::new(
                    self.cfg.num_key_value_heads,
                    capacity,
                    self.cfg.head_dim,
                    self.dtype,
                    &self.device,
                )?)),
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        Ok(SequenceCache::new_hybrid(layers, capacity, rollback))
    }

    pub fn embed(&self, tokens: &[u32]) -> ModelResult<Tensor> {
        let ids = Tensor::new(tokens, &self.device)?;
        Ok(self.embed_tokens.index_select(&ids, 0)?)
    }

    pub fn lm_head(&self, x: &Tensor) -> ModelResult<Tensor> {
        Ok(linear(x, &self.lm_head)?.to_dtype(DType::F32)?)
    }

    pub fn final_norm(&self, x: &Tensor) -> ModelResult<Tensor> {
        Ok(rms_norm(x, &self.norm, self.cfg.rms_norm_eps, self.mode)?)
    }
}
