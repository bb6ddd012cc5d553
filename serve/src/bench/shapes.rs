//! Published Qwen3 shapes, so the benchmark needs no download: `--model qwen3-8b` builds a
//! model of that shape with random weights. Any `config.json` path works too.

use std::path::Path;

use anyhow::{bail, Context, Result};
use dflash_common::{LayerType, Qwen3Config, RopeScaling};

/// (name, hidden, intermediate, layers, heads, kv heads, tied embeddings) of the dense Qwen3
/// checkpoints on the Hub (all use head_dim 128, vocab 151936, rope_theta 1e6).
const SHAPES: [(&str, usize, usize, usize, usize, usize, bool); 6] = [
    ("qwen3-0.6b", 1024, 3072, 28, 16, 8, true),
    ("qwen3-1.7b", 2048, 6144, 28, 16, 8, true),
    ("qwen3-4b", 2560, 9728, 36, 32, 8, true),
    ("qwen3-8b", 4096, 12288, 36, 32, 8, false),
    ("qwen3-14b", 5120, 17408, 40, 40, 8, false),
    ("qwen3-32b", 5120, 25600, 64, 64, 8, false),
];

pub fn names() -> Vec<&'static str> {
    SHAPES.iter().map(|s| s.0).collect()
}

/// A published shape by name (case-insensitive, `Qwen/Qwen3-8B` works) or a config.json path.
pub fn resolve(spec: &str) -> Result<Qwen3Config> {
    let key = spec.to_ascii_lowercase();
    let key = key.trim_start_matches("qwen/");
    if let Some(&(_, h, i, l, nh, nkv, tie)) = SHAPES.iter().find(|s| s.0 == key) {
        return Ok(Qwen3Config {
            vocab_size: 151936,
            hidden_size: h,
            intermediate_size: i,
            num_hidden_layers: l,
            num_attention_heads: nh,
            num_key_value_heads: nkv,
            head_dim: 128,
            rms_norm_eps: 1e-6,
            rope_theta: 1e6,
            rope_scaling: RopeScaling::Default,
            max_position_embeddings: 40960,
            tie_word_embeddings: tie,
            eos_token_ids: vec![151645],
            bos_token_id: None,
            layer_types: vec![LayerType::FullAttention; l],
            sliding_window: None,
            moe: None,
        });
    }
    let path = Path::new(spec);
    let file = if path.is_dir() {
        path.join("config.json")
    } else {
        path.to_path_buf()
    };
    if !file.exists() {
        bail!(
            "--model {spec}: not a published shape ({}) nor a config.json path",
            names().join(", ")
        );
    }
    Qwen3Config::from_file(&file).with_context(|| format!("--model {}", file.display()))
}

/// Weight count of everything a decode step reads: every layer, the final norm, the LM head
/// (one embedding row is negligible and not counted).
pub fn step_params(cfg: &Qwen3Config) -> f64 {
    layer_params(cfg) * cfg.num_hidden_layers as f64
        + (cfg.vocab_size * cfg.hidden_size) as f64
        + cfg.hidden_size as f64
}

/// Weights of one decoder layer (projections, MLP, norms).
pub fn layer_params(cfg: &Qwen3Config) -> f64 {
    let (h, i, d) = (
        cfg.hidden_size as f64,
        cfg.intermediate_size as f64,
        cfg.head_dim as f64,
    );
    let (nh, nkv) = (
        cfg.num_attention_heads as f64,
        cfg.num_key_value_heads as f64,
    );
    h * nh * d * 2.0 + h * nkv * d * 2.0 + 3.0 * h * i + 2.0 * h + 2.0 * d
}

/// K+V bytes one step reads per context position (all layers).
pub fn kv_bytes_per_position(cfg: &Qwen3Config, dtype_bytes: f64) -> f64 {
    2.0 * (cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim) as f64 * dtype_bytes
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn qwen3_8b_shape_has_8b_parameters() {
        let cfg = resolve("Qwen/Qwen3-8B").unwrap();
        let total = step_params(&cfg) + (cfg.vocab_size * cfg.hidden_size) as f64;
        assert!((total / 1e9 - 8.19).abs() < 0.02, "{}", total / 1e9);
        assert!(resolve("qwen3-9b").is_err());
    }
}
