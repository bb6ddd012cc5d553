//! Checkpoints in the z-lab layout, plus what an exact resume needs.
//!
//! A drafter directory is `config.json` (HF `Qwen3Config` fields plus `architectures:
//! ["DFlashDraftModel"]`, `block_size`, `dflash_config {mask_token_id, target_layer_ids}`,
//! `num_target_layers`, `layer_types`) and `model.safetensors` with z-lab names (`fc.weight`,
//! `hidden_norm.weight`, `layers.N.*`, `norm.weight`), which `DFlashDrafter::load` and the
//! serving engines read. A checkpoint directory `checkpoint-NNNNNNNN` adds
//! `optimizer.safetensors` (f32 master weights and both AdamW moments),
//! `trainer_state.json` (step, batches consumed, the settings that fix the data order) and,
//! written last, `manifest.json` (size and SHA-256 of the others; `manifest.rs`).
//!
//! A checkpoint is built as `.checkpoint-N.tmp`, every file fsynced, then the directory fsynced
//! and renamed whole, so a crash leaves the previous checkpoint intact and a complete one on
//! disk. Loading takes a directory that `resume.rs` chose and verified.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use dflash_common::{DFlashConfig, LayerType, RopeScaling};
use serde_json::{json, Value};

use super::error::{TrainError, TrainResult};
use super::manifest::{self, Manifest, MANIFEST_FILE};
use crate::durable;

pub const STATE_FILE: &str = "trainer_state.json";
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
pub const CONFIG_FILE: &str = "config.json";
pub const MODEL_FILE: &str = "model.safetensors";
/// The files every checkpoint's manifest must list.
pub const CHECKPOINT_FILES: [&str; 4] = [CONFIG_FILE, MODEL_FILE, OPTIMIZER_FILE, STATE_FILE];
pub const CHECKPOINT_PREFIX: &str = "checkpoint-";

/// What must match for a resumed run to see the same data in the same order.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct RunFingerprint {
    pub datasets: Vec<String>,
    pub max_records: Option<usize>,
    pub max_len: usize,
    pub min_supervised: usize,
    pub plan: super::plan::PlanConfig,
    pub num_anchors: usize,
    pub grad_accum: usize,
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct TrainerState {
    /// Optimizer steps taken (skipped non-finite steps included).
    pub step: usize,
    /// Trainer batches consumed.
    pub batches: usize,
    /// AdamW updates applied.
    pub adam_t: u64,
    pub skipped_steps: usize,
    pub nonfinite_in_row: usize,
    pub total_steps: usize,
    pub fingerprint: RunFingerprint,
}

/// The optimizer state as a checkpoint stores it, per tensor in checkpoint order: the f32
/// master weights and both moments (on any device; written as f32). Both optimizers
/// (`optimizer.rs`) save and restore through this, so a checkpoint is the same whichever ran.
pub struct OptimizerTensors {
    pub params: Vec<(String, Tensor)>,
    pub m: Vec<Tensor>,
    pub v: Vec<Tensor>,
}

fn ckpt_err(path: &Path, message: impl Into<String>) -> TrainError {
    TrainError::Checkpoint {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

/// Writes `bytes` to `path` durably (`durable::write_atomic`); the error names the file.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> TrainResult<()> {
    durable::write_atomic(path, bytes).map_err(|e| ckpt_err(path, format!("cannot write: {e}")))
}

fn rope_scaling_json(r: &RopeScaling) -> Value {
    match r {
        RopeScaling::Default => Value::Null,
        RopeScaling::Linear { factor } => json!({"rope_type": "linear", "factor": factor}),
        RopeScaling::Yarn {
            factor,
            original_max_position_embeddings,
            beta_fast,
            beta_slow,
            attention_factor,
        } => json!({
            "rope_type": "yarn",
            "factor": factor,
            "original_max_position_embeddings": original_max_position_embeddings,
            "beta_fast": beta_fast,
            "beta_slow": beta_slow,
            "attention_factor": attention_factor,
        }),
    }
}

/// The z-lab `config.json` of a drafter.
pub fn zlab_config(cfg: &DFlashConfig, num_target_layers: usize, dtype: DType) -> Value {
    let l = &cfg.layers;
    let layer_types: Vec<&str> = l
        .layer_types
        .iter()
        .map(|t| match t {
            LayerType::FullAttention => "full_attention",
            LayerType::SlidingAttention => "sliding_attention",
        })
        .collect();
    let sliding = l.layer_types.contains(&LayerType::SlidingAttention);
    json!({
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3",
        "block_size": cfg.block_size,
        "dflash_config": {
            "mask_token_id": cfg.mask_token_id,
            "target_layer_ids": cfg.target_layer_ids,
        },
        "num_target_layers": num_target_layers,
        "layer_types": layer_types,
        "use_sliding_window": sliding,
        "sliding_window": l.sliding_window,
        "max_window_layers": l.num_hidden_layers,
        "vocab_size": l.vocab_size,
        "hidden_size": l.hidden_size,
        "intermediate_size": l.intermediate_size,
        "num_hidden_layers": l.num_hidden_layers,
        "num_attention_heads": l.num_attention_heads,
        "num_key_value_heads": l.num_key_value_heads,
        "head_dim": l.head_dim,
        "hidden_act": "silu",
        "attention_bias": false,
        "attention_dropout": 0.0,
        "rms_norm_eps": l.rms_norm_eps,
        "rope_theta": l.rope_theta,
        "rope_scaling": rope_scaling_json(&l.rope_scaling),
        "max_position_embeddings": l.max_position_embeddings,
        "tie_word_embeddings": false,
        "bos_token_id": l.bos_token_id,
        "eos_token_id": l.eos_token_ids,
        "torch_dtype": if dtype == DType::BF16 { "bfloat16" } else { "float32" },
    })
}

fn safetensors_bytes(
    tensors: &[(String, Tensor)],
    dtype: Option<DType>,
    path: &Path,
) -> TrainResult<Vec<u8>> {
    let converted = tensors
        .iter()
        .map(|(n, t)| {
            let t = t.to_device(&Device::Cpu)?;
            Ok((
                n.clone(),
                match dtype {
                    Some(d) => t.to_dtype(d)?,
                    None => t,
                },
            ))
        })
        .collect::<candle_core::Result<Vec<_>>>()?;
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize(converted, Some(meta))
        .map_err(|e| ckpt_err(path, format!("cannot serialize: {e}")))
}

/// `config.json` and `model.safetensors` of a drafter, as the bytes to write.
fn drafter_files(
    cfg: &DFlashConfig,
    num_target_layers: usize,
    tensors: &[(String, Tensor)],
    dtype: DType,
    dir: &Path,
) -> TrainResult<[(&'static str, Vec<u8>); 2]> {
    let config = serde_json::to_string_pretty(&zlab_config(cfg, num_target_layers, dtype))
        .expect("config serializes");
    let model = safetensors_bytes(tensors, Some(dtype), &dir.join(MODEL_FILE))?;
    Ok([(MODEL_FILE, model), (CONFIG_FILE, config.into_bytes())])
}

/// Writes `config.json` and `model.safetensors` of a drafter into `dir` (which must exist).
pub fn write_drafter(
    dir: &Path,
    cfg: &DFlashConfig,
    num_target_layers: usize,
    tensors: &[(String, Tensor)],
    dtype: DType,
) -> TrainResult<()> {
    for (name, bytes) in drafter_files(cfg, num_target_layers, tensors, dtype, dir)? {
        write_atomic(&dir.join(name), &bytes)?;
    }
    Ok(())
}

/// Writes a full checkpoint under `out/checkpoint-{step}` and keeps the newest `keep` ones.
#[allow(clippy::too_many_arguments)]
pub fn save_checkpoint(
    out: &Path,
    cfg: &DFlashConfig,
    num_target_layers: usize,
    opt: &OptimizerTensors,
    state: &TrainerState,
    save_dtype: DType,
    keep: usize,
) -> TrainResult<PathBuf> {
    let name = format!("{CHECKPOINT_PREFIX}{:08}", state.step);
    let tmp = out.join(format!(".{name}.tmp"));
    let fin = out.join(&name);
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).map_err(|e| ckpt_err(&tmp, format!("cannot create: {e}")))?;
    let params = &opt.params;
    let mut files = Vec::from(drafter_files(
        cfg,
        num_target_layers,
        params,
        save_dtype,
        &tmp,
    )?);
    let mut opt_tensors = Vec::with_capacity(params.len() * 3);
    for (i, (n, p)) in params.iter().enumerate() {
        opt_tensors.push((format!("param.{n}"), p.clone()));
        opt_tensors.push((format!("m.{n}"), opt.m[i].clone()));
        opt_tensors.push((format!("v.{n}"), opt.v[i].clone()));
    }
    let opt_bytes = safetensors_bytes(&opt_tensors, Some(DType::F32), &tmp.join(OPTIMIZER_FILE))?;
    files.push((OPTIMIZER_FILE, opt_bytes));
    let state_json = serde_json::to_string_pretty(state).expect("state serializes");
    files.push((STATE_FILE, state_json.into_bytes()));
    // The manifest digests the very bytes handed to the file system, and is written only once
    // they are all on disk: a manifest never vouches for a file that was not fully written.
    let mut manifest = Manifest::default();
    for (file, bytes) in &files {
        let path = tmp.join(file);
        durable::write_synced(&path, bytes)
            .map_err(|e| ckpt_err(&path, format!("cannot write: {e}")))?;
        manifest.add(file, bytes);
    }
    let manifest_path = tmp.join(MANIFEST_FILE);
    durable::write_synced(&manifest_path, manifest.to_json().as_bytes())
        .and_then(|_| durable::sync_dir(&tmp))
        .map_err(|e| ckpt_err(&manifest_path, format!("cannot write: {e}")))?;
    if fin.exists() {
        std::fs::remove_dir_all(&fin)
            .map_err(|e| ckpt_err(&fin, format!("cannot replace: {e}")))?;
    }
    std::fs::rename(&tmp, &fin)
        .and_then(|_| durable::sync_dir(out))
        .map_err(|e| ckpt_err(&fin, format!("cannot rename into place: {e}")))?;
    let mut all = list_checkpoints(out);
    while all.len() > keep.max(1) {
        let (_, old) = all.remove(0);
        if let Err(e) = std::fs::remove_dir_all(&old) {
            tracing::warn!("cannot remove old checkpoint {}: {e}", old.display());
        }
    }
    Ok(fin)
}

/// The step of a `checkpoint-N` directory name (`None` for anything else, `.corrupt` included).
pub fn checkpoint_step(name: &str) -> Option<usize> {
    name.strip_prefix(CHECKPOINT_PREFIX)?.parse().ok()
}

/// Checks `dir` against its manifest (see `manifest.rs`).
pub fn verify_checkpoint(dir: &Path) -> Result<Manifest, manifest::IntegrityError> {
    manifest::verify(dir, &CHECKPOINT_FILES)
}

/// The newest checkpoint in `out` that verifies: what "the last good checkpoint" means.
pub fn newest_verified(out: &Path) -> Option<PathBuf> {
    list_checkpoints(out)
        .into_iter()
        .rev()
        .map(|(_, dir)| dir)
        .find(|dir| verify_checkpoint(dir).is_ok())
}

/// `checkpoint-N` directories in `out`, oldest first.
pub fn list_checkpoints(out: &Path) -> Vec<(usize, PathBuf)> {
    let mut v: Vec<(usize, PathBuf)> = std::fs::read_dir(out)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let step = checkpoint_step(&e.file_name().to_string_lossy())?;
            Some((step, e.path()))
        })
        .collect();
    v.sort();
    v
}

pub struct LoadedCheckpoint {
    pub dir: PathBuf,
    pub cfg: DFlashConfig,
    pub params: Vec<(String, Tensor)>,
    pub m: Vec<Tensor>,
    pub v: Vec<Tensor>,
    pub state: TrainerState,
}

/// Loads the checkpoint directory `dir` (verified first by the caller: see `resume.rs`).
pub fn load_checkpoint(dir: &Path, device: &Device) -> TrainResult<LoadedCheckpoint> {
    let dir = dir.to_path_buf();
    let state_path = dir.join(STATE_FILE);
    let text = std::fs::read_to_string(&state_path)
        .map_err(|e| ckpt_err(&state_path, format!("cannot read: {e}")))?;
    let state: TrainerState = serde_json::from_str(&text)
        .map_err(|e| ckpt_err(&state_path, format!("corrupt trainer state: {e}")))?;
    let cfg = DFlashConfig::from_file(dir.join(CONFIG_FILE))?;
    let opt_path = dir.join(OPTIMIZER_FILE);
    let mut tensors = candle_core::safetensors::load(&opt_path, device)
        .map_err(|e| ckpt_err(&opt_path, format!("corrupt optimizer state: {e}")))?;
    let shapes = dflash_models::DFlashDrafter::parameter_shapes(&cfg);
    let (mut params, mut m, mut v) = (Vec::new(), Vec::new(), Vec::new());
    for (name, shape) in shapes {
        let mut take = |kind: &str| {
            let key = format!("{kind}.{name}");
            let t = tensors
                .remove(&key)
                .ok_or_else(|| ckpt_err(&opt_path, format!("tensor `{key}` is missing")))?;
            if t.dims() != shape.as_slice() || t.dtype() != DType::F32 {
                return Err(ckpt_err(
                    &opt_path,
                    format!(
                        "tensor `{key}` is {:?} {:?}, expected F32 {shape:?}",
                        t.dtype(),
                        t.dims()
                    ),
                ));
            }
            Ok(t)
        };
        params.push((name.clone(), take("param")?));
        m.push(take("m")?);
        v.push(take("v")?);
    }
    Ok(LoadedCheckpoint {
        dir,
        cfg,
        params,
        m,
        v,
        state,
    })
}
