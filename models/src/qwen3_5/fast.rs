//! When [`Qwen35Model`] takes its fused CUDA forward (`cuda.rs`): the availability test, the
//! stacked weights it reads, and the switch the benches flip to compare it with the plain path.

#[cfg(feature = "cuda")]
use candle_core::{DType, Tensor};

#[cfg(feature = "cuda")]
use crate::error::ModelError;
use crate::error::ModelResult;
use crate::layers::moe::FeedForward;
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

impl HybridLayer {
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
    /// MLPs, GDN heads of 128 with a conv of at most 4 taps, and every projection in the
    /// skinny GEMMs' shapes (`k % 256 == 0`, `n % 16 == 0`; true for the published shapes).
    pub fn fast_kernels_available(&self) -> bool {
        #[cfg(feature = "cuda")]
        {
            let c = &self.cfg;
            let fits = |n: usize, k: usize| n.is_multiple_of(16) && k.is_multiple_of(256);
            let h = c.hidden_size;
            let (nh, nkv, d) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
            let hv_dv = c.linear_num_value_heads * c.linear_value_head_dim;
            self.device.is_cuda()
                && self.dtype == DType::BF16
                && self.mode == OpsMode::Fused
                && c.moe.is_none()
                && c.linear_key_head_dim == crate::cuda::GDN_HEAD_DIM
                && c.linear_value_head_dim == crate::cuda::GDN_HEAD_DIM
                && c.linear_conv_kernel_dim <= crate::cuda::GDN_MAX_CONV
                && fits(c.conv_dim() + hv_dv + 2 * c.linear_num_value_heads, h)
                && fits(h, hv_dv)
                && fits(2 * nh * d + 2 * nkv * d, h)
                && fits(h, nh * d)
                && fits(c.intermediate_size, h)
                && fits(h, c.intermediate_size)
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
                if let FeedForward::Dense(m) = &mut l.mlp {
                    l.gate_up = Some(m.stack_gate_up()?);
                }
            }
            self.fast = true;
        }
        Ok(self)
    }

    /// Turns the fused forward on or off (off: the plain candle path, for comparisons); no
    /// effect where it is not available.
    pub fn with_fast_kernels(mut self, on: bool) -> Self {
        self.fast = on
            && self.fast_kernels_available()
            && self.layers.iter().all(|l| {
                l.gate_up.is_some()
                    && match &l.mixer {
                        Mixer::Full(a) => a.fused_qkv().is_some(),
                        Mixer::Linear(_) => true,
                    }
            });
        self
    }

    /// Chooses the fused GDN mixers (the benches compare them; the default is what measured
    /// fastest).
    pub fn with_gdn_paths(mut self, paths: GdnPaths) -> Self {
        self.gdn_paths = paths;
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
}
