//! The SwiGLU MLP (HF `Qwen3MLP`, `Qwen3MoeMLP`, `Qwen3_5MLP`): `down(silu(gate(x)) * up(x))`.
//! One type for the dense MLP of every family and for each expert of the sparse-MoE block
//! (`moe.rs`), so the three projections are written once.

use candle_core::{DType, Device, Result, Tensor};
use dflash_common::WeightFiles;

use crate::error::ModelResult;
use crate::layers::ops::{linear, silu_mul, OpsMode};
use crate::random::WeightRng;

#[derive(Debug, Clone)]
pub struct Mlp {
    gate_proj: Tensor,
    up_proj: Tensor,
    down_proj: Tensor,
}

impl Mlp {
    /// From `gate_proj` / `up_proj` `[I, H]` and `down_proj` `[H, I]` (MoE experts, a trainer's
    /// parameters).
    pub fn from_parts(gate_proj: Tensor, up_proj: Tensor, down_proj: Tensor) -> Self {
        Self {
            gate_proj,
            up_proj,
            down_proj,
        }
    }

    /// Loads `{p}.gate_proj.weight`, `{p}.up_proj.weight`, `{p}.down_proj.weight` for hidden
    /// size `h` and width `i`, checking their shapes.
    pub fn load(
        w: &WeightFiles,
        p: &str,
        h: usize,
        i: usize,
        dtype: DType,
        device: &Device,
    ) -> ModelResult<Self> {
        let t =
            |name: &str, shape: &[usize]| w.tensor(&format!("{p}.{name}"), shape, dtype, device);
        Ok(Self {
            gate_proj: t("gate_proj.weight", &[i, h])?,
            up_proj: t("up_proj.weight", &[i, h])?,
            down_proj: t("down_proj.weight", &[h, i])?,
        })
    }

    pub fn random(
        rng: &mut WeightRng,
        h: usize,
        i: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        Ok(Self {
            gate_proj: rng.linear(i, h, dtype, device)?,
            up_proj: rng.linear(i, h, dtype, device)?,
            down_proj: rng.linear(h, i, dtype, device)?,
        })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_with(x, OpsMode::Fused)
    }

    /// [`Self::forward`] with the SiLU-gate product as `mode` says (the trainer's layers pass
    /// `Differentiable`, which takes the fused trainable kernel on CUDA).
    pub fn forward_with(&self, x: &Tensor, mode: OpsMode) -> Result<Tensor> {
        let gate = linear(x, &self.gate_proj)?;
        let up = linear(x, &self.up_proj)?;
        linear(&silu_mul(&gate, &up, mode)?, &self.down_proj)
    }

    /// (gate, up, down) weights.
    pub fn weights(&self) -> (&Tensor, &Tensor, &Tensor) {
        (&self.gate_proj, &self.up_proj, &self.down_proj)
    }

    /// Re-points gate and up at views of `[gate; up]` stacked along the output dimension (one
    /// GEMM for the fused CUDA path; same values, same memory) and returns the stack.
    pub fn stack_gate_up(&mut self) -> Result<Tensor> {
        let gate_up = Tensor::cat(&[&self.gate_proj, &self.up_proj], 0)?;
        let i = self.gate_proj.dim(0)?;
        self.gate_proj = gate_up.narrow(0, 0, i)?;
        self.up_proj = gate_up.narrow(0, i, i)?;
        Ok(gate_up)
    }
}
