//! `config.json` parsing for the hybrid family: Qwen3.5 / Qwen3.6 (`qwen3_5`, nested
//! `text_config` of type `qwen3_5_text`, or the flat text config) and Qwen3-Next (`qwen3_next`).
//!
//! Three of every four layers are Gated DeltaNet (`linear_attention`), the rest gated full
//! attention. The layer pattern comes from `layer_types` or, when absent, from
//! `full_attention_interval` (HF `Qwen3_5TextConfig.__post_init__`: layer i is full attention iff
//! `(i + 1) % interval == 0`); when a file carries both they must agree, because a mismatch means
//! the weights and the config disagree about which layers hold recurrent state.

use std::path::Path;

use serde::Deserialize;
use serde_json::Value;

use crate::config::{field_err, parse_eos, parse_rope, RopeScaling};
use crate::config_moe::{check_block, sparse_layer_pattern, MoeConfig};
use crate::error::ConfigError;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HybridLayerType {
    /// Gated DeltaNet token mixer with a recurrent state.
    LinearAttention,
    /// Gated full attention with a K/V cache.
    FullAttention,
}

/// The fields of a hybrid text config that the forward pass depends on.
#[derive(Debug, Clone, PartialEq)]
pub struct HybridConfig {
    /// `qwen3_5_text` or `qwen3_next` (the text model's type, after unwrapping `text_config`).
    pub model_type: String,
    /// True when the file was the multimodal wrapper (`qwen3_5` with `text_config`): the text
    /// weights then sit under `model.language_model.`.
    pub nested: bool,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: RopeScaling,
    /// `int(head_dim * partial_rotary_factor)`: the leading dims of each q/k head that rotate.
    pub rotary_dim: usize,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    pub eos_token_ids: Vec<u32>,
    pub bos_token_id: Option<u32>,
    pub layer_types: Vec<HybridLayerType>,
    pub linear_conv_kernel_dim: usize,
    pub linear_key_head_dim: usize,
    pub linear_value_head_dim: usize,
    pub linear_num_key_heads: usize,
    pub linear_num_value_heads: usize,
    /// Built-in MTP layers shipped under `mtp.` (0 when the checkpoint has none).
    pub mtp_num_hidden_layers: usize,
    /// The sparse-MoE block's shape when any layer is sparse (Qwen3.5/3.6-MoE, Qwen3-Next).
    pub moe: Option<MoeConfig>,
    /// Per layer: true where the MLP is the sparse-MoE block (all false for dense models).
    pub sparse_layers: Vec<bool>,
}

#[derive(Deserialize)]
struct RawHybrid {
    model_type: Option<String>,
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: Option<usize>,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    #[serde(default = "default_eps")]
    rms_norm_eps: f64,
    rope_theta: Option<f64>,
    rope_scaling: Option<Value>,
    rope_parameters: Option<Value>,
    partial_rotary_factor: Option<f64>,
    #[serde(default = "default_max_pos")]
    max_position_embeddings: usize,
    tie_word_embeddings: Option<bool>,
    #[serde(default)]
    attention_bias: bool,
    hidden_act: Option<String>,
    eos_token_id: Option<Value>,
    bos_token_id: Option<u32>,
    layer_types: Option<Vec<String>>,
    full_attention_interval: Option<usize>,
    #[serde(default = "default_conv")]
    linear_conv_kernel_dim: usize,
    #[serde(default = "default_linear_dim")]
    linear_key_head_dim: usize,
    #[serde(default = "default_linear_dim")]
    linear_value_head_dim: usize,
    #[serde(default = "default_linear_k_heads")]
    linear_num_key_heads: usize,
    #[serde(default = "default_linear_v_heads")]
    linear_num_value_heads: usize,
    attn_output_gate: Option<bool>,
    #[serde(default)]
    mtp_num_hidden_layers: usize,
    // MoE keys (Qwen3-Next, qwen3_5_moe); absent ones take HF's per-type defaults.
    num_experts: Option<usize>,
    num_experts_per_tok: Option<usize>,
    moe_intermediate_size: Option<usize>,
    shared_expert_intermediate_size: Option<usize>,
    norm_topk_prob: Option<bool>,
    mlp_only_layers: Option<Vec<usize>>,
    decoder_sparse_step: Option<usize>,
}

fn default_eps() -> f64 {
    1e-6
}
fn default_max_pos() -> usize {
    32768
}
fn default_conv() -> usize {
    4
}
fn default_linear_dim() -> usize {
    128
}
fn default_linear_k_heads() -> usize {
    16
}
fn default_linear_v_heads() -> usize {
    32
}

const TEXT_TYPES: [&str; 3] = ["qwen3_5_text", "qwen3_next", "qwen3_5_moe_text"];
/// Multimodal wrappers whose `text_config` holds the text model (`model.language_model.`).
const WRAPPER_TYPES: [&str; 2] = ["qwen3_5", "qwen3_5_moe"];

impl HybridConfig {
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, ConfigError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let value: Value = serde_json::from_str(&text).map_err(|e| ConfigError::Invalid {
            path: path.to_path_buf(),
            message: format!("not valid JSON: {e}"),
        })?;
        Self::from_value(path, &value)
    }

    /// Whether `config.json` at `path` declares a hybrid-family model (for loaders that accept
    /// several families). Unreadable files answer false; the real parser reports them.
    pub fn is_hybrid_file(path: &Path) -> bool {
        let Ok(text) = std::fs::read_to_string(path) else {
            return false;
        };
        let Ok(v) = serde_json::from_str::<Value>(&text) else {
            return false;
        };
        let ty = v.get("model_type").and_then(Value::as_str).unwrap_or("");
        WRAPPER_TYPES.contains(&ty) || TEXT_TYPES.contains(&ty)
    }

    pub fn from_value(path: &Path, value: &Value) -> Result<Self, ConfigError> {
        let outer_type = value.get("model_type").and_then(Value::as_str);
        // The multimodal wrapper nests the text model; its top-level tie flag wins (HF reads
        // `tie_word_embeddings` from the outer config for the LM head).
        let (text, nested, prefix) = match value.get("text_config") {
            Some(tc) if tc.is_object() => (tc, true, "text_config."),
            _ => (value, false, ""),
        };
        let raw: RawHybrid = serde_path_to_error::deserialize(text).map_err(|e| {
            let field = format!("{prefix}{}", e.path());
            let message = e.into_inner().to_string();
            match message
                .strip_prefix("missing field `")
                .and_then(|m| m.strip_suffix('`'))
            {
                Some(missing) => field_err(
                    path,
                    &format!("{prefix}{missing}"),
                    "required field is missing",
                ),
                None => field_err(path, &field, message),
            }
        })?;
        let model_type = match raw.model_type.as_deref() {
            Some(t) if TEXT_TYPES.contains(&t) => t.to_string(),
            None if outer_type == Some("qwen3_5_moe") => "qwen3_5_moe_text".to_string(),
            None if nested || outer_type == Some("qwen3_5") => "qwen3_5_text".to_string(),
            other => {
                return Err(field_err(
                    path,
                    &format!("{prefix}model_type"),
                    format!("{other:?} is not a hybrid text model; expected qwen3_5 / qwen3_5_moe (with text_config), qwen3_5_text, qwen3_5_moe_text or qwen3_next"),
                ))
            }
        };
        if outer_type == Some("qwen3_5_moe") && model_type != "qwen3_5_moe_text" {
            return Err(field_err(
                path,
                "text_config.model_type",
                format!("`{model_type}` inside a qwen3_5_moe wrapper; expected qwen3_5_moe_text"),
            ));
        }
        let tie = value
            .get("tie_word_embeddings")
            .and_then(Value::as_bool)
            .filter(|_| nested)
            .or(raw.tie_word_embeddings)
            .unwrap_or(false);
        Self::from_raw(path, prefix, raw, model_type, nested, tie)
    }

    fn from_raw(
        path: &Path,
        prefix: &str,
        raw: RawHybrid,
        model_type: String,
        nested: bool,
        tie_word_embeddings: bool,
    ) -> Result<Self, ConfigError> {
        let f = |name: &str| format!("{prefix}{name}");
        let err = |name: &str, msg: String| field_err(path, &f(name), msg);
        for (name, v) in [
            ("vocab_size", raw.vocab_size),
            ("hidden_size", raw.hidden_size),
            ("num_hidden_layers", raw.num_hidden_layers),
            ("num_attention_heads", raw.num_attention_heads),
            ("linear_conv_kernel_dim", raw.linear_conv_kernel_dim),
            ("linear_key_head_dim", raw.linear_key_head_dim),
            ("linear_value_head_dim", raw.linear_value_head_dim),
            ("linear_num_key_heads", raw.linear_num_key_heads),
            ("linear_num_value_heads", raw.linear_num_value_heads),
        ] {
            if v == 0 {
                return Err(err(name, "must be positive".into()));
            }
        }
        let (moe, sparse_layers) = parse_moe(path, prefix, &raw, &model_type)?;
        // qwen3_5_moe has no dense MLP, so no intermediate_size; elsewhere a dense layer needs it.
        let intermediate_size = match raw.intermediate_size {
            Some(i) => i,
            None if sparse_layers.iter().all(|&s| s) => 0,
            None => return Err(err("intermediate_size", "required field is missing".into())),
        };
        let num_kv = raw.num_key_value_heads.unwrap_or(raw.num_attention_heads);
        if num_kv == 0 || !raw.num_attention_heads.is_multiple_of(num_kv) {
            return Err(err(
                "num_key_value_heads",
                format!(
                    "{num_kv} does not divide num_attention_heads ({})",
                    raw.num_attention_heads
                ),
            ));
        }
        if !raw
            .linear_num_value_heads
            .is_multiple_of(raw.linear_num_key_heads)
        {
            return Err(err(
                "linear_num_value_heads",
                format!(
                    "{} is not a multiple of linear_num_key_heads ({}): each key head must serve a whole group of value heads",
                    raw.linear_num_value_heads, raw.linear_num_key_heads
                ),
            ));
        }
        let head_dim = raw
            .head_dim
            .unwrap_or(raw.hidden_size / raw.num_attention_heads);
        if head_dim == 0 || !head_dim.is_multiple_of(2) {
            return Err(err(
                "head_dim",
                format!("{head_dim} must be a positive even number"),
            ));
        }
        if raw.attention_bias {
            return Err(err(
                "attention_bias",
                "true is not supported: hybrid Qwen checkpoints have no attention biases".into(),
            ));
        }
        if let Some(act) = raw.hidden_act.as_deref().filter(|a| *a != "silu") {
            return Err(err(
                "hidden_act",
                format!("`{act}` is not supported; only silu"),
            ));
        }
        if raw.attn_output_gate == Some(false) {
            return Err(err(
                "attn_output_gate",
                "false is not supported: every released hybrid checkpoint gates its attention output".into(),
            ));
        }
        let (rope_theta, rope_scaling) = parse_rope(
            path,
            raw.rope_theta,
            raw.rope_scaling.as_ref(),
            raw.rope_parameters.as_ref(),
            raw.max_position_embeddings,
        )?;
        // HF sets partial_rotary_factor 0.25 when absent; Qwen3.5 keeps it in rope_parameters.
        let factor = raw
            .rope_parameters
            .as_ref()
            .and_then(|p| p.get("partial_rotary_factor"))
            .and_then(Value::as_f64)
            .or(raw.partial_rotary_factor)
            .unwrap_or(0.25);
        let rotary_dim = (head_dim as f64 * factor) as usize;
        if rotary_dim == 0 || !rotary_dim.is_multiple_of(2) || rotary_dim > head_dim {
            return Err(err(
                "partial_rotary_factor",
                format!("{factor} gives a rotary dim of {rotary_dim} for head_dim {head_dim}; it must be even and in 2..=head_dim"),
            ));
        }
        let layer_types = parse_hybrid_layer_types(path, prefix, &raw)?;
        let eos_token_ids = parse_eos(path, raw.eos_token_id.as_ref())?;
        Ok(Self {
            model_type,
            nested,
            vocab_size: raw.vocab_size,
            hidden_size: raw.hidden_size,
            intermediate_size,
            num_hidden_layers: raw.num_hidden_layers,
            num_attention_heads: raw.num_attention_heads,
            num_key_value_heads: num_kv,
            head_dim,
            rms_norm_eps: raw.rms_norm_eps,
            rope_theta,
            rope_scaling,
            rotary_dim,
            max_position_embeddings: raw.max_position_embeddings,
            tie_word_embeddings,
            eos_token_ids,
            bos_token_id: raw.bos_token_id,
            layer_types,
            linear_conv_kernel_dim: raw.linear_conv_kernel_dim,
            linear_key_head_dim: raw.linear_key_head_dim,
            linear_value_head_dim: raw.linear_value_head_dim,
            linear_num_key_heads: raw.linear_num_key_heads,
            linear_num_value_heads: raw.linear_num_value_heads,
            mtp_num_hidden_layers: raw.mtp_num_hidden_layers,
            moe,
            sparse_layers,
        })
    }

    pub fn num_kv_groups(&self) -> usize {
        self.num_attention_heads / self.num_key_value_heads
    }

    /// Channels of the short convolution: q and k of every key head, v of every value head.
    pub fn conv_dim(&self) -> usize {
        2 * self.linear_num_key_heads * self.linear_key_head_dim
            + self.linear_num_value_heads * self.linear_value_head_dim
    }

    pub fn num_linear_layers(&self) -> usize {
        self.layer_types
            .iter()
            .filter(|t| **t == HybridLayerType::LinearAttention)
            .count()
    }

    /// Bytes of one sequence's recurrent state in one GDN layer: the f32 delta-rule state plus
    /// the conv window (K - 1 rows of `conv_dim`) at `conv_bytes` per element.
    pub fn recurrent_state_bytes_per_layer(&self, conv_bytes: usize) -> usize {
        self.linear_num_value_heads * self.linear_key_head_dim * self.linear_value_head_dim * 4
            + (self.linear_conv_kernel_dim - 1) * self.conv_dim() * conv_bytes
    }

    /// Bytes one verified (rollback-able) row stages in one GDN layer on the plain path
    /// instead of a full state: its pre-conv q|k|v row at `conv_bytes` per element, and in
    /// f32 its key per key head, the value it wrote per value head and its log-decay per value
    /// head (`dflash_models::cache::recurrent`).
    pub fn staged_bytes_per_verified_row_per_layer(&self, conv_bytes: usize) -> usize {
        self.conv_dim() * conv_bytes
            + 4 * (self.linear_num_key_heads * self.linear_key_head_dim
                + self.linear_num_value_heads * self.linear_value_head_dim
                + self.linear_num_value_heads)
    }

    /// [`Self::staged_bytes_per_verified_row_per_layer`] over every GDN layer: what one
    /// sequence stages per verified row (a tree node) until the commit.
    pub fn staged_bytes_per_verified_row(&self, conv_bytes: usize) -> usize {
        self.num_linear_layers() * self.staged_bytes_per_verified_row_per_layer(conv_bytes)
    }
}

/// Which layers are sparse and the MoE block's shape, as HF decides: every layer of
/// `qwen3_5_moe_text` (its decoder layer always builds the sparse block and always renormalises
/// the top-k, ignoring `mlp_only_layers` / `decoder_sparse_step` / `norm_topk_prob`); for
/// `qwen3_next`, layer i unless it is in `mlp_only_layers` or `(i + 1) % decoder_sparse_step != 0`
/// (none when `num_experts` is 0). Absent keys take HF's defaults for the type.
fn parse_moe(
    path: &Path,
    prefix: &str,
    raw: &RawHybrid,
    model_type: &str,
) -> Result<(Option<MoeConfig>, Vec<bool>), ConfigError> {
    let n = raw.num_hidden_layers;
    let err = |name: &str, msg: String| field_err(path, &format!("{prefix}{name}"), msg);
    let (sparse, defaults) = match model_type {
        "qwen3_5_moe_text" => (vec![true; n], (256, 8)),
        "qwen3_next" => {
            let sparse = sparse_layer_pattern(
                n,
                raw.num_experts.unwrap_or(512),
                raw.decoder_sparse_step.unwrap_or(1),
                raw.mlp_only_layers.as_deref().unwrap_or(&[]),
            )
            .map_err(|(field, msg)| err(field, msg))?;
            (sparse, (512, 10))
        }
        _ => {
            if raw.num_experts.is_some_and(|e| e > 0) {
                return Err(err(
                    "num_experts",
                    format!("is set, but model_type `{model_type}` has no MoE layers; a Qwen3.5/3.6 MoE checkpoint is model_type qwen3_5_moe / qwen3_5_moe_text"),
                ));
            }
            return Ok((None, vec![false; n]));
        }
    };
    if !sparse.contains(&true) {
        return Ok((None, sparse));
    }
    let block = MoeConfig {
        num_experts: raw.num_experts.unwrap_or(defaults.0),
        num_experts_per_tok: raw.num_experts_per_tok.unwrap_or(defaults.1),
        moe_intermediate_size: raw.moe_intermediate_size.unwrap_or(512),
        shared_expert_intermediate_size: Some(raw.shared_expert_intermediate_size.unwrap_or(512)),
        norm_topk_prob: model_type == "qwen3_5_moe_text" || raw.norm_topk_prob.unwrap_or(true),
    };
    check_block(&block, err)?;
    Ok((Some(block), sparse))
}

fn parse_hybrid_layer_types(
    path: &Path,
    prefix: &str,
    raw: &RawHybrid,
) -> Result<Vec<HybridLayerType>, ConfigError> {
    let n = raw.num_hidden_layers;
    let from_interval = |interval: usize| -> Vec<HybridLayerType> {
        (0..n)
            .map(|i| {
                if (i + 1) % interval == 0 {
                    HybridLayerType::FullAttention
                } else {
                    HybridLayerType::LinearAttention
                }
            })
            .collect()
    };
    if raw.full_attention_interval == Some(0) {
        return Err(field_err(
            path,
            &format!("{prefix}full_attention_interval"),
            "must be positive",
        ));
    }
    let Some(types) = &raw.layer_types else {
        return Ok(from_interval(raw.full_attention_interval.unwrap_or(4)));
    };
    let field = format!("{prefix}layer_types");
    if types.len() != n {
        return Err(field_err(
            path,
            &field,
            format!("has {} entries but num_hidden_layers is {n}", types.len()),
        ));
    }
    let parsed = types
        .iter()
        .enumerate()
        .map(|(i, t)| match t.as_str() {
            "linear_attention" => Ok(HybridLayerType::LinearAttention),
            "full_attention" => Ok(HybridLayerType::FullAttention),
            other => Err(field_err(
                path,
                &format!("{field}[{i}]"),
                format!("`{other}` is not a hybrid layer type; expected linear_attention or full_attention"),
            )),
        })
        .collect::<Result<Vec<_>, _>>()?;
    if let Some(interval) = raw.full_attention_interval {
        if let Some(i) = (0..n).find(|&i| parsed[i] != from_interval(interval)[i]) {
            return Err(field_err(
                path,
                &field,
                format!("layer {i} is {:?} but full_attention_interval {interval} makes it {:?}; the two keys disagree, so the file does not say which layers are recurrent — fix one of them", parsed[i], from_interval(interval)[i]),
            ));
        }
    }
    if !parsed.contains(&HybridLayerType::LinearAttention) {
        return Err(field_err(
            path,
            &field,
            "has no linear_attention layer: this is not a hybrid model (load it as a Qwen3 target)",
        ));
    }
    Ok(parsed)
}

#[cfg(test)]
mod tests;
