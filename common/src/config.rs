//! `config.json` parsing for Qwen3 targets and z-lab DFlash drafters.
//!
//! Field names are Hugging Face's, verbatim. Parsing goes through `serde_path_to_error` so a field
//! of the wrong type is reported by name; the semantic checks (head counts divide, layer ids exist)
//! run once here so that model constructors never see an inconsistent config.

use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_json::Value;

use crate::config_moe::{parse_qwen3_moe, MoeConfig, MoeLayers};
pub(crate) use crate::error::field_err;
use crate::error::ConfigError;

/// RoPE frequency scaling as found in `rope_scaling` (or transformers 5's `rope_parameters`).
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// Plain RoPE: `inv_freq[i] = theta^(-2i/d)`.
    Default,
    /// Positions divided by `factor` (HF "linear").
    Linear { factor: f64 },
    /// YaRN as implemented by HF `_compute_yarn_parameters`.
    Yarn {
        factor: f64,
        original_max_position_embeddings: usize,
        beta_fast: f64,
        beta_slow: f64,
        attention_factor: Option<f64>,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerType {
    FullAttention,
    SlidingAttention,
}

/// The fields of a Qwen3 `config.json` that the forward pass depends on.
#[derive(Debug, Clone, PartialEq)]
pub struct Qwen3Config {
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
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    pub eos_token_ids: Vec<u32>,
    pub bos_token_id: Option<u32>,
    pub layer_types: Vec<LayerType>,
    pub sliding_window: Option<usize>,
    /// The sparse-MoE layout of a `qwen3_moe` target (None: every MLP is dense; always None
    /// for a DFlash drafter).
    pub moe: Option<MoeLayers>,
}

/// A z-lab DFlash drafter config: the Qwen3 layer shape plus the DFlash extras.
#[derive(Debug, Clone, PartialEq)]
pub struct DFlashConfig {
    pub layers: Qwen3Config,
    pub block_size: usize,
    pub mask_token_id: u32,
    /// 0-based target layers whose *output* (HF `hidden_states[id + 1]`, so the last layer's
    /// after the final norm: `dflash_models::taps`) feeds `fc`.
    pub target_layer_ids: Vec<usize>,
}

#[derive(Deserialize)]
struct RawConfig {
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    #[serde(default = "default_eps")]
    rms_norm_eps: f64,
    rope_theta: Option<f64>,
    rope_scaling: Option<Value>,
    rope_parameters: Option<Value>,
    #[serde(default = "default_max_pos")]
    max_position_embeddings: usize,
    #[serde(default)]
    tie_word_embeddings: bool,
    #[serde(default)]
    attention_bias: bool,
    hidden_act: Option<String>,
    eos_token_id: Option<Value>,
    bos_token_id: Option<u32>,
    #[serde(default)]
    use_sliding_window: bool,
    sliding_window: Option<usize>,
    layer_types: Option<Vec<String>>,
    // DFlash extras.
    block_size: Option<usize>,
    dflash_config: Option<RawDFlash>,
    num_target_layers: Option<usize>,
}

#[derive(Deserialize)]
struct RawDFlash {
    mask_token_id: Option<u32>,
    target_layer_ids: Option<Vec<usize>>,
    block_size: Option<usize>,
}

fn default_eps() -> f64 {
    1e-6
}
fn default_max_pos() -> usize {
    40960
}

fn read_raw(path: &Path) -> Result<(RawConfig, Value), ConfigError> {
    let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let value: Value = serde_json::from_str(&text).map_err(|e| ConfigError::Invalid {
        path: path.to_path_buf(),
        message: format!("not valid JSON: {e}"),
    })?;
    let raw: RawConfig = serde_path_to_error::deserialize(&value).map_err(|e| {
        let field = e.path().to_string();
        let message = e.into_inner().to_string();
        if let Some(missing) = message
            .strip_prefix("missing field `")
            .and_then(|m| m.strip_suffix('`'))
        {
            ConfigError::Field {
                path: path.to_path_buf(),
                field: missing.to_string(),
                message: "required field is missing".into(),
            }
        } else {
            ConfigError::Field {
                path: path.to_path_buf(),
                field,
                message,
            }
        }
    })?;
    Ok((raw, value))
}

fn parse_rope_scaling(path: &Path, raw: &RawConfig) -> Result<(f64, RopeScaling), ConfigError> {
    parse_rope(
        path,
        raw.rope_theta,
        raw.rope_scaling.as_ref(),
        raw.rope_parameters.as_ref(),
        raw.max_position_embeddings,
    )
}

/// RoPE theta and scaling from the top-level `rope_theta`, `rope_scaling` or transformers 5's
/// `rope_parameters` (shared with the hybrid-family parser).
pub(crate) fn parse_rope(
    path: &Path,
    rope_theta: Option<f64>,
    rope_scaling: Option<&Value>,
    rope_parameters: Option<&Value>,
    max_position_embeddings: usize,
) -> Result<(f64, RopeScaling), ConfigError> {
    // transformers 5 folds rope_theta into rope_parameters; older files keep it top-level.
    let params = rope_scaling
        .filter(|v| !v.is_null())
        .or(rope_parameters.filter(|v| !v.is_null()));
    let theta_from_params = rope_parameters
        .and_then(|p| p.get("rope_theta"))
        .and_then(Value::as_f64);
    let theta = rope_theta.or(theta_from_params).unwrap_or(10_000.0);
    let Some(p) = params else {
        return Ok((theta, RopeScaling::Default));
    };
    let field = if rope_scaling.is_some_and(|v| !v.is_null()) {
        "rope_scaling"
    } else {
        "rope_parameters"
    };
    let kind = p
        .get("rope_type")
        .or_else(|| p.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let num = |k: &str| p.get(k).and_then(Value::as_f64);
    let factor = || {
        num("factor").ok_or_else(|| {
            field_err(
                path,
                &format!("{field}.factor"),
                format!("rope type `{kind}` needs a numeric factor"),
            )
        })
    };
    let scaling = match kind {
        "default" => RopeScaling::Default,
        "linear" => RopeScaling::Linear { factor: factor()? },
        "yarn" => RopeScaling::Yarn {
            factor: factor()?,
            original_max_position_embeddings: num("original_max_position_embeddings")
                .map(|v| v as usize)
                .unwrap_or(max_position_embeddings),
            beta_fast: num("beta_fast").unwrap_or(32.0),
            beta_slow: num("beta_slow").unwrap_or(1.0),
            attention_factor: num("attention_factor"),
        },
        other => {
            return Err(field_err(
                path,
                &format!("{field}.rope_type"),
                format!("`{other}` is not supported; supported: default, linear, yarn"),
            ))
        }
    };
    Ok((theta, scaling))
}

fn parse_layer_types(path: &Path, raw: &RawConfig) -> Result<Vec<LayerType>, ConfigError> {
    match &raw.layer_types {
        None => Ok(vec![LayerType::FullAttention; raw.num_hidden_layers]),
        Some(types) => {
            if types.len() != raw.num_hidden_layers {
                return Err(field_err(
                    path,
                    "layer_types",
                    format!(
                        "has {} entries but num_hidden_layers is {}",
                        types.len(),
                        raw.num_hidden_layers
                    ),
                ));
            }
            types
                .iter()
                .enumerate()
                .map(|(i, t)| match t.as_str() {
                    "full_attention" => Ok(LayerType::FullAttention),
                    "sliding_attention" => Ok(LayerType::SlidingAttention),
                    other => Err(field_err(
                        path,
                        &format!("layer_types[{i}]"),
                        format!("`{other}` is not supported; expected full_attention or sliding_attention"),
                    )),
                })
                .collect()
        }
    }
}

/// `eos_token_id` as one id or a list of ids.
pub(crate) fn parse_eos(path: &Path, eos: Option<&Value>) -> Result<Vec<u32>, ConfigError> {
    match eos {
        None | Some(Value::Null) => Ok(vec![]),
        Some(Value::Number(n)) => Ok(vec![n
            .as_u64()
            .ok_or_else(|| field_err(path, "eos_token_id", "must be a non-negative integer"))?
            as u32]),
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| {
                v.as_u64().map(|x| x as u32).ok_or_else(|| {
                    field_err(path, "eos_token_id", "must hold non-negative integers")
                })
            })
            .collect::<Result<_, _>>(),
        Some(_) => Err(field_err(
            path,
            "eos_token_id",
            "must be an integer or a list of integers",
        )),
    }
}

fn layers_from_raw(path: &Path, raw: &RawConfig) -> Result<Qwen3Config, ConfigError> {
    let positive = |name: &str, v: usize| {
        if v == 0 {
            Err(field_err(path, name, "must be positive"))
        } else {
            Ok(())
        }
    };
    positive("vocab_size", raw.vocab_size)?;
    positive("hidden_size", raw.hidden_size)?;
    positive("intermediate_size", raw.intermediate_size)?;
    positive("num_hidden_layers", raw.num_hidden_layers)?;
    positive("num_attention_heads", raw.num_attention_heads)?;
    let num_kv = raw.num_key_value_heads.unwrap_or(raw.num_attention_heads);
    positive("num_key_value_heads", num_kv)?;
    if !raw.num_attention_heads.is_multiple_of(num_kv) {
        return Err(field_err(
            path,
            "num_key_value_heads",
            format!(
                "{num_kv} does not divide num_attention_heads ({})",
                raw.num_attention_heads
            ),
        ));
    }
    let head_dim = raw
        .head_dim
        .unwrap_or(raw.hidden_size / raw.num_attention_heads);
    if head_dim == 0 || !head_dim.is_multiple_of(2) {
        return Err(field_err(
            path,
            "head_dim",
            format!("{head_dim} must be a positive even number"),
        ));
    }
    if raw.attention_bias {
        return Err(field_err(
            path,
            "attention_bias",
            "true is not supported: Qwen3 checkpoints have no attention biases",
        ));
    }
    if let Some(act) = &raw.hidden_act {
        if act != "silu" {
            return Err(field_err(
                path,
                "hidden_act",
                format!("`{act}` is not supported; only silu"),
            ));
        }
    }
    let (rope_theta, rope_scaling) = parse_rope_scaling(path, raw)?;
    let eos_token_ids = parse_eos(path, raw.eos_token_id.as_ref())?;
    let layer_types = parse_layer_types(path, raw)?;
    let sliding_window = if layer_types.contains(&LayerType::SlidingAttention) {
        Some(raw.sliding_window.ok_or_else(|| {
            field_err(
                path,
                "sliding_window",
                "layer_types has sliding_attention layers but sliding_window is not set",
            )
        })?)
    } else {
        None
    };
    Ok(Qwen3Config {
        vocab_size: raw.vocab_size,
        hidden_size: raw.hidden_size,
        intermediate_size: raw.intermediate_size,
        num_hidden_layers: raw.num_hidden_layers,
        num_attention_heads: raw.num_attention_heads,
        num_key_value_heads: num_kv,
        head_dim,
        rms_norm_eps: raw.rms_norm_eps,
        rope_theta,
        rope_scaling,
        max_position_embeddings: raw.max_position_embeddings,
        tie_word_embeddings: raw.tie_word_embeddings,
        eos_token_ids,
        bos_token_id: raw.bos_token_id,
        layer_types,
        sliding_window,
        moe: None,
    })
}

/// Python's `round` (round half to even), which the default layer rule uses.
fn round_half_even(x: f64) -> f64 {
    let r = x.round();
    if (x - x.trunc()).abs() == 0.5 && r % 2.0 != 0.0 {
        r - x.signum()
    } else {
        r
    }
}

/// The published DFlash tap rule (z-lab `build_target_layer_ids`, SpecForge, SGLang agree):
/// one feature takes the middle layer; several are spread evenly from layer 1 to layer L-3
/// inclusive. A checkpoint without `target_layer_ids` was made with it, so loading one uses it
/// unchanged (for L >= 4, as SGLang requires).
pub fn zlab_target_layer_ids(num_target_layers: usize, num_features: usize) -> Vec<usize> {
    if num_features == 1 {
        return vec![num_target_layers / 2];
    }
    spread(1, num_target_layers as f64 - 3.0, num_features)
}

/// `n` layers evenly spaced from `lo` to `hi` inclusive, rounded as Python does.
fn spread(lo: usize, hi: f64, n: usize) -> Vec<usize> {
    let span = hi - lo as f64;
    (0..n)
        .map(|i| round_half_even(lo as f64 + i as f64 * span / (n as f64 - 1.0)) as usize)
        .collect()
}

/// The taps a new drafter gets when none are given. The published rule where it gives distinct
/// layers short of the last, i.e. on every target of at least `num_features + 3` layers (every
/// published one). On shallower targets it repeats layers (layer 1 twice for 2 features on the
/// 4-layer tiny-coder-demo) or, below 4 layers, leaves the target; there the features are spread
/// over layers 1..=L-2 (0..=L-2 when that is too few), still never the last layer. A tap on the
/// last layer is the final-normed output in transformers and z-lab (`dflash_models::taps`) but
/// not in SGLang or vLLM, so only taps below it are served alike by every engine. Only when the
/// target has no more layers than features does the last layer (and then repeats) come in.
pub fn default_target_layer_ids(num_target_layers: usize, num_features: usize) -> Vec<usize> {
    let l = num_target_layers;
    if num_features == 1 {
        return vec![(l / 2).min(l.saturating_sub(2))];
    }
    if l >= num_features + 3 {
        return zlab_target_layer_ids(l, num_features);
    }
    if l >= num_features + 2 {
        return spread(1, l as f64 - 2.0, num_features);
    }
    if l > num_features {
        return spread(0, l as f64 - 2.0, num_features);
    }
    spread(0, l as f64 - 1.0, num_features)
}

impl Qwen3Config {
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, ConfigError> {
        let path = path.as_ref();
        let (raw, value) = read_raw(path)?;
        let mut cfg = layers_from_raw(path, &raw)?;
        cfg.moe = parse_qwen3_moe(path, &value, cfg.num_hidden_layers)?;
        if cfg.layer_types.contains(&LayerType::SlidingAttention) || raw.use_sliding_window {
            return Err(field_err(
                path,
                "use_sliding_window",
                "sliding-window attention in a Qwen3 target is not supported (released Qwen3 configs set it false)",
            ));
        }
        Ok(cfg)
    }

    pub fn num_kv_groups(&self) -> usize {
        self.num_attention_heads / self.num_key_value_heads
    }

    /// Whether layer `layer`'s MLP is the sparse-MoE block.
    pub fn is_sparse(&self, layer: usize) -> bool {
        self.moe.as_ref().is_some_and(|m| m.is_sparse(layer))
    }

    /// The sparse-MoE block's shape where layer `layer` is sparse; None where it is dense.
    pub fn layer_moe(&self, layer: usize) -> Option<&MoeConfig> {
        self.moe
            .as_ref()
            .filter(|m| m.is_sparse(layer))
            .map(|m| &m.block)
    }
}

impl DFlashConfig {
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, ConfigError> {
        let path = path.as_ref();
        let (raw, _) = read_raw(path)?;
        let layers = layers_from_raw(path, &raw)?;
        let dflash = raw.dflash_config.as_ref();
        let block_size = raw
            .block_size
            .or(dflash.and_then(|d| d.block_size))
            .unwrap_or(16);
        if block_size < 2 {
            return Err(field_err(path, "block_size", format!("{block_size} is too small: a block holds the bonus token plus at least one draft")));
        }
        let mask_token_id = dflash.and_then(|d| d.mask_token_id).ok_or_else(|| {
            field_err(
                path,
                "dflash_config.mask_token_id",
                "required: the id of the mask token in the target vocabulary",
            )
        })?;
        let target_layer_ids = match dflash.and_then(|d| d.target_layer_ids.clone()) {
            Some(ids) if !ids.is_empty() => ids,
            Some(_) => {
                return Err(field_err(
                    path,
                    "dflash_config.target_layer_ids",
                    "must not be empty",
                ))
            }
            None => {
                let n = raw.num_target_layers.ok_or_else(|| {
                    field_err(
                        path,
                        "num_target_layers",
                        "needed when dflash_config.target_layer_ids is absent",
                    )
                })?;
                if n < 4 {
                    return Err(field_err(
                        path,
                        "num_target_layers",
                        format!("{n} is too small for the default layer rule (needs at least 4)"),
                    ));
                }
                zlab_target_layer_ids(n, layers.num_hidden_layers)
            }
        };
        Ok(Self {
            layers,
            block_size,
            mask_token_id,
            target_layer_ids,
        })
    }

    /// A config for a fresh drafter of `num_layers` full-attention layers shaped like `target`;
    /// `target_layer_ids` defaults to [`default_target_layer_ids`] (the published rule on
    /// every target deep enough for it).
    pub fn for_target(
        target: &Qwen3Config,
        num_layers: usize,
        block_size: usize,
        mask_token_id: u32,
        target_layer_ids: Option<Vec<usize>>,
    ) -> Self {
        let mut layers = target.clone();
        layers.num_hidden_layers = num_layers;
        layers.layer_types = vec![LayerType::FullAttention; num_layers];
        layers.sliding_window = None;
        // DFlash layers are dense whatever the target's MLPs are (z-lab's MoE-target drafters).
        layers.moe = None;
        let target_layer_ids = target_layer_ids
            .unwrap_or_else(|| default_target_layer_ids(target.num_hidden_layers, num_layers));
        Self {
            layers,
            block_size,
            mask_token_id,
            target_layer_ids,
        }
    }

    /// Checks the drafter against the target it will be paired with; the error names the file.
    pub fn check_against_target(
        &self,
        path: &Path,
        target: &Qwen3Config,
    ) -> Result<(), ConfigError> {
        self.check_against_shape(
            path,
            target.hidden_size,
            target.num_hidden_layers,
            target.vocab_size,
        )
    }

    /// [`Self::check_against_target`] for any target family, given its hidden size, depth
    /// and vocabulary.
    pub fn check_against_shape(
        &self,
        path: &Path,
        hidden_size: usize,
        num_hidden_layers: usize,
        vocab_size: usize,
    ) -> Result<(), ConfigError> {
        let target = TargetShape {
            hidden_size,
            num_hidden_layers,
            vocab_size,
        };
        if self.layers.hidden_size != target.hidden_size {
            return Err(field_err(
                path,
                "hidden_size",
                format!("drafter hidden_size {} differs from the target's {}; this drafter was made for another target", self.layers.hidden_size, target.hidden_size),
            ));
        }
        if let Some(&bad) = self
            .target_layer_ids
            .iter()
            .find(|&&id| id >= target.num_hidden_layers)
        {
            return Err(field_err(
                path,
                "dflash_config.target_layer_ids",
                format!(
                    "layer {bad} does not exist: the target has {} layers (0..{})",
                    target.num_hidden_layers,
                    target.num_hidden_layers - 1
                ),
            ));
        }
        if self.mask_token_id as usize >= target.vocab_size {
            return Err(field_err(
                path,
                "dflash_config.mask_token_id",
                format!(
                    "{} is outside the target vocabulary ({} rows)",
                    self.mask_token_id, target.vocab_size
                ),
            ));
        }
        Ok(())
    }
}

struct TargetShape {
    hidden_size: usize,
    num_hidden_layers: usize,
    vocab_size: usize,
}

/// `dir/config.json`, for error messages and loaders.
pub fn config_path(dir: &Path) -> PathBuf {
    dir.join("config.json")
}

#[cfg(test)]
mod tests;
