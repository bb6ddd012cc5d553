//! Everything a run needs before its first step: the output directory, the drafter config (fresh,
//! from a file, or from the checkpoint being resumed), the target's frozen embedding and head
//! on the drafter device, the target workers, and the initial parameters.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor, Var};
use dflash_common::{DFlashConfig, Qwen3Config, WeightFiles};
use dflash_models::random::WeightRng;
use dflash_models::{DFlashDrafter, OpsMode, TargetEmbeddingsAndHead};

use super::error::{TrainError, TrainResult};
use super::{ComputeDtype, TrainArgs};
use crate::tap_compat::last_layer_tap_warning;

/// HF's `initializer_range` for Qwen3: linear weights start as N(0, 0.02), norms as ones.
const INIT_STD: f32 = 0.02;

/// Creates `dir` and proves it writable, so a run never trains for hours and then fails to save.
pub fn check_output_dir(dir: &Path) -> TrainResult<()> {
    let err = |message: String| TrainError::OutputDir {
        path: dir.to_path_buf(),
        message,
    };
    std::fs::create_dir_all(dir).map_err(|e| err(e.to_string()))?;
    let probe = dir.join(format!(".write-probe-{}", std::process::id()));
    std::fs::write(&probe, b"ok").map_err(|e| err(e.to_string()))?;
    let _ = std::fs::remove_file(&probe);
    Ok(())
}

pub fn compute_dtype(flag: ComputeDtype, device: &Device) -> DType {
    match flag {
        ComputeDtype::F32 => DType::F32,
        ComputeDtype::Bf16 => DType::BF16,
        ComputeDtype::Auto if device.is_cpu() => DType::F32,
        ComputeDtype::Auto => DType::BF16,
    }
}

/// The config of a fresh drafter from `--drafter-config` or the shape flags, checked against
/// the target; errors name the flag or file to change.
pub fn fresh_config(
    args: &TrainArgs,
    target: &Qwen3Config,
    mask_from_tokenizer: Option<u32>,
) -> TrainResult<DFlashConfig> {
    let from_file = args
        .drafter_config
        .clone()
        .or_else(|| args.init_drafter.as_ref().map(|d| d.join("config.json")));
    if let Some(path) = &from_file {
        let cfg = DFlashConfig::from_file(path)?;
        cfg.check_against_target(path, target)
            .map_err(|e| TrainError::DrafterMismatch(e.to_string()))?;
        return Ok(cfg);
    }
    let mask = args.mask_token_id.or(mask_from_tokenizer).ok_or(TrainError::Flag {
        flag: "--mask-token-id",
        message: "the tokenizer has no `<|MASK|>` token; pass the id of an unused row of the target's embedding".into(),
    })?;
    if mask as usize >= target.vocab_size {
        return Err(TrainError::DrafterMismatch(format!(
            "--mask-token-id {mask} is outside the target vocabulary ({} rows)",
            target.vocab_size
        )));
    }
    if args.block_size < 2 {
        return Err(TrainError::Flag {
            flag: "--block-size",
            message: format!(
                "{} is too small: a block holds the bonus token plus at least one draft",
                args.block_size
            ),
        });
    }
    if args.num_draft_layers == 0 {
        return Err(TrainError::Flag {
            flag: "--num-draft-layers",
            message: "must be at least 1".into(),
        });
    }
    if let Some(ids) = &args.target_layer_ids {
        if let Some(&bad) = ids.iter().find(|&&i| i >= target.num_hidden_layers) {
            return Err(TrainError::DrafterMismatch(format!(
                "--target-layer-ids has layer {bad}, but the target has {} layers (0..{})",
                target.num_hidden_layers,
                target.num_hidden_layers - 1
            )));
        }
        if ids.is_empty() {
            return Err(TrainError::Flag {
                flag: "--target-layer-ids",
                message: "must name at least one layer".into(),
            });
        }
    }
    let mut cfg = DFlashConfig::for_target(
        target,
        args.num_draft_layers,
        args.block_size,
        mask,
        args.target_layer_ids.clone(),
    );
    if let Some(i) = args.draft_intermediate_size {
        cfg.layers.intermediate_size = i;
    }
    Ok(cfg)
}

/// Warns when the drafter taps the target's last layer, which SGLang and vLLM would serve
/// otherwise than this project does ([`crate::tap_compat`]).
pub fn warn_on_last_layer_tap(cfg: &DFlashConfig, target: &Qwen3Config) {
    if let Some(w) = last_layer_tap_warning(&cfg.target_layer_ids, target.num_hidden_layers) {
        tracing::warn!("{w}");
    }
}

/// The target's embedding and LM head, loaded straight onto the drafter device.
pub fn load_embeddings_and_head(
    target_dir: &Path,
    target: &Qwen3Config,
    dtype: DType,
    device: &Device,
    max_positions: usize,
) -> TrainResult<TargetEmbeddingsAndHead> {
    let w = WeightFiles::open_dir(target_dir)?;
    let shape = [target.vocab_size, target.hidden_size];
    let embed_tokens = w.tensor("model.embed_tokens.weight", &shape, dtype, device)?;
    let lm_head = if target.tie_word_embeddings && !w.contains("lm_head.weight") {
        embed_tokens.clone()
    } else {
        w.tensor("lm_head.weight", &shape, dtype, device)?
    };
    Ok(TargetEmbeddingsAndHead {
        embed_tokens,
        lm_head,
        max_positions,
    })
}

/// Seeded fresh parameters (f32), in checkpoint order. With `from_target = Some(layers)`,
/// draft layer `i` starts as a copy of target layer `layers[i]` and the final norm as the
/// target's (`fc` and `hidden_norm` stay fresh): an opt-in warm start for short budgets, not
/// part of the published recipe.
pub fn init_params(
    cfg: &DFlashConfig,
    seed: u64,
    device: &Device,
    target_dir: Option<&Path>,
    from_target: Option<&[usize]>,
) -> TrainResult<Vec<(String, Tensor)>> {
    let mut rng = WeightRng::new(seed);
    let target = from_target
        .map(|layers| {
            if layers.len() != cfg.layers.num_hidden_layers {
                return Err(TrainError::Flag {
                    flag: "--init-from-target-layers",
                    message: format!(
                        "names {} layers but the drafter has {}",
                        layers.len(),
                        cfg.layers.num_hidden_layers
                    ),
                });
            }
            let dir = target_dir.ok_or(TrainError::Flag {
                flag: "--init-from-target-layers",
                message: "needs a target checkpoint directory, not a random target".into(),
            })?;
            Ok((WeightFiles::open_dir(dir)?, layers))
        })
        .transpose()?;
    DFlashDrafter::parameter_shapes(cfg)
        .into_iter()
        .map(|(name, shape)| {
            let source = target.as_ref().and_then(|(_, layers)| {
                if name == "norm.weight" {
                    return Some("model.norm.weight".to_string());
                }
                let rest = name.strip_prefix("layers.")?;
                let (i, tail) = rest.split_once('.')?;
                Some(format!(
                    "model.layers.{}.{tail}",
                    layers[i.parse::<usize>().ok()?]
                ))
            });
            let t = match (source, &target) {
                (Some(src), Some((w, _))) => w.tensor(&src, &shape, DType::F32, device)?,
                _ if shape.len() == 1 => Tensor::ones(shape.as_slice(), DType::F32, device)?,
                _ => rng.normal(&shape, 0.0, INIT_STD, DType::F32, device)?,
            };
            Ok((name, t))
        })
        .collect()
}

/// The f32 parameters of an existing z-lab drafter (`--init-drafter`), in checkpoint order.
pub fn load_params(
    cfg: &DFlashConfig,
    dir: &Path,
    device: &Device,
) -> TrainResult<Vec<(String, Tensor)>> {
    let w = WeightFiles::open_dir(dir)?;
    DFlashDrafter::parameter_shapes(cfg)
        .into_iter()
        .map(|(name, shape)| {
            let t = w.tensor(&name, &shape, DType::F32, device)?;
            Ok((name, t))
        })
        .collect()
}

pub fn to_vars(params: Vec<(String, Tensor)>) -> TrainResult<Vec<(String, Var)>> {
    params
        .into_iter()
        .map(|(n, t)| Ok((n, Var::from_tensor(&t)?)))
        .collect()
}

/// A drafter whose weights are the trainable variables (cast to `dtype` when it is not f32,
/// which keeps the cast in the graph so gradients reach the f32 masters). With `tracked`
/// false the weights are detached views (same storage, so the optimizer's updates show): the
/// explicit engine's ops then record no autograd graph, which would keep every intermediate
/// alive until the step ends.
pub fn drafter_from_vars(
    cfg: &DFlashConfig,
    params: &[(String, Var)],
    parts: &TargetEmbeddingsAndHead,
    dtype: DType,
    tracked: bool,
) -> TrainResult<DFlashDrafter> {
    let tensors = params
        .iter()
        .map(|(n, v)| {
            let t = if tracked {
                v.as_tensor().clone()
            } else {
                v.as_tensor().detach()
            };
            let t = &t;
            let t = if t.dtype() == dtype {
                t.clone()
            } else {
                t.to_dtype(dtype)?
            };
            Ok((n.clone(), t))
        })
        .collect::<TrainResult<HashMap<_, _>>>()?;
    Ok(DFlashDrafter::from_tensors(
        cfg.clone(),
        &tensors,
        parts,
        OpsMode::Differentiable,
    )?)
}
