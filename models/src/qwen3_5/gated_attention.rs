//! Gated full attention (HF `Qwen3_5Attention` / `Qwen3NextAttention`).
//!
//! `q_proj` is twice the usual height: per head, `head_dim` query rows then `head_dim` gate rows.
//! q and k get a zero-centred RMSNorm per head, then RoPE on their leading `rotary_dim` dims
//! only; the attention output is multiplied by `sigmoid(gate)` before `o_proj`.

use candle_core::{DType, Device, Result, Tensor, D};
use dflash_common::{HybridConfig, WeightFiles};

use crate::error::ModelResult;
use crate::layers::decoder_layer::linear;
use crate::layers::ops::{rms_norm, rope, OpsMode};
use crate::random::WeightRng;

/// A zero-centred norm weight as the multiplier it stands for: `1 + w` (computed once, in f32
/// as HF does, then stored in the model dtype).
pub fn one_plus(w: &Tensor) -> Result<Tensor> {
    (w.to_dtype(DType::F32)? + 1.0)?.to_dtype(w.dtype())
}

#[derive(Debug, Clone)]
pub struct GatedAttention {
    q_proj: Tensor,
    k_proj: Tensor,
    v_proj: Tensor,
    o_proj: Tensor,
    q_norm: Tensor,
    k_norm: Tensor,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    rotary_dim: usize,
    eps: f64,
    mode: OpsMode,
    /// `[q_proj; k_proj; v_proj]` stacked for the fused CUDA path (the three re-pointed at
    /// views of it), once [`Self::fuse_projections`] ran.
    qkv: Option<Tensor>,
}

impl GatedAttention {
    pub fn load(
        w: &WeightFiles,
        p: &str,
        cfg: &HybridConfig,
        dtype: DType,
        device: &Device,
        mode: OpsMode,
    ) -> ModelResult<Self> {
        let (h, nh, nkv, d) = (
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        );
        let t =
            |name: &str, shape: &[usize]| w.tensor(&format!("{p}.{name}"), shape, dtype, device);
        Ok(Self {
            q_proj: t("q_proj.weight", &[2 * nh * d, h])?,
            k_proj: t("k_proj.weight", &[nkv * d, h])?,
            v_proj: t("v_proj.weight", &[nkv * d, h])?,
            o_proj: t("o_proj.weight", &[h, nh * d])?,
            q_norm: one_plus(&t("q_norm.weight", &[d])?)?,
            k_norm: one_plus(&t("k_norm.weight", &[d])?)?,
            num_heads: nh,
            num_kv_heads: nkv,
            head_dim: d,
            rotary_dim: cfg.rotary_dim,
            eps: cfg.rms_norm_eps,
            mode,
            qkv: None,
        })
    }

    pub fn random(
        rng: &mut WeightRng,
        cfg: &HybridConfig,
        dtype: DType,
        device: &Device,
        mode: OpsMode,
    ) -> Result<Self> {
        let (h, nh, nkv, d) = (
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        );
        Ok(Self {
            q_proj: rng.linear(2 * nh * d, h, dtype, device)?,
            k_proj: rng.linear(nkv * d, h, dtype, device)?,
            v_proj: rng.linear(nkv * d, h, dtype, device)?,
            o_proj: rng.linear(h, nh * d, dtype, device)?,
            q_norm: rng.norm(d, dtype, device)?,
            k_norm: rng.norm(d, dtype, device)?,
            num_heads: nh,
            num_kv_heads: nkv,
            head_dim: d,
            rotary_dim: cfg.rotary_dim,
            eps: cfg.rms_norm_eps,
            mode,
            qkv: None,
        })
    }

    /// RoPE on the leading `rotary_dim` dims of `x: [rows, heads, head_dim]`.
    fn partial_rope(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
        let r = self.rotary_dim;
        if r == self.head_dim {
            return rope(x, cos, sin, self.mode);
        }
        let rot = rope(
            &x.narrow(D::Minus1, 0, r)?.contiguous()?,
            cos,
            sin,
            self.mode,
        )?;
        Tensor::cat(
            &[&rot, &x.narrow(D::Minus1, r, self.head_dim - r)?],
            D::Minus1,
        )
    }

    /// Queries `[heads, rows, d]`, keys and values `[kv_heads, rows, d]`, and the output gate
    /// `[rows, heads * d]` of already-normed `x`.
    pub fn qkv_gate(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor, Tensor)> {
        let qg = linear(x, &self.q_proj)?;
        let k = linear(x, &self.k_proj)?;
        let v = linear(x, &self.v_proj)?;
        self.split_heads(&qg, &k, &v, cos, sin)
    }

    /// [`Self::qkv_gate`] from the projections already made: `qg` `[rows, 2 * heads * d]`,
    /// `k` and `v` `[rows, kv_heads * d]` (views of one fused product are fine).
    pub fn split_heads(
        &self,
        qg: &Tensor,
        k: &Tensor,
        v: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor, Tensor)> {
        let rows = qg.dim(0)?;
        let (nh, nkv, d) = (self.num_heads, self.num_kv_heads, self.head_dim);
        let qg = qg.reshape((rows, nh, 2 * d))?;
        let gate = qg.narrow(2, d, d)?.reshape((rows, nh * d))?;
        let q = rms_norm(
            &qg.narrow(2, 0, d)?.contiguous()?,
            &self.q_norm,
            self.eps,
            self.mode,
        )?;
        let q = self
            .partial_rope(&q, cos, sin)?
            .transpose(0, 1)?
            .contiguous()?;
        let k = k.reshape((rows, nkv, d))?;
        let k = rms_norm(&k.contiguous()?, &self.k_norm, self.eps, self.mode)?;
        let k = self
            .partial_rope(&k, cos, sin)?
            .transpose(0, 1)?
            .contiguous()?;
        let v = v.reshape((rows, nkv, d))?.transpose(0, 1)?.contiguous()?;
        Ok((q, k, v, gate))
    }

    /// Stacks q/k/v into one tensor for the fused path and re-points the three at views of
    /// it (same values, same memory); inference only.
    pub fn fuse_projections(&mut self) -> Result<()> {
        if self.qkv.is_some() {
            return Ok(());
        }
        let qkv = Tensor::cat(&[&self.q_proj, &self.k_proj, &self.v_proj], 0)?;
        let (nq, nk) = (self.q_proj.dim(0)?, self.k_proj.dim(0)?);
        self.q_proj = qkv.narrow(0, 0, nq)?;
        self.k_proj = qkv.narrow(0, nq, nk)?;
        self.v_proj = qkv.narrow(0, nq + nk, nk)?;
        self.qkv = Some(qkv);
        Ok(())
    }

    /// The stacked `[q_proj; k_proj; v_proj]` (after [`Self::fuse_projections`]).
    pub fn fused_qkv(&self) -> Option<&Tensor> {
        self.qkv.as_ref()
    }

    pub fn o_proj(&self) -> &Tensor {
        &self.o_proj
    }

    /// `(q rows incl. the gate, k rows)` of the stacked projection.
    /// `(query heads, KV heads)`.
    pub fn heads(&self) -> (usize, usize) {
        (self.num_heads, self.num_kv_heads)
    }

    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    pub fn qkv_widths(&self) -> (usize, usize) {
        (
            2 * self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        )
    }

    /// The fused CUDA form of [`Self::split_heads`] + cache write + attention + [`Self::gated`]
    /// for a causal chain (`cuda/gattn.cu`): the o_proj input of the rows of `qkv` (the
    /// stacked projection), their K/V written to rows `cache_len ..` of the cache buffers
    /// `kc`/`vc` (`[kv_heads, capacity, head_dim]`). None where the kernels do not take the
    /// head size (the caller keeps the plain ops). `keys_per_split`: None for the kernels'
    /// plan (the forward), else forced (the checks' timings).
    #[cfg(feature = "cuda")]
    pub fn attend_chain_fused(
        &self,
        qkv: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        (kc, vc): (&Tensor, &Tensor),
        cache_len: usize,
        keys_per_split: Option<usize>,
    ) -> Result<Option<Tensor>> {
        self.attend_chain_fused_graph(qkv, cos, sin, (kc, vc), cache_len, keys_per_split, None)
    }

    /// [`Self::attend_chain_fused`] that reads the committed length from a device tensor
    /// (`graph`: a CUDA graph's replays), over a split fixed for the whole cache.
    #[cfg(feature = "cuda")]
    #[allow(clippy::too_many_arguments)]
    pub fn attend_chain_fused_graph(
        &self,
        qkv: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        kv: (&Tensor, &Tensor),
        cache_len: usize,
        keys_per_split: Option<usize>,
        graph: Option<crate::cuda::GraphSplit<'_>>,
    ) -> Result<Option<Tensor>> {
        self.attend_fused(qkv, (cos, sin), kv, cache_len, keys_per_split, graph, None)
    }

    /// [`Self::attend_chain_fused`] for a verify tree of at most 64 nodes: each new row sees
    /// the committed rows, its ancestors and itself (`bits`: i64 `[t]`, `cuda::tree_bits`).
    #[cfg(feature = "cuda")]
    pub fn attend_tree_fused(
        &self,
        qkv: &Tensor,
        (cos, sin): (&Tensor, &Tensor),
        kv: (&Tensor, &Tensor),
        cache_len: usize,
        bits: &Tensor,
    ) -> Result<Option<Tensor>> {
        self.attend_fused(qkv, (cos, sin), kv, cache_len, None, None, Some(bits))
    }

    #[cfg(feature = "cuda")]
    #[allow(clippy::too_many_arguments)]
    fn attend_fused(
        &self,
        qkv: &Tensor,
        (cos, sin): (&Tensor, &Tensor),
        (kc, vc): (&Tensor, &Tensor),
        cache_len: usize,
        keys_per_split: Option<usize>,
        graph: Option<crate::cuda::GraphSplit<'_>>,
        tree: Option<&Tensor>,
    ) -> Result<Option<Tensor>> {
        if self.head_dim != crate::cuda::GATTN_HEAD_DIM {
            return Ok(None);
        }
        crate::cuda::gated_attention_chain_split(
            &crate::cuda::GattnRows {
                qkv,
                q_norm: &self.q_norm,
                k_norm: &self.k_norm,
                cos,
                sin,
                kc,
                vc,
                cache_len,
                graph,
                tree,
                heads: (self.num_heads, self.num_kv_heads),
                rotary_dim: self.rotary_dim,
                eps: self.eps,
            },
            keys_per_split,
        )
        .map(Some)
    }

    /// `attn * sigmoid(gate)`, the input of `o_proj`.
    pub fn gated(&self, attn: &Tensor, gate: &Tensor) -> Result<Tensor> {
        attn * candle_nn::ops::sigmoid(gate)?
    }

    /// `o_proj(attn * sigmoid(gate))`.
    pub fn out(&self, attn: &Tensor, gate: &Tensor) -> Result<Tensor> {
        linear(&self.gated(attn, gate)?, &self.o_proj)
    }
}
