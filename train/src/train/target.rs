//! The frozen target of a run: a checkpoint directory, or random weights of a published shape
//! (`random:qwen3-8b`) or of any `config.json` (`random:path/config.json`).
//!
//! Random targets exist for throughput runs: the cost of a training step depends only on the
//! shapes, so a Qwen3-8B-shaped target with random weights measures what a real one would
//! without a 16 GB download (the GPU machine has no network). They have no tokenizer, so they
//! pair with the synthetic dataset (`--dataset synthetic:...`).

use std::path::{Path, PathBuf};
use std::str::FromStr;

use candle_core::{DType, Device};
use dflash_common::chat::ChatTemplate;
use dflash_common::tokenizer::Tokenizer;
use dflash_common::{LayerType, Qwen3Config, RopeScaling};
use dflash_models::random::WeightRng;
use dflash_models::{OpsMode, Qwen3Model, TargetEmbeddingsAndHead};

use super::error::{TrainError, TrainResult};
use super::pipeline::TargetWorker;
use super::setup::{self, compute_dtype};
use super::{ComputeDtype, DeviceSpec};

/// `--target-model`: a directory, or `random:<shape|config.json>[,seed=N]`.
#[derive(Debug, Clone, PartialEq)]
pub enum TargetSpec {
    Dir(PathBuf),
    Random { shape: RandomShape, seed: u64 },
}

#[derive(Debug, Clone, PartialEq)]
pub enum RandomShape {
    /// A published shape by name (see [`PUBLISHED_SHAPES`]).
    Named(String),
    /// The shape of a Qwen3 `config.json`.
    Config(PathBuf),
}

/// Names accepted by `random:<name>`.
pub const PUBLISHED_SHAPES: &[&str] = &[
    "tiny",
    "qwen3-0.6b",
    "qwen3-1.7b",
    "qwen3-4b",
    "qwen3-8b",
    "qwen3-14b",
];

impl FromStr for TargetSpec {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let Some(rest) = s.strip_prefix("random:") else {
            return Ok(Self::Dir(PathBuf::from(s)));
        };
        let mut parts = rest.split(',');
        let name = parts.next().unwrap_or_default().trim();
        let mut seed = 0;
        for p in parts {
            match p.split_once('=') {
                Some(("seed", v)) => {
                    seed = v
                        .parse()
                        .map_err(|_| format!("`{v}` is not a seed (an integer)"))?
                }
                _ => return Err(format!("unknown random-target option `{p}`; only seed=N")),
            }
        }
        let shape = if name.ends_with(".json") {
            RandomShape::Config(PathBuf::from(name))
        } else if PUBLISHED_SHAPES.contains(&name.to_ascii_lowercase().as_str()) {
            RandomShape::Named(name.to_ascii_lowercase())
        } else {
            return Err(format!(
                "unknown random target shape `{name}`; use one of {} or a config.json path",
                PUBLISHED_SHAPES.join(", ")
            ));
        };
        Ok(Self::Random { shape, seed })
    }
}

impl std::fmt::Display for TargetSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Dir(p) => write!(f, "{}", p.display()),
            Self::Random {
                shape: RandomShape::Named(n),
                seed,
            } => write!(f, "random:{n},seed={seed}"),
            Self::Random {
                shape: RandomShape::Config(p),
                seed,
            } => write!(f, "random:{},seed={seed}", p.display()),
        }
    }
}

/// The Qwen3 config of a published shape (the fields the forward depends on).
pub fn published_config(name: &str) -> Option<Qwen3Config> {
    // (vocab, hidden, intermediate, layers, heads, kv heads, head_dim, tied)
    let (v, h, i, l, nh, kv, hd, tie) = match name {
        "tiny" => (512, 64, 128, 4, 4, 2, 16, true),
        "qwen3-0.6b" => (151936, 1024, 3072, 28, 16, 8, 128, true),
        "qwen3-1.7b" => (151936, 2048, 6144, 28, 16, 8, 128, true),
        "qwen3-4b" => (151936, 2560, 9728, 36, 32, 8, 128, true),
        "qwen3-8b" => (151936, 4096, 12288, 36, 32, 8, 128, false),
        "qwen3-14b" => (151936, 5120, 17408, 40, 40, 8, 128, false),
        _ => return None,
    };
    Some(Qwen3Config {
        vocab_size: v,
        hidden_size: h,
        intermediate_size: i,
        num_hidden_layers: l,
        num_attention_heads: nh,
        num_key_value_heads: kv,
        head_dim: hd,
        rms_norm_eps: 1e-6,
        rope_theta: 1e6,
        rope_scaling: RopeScaling::Default,
        max_position_embeddings: 40960,
        tie_word_embeddings: tie,
        eos_token_ids: if v > 151645 { vec![151645] } else { vec![] },
        bos_token_id: None,
        layer_types: vec![LayerType::FullAttention; l],
        sliding_window: None,
        moe: None,
    })
}

/// A resolved target: its config, and for checkpoints its tokenizer and chat template.
pub struct Target {
    pub spec: TargetSpec,
    pub config: Qwen3Config,
    /// File named in errors about the target's shape (config.json, or the spec).
    pub config_path: PathBuf,
    pub text: Option<(Tokenizer, ChatTemplate)>,
}

impl Target {
    pub fn open(spec: &TargetSpec) -> TrainResult<Self> {
        match spec {
            TargetSpec::Dir(dir) => {
                let config_path = dir.join("config.json");
                let config = Qwen3Config::from_file(&config_path)?;
                let tok = Tokenizer::from_dir(dir)?;
                let template = ChatTemplate::from_model(dir, tok.config(), None)?;
                Ok(Self {
                    spec: spec.clone(),
                    config,
                    config_path,
                    text: Some((tok, template)),
                })
            }
            TargetSpec::Random { shape, .. } => {
                let (config, config_path) = match shape {
                    RandomShape::Named(n) => (
                        published_config(n).expect("names are checked when parsed"),
                        PathBuf::from(format!("random:{n}")),
                    ),
                    RandomShape::Config(p) => (Qwen3Config::from_file(p)?, p.clone()),
                };
                Ok(Self {
                    spec: spec.clone(),
                    config,
                    config_path,
                    text: None,
                })
            }
        }
    }

    pub fn dir(&self) -> Option<&Path> {
        match &self.spec {
            TargetSpec::Dir(d) => Some(d),
            TargetSpec::Random { .. } => None,
        }
    }

    /// The default mask token: the tokenizer's `<|MASK|>`; for random targets z-lab's Qwen3 id
    /// (151669) when the vocabulary has it, else the last row.
    pub fn default_mask_token(&self) -> Option<u32> {
        match &self.text {
            Some((tok, _)) => tok.token_to_id("<|MASK|>"),
            None if self.config.vocab_size > 151669 => Some(151669),
            None => Some(self.config.vocab_size as u32 - 1),
        }
    }

    fn weight_rng(&self, device: &Device) -> WeightRng {
        match (&self.spec, device.is_cpu()) {
            // Reproducible (and equal on every CPU worker) where it is cheap.
            (TargetSpec::Random { seed, .. }, true) => WeightRng::new(*seed),
            // Billions of weights: the device's own generator (seconds instead of minutes).
            _ => WeightRng::on_device(),
        }
    }

    /// One frozen target per `--target-devices` entry (fused kernels, no gradients), cut
    /// after the deepest of `taps` (the layers after it would only be computed and thrown
    /// away). A worker on a drafter replica's GPU keeps its features there.
    pub fn load_workers(
        &self,
        devices: &[DeviceSpec],
        compute: ComputeDtype,
        max_positions: usize,
        taps: &[usize],
        drafters: &[Device],
    ) -> TrainResult<Vec<TargetWorker>> {
        let last_tap = taps
            .iter()
            .copied()
            .max()
            .unwrap_or(self.config.num_hidden_layers - 1);
        devices
            .iter()
            .map(|spec| {
                let device = spec.open("--target-devices")?;
                let dtype = compute_dtype(compute, &device);
                let model = match self.dir() {
                    Some(dir) => {
                        Qwen3Model::load(dir, dtype, &device, max_positions, OpsMode::Fused)?
                    }
                    None => Qwen3Model::random_with(
                        self.config.clone(),
                        &mut self.weight_rng(&device),
                        dtype,
                        &device,
                        max_positions,
                        OpsMode::Fused,
                    )?,
                };
                let model = model.stop_after_layer(last_tap)?;
                // The weights were written on this thread's stream; the worker thread launches
                // on its own, so they must be complete before it starts.
                device.synchronize()?;
                Ok(TargetWorker {
                    device: spec.to_string(),
                    keep_on_device: !device.is_cpu()
                        && drafters.iter().any(|d| device.same_device(d)),
                    model,
                })
            })
            .collect()
    }

    /// The embedding and LM head on the drafter device: the tensors of a worker on the same
    /// device when there is one (no second copy of a 1.2 GB embedding and head; devices are
    /// opened once per GPU, see [`DeviceSpec::open`]), else loaded from the checkpoint, or for a
    /// random target drawn again (equal to the workers' on CPU for the embedding and a tied
    /// head).
    pub fn embeddings_and_head(
        &self,
        workers: &[TargetWorker],
        dtype: DType,
        device: &Device,
        max_positions: usize,
    ) -> TrainResult<TargetEmbeddingsAndHead> {
        if let Some(w) = workers
            .iter()
            .find(|w| w.model.device().same_device(device))
        {
            let cast = |t: &candle_core::Tensor| t.to_dtype(dtype);
            return Ok(TargetEmbeddingsAndHead {
                embed_tokens: cast(w.model.embed_weight())?,
                lm_head: cast(w.model.lm_head_weight())?,
                max_positions,
            });
        }
        if let Some(dir) = self.dir() {
            return setup::load_embeddings_and_head(
                dir,
                &self.config,
                dtype,
                device,
                max_positions,
            );
        }
        let (v, h) = (self.config.vocab_size, self.config.hidden_size);
        let mut rng = self.weight_rng(device);
        let embed_tokens = rng.normal(&[v, h], 0.0, 1.0, dtype, device)?;
        let lm_head = if self.config.tie_word_embeddings {
            embed_tokens.clone()
        } else {
            rng.linear(v, h, dtype, device)?
        };
        Ok(TargetEmbeddingsAndHead {
            embed_tokens,
            lm_head,
            max_positions,
        })
    }

    /// Refuses options that need the target's files.
    pub fn require_dir(&self, flag: &'static str) -> TrainResult<&Path> {
        self.dir().ok_or_else(|| TrainError::Flag {
            flag,
            message: format!(
                "needs a target checkpoint directory, but --target-model is {}",
                self.spec
            ),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_specs_parse_and_unknown_shapes_are_refused() {
        assert_eq!(
            "random:qwen3-8b".parse::<TargetSpec>().unwrap(),
            TargetSpec::Random {
                shape: RandomShape::Named("qwen3-8b".into()),
                seed: 0
            }
        );
        assert_eq!(
            "random:cfg/config.json,seed=3"
                .parse::<TargetSpec>()
                .unwrap(),
            TargetSpec::Random {
                shape: RandomShape::Config("cfg/config.json".into()),
                seed: 3
            }
        );
        assert_eq!(
            "some/dir".parse::<TargetSpec>().unwrap(),
            TargetSpec::Dir("some/dir".into())
        );
        let e = "random:qwen9".parse::<TargetSpec>().unwrap_err();
        assert!(e.contains("qwen3-8b"), "{e}");
        for n in PUBLISHED_SHAPES {
            let c = published_config(n).unwrap();
            assert_eq!(c.layer_types.len(), c.num_hidden_layers);
        }
    }
}
