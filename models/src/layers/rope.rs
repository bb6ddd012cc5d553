//! Rotary position tables (HF `Qwen3RotaryEmbedding` and `_compute_*_parameters`).
//!
//! The table is built once for every position the engine will use; each forward gathers the
//! rows of its tokens' absolute positions, so tokens of one batch may sit anywhere (tree nodes
//! share positions, sequences have different lengths).

use candle_core::{DType, Device, Result, Tensor};
use dflash_common::{Qwen3Config, RopeScaling};

#[derive(Debug, Clone)]
pub struct RotaryEmbedding {
    /// [max_positions, head_dim / 2], f32
    cos: Tensor,
    sin: Tensor,
    max_positions: usize,
}

fn yarn_inv_freq(
    head_dim: usize,
    base: f64,
    factor: f64,
    original_max: usize,
    beta_fast: f64,
    beta_slow: f64,
) -> Vec<f64> {
    let dim = head_dim as f64;
    let correction_dim = |rot: f64| {
        dim * (original_max as f64 / (rot * 2.0 * std::f64::consts::PI)).ln() / (2.0 * base.ln())
    };
    let low = correction_dim(beta_fast).floor().max(0.0);
    let high = correction_dim(beta_slow).ceil().min(dim - 1.0);
    let high = if low == high { high + 0.001 } else { high };
    (0..head_dim / 2)
        .map(|i| {
            let pos_freq = base.powf((2 * i) as f64 / dim);
            let extrapolation = 1.0 / pos_freq;
            let interpolation = 1.0 / (factor * pos_freq);
            let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
            let extrapolation_factor = 1.0 - ramp;
            interpolation * (1.0 - extrapolation_factor) + extrapolation * extrapolation_factor
        })
        .collect()
}

impl RotaryEmbedding {
    pub fn new(cfg: &Qwen3Config, max_positions: usize, device: &Device) -> Result<Self> {
        Self::from_params(
            cfg.head_dim,
            cfg.rope_theta,
            &cfg.rope_scaling,
            max_positions,
            device,
        )
    }

    /// A table for `d` rotated dims (the hybrid family rotates only the leading
    /// `partial_rotary_factor` share of each head, so `d` is less than the head dim there).
    pub fn from_params(
        d: usize,
        base: f64,
        scaling: &RopeScaling,
        max_positions: usize,
        device: &Device,
    ) -> Result<Self> {
        let plain: Vec<f64> = (0..d / 2)
            .map(|i| 1.0 / base.powf((2 * i) as f64 / d as f64))
            .collect();
        let (inv_freq, position_scale, attention_scale) = match scaling {
            RopeScaling::Default => (plain, 1.0, 1.0),
            RopeScaling::Linear { factor } => (plain, 1.0 / factor, 1.0),
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                attention_factor,
            } => {
                let mscale = attention_factor.unwrap_or(if *factor > 1.0 {
                    0.1 * factor.ln() + 1.0
                } else {
                    1.0
                });
                (
                    yarn_inv_freq(
                        d,
                        base,
                        *factor,
                        *original_max_position_embeddings,
                        *beta_fast,
                        *beta_slow,
                    ),
                    1.0,
                    mscale,
                )
            }
        };
        // HF keeps inv_freq and the angles in f32; doing the same keeps parity at 1e-6.
        let inv_freq: Vec<f32> = inv_freq.iter().map(|&f| f as f32).collect();
        let inv_freq = Tensor::from_vec(inv_freq, (1, d / 2), device)?;
        let positions: Vec<f32> = (0..max_positions)
            .map(|p| (p as f64 * position_scale) as f32)
            .collect();
        let positions = Tensor::from_vec(positions, (max_positions, 1), device)?;
        let freqs = positions.broadcast_mul(&inv_freq)?;
        let cos = (freqs.cos()? * attention_scale)?;
        let sin = (freqs.sin()? * attention_scale)?;
        Ok(Self {
            cos,
            sin,
            max_positions,
        })
    }

    /// The f32 `[max_positions, head_dim / 2]` cos and sin tables.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn tables(&self) -> (&Tensor, &Tensor) {
        (&self.cos, &self.sin)
    }

    pub fn max_positions(&self) -> usize {
        self.max_positions
    }

    /// cos/sin rows for `positions` (a u32 tensor of absolute positions): `[tokens, head_dim/2]`.
    pub fn gather(&self, positions: &Tensor) -> Result<(Tensor, Tensor)> {
        Ok((
            self.cos.index_select(positions, 0)?,
            self.sin.index_select(positions, 0)?,
        ))
    }

    /// Full-width tables `[positions, head_dim]` as HF returns them, for parity tests.
    pub fn full_tables(&self, n: usize) -> Result<(Tensor, Tensor)> {
        let c = self.cos.narrow(0, 0, n)?;
        let s = self.sin.narrow(0, 0, n)?;
        Ok((Tensor::cat(&[&c, &c], 1)?, Tensor::cat(&[&s, &s], 1)?))
    }

    pub fn dtype(&self) -> DType {
        self.cos.dtype()
    }
}
