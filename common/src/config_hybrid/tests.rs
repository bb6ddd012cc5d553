use super::*;
use serde_json::json;

fn parse(v: Value) -> Result<HybridConfig, ConfigError> {
    HybridConfig::from_value(Path::new("/m/config.json"), &v)
}

/// The Qwen3.6-27B text config as transcribed in QWEN_TARGETS.md §3.2, nested as released.
fn qwen36_27b() -> Value {
    let layer_types: Vec<&str> = (0..64)
        .map(|i| {
            if (i + 1) % 4 == 0 {
                "full_attention"
            } else {
                "linear_attention"
            }
        })
        .collect();
    json!({
        "model_type": "qwen3_5",
        "tie_word_embeddings": false,
        "text_config": {
            "model_type": "qwen3_5_text",
            "vocab_size": 248320, "hidden_size": 5120, "intermediate_size": 17408,
            "num_hidden_layers": 64, "num_attention_heads": 24, "num_key_value_heads": 4,
            "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 48,
            "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
            "rms_norm_eps": 1e-6, "max_position_embeddings": 262144,
            "full_attention_interval": 4, "layer_types": layer_types,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000000,
                "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10], "mrope_interleaved": true},
            "attn_output_gate": true, "mtp_num_hidden_layers": 1, "eos_token_id": 248044
        },
        "vision_config": {"depth": 27}
    })
}

#[test]
fn nested_qwen36_27b_config_parses_with_the_published_shape() {
    let c = parse(qwen36_27b()).unwrap();
    assert!(c.nested);
    assert_eq!(c.model_type, "qwen3_5_text");
    assert_eq!(c.num_linear_layers(), 48);
    assert_eq!(c.layer_types[3], HybridLayerType::FullAttention);
    assert_eq!(c.layer_types[0], HybridLayerType::LinearAttention);
    assert_eq!(c.rotary_dim, 64);
    assert_eq!(c.rope_theta, 1e7);
    assert_eq!(c.conv_dim(), 10240);
    assert_eq!(c.mtp_num_hidden_layers, 1);
    assert_eq!(c.eos_token_ids, vec![248044]);
    // 48·128·128·4 B = 3 MiB of delta-rule state per GDN layer (QWEN_TARGETS §3.4 table).
    assert_eq!(c.recurrent_state_bytes_per_layer(0), 3 << 20);
}

#[test]
fn layer_types_default_from_the_full_attention_interval() {
    let mut v = qwen36_27b()["text_config"].clone();
    v.as_object_mut().unwrap().remove("layer_types");
    v["full_attention_interval"] = json!(2);
    let c = parse(v).unwrap();
    assert!(!c.nested);
    assert_eq!(c.layer_types[0], HybridLayerType::LinearAttention);
    assert_eq!(c.layer_types[1], HybridLayerType::FullAttention);
    assert_eq!(c.num_linear_layers(), 32);
}

#[test]
fn layer_types_disagreeing_with_the_interval_is_refused_by_name() {
    let mut v = qwen36_27b();
    v["text_config"]["layer_types"][5] = json!("full_attention");
    let e = parse(v).unwrap_err().to_string();
    assert!(e.contains("text_config.layer_types"), "{e}");
    assert!(e.contains("layer 5"), "{e}");
    assert!(e.contains("full_attention_interval"), "{e}");
}

#[test]
fn wrong_layer_type_and_wrong_count_are_refused() {
    let mut v = qwen36_27b();
    v["text_config"]["layer_types"][2] = json!("sliding_attention");
    let e = parse(v).unwrap_err().to_string();
    assert!(
        e.contains("layer_types[2]") && e.contains("sliding_attention"),
        "{e}"
    );
    let mut v = qwen36_27b();
    v["text_config"]["num_hidden_layers"] = json!(63);
    let e = parse(v).unwrap_err().to_string();
    assert!(e.contains("64 entries") && e.contains("63"), "{e}");
}

#[test]
fn a_dense_text_config_in_a_moe_wrapper_and_bad_head_ratios_are_refused_with_the_field_named() {
    let mut v = qwen36_27b();
    v["model_type"] = json!("qwen3_5_moe");
    let e = parse(v).unwrap_err().to_string();
    assert!(
        e.contains("text_config.model_type") && e.contains("qwen3_5_moe_text"),
        "{e}"
    );
    let mut v = qwen36_27b();
    v["text_config"]["linear_num_value_heads"] = json!(40);
    v["text_config"]["linear_num_key_heads"] = json!(16);
    let e = parse(v).unwrap_err().to_string();
    assert!(e.contains("text_config.linear_num_value_heads"), "{e}");
    let mut v = qwen36_27b();
    v["text_config"]["hidden_size"] = json!("5120");
    let e = parse(v).unwrap_err().to_string();
    assert!(e.contains("text_config.hidden_size"), "{e}");
}

#[test]
fn qwen3_next_flat_config_with_dense_layers_parses() {
    let v = json!({
        "model_type": "qwen3_next", "vocab_size": 100, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 16, "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "linear_key_head_dim": 8, "linear_value_head_dim": 8,
        "num_experts": 4, "mlp_only_layers": [0, 1, 2, 3]
    });
    let c = parse(v.clone()).unwrap();
    assert_eq!(c.model_type, "qwen3_next");
    assert_eq!(c.rotary_dim, 8);
    assert_eq!(c.num_linear_layers(), 3);
    assert!(c.moe.is_none() && c.sparse_layers == vec![false; 4]);
}

/// Qwen3.5-35B-A3B's text config (released nested under `qwen3_5_moe`), abridged.
fn qwen35_a3b() -> Value {
    json!({
        "model_type": "qwen3_5_moe",
        "tie_word_embeddings": false,
        "text_config": {
            "model_type": "qwen3_5_moe_text", "vocab_size": 248320, "hidden_size": 2048,
            "num_hidden_layers": 40, "num_attention_heads": 16, "num_key_value_heads": 2,
            "head_dim": 256, "full_attention_interval": 4, "linear_num_key_heads": 16,
            "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
            "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
            "shared_expert_intermediate_size": 512, "mtp_num_hidden_layers": 1,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000000,
                                "partial_rotary_factor": 0.25}
        }
    })
}

#[test]
fn qwen3_5_moe_makes_every_layer_sparse_and_always_renormalises() {
    let c = parse(qwen35_a3b()).unwrap();
    assert_eq!(c.model_type, "qwen3_5_moe_text");
    assert!(c.nested);
    assert_eq!(c.sparse_layers, vec![true; 40]);
    assert_eq!(c.intermediate_size, 0);
    assert_eq!(
        c.moe,
        Some(MoeConfig {
            num_experts: 256,
            num_experts_per_tok: 8,
            moe_intermediate_size: 512,
            shared_expert_intermediate_size: Some(512),
            norm_topk_prob: true,
        })
    );
    // transformers' qwen3_5_moe ignores these keys: every layer stays sparse, weights renormalised.
    let mut v = qwen35_a3b();
    v["text_config"]["mlp_only_layers"] = json!([0]);
    v["text_config"]["norm_topk_prob"] = json!(false);
    let c = parse(v).unwrap();
    assert!(c.sparse_layers[0] && c.moe.unwrap().norm_topk_prob);
    // The flat text config too.
    let flat = qwen35_a3b()["text_config"].clone();
    assert_eq!(parse(flat).unwrap().sparse_layers, vec![true; 40]);
}

#[test]
fn qwen3_next_sparse_layers_follow_mlp_only_layers_and_decoder_sparse_step() {
    let base = json!({
        "model_type": "qwen3_next", "vocab_size": 100, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 16, "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "linear_key_head_dim": 8, "linear_value_head_dim": 8
    });
    // HF defaults: 512 experts, top-10, every layer sparse.
    let c = parse(base.clone()).unwrap();
    let moe = c.moe.unwrap();
    assert_eq!((moe.num_experts, moe.num_experts_per_tok), (512, 10));
    assert_eq!(c.sparse_layers, vec![true; 4]);
    let mut v = base.clone();
    v["num_experts"] = json!(4);
    v["num_experts_per_tok"] = json!(2);
    v["mlp_only_layers"] = json!([0]);
    v["decoder_sparse_step"] = json!(2);
    v["norm_topk_prob"] = json!(false);
    let c = parse(v).unwrap();
    assert_eq!(c.sparse_layers, vec![false, true, false, true]);
    assert!(!c.moe.unwrap().norm_topk_prob);
    let mut v = base;
    v["num_experts"] = json!(0);
    let c = parse(v).unwrap();
    assert!(c.moe.is_none() && c.sparse_layers == vec![false; 4]);
}

#[test]
fn inconsistent_moe_configs_are_refused_with_the_key_named() {
    let cases: [(&str, Value, &str); 6] = [
        (
            "num_experts_per_tok",
            json!(300),
            "text_config.num_experts_per_tok",
        ),
        (
            "num_experts_per_tok",
            json!(0),
            "text_config.num_experts_per_tok",
        ),
        (
            "moe_intermediate_size",
            json!(0),
            "text_config.moe_intermediate_size",
        ),
        (
            "shared_expert_intermediate_size",
            json!(0),
            "text_config.shared_expert_intermediate_size",
        ),
        ("num_experts", json!(0), "text_config.num_experts"),
        ("num_experts", json!("8"), "text_config.num_experts"),
    ];
    for (key, value, named) in cases {
        let mut v = qwen35_a3b();
        v["text_config"][key] = value;
        let e = parse(v).unwrap_err().to_string();
        assert!(e.contains(named), "{key}: {e}");
    }
    let next = json!({
        "model_type": "qwen3_next", "vocab_size": 100, "hidden_size": 32,
        "num_hidden_layers": 4, "num_attention_heads": 2, "head_dim": 16,
        "num_experts": 4, "num_experts_per_tok": 2
    });
    for (key, value, named) in [
        ("decoder_sparse_step", json!(0), "decoder_sparse_step"),
        ("mlp_only_layers", json!([4]), "mlp_only_layers"),
        // A dense layer needs intermediate_size.
        ("mlp_only_layers", json!([1]), "intermediate_size"),
    ] {
        let mut v = next.clone();
        v[key] = value;
        let e = parse(v).unwrap_err().to_string();
        assert!(e.contains(named), "{key}: {e}");
    }
    // Experts on a dense model type are a mislabelled checkpoint.
    let mut v = qwen36_27b();
    v["text_config"]["num_experts"] = json!(8);
    let e = parse(v).unwrap_err().to_string();
    assert!(
        e.contains("text_config.num_experts") && e.contains("qwen3_5_moe"),
        "{e}"
    );
}
