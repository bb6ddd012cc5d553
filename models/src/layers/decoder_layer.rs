//! The Qwen3 decoder layer (HF `modeling_qwen3.py`: `Qwen3Attention`, `Qwen3MLP`,
//! `Qwen3DecoderLayer`; `modeling_qwen3_moe.py`'s `Qwen3MoeDecoderLayer` is the same attention
//! with a dense or sparse-MoE MLP per layer), shared by the dense and MoE targets and the DFlash
//! drafter, whose layers have the same weights and layout (z-lab `Qwen3DFlashDecoderLayer`,
//! always dense). Only where K/V come from and which pattern the queries use differ; that lives
//! with each model.

use candle_core::{DType, Device, Result, Tensor};
use dflash_common::{Qwen3Config, WeightFiles};

use crate::error::ModelResult;
use crate::layers::mlp::Mlp;
use crate::layers::moe::{FeedForward, StackedExperts};
pub use crate::layers::ops::linear;
use crate::layers::ops::{qk_norm_rope, rms_norm, rope, OpsMode};
use crate::random::WeightRng;

#[derive(Debug, Clone)]
pub struct DecoderLayer {
    input_layernorm: Tensor,
    post_attention_layernorm: Tensor,
    q_proj: Tensor,
    k_proj: Tensor,
    v_proj: Tensor,
    o_proj: Tensor,
    q_norm: Tensor,
    k_norm: Tensor,
    /// Dense SwiGLU, or the sparse-MoE block where `cfg.is_sparse(layer)`.
    mlp: FeedForward,
    eps: f64,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    mode: OpsMode,
    /// Concatenated projections for the fused CUDA path (see [`Self::fuse_projections`]).
    fused: Option<FusedWeights>,
}

/// `[q; k; v]` and `[gate; up]` stacked along the output dimension: one GEMM each. The
/// layer's own q/k/v/gate/up tensors become views into these, so no weight is stored twice.
/// A sparse-MoE layer has its experts stacked instead (`experts`, no `gate_up`).
#[derive(Debug, Clone)]
pub struct FusedWeights {
    pub qkv: Tensor,
    /// The dense MLP's `[gate; up]` (None for a sparse-MoE layer).
    pub gate_up: Option<Tensor>,
    /// The sparse-MoE block stacked for the device kernels (None for a dense layer).
    pub experts: Option<StackedExperts>,
}

impl DecoderLayer {
    /// Loads `{prefix}.self_attn.*`, `{prefix}.mlp.*` and the two norms of layer `layer`,
    /// checking every shape; the MLP is sparse where `cfg` makes that layer sparse.
    pub fn load(
        w: &WeightFiles,
        prefix: &str,
        layer: usize,
        cfg: &Qwen3Config,
        dtype: DType,
        device: &Device,
        mode: OpsMode,
    ) -> ModelResult<Self> {
        let h = cfg.hidden_size;
        let (nh, nkv, d, i) = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            cfg.intermediate_size,
        );
        let t = |name: &str, shape: &[usize]| {
            w.tensor(&format!("{prefix}.{name}"), shape, dtype, device)
        };
        Ok(Self {
            input_layernorm: t("input_layernorm.weight", &[h])?,
            post_attention_layernorm: t("post_attention_layernorm.weight", &[h])?,
            q_proj: t("self_attn.q_proj.weight", &[nh * d, h])?,
            k_proj: t("self_attn.k_proj.weight", &[nkv * d, h])?,
            v_proj: t("self_attn.v_proj.weight", &[nkv * d, h])?,
            o_proj: t("self_attn.o_proj.weight", &[h, nh * d])?,
            q_norm: t("self_attn.q_norm.weight", &[d])?,
            k_norm: t("self_attn.k_norm.weight", &[d])?,
            mlp: FeedForward::load(
                w,
                &format!("{prefix}.mlp"),
                h,
                i,
                cfg.layer_moe(layer),
                dtype,
                device,
            )?,
            eps: cfg.rms_norm_eps,
            num_heads: nh,
            num_kv_heads: nkv,
            head_dim: d,
            mode,
            fused: None,
        })
    }

    /// Layer `layer` with seeded random weights of the config's shape.
    pub fn random(
        rng: &mut WeightRng,
        cfg: &Qwen3Config,
        layer: usize,
        dtype: DType,
        device: &Device,
        mode: OpsMode,
    ) -> Result<Self> {
        let h = cfg.hidden_size;
        let (nh, nkv, d, i) = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            cfg.intermediate_size,
        );
        Ok(Self {
            input_layernorm: rng.norm(h, dtype, device)?,
            post_attention_layernorm: rng.norm(h, dtype, device)?,
            q_proj: rng.linear(nh * d, h, dtype, device)?,
            k_proj: rng.linear(nkv * d, h, dtype, device)?,
            v_proj: rng.linear(nkv * d, h, dtype, device)?,
            o_proj: rng.linear(h, nh * d, dtype, device)?,
            q_norm: rng.norm(d, dtype, device)?,
            k_norm: rng.norm(d, dtype, device)?,
            mlp: FeedForward::random(rng, h, i, cfg.layer_moe(layer), dtype, device)?,
            eps: cfg.rms_norm_eps,
            num_heads: nh,
            num_kv_heads: nkv,
            head_dim: d,
            mode,
            fused: None,
        })
    }

    /// A dense layer from already-materialised tensors (a trainer's parameters, for instance). `get`
    /// receives each tensor's name relative to the layer prefix (see [`Self::TENSOR_NAMES`]) and
    /// the shape `cfg` implies, and returns the tensor or an error naming it.
    pub fn from_tensors(
        cfg: &Qwen3Config,
        mode: OpsMode,
        mut get: impl FnMut(&str, &[usize]) -> ModelResult<Tensor>,
    ) -> ModelResult<Self> {
        let h = cfg.hidden_size;
        let (nh, nkv, d, i) = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            cfg.intermediate_size,
        );
        Ok(Self {
            input_layernorm: get("input_layernorm.weight", &[h])?,
            post_attention_layernorm: get("post_attention_layernorm.weight", &[h])?,
            q_proj: get("self_attn.q_proj.weight", &[nh * d, h])?,
            k_proj: get("self_attn.k_proj.weight", &[nkv * d, h])?,
            v_proj: get("self_attn.v_proj.weight", &[nkv * d, h])?,
            o_proj: get("self_attn.o_proj.weight", &[h, nh * d])?,
            q_norm: get("self_attn.q_norm.weight", &[d])?,
            k_norm: get("self_attn.k_norm.weight", &[d])?,
            mlp: FeedForward::Dense(Mlp::from_parts(
                get("mlp.gate_proj.weight", &[i, h])?,
                get("mlp.up_proj.weight", &[i, h])?,
                get("mlp.down_proj.weight", &[h, i])?,
            )),
            eps: cfg.rms_norm_eps,
            num_heads: nh,
            num_kv_heads: nkv,
            head_dim: d,
            mode,
            fused: None,
        })
    }

    /// The checkpoint names of a dense layer's tensors, relative to its prefix (HF / z-lab
    /// naming; a drafter's layers).
    pub const TENSOR_NAMES: [&'static str; 11] = [
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "self_attn.q_norm.weight",
        "self_attn.k_norm.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
    ];

    /// The shape `cfg` implies for each of [`Self::TENSOR_NAMES`], in the same order.
    pub fn tensor_shapes(cfg: &Qwen3Config) -> [Vec<usize>; 11] {
        let h = cfg.hidden_size;
        let (nh, nkv, d, i) = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            cfg.intermediate_size,
        );
        [
            vec![h],
            vec![h],
            vec![nh * d, h],
            vec![nkv * d, h],
            vec![nkv * d, h],
            vec![h, nh * d],
            vec![d],
            vec![d],
            vec![i, h],
            vec![i, h],
            vec![h, i],
        ]
    }

    /// This layer's tensors with their checkpoint names relative to its prefix; for a dense
    /// layer, [`Self::TENSOR_NAMES`] in order.
    /// The tensors the explicit training engine reads (`dflash/train_explicit.rs`), as
    /// `(attention half, MLP half)`; None for a sparse-MoE layer (drafters are dense).
    pub(crate) fn train_weights(
        &self,
    ) -> Option<(
        crate::training::explicit_attn::AttnWeights<'_>,
        crate::training::explicit_mlp::MlpWeights<'_>,
    )> {
        let (gate, up, down) = self.mlp.dense()?.weights();
        Some((
            crate::training::explicit_attn::AttnWeights {
                input_norm: &self.input_layernorm,
                q: &self.q_proj,
                k: &self.k_proj,
                v: &self.v_proj,
                o: &self.o_proj,
                q_norm: &self.q_norm,
                k_norm: &self.k_norm,
                heads: self.num_heads,
                kv_heads: self.num_kv_heads,
                eps: self.eps,
            },
            crate::training::explicit_mlp::MlpWeights {
                norm: &self.post_attention_layernorm,
                gate,
                up,
                down,
                eps: self.eps,
            },
        ))
    }

    pub fn named_tensors(&self) -> Vec<(String, &Tensor)> {
        let mut out: Vec<(String, &Tensor)> = Self::TENSOR_NAMES[..8]
            .iter()
            .map(|n| n.to_string())
            .zip([
                &self.input_layernorm,
                &self.post_attention_layernorm,
                &self.q_proj,
                &self.k_proj,
                &self.v_proj,
                &self.o_proj,
                &self.q_norm,
                &self.k_norm,
            ])
            .collect();
        out.extend(
            self.mlp
                .named_tensors()
                .into_iter()
                .map(|(n, t)| (format!("mlp.{n}"), t)),
        );
        out
    }

    pub fn input_norm(&self, x: &Tensor) -> Result<Tensor> {
        rms_norm(x, &self.input_layernorm, self.eps, self.mode)
    }

    /// Per-head projection, per-head RMSNorm, then RoPE: `[rows, hidden]` -> `[heads, rows, d]`.
    /// `mode` picks the q/k norm + RoPE's form (see [`Self::qkv_with`]); the rest follows
    /// the layer's own mode.
    fn project(
        &self,
        x: &Tensor,
        w: &Tensor,
        norm: Option<&Tensor>,
        heads: usize,
        rot: Option<(&Tensor, &Tensor)>,
        mode: OpsMode,
    ) -> Result<Tensor> {
        let rows = x.dim(0)?;
        let mut y = linear(x, w)?.reshape((rows, heads, self.head_dim))?;
        if let (Some(n), Some((cos, sin))) = (norm, rot) {
            return qk_norm_rope(&y, n, cos, sin, self.eps, mode);
        }
        if let Some(n) = norm {
            y = rms_norm(&y, n, self.eps, self.mode)?;
        }
        if let Some((cos, sin)) = rot {
            y = rope(&y, cos, sin, self.mode)?;
        }
        y.transpose(0, 1)?.contiguous()
    }

    /// Queries, keys and values of already-normed input `x: [rows, hidden]` at the positions
    /// whose rotary rows are `cos`, `sin`: `[heads, rows, d]`, `[kv_heads, rows, d]` twice.
    pub fn qkv(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        self.qkv_with(x, cos, sin, self.mode)
    }

    /// [`Self::qkv`] with the q/k norm + RoPE as `mode` says: the trainer's frozen target
    /// passes `Differentiable` for the one fused kernel on CUDA (norm, RoPE and the head-major
    /// write; `layers::train_ops::qk_norm_rope`) in place of candle's norm, rope and transpose.
    pub fn qkv_with(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        mode: OpsMode,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let q = self.project(
            x,
            &self.q_proj,
            Some(&self.q_norm),
            self.num_heads,
            Some((cos, sin)),
            mode,
        )?;
        let (k, v) = self.kv_with(x, cos, sin, mode)?;
        Ok((q, k, v))
    }

    /// Keys and values only (the DFlash context path: no query, no input norm).
    pub fn kv(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<(Tensor, Tensor)> {
        self.kv_with(x, cos, sin, self.mode)
    }

    /// [`Self::kv`] with the k norm + RoPE as `mode` says (see [`Self::qkv_with`]).
    fn kv_with(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        mode: OpsMode,
    ) -> Result<(Tensor, Tensor)> {
        let k = self.project(
            x,
            &self.k_proj,
            Some(&self.k_norm),
            self.num_kv_heads,
            Some((cos, sin)),
            mode,
        )?;
        let v = self.project(x, &self.v_proj, None, self.num_kv_heads, None, mode)?;
        Ok((k, v))
    }

    /// `residual + o_proj(attn)`, then the MLP block with its own residual.
    pub fn finish(&self, residual: &Tensor, attn: &Tensor) -> Result<Tensor> {
        self.finish_with(residual, attn, self.mode)
    }

    /// [`Self::finish`] with a dense MLP's SiLU-gate product as `mlp_mode` says: the
    /// trainer's frozen target passes `Differentiable` for the one fused kernel on CUDA
    /// (`layers::train_ops::silu_mul`, f32 inside) in place of candle's silu and multiply.
    pub fn finish_with(
        &self,
        residual: &Tensor,
        attn: &Tensor,
        mlp_mode: OpsMode,
    ) -> Result<Tensor> {
        let x = (residual + linear(attn, &self.o_proj)?)?;
        let h = rms_norm(&x, &self.post_attention_layernorm, self.eps, self.mode)?;
        let mlp = match &self.mlp {
            FeedForward::Dense(m) => m.forward_with(&h, mlp_mode)?,
            sparse => sparse.forward(&h)?,
        };
        x + mlp
    }

    /// The MLP block (dense or sparse-MoE), for the plain forward of a fused stack's rows that
    /// the device MoE kernels leave to it (prefills).
    pub fn mlp(&self) -> &FeedForward {
        &self.mlp
    }

    /// Whether the MLP is the sparse-MoE block.
    pub fn is_sparse(&self) -> bool {
        matches!(self.mlp, FeedForward::Sparse(_))
    }

    pub fn mode(&self) -> OpsMode {
        self.mode
    }

    /// Stacks q/k/v and gate/up into [`FusedWeights`] and re-points the separate tensors at
    /// views of them (same values, same memory). Inference only: a trainer's parameters must
    /// stay separate variables. A sparse-MoE layer gets its experts stacked instead
    /// ([`crate::layers::moe::SparseMoe::stack_experts`]); one with a shared expert stays
    /// unfused ([`Self::fused`] None), so a model holding one keeps the plain path.
    pub fn fuse_projections(&mut self) -> Result<()> {
        if self.fused.is_some() {
            return Ok(());
        }
        let (gate_up, experts) = match &mut self.mlp {
            FeedForward::Dense(mlp) => (Some(mlp.stack_gate_up()?), None),
            // The dense-attention stack runs no shared expert (`qwen3_moe` has none).
            FeedForward::Sparse(moe) if moe.has_shared_expert() => return Ok(()),
            FeedForward::Sparse(moe) => match moe.stack_experts()? {
                Some(stacked) => (None, Some(stacked)),
                None => return Ok(()),
            },
        };
        let qkv = Tensor::cat(&[&self.q_proj, &self.k_proj, &self.v_proj], 0)?;
        let (nq, nk) = (self.q_proj.dim(0)?, self.k_proj.dim(0)?);
        self.q_proj = qkv.narrow(0, 0, nq)?;
        self.k_proj = qkv.narrow(0, nq, nk)?;
        self.v_proj = qkv.narrow(0, nq + nk, nk)?;
        self.fused = Some(FusedWeights {
            qkv,
            gate_up,
            experts,
        });
        Ok(())
    }

    pub fn fused(&self) -> Option<&FusedWeights> {
        self.fused.as_ref()
    }

    /// (input norm, post-attention norm, q norm, k norm) weights.
    pub fn norm_weights(&self) -> (&Tensor, &Tensor, &Tensor, &Tensor) {
        (
            &self.input_layernorm,
            &self.post_attention_layernorm,
            &self.q_norm,
            &self.k_norm,
        )
    }

    pub fn o_proj(&self) -> &Tensor {
        &self.o_proj
    }

    /// The dense MLP's down projection (None for a sparse-MoE layer).
    pub fn down_proj(&self) -> Option<&Tensor> {
        self.mlp.dense().map(|m| m.weights().2)
    }

    pub fn eps(&self) -> f64 {
        self.eps
    }

    /// (query heads, kv heads, head dim).
    pub fn heads(&self) -> (usize, usize, usize) {
        (self.num_heads, self.num_kv_heads, self.head_dim)
    }
}
