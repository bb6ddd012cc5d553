//! When [`Qwen35Model`] takes its fused CUDA forward (`cuda.rs`): the availability test, the
//! stacked weights it reads, and the switch the benches flip to compare it with the plain path.

#[cfg(feature = "cuda")]
use candle_core::{DType, Tensor};

use crate::cuda::graphs::GraphCache;
#[cfg(feature = "cuda")]
use crate::error::ModelError;
use crate::error::ModelResult;
use crate::layers::moe::{FeedForward, SharedExpertWeights, SparseMoe, StackedExperts};
#[cfg(feature = "cuda")]
use crate::layers::ops::OpsMode;
use crate::qwen3_5::{HybridLayer, Mixer, Qwen35Model};

/// Which fused Gated DeltaNet mixer a fused chain forward runs (`cuda.rs`), and how it stages
/// the recurrent states of a forward that may be rolled back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GdnPath {
    /// `gdn_chain` (one kernel; every column block recomputes its head's conv), the state
    /// after every row staged ([`crate::cache::StagedState::Rows`]).
    Chain,
    /// `gdn_split` (prologue, then a warp-shuffle scan over twice the warps), the state after
    /// every row staged.
    SplitStates,
    /// `gdn_split` writing each row's value `u` instead of its state: the rows stage
    /// [`crate::cache::RowInputs`] and the commit rebuilds the accepted row's state (one
    /// `gdn_state_along` launch per layer), so a verify writes no per-row states at all.
    SplitInputs,
}

/// The [`GdnPath`] of a decode step (1 token) and of a longer chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GdnPaths {
    pub decode: GdnPath,
    pub verify: GdnPath,
}

impl Default for GdnPaths {
    fn default() -> Self {
        Self {
            decode: GdnPath::Chain,
            verify: GdnPath::SplitInputs,
        }
    }
}

impl GdnPaths {
    /// The path of a forward of `t` tokens.
    pub fn for_tokens(&self, t: usize) -> GdnPath {
        if t == 1 {
            self.decode
        } else {
            self.verify
        }
    }
}

/// A sparse-MoE layer's block as the device path reads it: the routed experts stacked for
/// `cuda::moe_block` (router, routing and only the selected experts on the device, no host
/// sync) and the shared expert's stacked weights.
#[derive(Debug, Clone)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub struct MoeKernels {
    experts: StackedExperts,
    shared: Option<SharedExpertWeights>,
    /// `[E + 16, H]`: the router's rows, the shared expert's gate row, zeros; where the shared
    /// expert has the routed width, so the one-row device block runs it as one more pair
    /// (`cuda::SharedExpertRefs`). A copy of the router (E x H, 1 MB a layer at the 35B-A3B
    /// shape).
    router_gate: Option<candle_core::Tensor>,
}

impl MoeKernels {
    /// Stacks `moe`'s experts (re-pointing them at views of the stacks: the plain block keeps
    /// its values and shares the memory).
    pub fn stack(moe: &mut SparseMoe) -> candle_core::Result<Option<Self>> {
        Ok(match moe.stack_experts()? {
            Some(experts) => {
                let shared = moe.stack_shared()?;
                let router_gate = Self::router_gate(&experts, shared.as_ref())?;
                Some(Self {
                    experts,
                    shared,
                    router_gate,
                })
            }
            None => None,
        })
    }

    /// The block's weights with the shared expert inside, where it can ride in the one-row
    /// block ([`crate::cuda::SharedExpertRefs`]) and [`crate::cuda::moe_shared_in_block`] is on.
    #[cfg(feature = "cuda")]
    fn with_shared_inside(&self) -> Option<crate::cuda::MoeWeights<'_>> {
        let (sh, router_gate) = (self.shared.as_ref()?, self.router_gate.as_ref()?);
        crate::cuda::moe_shared_in_block().then_some(crate::cuda::MoeWeights {
            router: &self.experts.router,
            gate_up: &self.experts.gate_up,
            down: &self.experts.down,
            top_k: self.experts.top_k,
            norm_topk_prob: self.experts.norm_topk_prob,
            shared: Some(crate::cuda::SharedExpertRefs {
                router_gate,
                gate_up: &sh.gate_up,
                down: &sh.down,
            }),
        })
    }

    /// `x1 + moe(norm(x1))` for the fused forward's one-row steps: with the shared expert
    /// inside the block the norm is applied by the router GEMV and the gate/up kernel as `x1`
    /// streams in (no separate norm launch); otherwise the norm, then [`Self::apply`].
    #[cfg(feature = "cuda")]
    pub fn apply_normed(
        &self,
        x1: &Tensor,
        norm: crate::cuda::RowNorm<'_>,
    ) -> candle_core::Result<Option<Tensor>> {
        let one_cuda_row = x1.dim(0)? == 1 && x1.device().is_cuda() && x1.dtype() == DType::BF16;
        if let (true, Some(w)) = (one_cuda_row, self.with_shared_inside()) {
            return Ok(Some(
                crate::cuda::moe_block(x1, Some(norm), &w, Some(x1), false)?.0,
            ));
        }
        let h = crate::cuda::rms_apply(x1, norm)?;
        self.apply(x1, &h)
    }

    /// The router with the shared expert's gate row under it and zero rows to
    /// [`crate::cuda::SHARED_ROUTER_PAD`], where the shared expert has the routed width.
    #[cfg(feature = "cuda")]
    fn router_gate(
        experts: &StackedExperts,
        shared: Option<&SharedExpertWeights>,
    ) -> candle_core::Result<Option<Tensor>> {
        let Some(sh) = shared else { return Ok(None) };
        let r = &experts.router;
        let h = r.dim(1)?;
        if sh.down.dim(1)? != experts.down.dim(2)? || sh.gate.dims2()? != (1, h) {
            return Ok(None);
        }
        let pad = Tensor::zeros(
            (crate::cuda::SHARED_ROUTER_PAD - 1, h),
            r.dtype(),
            r.device(),
        )?;
        Ok(Some(Tensor::cat(&[r, &sh.gate, &pad], 0)?))
    }

    /// Without CUDA no device block reads it.
    #[cfg(not(feature = "cuda"))]
    fn router_gate(
        _experts: &StackedExperts,
        _shared: Option<&SharedExpertWeights>,
    ) -> candle_core::Result<Option<candle_core::Tensor>> {
        Ok(None)
    }

    /// `x1 + moe(h)` on the device for `h = norm(x1)` (`[rows, H]`, CUDA bf16, any number of
    /// rows: [`crate::cuda::moe_block`] routes prefills in tiles): the shared expert (skinny
    /// GEMMs up to [`crate::cuda::GEMV_MAX_ROWS`] rows, cuBLAS above) scaled by its sigmoid
    /// gate and added to `x1`, then the routed experts with that sum as the residual of
    /// `cuda::moe_block`'s combine. The same math as `SparseMoe::forward` (to bf16 rounding: the sums are grouped
    /// differently). None where it does not apply (the caller runs the plain block).
    #[cfg(feature = "cuda")]
    pub fn apply(&self, x1: &Tensor, h: &Tensor) -> candle_core::Result<Option<Tensor>> {
        use crate::cuda;
        use crate::layers::ops::linear;
        let rows = h.dim(0)?;
        if !h.device().is_cuda() || h.dtype() != DType::BF16 {
            return Ok(None);
        }
        // One row: the shared expert as one more pair of the block (4 launches in all).
        if let (1, Some(w)) = (rows, self.with_shared_inside()) {
            return Ok(Some(cuda::moe_block(h, None, &w, Some(x1), false)?.0));
        }
        let resid = match &self.shared {
            Some(sh) => {
                let out = if rows <= cuda::GEMV_MAX_ROWS {
                    let act = cuda::gemv_silu(h, &sh.gate_up, None)?;
                    cuda::gemv(&act, &sh.down, None)?
                } else {
                    let gu = linear(h, &sh.gate_up)?;
                    let s = sh.down.dim(1)?;
                    let act =
                        (candle_nn::ops::silu(&gu.narrow(1, 0, s)?)? * gu.narrow(1, s, s)?)?;
                    linear(&act, &sh.down)?
                };
                let g = candle_nn::ops::sigmoid(&linear(h, &sh.gate)?)?;
                (x1 + out.broadcast_mul(&g)?)?
            }
            None => x1.clone(),
        };
        let w = cuda::MoeWeights {
            router: &self.experts.router,
            gate_up: &self.experts.gate_up,
            down: &self.experts.down,
            top_k: self.experts.top_k,
            norm_topk_prob: self.experts.norm_topk_prob,
            shared: None,
        };
        Ok(Some(cuda::moe_block(h, None, &w, Some(&resid), false)?.0))
    }
}

impl HybridLayer {
    /// `x1 + mlp(h)` on the device kernels of the fast path: [`MoeKernels::apply`] for a sparse
    /// layer; for a dense one with stacked gate/up, a verify's rows (2..=64, as a tree's) as
    /// cuBLASLt products with the residual folded in where [`crate::cuda::hybrid_lt_product`]
    /// picks them; None otherwise (the caller runs the plain block).
    #[cfg(feature = "cuda")]
    pub(crate) fn mlp_on_device(&self, x1: &Tensor, h: &Tensor) -> ModelResult<Option<Tensor>> {
        use crate::cuda;
        if let Some(k) = &self.moe {
            return Ok(k.apply(x1, h)?);
        }
        let rows = x1.dim(0)?;
        let fits =
            rows <= cuda::TUNED_MAX_ROWS && x1.device().is_cuda() && x1.dtype() == DType::BF16;
        match (&self.gate_up, self.mlp.dense()) {
            (Some(gu), Some(m)) if fits && cuda::hybrid_lt_product(rows, gu.elem_count()) => {
                let act = cuda::silu_mul(&cuda::linear_lt_dense(h, gu, None)?)?;
                Ok(Some(cuda::linear_lt_dense(&act, m.weights().2, Some(x1))?))
            }
            _ => Ok(None),
        }
    }

    /// A sparse layer's `x1 + moe(norm(x1))` in the fused forward ([`MoeKernels::apply_normed`]);
    /// an error for a dense layer or a block off the device.
    #[cfg(feature = "cuda")]
    pub(crate) fn moe_block_normed(
        &self,
        x1: &Tensor,
        norm: crate::cuda::RowNorm<'_>,
    ) -> ModelResult<Tensor> {
        let out = match &self.moe {
            Some(k) => k.apply_normed(x1, norm)?,
            None => None,
        };
        out.ok_or_else(|| {
            ModelError::Unsupported("the fused forward: a sparse layer off the device".into())
        })
    }

    /// Without CUDA there is no device block.
    #[cfg(not(feature = "cuda"))]
    pub(crate) fn mlp_on_device(
        &self,
        _x1: &candle_core::Tensor,
        _h: &candle_core::Tensor,
    ) -> ModelResult<Option<candle_core::Tensor>> {
        Ok(None)
    }

    /// Whether the layer's MLP is a sparse-MoE block.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn is_sparse(&self) -> bool {
        matches!(self.mlp, FeedForward::Sparse(_))
    }

    /// The stacked gate/up and the down projection of a dense MLP (fused path only).
    #[cfg(feature = "cuda")]
    pub(crate) fn fused_mlp(&self) -> ModelResult<(&Tensor, &Tensor)> {
        match (&self.gate_up, self.mlp.dense()) {
            (Some(gu), Some(m)) => Ok((gu, m.weights().2)),
            _ => Err(ModelError::Unsupported(
                "the fused hybrid forward runs dense MLPs with stacked gate/up only".into(),
            )),
        }
    }
}

impl Qwen35Model {
    /// Whether the fused CUDA forward can run this model: CUDA, bf16, inference mode, dense
    /// MLPs or sparse-MoE blocks the device kernels take, GDN heads of 128 with a conv of at most 4 taps, and every projection in the
    /// skinny GEMMs' shapes (`k % 256 == 0`, `n % 16 == 0`; true for the published shapes).
    pub fn fast_kernels_available(&self) -> bool {
        #[cfg(feature = "cuda")]
        {
            let c = &self.cfg;
            let fits = |n: usize, k: usize| n.is_multiple_of(16) && k.is_multiple_of(256);
            let h = c.hidden_size;
            let (nh, nkv, d) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
            let hv_dv = c.linear_num_value_heads * c.linear_value_head_dim;
            let has_dense = c.moe.is_none() || c.sparse_layers.iter().any(|s| !s);
            self.device.is_cuda()
                && self.dtype == DType::BF16
                && self.mode == OpsMode::Fused
                && c.moe.as_ref().is_none_or(|m| {
                    crate::cuda::moe_shape_fits(
                        m.num_experts,
                        h,
                        m.moe_intermediate_size,
                        m.num_experts_per_tok,
                    ) && m
                        .shared_expert_intermediate_size
                        .is_none_or(|s| fits(2 * s, h) && fits(h, s))
                })
                && c.linear_key_head_dim == crate::cuda::GDN_HEAD_DIM
                && c.linear_value_head_dim == crate::cuda::GDN_HEAD_DIM
                && c.linear_conv_kernel_dim <= crate::cuda::GDN_MAX_CONV
                && fits(c.conv_dim() + hv_dv + 2 * c.linear_num_value_heads, h)
                && fits(h, hv_dv)
                && fits(2 * nh * d + 2 * nkv * d, h)
                && fits(h, nh * d)
                && (!has_dense || fits(c.intermediate_size, h))
                && (!has_dense || fits(h, c.intermediate_size))
                && fits(c.vocab_size, h)
        }
        #[cfg(not(feature = "cuda"))]
        false
    }

    /// Where the fused forward applies, stacks the projections it reads (the separate ones
    /// become views: same memory) and turns it on.
    pub(super) fn prepare_fast(mut self) -> ModelResult<Self> {
        if self.fast_kernels_available() {
            for l in &mut self.layers {
                if let Mixer::Full(a) = &mut l.mixer {
                    a.fuse_projections()?;
                }
                match &mut l.mlp {
                    FeedForward::Dense(m) => l.gate_up = Some(m.stack_gate_up()?),
                    FeedForward::Sparse(m) => l.moe = MoeKernels::stack(m)?,
                }
            }
            self.fast = true;
            let sparse_moe = self
                .layers
                .iter()
                .any(|l| matches!(l.mlp, FeedForward::Sparse(_)));
            self.step_graphs = GraphCache::new(crate::cuda::hybrid_decode_graphs(sparse_moe));
        }
        Ok(self)
    }

    /// Turns the fused forward on or off (off: the plain candle path, for comparisons); no
    /// effect where it is not available.
    pub fn with_fast_kernels(mut self, on: bool) -> Self {
        self.fast = on
            && self.fast_kernels_available()
            && self.layers.iter().all(|l| {
                (l.gate_up.is_some() || l.moe.is_some())
                    && match &l.mixer {
                        Mixer::Full(a) => a.fused_qkv().is_some(),
                        Mixer::Linear(_) => true,
                    }
            });
        self.step_graphs = self.step_graphs.fresh();
        self
    }

    /// Turns the replay of decode steps from CUDA graphs on or off (`graph.rs`; the default
    /// is `cuda::hybrid_decode_graphs`). No effect without the fused kernels.
    pub fn with_step_graphs(mut self, on: bool) -> Self {
        self.step_graphs = GraphCache::new(on && self.fast);
        self
    }

    /// Whether decode steps are captured and replayed as graphs.
    pub fn step_graphs_on(&self) -> bool {
        self.step_graphs.is_on()
    }

    /// Decode graphs held (0 with graphs off).
    pub fn step_graphs_held(&self) -> usize {
        self.step_graphs.held()
    }

    /// Forwards replayed from a decode graph so far (shared by the model's clones).
    pub fn graph_replays(&self) -> u64 {
        self.step_graphs.replays()
    }

    /// Chooses the fused GDN mixers (the benches compare them; the default is what measured
    /// fastest). Graphs captured before are dropped.
    pub fn with_gdn_paths(mut self, paths: GdnPaths) -> Self {
        self.gdn_paths = paths;
        self.step_graphs = self.step_graphs.fresh();
        self
    }

    pub fn gdn_paths(&self) -> GdnPaths {
        self.gdn_paths
    }

    /// Whether forwards that fit take the fused CUDA path.
    pub fn fast_kernels(&self) -> bool {
        self.fast
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device};
    use dflash_common::HybridConfig;

    use crate::layers::ops::OpsMode;
    use crate::qwen3_5::Qwen35Model;
    use crate::random::WeightRng;

    #[test]
    fn the_fused_forward_is_never_chosen_on_cpu_even_for_shapes_it_takes() {
        // Sizes inside every fused-kernel constraint (GDN heads of 128, k % 256, n % 16), so
        // only the device keeps the plain path.
        let v = serde_json::json!({
            "model_type": "qwen3_5_text", "vocab_size": 256, "hidden_size": 256,
            "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_key_value_heads": 1, "head_dim": 128,
            "layer_types": ["linear_attention", "full_attention"],
            "linear_num_key_heads": 1, "linear_num_value_heads": 2, "linear_key_head_dim": 128,
            "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
        });
        let cfg = HybridConfig::from_value(std::path::Path::new("fused-shape"), &v).unwrap();
        let m = Qwen35Model::random(
            cfg,
            &mut WeightRng::new(1),
            DType::BF16,
            &Device::Cpu,
            64,
            OpsMode::Fused,
        )
        .unwrap();
        assert!(!m.fast_kernels_available());
        assert!(!m.fast_kernels());
        assert!(!m.with_fast_kernels(true).fast_kernels());
    }

    /// `GatedDeltaNet::to_dtype` is the kernel checks' f32 reference (`gpu_check --hybrid`):
    /// an f32 layer's copy mixes bit-identically, and a bf16 layer's f32 copy holds exactly
    /// the bf16 weights and mixes within bf16 rounding of the bf16 layer.
    #[test]
    fn a_gdn_layers_f32_copy_holds_its_weights_and_mixes_as_it_does() {
        use crate::qwen3_5::delta_rule::Forest;
        use crate::qwen3_5::GatedDeltaNet;
        let v = serde_json::json!({
            "model_type": "qwen3_5_text", "vocab_size": 64, "hidden_size": 32,
            "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
            "num_key_value_heads": 1, "head_dim": 16, "layer_types": ["linear_attention"],
            "linear_num_key_heads": 1, "linear_num_value_heads": 2, "linear_key_head_dim": 8,
            "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
        });
        let cfg = HybridConfig::from_value(std::path::Path::new("gdn-copy"), &v).unwrap();
        let cpu = Device::Cpu;
        let chain: Vec<Option<usize>> = (0..5).map(|i: usize| i.checked_sub(1)).collect();
        let forest = Forest::new(&[chain.as_slice()], 4, &cpu).unwrap();
        let mix = |g: &GatedDeltaNet, proj: &candle_core::Tensor, dtype: DType| {
            let state = g.zero_state(dtype, &cpu).unwrap();
            let (y, _) = g.mix(proj, &forest, &[&state], &[false], true).unwrap();
            y.to_dtype(DType::F32).unwrap()
        };
        let g = GatedDeltaNet::random(&mut WeightRng::new(3), &cfg, DType::F32, &cpu).unwrap();
        // Projection width: q|k|v (the conv), z (Hv x dv), b and a (Hv each).
        let p = g.conv_dim() + 2 * 8 + 2 * 2;
        let proj = WeightRng::new(4)
            .normal(&[5, p], 0.0, 1.0, DType::BF16, &cpu)
            .unwrap();
        let proj32 = proj.to_dtype(DType::F32).unwrap();
        let same = g.to_dtype(DType::F32).unwrap();
        assert_eq!(
            mix(&g, &proj32, DType::F32).to_vec2::<f32>().unwrap(),
            mix(&same, &proj32, DType::F32).to_vec2::<f32>().unwrap()
        );
        let gb = GatedDeltaNet::random(&mut WeightRng::new(3), &cfg, DType::BF16, &cpu).unwrap();
        let g32 = gb.to_dtype(DType::F32).unwrap();
        assert_eq!(
            g32.in_proj.to_vec2::<f32>().unwrap(),
            gb.in_proj
                .to_dtype(DType::F32)
                .unwrap()
                .to_vec2::<f32>()
                .unwrap()
        );
        let (yb, y32) = (mix(&gb, &proj, DType::BF16), mix(&g32, &proj32, DType::F32));
        let err = (&yb - &y32).unwrap().abs().unwrap().max_all().unwrap();
        let scale = y32.abs().unwrap().max_all().unwrap();
        let rel = err.to_scalar::<f32>().unwrap() / scale.to_scalar::<f32>().unwrap();
        assert!(rel < 2e-2, "bf16 layer vs its f32 copy: {rel}");
    }
}
