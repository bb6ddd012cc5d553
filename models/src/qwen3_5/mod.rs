//! Qwen3.5 / Qwen3.6 / Qwen3-Next hybrid text model (HF `Qwen3_5ForCausalLM`,
//! `Qwen3_5MoeForCausalLM`, `Qwen3NextForCausalLM`; sparse-MoE MLPs in [`moe`]), built for
//! speculative decoding like [`Qwen3Model`]: one forward over a batch of sequences with
//! per-token positions, causal or tree patterns, logits for the rows asked and taps of any
//! layer, recurrent ones included (HF `hidden_states[i + 1]` as [`crate::taps`] defines them:
//! the last layer's after the final norm). This folder: the model and its forward (`mod.rs`),
//! the Gated DeltaNet layer
//! (`gdn.rs`) and its chunked / recurrent delta rule (`delta_rule.rs`), gated full attention
//! (`gated_attention.rs`), the MTP head (`mtp.rs`), the fused CUDA forward of short causal
//! chains (`cuda.rs`) and when it applies (`fast.rs`); the dense and sparse-MoE MLPs are the shared
//! `layers/mlp.rs` and `layers/moe.rs`.
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
pub mod gated_attention;
pub mod gdn;
#[cfg(feature = "cuda")]
mod graph;
pub mod mtp;

use std::path::Path;

use candle_core::{DType, Device, Tensor};
use dflash_common::{HybridConfig, HybridLayerType, WeightFiles};

use crate::batch::{check_batch, ForwardOutput, SeqForward, StackedBatch};
use crate::cache::{KvBuffer, LayerCache, SequenceCache, StagedState};
use crate::cuda::graphs::GraphCache;
use crate::error::{ModelError, ModelResult};
use crate::layers::attention::{attend, AttnPattern};
use crate::layers::decoder_layer::linear;
pub use crate::layers::mlp::Mlp;
pub use crate::layers::moe::{FeedForward, SparseMoe};
use crate::layers::ops::{rms_norm, OpsMode};
use crate::layers::rope::RotaryEmbedding;
use crate::qwen3_5::delta_rule::Forest;
use crate::random::WeightRng;
use crate::taps::TapCollector;
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

    /// Runs the new tokens of every sequence; on error no cache changes what is live.
    pub fn forward(
        &self,
        batch: &mut [SeqForward<'_>],
        taps: &[usize],
    ) -> ModelResult<ForwardOutput> {
        check_batch(
            batch,
            taps,
            self.layers.len(),
            self.cfg.vocab_size,
            self.rope.max_positions(),
        )?;
        #[cfg(feature = "cuda")]
        if self.takes_fused(batch) {
            if let Some(out) = self.forward_decode_graph(batch, taps)? {
                return Ok(out);
            }
            return self.forward_fused(&mut batch[0], taps);
        }
        let StackedBatch {
            tokens: all_tokens,
            positions: all_positions,
            logit_rows,
            token_offsets,
            logit_offsets,
        } = StackedBatch::new(batch);
        let mut forests: Vec<Vec<Option<usize>>> = Vec::with_capacity(batch.len());
        let mut keep_rows = Vec::with_capacity(batch.len());
        for seq in batch.iter() {
            let t = seq.tokens.len();
            let tracker = seq.cache.row_tracker().ok_or_else(|| {
                ModelError::BadInput(
                    "a hybrid model needs a cache from Qwen35Model::new_cache".into(),
                )
            })?;
            tracker.check_extendable(seq.cache.len())?;
            let keep = t <= tracker.rollback;
            let forest = match seq.pattern {
                AttnPattern::Tree { parents } => {
                    if !keep {
                        return Err(ModelError::BadInput(format!(
                            "a tree of {t} nodes exceeds the cache's rollback window of {} rows; create the cache with new_cache_with_rollback",
                            tracker.rollback
                        )));
                    }
                    parents.clone()
                }
                _ => (0..t).map(|i| i.checked_sub(1)).collect(),
            };
            forests.push(forest);
            keep_rows.push(keep);
        }
        // GDN plans, shared by every GDN layer: one forest over all sequences that take the
        // recurrence (their tokens of one depth step together), one per chunked sequence.
        let kernel = self.cfg.linear_conv_kernel_dim;
        let chunked: Vec<bool> = forests
            .iter()
            .zip(&keep_rows)
            .map(|(f, &keep)| GatedDeltaNet::use_chunked(f.len(), keep, self.form))
            .collect();
        // Rollback-able forwards take the tree form one sequence at a time (`mix_staged`).
        let members: Vec<usize> = (0..batch.len())
            .filter(|&s| !chunked[s] && !keep_rows[s])
            .collect();
        let plan = if members.is_empty() {
            None
        } else {
            let segs: Vec<&[Option<usize>]> =
                members.iter().map(|&s| forests[s].as_slice()).collect();
            let forest = Forest::new(&segs, kernel, &self.device)?;
            // The members' proj rows, unless they are the whole batch in order.
            let rows = if members.len() == batch.len() {
                None
            } else {
                let r: Vec<u32> = members
                    .iter()
                    .flat_map(|&s| (token_offsets[s]..token_offsets[s + 1]).map(|i| i as u32))
                    .collect();
                Some(Tensor::new(r.as_slice(), &self.device)?)
            };
            Some((forest, rows))
        };
        let single: Vec<Option<Forest>> = (0..batch.len())
            .map(|s| {
                (chunked[s] || keep_rows[s])
                    .then(|| Forest::new(&[forests[s].as_slice()], kernel, &self.device))
                    .transpose()
            })
            .collect::<candle_core::Result<_>>()?;
        let masks = batch
            .iter()
            .map(|s| s.pattern.mask(s.cache.len(), s.tokens.len(), &self.device))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let positions = Tensor::new(all_positions.as_slice(), &self.device)?;
        let (cos, sin) = self.rope.gather(&positions)?;
        let (cos, sin) = (cos.to_dtype(self.dtype)?, sin.to_dtype(self.dtype)?);
        self.phase("embed");
        let mut x = self.embed(&all_tokens)?;
        let mut tapped = TapCollector::new(taps, self.layers.len());
        let mut staged: Vec<Vec<(usize, StagedState)>> = batch.iter().map(|_| Vec::new()).collect();
        for (li, layer) in self.layers.iter().enumerate() {
            self.phase("input_norm");
            let h = rms_norm(&x, &layer.input_norm, self.cfg.rms_norm_eps, self.mode)?;
            let mixed = match &layer.mixer {
                Mixer::Full(attn) => {
                    self.phase("attn.qkv");
                    let (q, k, v, gate) = attn.qkv_gate(&h, &cos, &sin)?;
                    self.phase("attn.mix");
                    let mut outs = Vec::with_capacity(batch.len());
                    for (s, seq) in batch.iter().enumerate() {
                        let (off, t) = (token_offsets[s], seq.tokens.len());
                        let len = seq.cache.len();
                        seq.cache.write_kv(
                            li,
                            len,
                            &k.narrow(1, off, t)?,
                            &v.narrow(1, off, t)?,
                        )?;
                        let (kc, vc) = seq.cache.view_kv(li, len + t)?;
                        outs.push(attend(
                            &q.narrow(1, off, t)?,
                            &kc,
                            &vc,
                            masks[s].as_ref(),
                            self.mode,
                        )?);
                    }
                    self.phase("attn.out");
                    attn.out(&cat_rows(outs)?, &gate)?
                }
                Mixer::Linear(gdn) => {
                    self.phase("gdn.project");
                    let proj = gdn.project(&h)?;
                    self.phase("gdn.mix");
                    let mut pieces: Vec<Option<Tensor>> = vec![None; batch.len()];
                    if let Some((forest, rows)) = &plan {
                        let p = match rows {
                            Some(r) => proj.index_select(r, 0)?,
                            None => proj.clone(),
                        };
                        let states = members
                            .iter()
                            .map(|&s| batch[s].cache.layer(li).recurrent()?.last())
                            .collect::<ModelResult<Vec<_>>>()?;
                        let keep = vec![false; members.len()];
                        let (y, st) = gdn.mix(&p, forest, &states, &keep, false)?;
                        for ((&s, &(off, len)), st) in members.iter().zip(&forest.segments).zip(st)
                        {
                            pieces[s] = Some(y.narrow(0, off, len)?);
                            staged[s].push((li, st));
                        }
                    }
                    for (s, seq) in batch.iter().enumerate() {
                        let Some(forest) = &single[s] else { continue };
                        let (off, t) = (token_offsets[s], seq.tokens.len());
                        let state = seq.cache.layer(li).recurrent()?.last()?;
                        let p = proj.narrow(0, off, t)?;
                        #[cfg(feature = "cuda")]
                        if let Some((y, st)) =
                            self.gdn_kernels(gdn, &p, forest, &forests[s], state, keep_rows[s])?
                        {
                            pieces[s] = Some(y);
                            staged[s].push((li, st));
                            continue;
                        }
                        let (y, st) = if keep_rows[s] {
                            gdn.mix_staged(&p, forest, &forests[s], state)?
                        } else {
                            let (y, mut st) = gdn.mix(&p, forest, &[state], &[false], true)?;
                            (y, st.remove(0))
                        };
                        pieces[s] = Some(y);
                        staged[s].push((li, st));
                    }
                    let pieces = pieces
                        .into_iter()
                        .map(|p| {
                            p.ok_or_else(|| {
                                ModelError::BadInput("a sequence missed its GDN output".into())
                            })
                        })
                        .collect::<ModelResult<Vec<_>>>()?;
                    self.phase("gdn.out");
                    gdn.out(&cat_rows(pieces)?)?
                }
            };
            self.phase("mlp");
            let x1 = (x + mixed)?;
            let h2 = rms_norm(&x1, &layer.post_norm, self.cfg.rms_norm_eps, self.mode)?;
            // A sparse layer on the fast path: the block on the device (no host routing, so
            // trees and prefill pieces stay sync-free); else the plain block.
            let on_device = match self.fast {
                true => layer.moe_on_device(&x1, &h2)?,
                false => None,
            };
            x = match on_device {
                Some(x2) => x2,
                None => (&x1 + layer.mlp.forward(&h2)?)?,
            };
            tapped.layer_output(li, &x);
        }
        self.phase("commit_and_head");
        for (s, seq) in batch.iter_mut().enumerate() {
            let t = seq.tokens.len();
            let parents = keep_rows[s].then_some(forests[s].as_slice());
            seq.cache
                .commit_recurrent(t, parents, std::mem::take(&mut staged[s]))?;
        }
        // As in the dense forward: a last-layer tap norms every row, the logit rows reuse it.
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
        self.phase("end");
        Ok(ForwardOutput {
            logits,
            taps,
            token_offsets,
            logit_offsets,
        })
    }

    /// Marks the start of a phase of the plain forward for a bench's GPU-timeline profile
    /// (`cuda::phases`: one relaxed atomic load when no profile is open; nothing on the CPU).
    fn phase(&self, _label: &'static str) {
        #[cfg(feature = "cuda")]
        crate::cuda::phases::mark(&self.device, _label);
    }
}

fn cat_rows(mut outs: Vec<Tensor>) -> candle_core::Result<Tensor> {
    if outs.len() == 1 {
        Ok(outs.pop().expect("one output"))
    } else {
        Tensor::cat(&outs, 0)
    }
}
