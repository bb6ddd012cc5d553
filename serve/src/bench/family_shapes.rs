//! The non-dense target families the benchmark builds with random weights: the Qwen3.5/3.6
//! Gated-DeltaNet hybrids (dense MLP or MoE) and the dense-attention MoE `qwen3_moe`, by
//! published name (config values of ../shared/spec/QWEN_TARGETS.md) or by a `config.json` of
//! one of them; with the shape of the DFlash drafter published for each (DFLASH.md §1.2).

use std::path::Path;

use anyhow::{Context, Result};
use dflash_common::{HybridConfig, Qwen3Config};
use serde_json::{json, Value};

/// A target of a non-dense family.
#[derive(Debug, Clone)]
pub enum FamilyTarget {
    Hybrid(HybridConfig),
    /// `qwen3_moe` (Qwen3 attention, sparse MoE MLPs).
    Moe(Qwen3Config),
}

/// A benchmark target and its drafter's layer shape.
#[derive(Debug, Clone)]
pub struct Family {
    pub target: FamilyTarget,
    /// (hidden, intermediate, layers, heads, KV heads) of the DFlash drafter.
    pub drafter: (usize, usize, usize, usize, usize),
}

/// The fields both published hybrids share (Qwen3.5/3.6: a full-attention layer every fourth,
/// 16 GDN key heads of 128, head_dim 256, partial RoPE), for `layers` layers, with `specific`
/// (the size and MLP fields) merged in.
fn hybrid(layers: usize, specific: Value) -> Value {
    let layer_types: Vec<&str> = (0..layers)
        .map(|i| {
            if (i + 1) % 4 == 0 {
                "full_attention"
            } else {
                "linear_attention"
            }
        })
        .collect();
    let mut v = json!({
        "vocab_size": 248320, "num_hidden_layers": layers, "head_dim": 256,
        "linear_num_key_heads": 16, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4, "layer_types": layer_types, "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": false,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25}
    });
    if let (Value::Object(base), Value::Object(extra)) = (&mut v, specific) {
        base.extend(extra);
    }
    v
}

fn hybrid_27b() -> Value {
    hybrid(
        64,
        json!({"model_type": "qwen3_5_text", "hidden_size": 5120, "intermediate_size": 17408,
               "num_attention_heads": 24, "num_key_value_heads": 4, "linear_num_value_heads": 48}),
    )
}

fn hybrid_35b_a3b() -> Value {
    hybrid(
        40,
        json!({"model_type": "qwen3_5_moe_text", "hidden_size": 2048, "num_attention_heads": 16,
               "num_key_value_heads": 2, "linear_num_value_heads": 32, "num_experts": 256,
               "num_experts_per_tok": 8, "moe_intermediate_size": 512,
               "shared_expert_intermediate_size": 512}),
    )
}

fn moe_30b_a3b(coder: bool) -> Value {
    json!({
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "vocab_size": 151936, "hidden_size": 2048,
        "intermediate_size": if coder { 5472 } else { 6144 },
        "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
        "head_dim": 128, "rms_norm_eps": 1e-6,
        "rope_theta": if coder { 10000000.0 } else { 1000000.0 },
        "max_position_embeddings": if coder { 262144 } else { 40960 },
        "tie_word_embeddings": false, "num_experts": 128, "num_experts_per_tok": 8,
        "moe_intermediate_size": 768, "norm_topk_prob": true, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "hidden_act": "silu", "eos_token_id": 151645
    })
}

/// The published drafters: Qwen3.6-27B-DFlash 5120 / 17408 / 5 / 32 / 8; the A3B MoE ones
/// 2048 / 6144 / 8 / 32 / 4.
const DRAFTER_27B: (usize, usize, usize, usize, usize) = (5120, 17408, 5, 32, 8);
const DRAFTER_A3B: (usize, usize, usize, usize, usize) = (2048, 6144, 8, 32, 4);

fn moe_config(v: &Value) -> Result<Qwen3Config> {
    // Qwen3Config reads files only: the config goes through a scratch file.
    let dir = std::env::temp_dir().join(format!("dflash-bench-shape-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("config.json");
    std::fs::write(&path, v.to_string())?;
    let cfg = Qwen3Config::from_file(&path);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(cfg?)
}

/// The family `spec` names (a published name, case-insensitive, or a `config.json` / model
/// directory of a hybrid or MoE target); `None` for a dense Qwen3 shape.
pub fn resolve(spec: &str) -> Result<Option<Family>> {
    let key = spec.to_ascii_lowercase();
    let key = key.trim_start_matches("qwen/");
    let hybrid = |v: Value| -> Result<FamilyTarget> {
        Ok(FamilyTarget::Hybrid(HybridConfig::from_value(
            Path::new(spec),
            &v,
        )?))
    };
    let published = match key {
        "qwen3.6-27b" | "qwen3.5-27b" => Some((hybrid(hybrid_27b())?, DRAFTER_27B)),
        "qwen3.6-35b-a3b" | "qwen3.5-35b-a3b" => Some((hybrid(hybrid_35b_a3b())?, DRAFTER_A3B)),
        "qwen3-coder-30b-a3b" | "qwen3-coder-30b-a3b-instruct" => Some((
            FamilyTarget::Moe(moe_config(&moe_30b_a3b(true))?),
            DRAFTER_A3B,
        )),
        "qwen3-30b-a3b" => Some((
            FamilyTarget::Moe(moe_config(&moe_30b_a3b(false))?),
            DRAFTER_A3B,
        )),
        _ => None,
    };
    if let Some((target, drafter)) = published {
        return Ok(Some(Family { target, drafter }));
    }
    let path = Path::new(spec);
    let file = if path.is_dir() {
        path.join("config.json")
    } else {
        path.to_path_buf()
    };
    if !file.is_file() {
        return Ok(None);
    }
    let ctx = || format!("--model {}", file.display());
    if HybridConfig::is_hybrid_file(&file) {
        let cfg = HybridConfig::from_file(&file).with_context(ctx)?;
        let inter = match &cfg.moe {
            Some(_) => 3 * cfg.hidden_size,
            None => cfg.intermediate_size,
        };
        let drafter = (
            cfg.hidden_size,
            inter,
            5,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
        );
        return Ok(Some(Family {
            target: FamilyTarget::Hybrid(cfg),
            drafter,
        }));
    }
    let cfg = Qwen3Config::from_file(&file).with_context(ctx)?;
    if cfg.moe.is_none() {
        return Ok(None);
    }
    let drafter = (
        cfg.hidden_size,
        3 * cfg.hidden_size,
        5,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
    );
    Ok(Some(Family {
        target: FamilyTarget::Moe(cfg),
        drafter,
    }))
}

/// Weights one decode token reads, all of them and the routed experts' share only:
/// `(total, active)` parameter counts (LM head included, one embedding row not).
pub fn params(t: &FamilyTarget) -> (f64, f64) {
    match t {
        FamilyTarget::Hybrid(c) => {
            let h = c.hidden_size as f64;
            let hv_dv = (c.linear_num_value_heads * c.linear_value_head_dim) as f64;
            let gdn = h * (c.conv_dim() as f64 + hv_dv + 2.0 * c.linear_num_value_heads as f64)
                + h * hv_dv;
            let (nh, nkv, d) = (
                c.num_attention_heads as f64,
                c.num_key_value_heads as f64,
                c.head_dim as f64,
            );
            // Gated attention: q and its gate, k, v, o.
            let attn = h * 2.0 * nh * d + 2.0 * h * nkv * d + h * nh * d;
            let lin = c.num_linear_layers() as f64;
            let full = c.num_hidden_layers as f64 - lin;
            let (mlp_total, mlp_active) = match &c.moe {
                Some(m) => moe_mlp(h, m),
                None => {
                    let dense = 3.0 * h * c.intermediate_size as f64;
                    (dense, dense)
                }
            };
            let layers = c.num_hidden_layers as f64;
            let common = lin * gdn + full * attn + c.vocab_size as f64 * h;
            (common + layers * mlp_total, common + layers * mlp_active)
        }
        FamilyTarget::Moe(c) => {
            let h = c.hidden_size as f64;
            let (nh, nkv, d) = (
                c.num_attention_heads as f64,
                c.num_key_value_heads as f64,
                c.head_dim as f64,
            );
            let attn = 2.0 * h * nh * d + 2.0 * h * nkv * d;
            let dense = 3.0 * h * c.intermediate_size as f64;
            let (mut total, mut active) = (c.vocab_size as f64 * h, c.vocab_size as f64 * h);
            for layer in 0..c.num_hidden_layers {
                let (t, a) = match &c.moe {
                    Some(m) if m.is_sparse(layer) => moe_mlp(h, &m.block),
                    _ => (dense, dense),
                };
                total += attn + t;
                active += attn + a;
            }
            (total, active)
        }
    }
}

/// (all experts, the top-k's) of one sparse block: router, experts, shared expert and gate.
fn moe_mlp(h: f64, m: &dflash_common::MoeConfig) -> (f64, f64) {
    let expert = 3.0 * h * m.moe_intermediate_size as f64;
    let router = h * m.num_experts as f64;
    let shared = m
        .shared_expert_intermediate_size
        .map_or(0.0, |s| 3.0 * h * s as f64 + h);
    (
        router + shared + m.num_experts as f64 * expert,
        router + shared + m.num_experts_per_tok as f64 * expert,
    )
}

/// K+V bytes per context position (full-attention layers only) and the recurrent state bytes
/// one step reads (GDN layers, 0 for `qwen3_moe`).
pub fn cache_bytes(t: &FamilyTarget, elem: f64) -> (f64, f64) {
    match t {
        FamilyTarget::Hybrid(c) => {
            let full = (c.num_hidden_layers - c.num_linear_layers()) as f64;
            let kv = full * 2.0 * (c.num_key_value_heads * c.head_dim) as f64 * elem;
            let state = c.num_linear_layers() as f64 * c.recurrent_state_bytes_per_layer(2) as f64;
            (kv, state)
        }
        FamilyTarget::Moe(c) => (
            2.0 * (c.num_hidden_layers * c.num_key_value_heads * c.head_dim) as f64 * elem,
            0.0,
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn published_families_have_their_parameter_counts() {
        let count = |name: &str| {
            let f = resolve(name).unwrap().expect(name);
            let (total, active) = params(&f.target);
            (total / 1e9, active / 1e9)
        };
        // Qwen3.6-27B: ~27B with the embedding (1.27B) outside the count.
        let (t27, a27) = count("Qwen/Qwen3.6-27B");
        assert!((25.0..27.5).contains(&t27) && t27 == a27, "{t27} {a27}");
        // The A3B models: ~30-35B in all, ~3B read per token.
        let (t35, a35) = count("qwen3.6-35b-a3b");
        assert!(
            (32.0..36.0).contains(&t35) && (2.5..3.8).contains(&a35),
            "{t35} {a35}"
        );
        let (t30, a30) = count("qwen3-coder-30b-a3b");
        assert!(
            (29.0..31.5).contains(&t30) && (2.8..3.6).contains(&a30),
            "{t30} {a30}"
        );
        assert!(resolve("qwen3-8b").unwrap().is_none());
    }
}
