//! The built-in multi-token-prediction head of Qwen3.5 / Qwen3.6 / Qwen3-Next ("stock MTP",
//! SGLang `--speculative-algorithm NEXTN`, vLLM `qwen3_next_mtp`), as SGLang and vLLM run it:
//!
//! `x = fc([pre_fc_norm_embedding(embed(token_{p+1})) ; pre_fc_norm_hidden(h_p)])`, one gated
//! full-attention decoder layer over the head's own K/V cache, `mtp.norm`, the target's LM head.
//! `h_p` is the target's final-normed hidden state at position p; the pair is placed at rotary
//! position p (vLLM feeds the target positions with the token ids shifted by one). Further
//! drafts feed back the head's own normed output. Every norm is zero-centred (`1 + w`); the
//! head shares the target's embeddings and LM head (`mtp_use_dedicated_embeddings: false`).
//!
//! There is no transformers reference for this head (transformers drops `mtp.*` on load), so
//! only the losslessness of drafting with it is tested here, not its numerics.

use candle_core::{DType, Device, Tensor};
use dflash_common::{HybridConfig, WeightFiles};

use crate::cache::SequenceCache;
use crate::error::{ModelError, ModelResult};
use crate::layers::attention::{attend, AttnPattern};
use crate::layers::decoder_layer::linear;
use crate::layers::moe::FeedForward;
use crate::layers::ops::{rms_norm, OpsMode};
use crate::qwen3_5::gated_attention::{one_plus, GatedAttention};
use crate::qwen3_5::Qwen35Model;
use crate::random::WeightRng;

#[derive(Debug, Clone)]
pub struct MtpHead {
    norm_embedding: Tensor,
    norm_hidden: Tensor,
    fc: Tensor,
    input_norm: Tensor,
    post_norm: Tensor,
    attn: GatedAttention,
    mlp: FeedForward,
    norm: Tensor,
    eps: f64,
    mode: OpsMode,
    num_kv_heads: usize,
    head_dim: usize,
}

impl MtpHead {
    /// Loads `mtp.*` from the target's checkpoint (only the first MTP layer is used, as the
    /// engines do for `num_speculative_steps` beyond the layer count).
    pub fn load(
        w: &WeightFiles,
        cfg: &HybridConfig,
        dtype: DType,
        device: &Device,
        mode: OpsMode,
    ) -> ModelResult<Self> {
        if !w.contains("mtp.fc.weight") {
            return Err(ModelError::Unsupported(format!(
                "{}: the checkpoint has no built-in MTP head (no `mtp.fc.weight`; config.json mtp_num_hidden_layers = {}); use a DFlash drafter or plain decoding",
                w.dir().display(),
                cfg.mtp_num_hidden_layers
            )));
        }
        let h = cfg.hidden_size;
        let t =
            |name: &str, shape: &[usize]| w.tensor(&format!("mtp.{name}"), shape, dtype, device);
        let norm = |name: &str| -> ModelResult<Tensor> { Ok(one_plus(&t(name, &[h])?)?) };
        Ok(Self {
            norm_embedding: norm("pre_fc_norm_embedding.weight")?,
            norm_hidden: norm("pre_fc_norm_hidden.weight")?,
            fc: t("fc.weight", &[h, 2 * h])?,
            input_norm: norm("layers.0.input_layernorm.weight")?,
            post_norm: norm("layers.0.post_attention_layernorm.weight")?,
            attn: GatedAttention::load(w, "mtp.layers.0.self_attn", cfg, dtype, device, mode)?,
            // MoE checkpoints ship a sparse MTP layer; follow the weights.
            mlp: FeedForward::load(
                w,
                "mtp.layers.0.mlp",
                h,
                cfg.intermediate_size,
                cfg.moe
                    .as_ref()
                    .filter(|_| w.contains("mtp.layers.0.mlp.gate.weight")),
                dtype,
                device,
            )?,
            norm: norm("norm.weight")?,
            eps: cfg.rms_norm_eps,
            mode,
            num_kv_heads: cfg.num_key_value_heads,
            head_dim: cfg.head_dim,
        })
    }

    pub fn random(
        rng: &mut WeightRng,
        cfg: &HybridConfig,
        dtype: DType,
        device: &Device,
        mode: OpsMode,
    ) -> ModelResult<Self> {
        let h = cfg.hidden_size;
        Ok(Self {
            norm_embedding: rng.norm(h, dtype, device)?,
            norm_hidden: rng.norm(h, dtype, device)?,
            fc: rng.linear(h, 2 * h, dtype, device)?,
            input_norm: rng.norm(h, dtype, device)?,
            post_norm: rng.norm(h, dtype, device)?,
            attn: GatedAttention::random(rng, cfg, dtype, device, mode)?,
            mlp: FeedForward::random(
                rng,
                h,
                cfg.intermediate_size,
                cfg.moe.as_ref(),
                dtype,
                device,
            )?,
            norm: rng.norm(h, dtype, device)?,
            eps: cfg.rms_norm_eps,
            mode,
            num_kv_heads: cfg.num_key_value_heads,
            head_dim: cfg.head_dim,
        })
    }

    /// The head's own K/V cache (one attention layer).
    /// Bytes of K/V one cached row of [`MtpHead::new_cache`] takes (its one attention layer).
    pub fn kv_bytes_per_row(&self, dtype: DType) -> usize {
        2 * self.num_kv_heads * self.head_dim * dtype.size_in_bytes()
    }

    pub fn new_cache(
        &self,
        capacity: usize,
        dtype: DType,
        device: &Device,
    ) -> ModelResult<SequenceCache> {
        Ok(SequenceCache::new_attention(
            1,
            self.num_kv_heads,
            self.head_dim,
            capacity,
            dtype,
            device,
        )?)
    }

    /// Runs `tokens` (token p+1 of each pair) with `hidden` (`[n, H]`, the normed hidden state
    /// of position p) at rotary positions `positions` (= p), appending to `cache`. Returns the
    /// head's normed output `[n, H]` (fed back for the next draft) and its logits `[n, V]`.
    pub fn forward(
        &self,
        target: &Qwen35Model,
        cache: &mut SequenceCache,
        tokens: &[u32],
        hidden: &Tensor,
        positions: &[u32],
    ) -> ModelResult<(Tensor, Tensor)> {
        let n = tokens.len();
        cache.check_room(n)?;
        let e = rms_norm(
            &target.embed(tokens)?,
            &self.norm_embedding,
            self.eps,
            self.mode,
        )?;
        let h = rms_norm(hidden, &self.norm_hidden, self.eps, self.mode)?;
        let x = linear(&Tensor::cat(&[&e, &h], 1)?, &self.fc)?;
        let pos = Tensor::new(positions, target.device())?;
        let (cos, sin) = target.rope().gather(&pos)?;
        let (cos, sin) = (cos.to_dtype(x.dtype())?, sin.to_dtype(x.dtype())?);
        let hn = rms_norm(&x, &self.input_norm, self.eps, self.mode)?;
        let (q, k, v, gate) = self.attn.qkv_gate(&hn, &cos, &sin)?;
        let len = cache.len();
        cache.write_kv(0, len, &k, &v)?;
        let (kc, vc) = cache.view_kv(0, len + n)?;
        let mask = AttnPattern::Causal.mask(len, n, target.device())?;
        let a = attend(&q, &kc, &vc, mask.as_ref(), self.mode)?;
        let x = (x + self.attn.out(&a, &gate)?)?;
        let x = (&x
            + self
                .mlp
                .forward(&rms_norm(&x, &self.post_norm, self.eps, self.mode)?)?)?;
        cache.advance(n);
        let out = rms_norm(&x, &self.norm, self.eps, self.mode)?;
        let logits = target.lm_head(&out)?;
        Ok((out, logits))
    }
}
