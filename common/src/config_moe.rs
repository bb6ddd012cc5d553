//! The sparse-MoE MLP's config, shared by the two families that have one: the dense-attention
//! `qwen3_moe` targets (Qwen3-30B-A3B, Qwen3-Coder-30B-A3B; parsed here and carried in
//! [`crate::Qwen3Config::moe`]) and the hybrid MoE targets (Qwen3.5/3.6-MoE, Qwen3-Next;
//! [`crate::HybridConfig::moe`]).
//!
//! Which layers are sparse follows HF `Qwen3MoeDecoderLayer` / `Qwen3NextDecoderLayer`: layer `i`
//! is sparse unless it is listed in `mlp_only_layers` or `(i + 1) % decoder_sparse_step != 0`, and
//! no layer is when `num_experts` is 0. A dense layer of a MoE model is an ordinary SwiGLU MLP of
//! width `intermediate_size`.

use std::path::Path;

use serde::Deserialize;
use serde_json::Value;

use crate::error::{field_err, ConfigError};

/// The sparse-MoE block (HF `Qwen3MoeSparseMoeBlock`, `Qwen3_5MoeSparseMoeBlock`,
/// `Qwen3NextSparseMoeBlock`): a router over `num_experts` SwiGLU experts of width
/// `moe_intermediate_size`, top-`num_experts_per_tok` per token, plus (hybrids only) one shared
/// expert scaled by `sigmoid(shared_expert_gate(x))`.
#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
    pub moe_intermediate_size: usize,
    /// The shared expert's width; None for `qwen3_moe`, whose block has no shared expert.
    pub shared_expert_intermediate_size: Option<usize>,
    /// Renormalise the top-k probabilities to sum to 1 (always on for qwen3_5_moe, whose
    /// router has no such switch; `norm_topk_prob` elsewhere).
    pub norm_topk_prob: bool,
}

/// A dense-attention target's MoE layout: the block's shape and, per layer, whether its MLP is
/// that block (the others are dense MLPs of `intermediate_size`).
#[derive(Debug, Clone, PartialEq)]
pub struct MoeLayers {
    pub block: MoeConfig,
    pub sparse: Vec<bool>,
}

impl MoeLayers {
    pub fn is_sparse(&self, layer: usize) -> bool {
        self.sparse.get(layer).copied().unwrap_or(false)
    }
}

/// Per layer, whether HF builds the sparse block there (see the module doc). The error is the
/// offending field and what is wrong with it.
pub(crate) fn sparse_layer_pattern(
    num_layers: usize,
    num_experts: usize,
    decoder_sparse_step: usize,
    mlp_only_layers: &[usize],
) -> Result<Vec<bool>, (&'static str, String)> {
    if num_experts > 0 && decoder_sparse_step == 0 {
        return Err((
            "decoder_sparse_step",
            "must be positive (HF computes (layer + 1) % decoder_sparse_step)".into(),
        ));
    }
    if let Some(&bad) = mlp_only_layers.iter().find(|&&l| l >= num_layers) {
        return Err((
            "mlp_only_layers",
            format!("lists layer {bad} but num_hidden_layers is {num_layers}"),
        ));
    }
    Ok((0..num_layers)
        .map(|i| {
            num_experts > 0 && !mlp_only_layers.contains(&i) && (i + 1) % decoder_sparse_step == 0
        })
        .collect())
}

/// Checks the block's sizes (after defaults); `err` builds the error for a field.
pub(crate) fn check_block(
    block: &MoeConfig,
    err: impl Fn(&str, String) -> ConfigError,
) -> Result<(), ConfigError> {
    let (e, k) = (block.num_experts, block.num_experts_per_tok);
    if e == 0 {
        return Err(err("num_experts", "must be positive".into()));
    }
    if k == 0 || k > e {
        return Err(err(
            "num_experts_per_tok",
            format!("{k} must be in 1..=num_experts ({e})"),
        ));
    }
    if block.moe_intermediate_size == 0 {
        return Err(err("moe_intermediate_size", "must be positive".into()));
    }
    if block.shared_expert_intermediate_size == Some(0) {
        return Err(err(
            "shared_expert_intermediate_size",
            "must be positive".into(),
        ));
    }
    Ok(())
}

/// The MoE keys of a `qwen3_moe` config; absent ones take HF `Qwen3MoeConfig`'s defaults.
#[derive(Deserialize)]
struct RawQwen3Moe {
    num_experts: Option<usize>,
    num_experts_per_tok: Option<usize>,
    moe_intermediate_size: Option<usize>,
    norm_topk_prob: Option<bool>,
    decoder_sparse_step: Option<usize>,
    mlp_only_layers: Option<Vec<usize>>,
    shared_expert_intermediate_size: Option<usize>,
}

/// The MoE layout of the config `value` read from `path`, by its `model_type`: `qwen3_moe`
/// gives its layout (None when no layer ends up sparse), any other type none, and a file
/// that sets `num_experts` without being `qwen3_moe` is refused, because its MoE weights
/// would otherwise be reported as missing dense-MLP tensors.
pub(crate) fn parse_qwen3_moe(
    path: &Path,
    value: &Value,
    num_layers: usize,
) -> Result<Option<MoeLayers>, ConfigError> {
    let model_type = value.get("model_type").and_then(Value::as_str);
    let raw: RawQwen3Moe = serde_path_to_error::deserialize(value)
        .map_err(|e| field_err(path, &e.path().to_string(), e.into_inner().to_string()))?;
    if model_type != Some("qwen3_moe") {
        if raw.num_experts.is_some_and(|e| e > 0) {
            return Err(field_err(
                path,
                "num_experts",
                format!("is set, but model_type is {model_type:?}; a Qwen3 MoE checkpoint (Qwen3-30B-A3B, Qwen3-Coder-30B-A3B) is model_type qwen3_moe"),
            ));
        }
        return Ok(None);
    }
    if raw.shared_expert_intermediate_size.is_some_and(|s| s > 0) {
        return Err(field_err(
            path,
            "shared_expert_intermediate_size",
            "is set, but qwen3_moe has no shared expert (HF Qwen3MoeSparseMoeBlock ignores it); a model with one is qwen3_next or qwen3_5_moe",
        ));
    }
    let block = MoeConfig {
        num_experts: raw.num_experts.unwrap_or(128),
        num_experts_per_tok: raw.num_experts_per_tok.unwrap_or(8),
        moe_intermediate_size: raw.moe_intermediate_size.unwrap_or(768),
        shared_expert_intermediate_size: None,
        norm_topk_prob: raw.norm_topk_prob.unwrap_or(false),
    };
    let sparse = sparse_layer_pattern(
        num_layers,
        block.num_experts,
        raw.decoder_sparse_step.unwrap_or(1),
        raw.mlp_only_layers.as_deref().unwrap_or(&[]),
    )
    .map_err(|(field, msg)| field_err(path, field, msg))?;
    if !sparse.contains(&true) {
        return Ok(None);
    }
    check_block(&block, |f, m| field_err(path, f, m))?;
    Ok(Some(MoeLayers { block, sparse }))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use serde_json::json;

    fn parse(v: Value) -> Result<Option<MoeLayers>, ConfigError> {
        let n = v["num_hidden_layers"].as_u64().unwrap() as usize;
        parse_qwen3_moe(Path::new("/m/config.json"), &v, n)
    }

    /// Qwen3-Coder-30B-A3B-Instruct's config.json (the fields that matter here), as published.
    pub(crate) fn coder_30b_a3b() -> Value {
        json!({
            "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
            "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
            "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
            "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000000,
            "max_position_embeddings": 262144, "tie_word_embeddings": false,
            "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
            "norm_topk_prob": true, "decoder_sparse_step": 1, "mlp_only_layers": [],
            "hidden_act": "silu", "attention_bias": false, "use_sliding_window": false,
            "eos_token_id": 151645, "bos_token_id": 151643, "output_router_logits": false,
            "router_aux_loss_coef": 0.001
        })
    }

    #[test]
    fn the_published_coder_config_makes_every_layer_sparse() {
        let m = parse(coder_30b_a3b()).unwrap().unwrap();
        assert_eq!(
            m.block,
            MoeConfig {
                num_experts: 128,
                num_experts_per_tok: 8,
                moe_intermediate_size: 768,
                shared_expert_intermediate_size: None,
                norm_topk_prob: true,
            }
        );
        assert_eq!(m.sparse, vec![true; 48]);
    }

    #[test]
    fn sparse_step_and_mlp_only_layers_pick_the_dense_layers_as_hf_does() {
        let mut v = coder_30b_a3b();
        v["num_hidden_layers"] = json!(6);
        v["decoder_sparse_step"] = json!(2);
        v["mlp_only_layers"] = json!([3]);
        let m = parse(v).unwrap().unwrap();
        // (i + 1) % 2 == 0 -> layers 1, 3, 5; layer 3 forced dense.
        assert_eq!(m.sparse, vec![false, true, false, false, false, true]);
        assert!(m.is_sparse(1) && !m.is_sparse(3));
    }

    #[test]
    fn absent_keys_take_hf_defaults_and_no_sparse_layer_means_no_moe() {
        let v = json!({"model_type": "qwen3_moe", "num_hidden_layers": 2});
        let m = parse(v).unwrap().unwrap();
        assert_eq!(
            (
                m.block.num_experts,
                m.block.num_experts_per_tok,
                m.block.moe_intermediate_size
            ),
            (128, 8, 768)
        );
        assert!(!m.block.norm_topk_prob);
        let v =
            json!({"model_type": "qwen3_moe", "num_hidden_layers": 2, "mlp_only_layers": [0, 1]});
        assert_eq!(parse(v).unwrap(), None);
        let v = json!({"model_type": "qwen3_moe", "num_hidden_layers": 2, "num_experts": 0});
        assert_eq!(parse(v).unwrap(), None);
        let v = json!({"model_type": "qwen3", "num_hidden_layers": 2});
        assert_eq!(parse(v).unwrap(), None);
    }

    #[test]
    fn bad_moe_fields_are_named() {
        for (key, val, field) in [
            ("num_experts_per_tok", json!(129), "num_experts_per_tok"),
            ("num_experts_per_tok", json!(0), "num_experts_per_tok"),
            ("moe_intermediate_size", json!(0), "moe_intermediate_size"),
            ("decoder_sparse_step", json!(0), "decoder_sparse_step"),
            ("mlp_only_layers", json!([48]), "mlp_only_layers"),
            ("mlp_only_layers", json!("all"), "mlp_only_layers"),
            (
                "shared_expert_intermediate_size",
                json!(512),
                "shared_expert_intermediate_size",
            ),
        ] {
            let mut v = coder_30b_a3b();
            v[key] = val;
            let e = parse(v).unwrap_err().to_string();
            assert!(e.contains(&format!("field `{field}`")), "{key}: {e}");
        }
    }
}
