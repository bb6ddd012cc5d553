//! The real engine behind the boundary: `dflash_models::speculative::Engine` with the target (Qwen3,
//! or a Qwen3.5 / Qwen3.6 / Qwen3-Next hybrid, picked by its config.json) and, when speculating,
//! a DFlash drafter or the target's built-in MTP head as its proposer. Only this file knows both
//! sides' types.

use std::path::Path;

use candle_core::{DType as CandleDType, Device};
use dflash_common::WeightFiles;
use dflash_models::qwen3_5::MtpHead;
use dflash_models::speculative::{
    Algorithm, DFlashProposer, Engine, EngineConfig, FinishReason, GenerationRequest, MtpProposer,
    Proposer, SamplingParams,
};
use dflash_models::{DFlashDrafter, OpsMode, Target};

use super::{
    AdmitError, EngineFinish, EngineInfo, EngineRequest, SeqId, StepEngine, StepError, StepEvent,
};
use crate::config::{DType, DeviceSpec, DraftSource, ServeConfig, SpeculativeConfig, VerifyMode};

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("--device {device}: {message}")]
    Device { device: String, message: String },
    #[error("loading the target model from {dir}: {message}")]
    Target { dir: String, message: String },
    #[error("{flag} {spec}: {message}")]
    Drafter {
        flag: &'static str,
        spec: String,
        message: String,
    },
    #[error("--speculative-num-draft-tokens {given} does not match the drafter's block_size {block_size}; drop the flag or pass {block_size}")]
    BlockSize { given: usize, block_size: usize },
    #[error("--speculative-algorithm NEXTN: {message}")]
    Mtp { message: String },
}

pub struct RealEngine {
    engine: Engine,
    algorithm: Algorithm,
}

fn device(spec: DeviceSpec) -> Result<Device, LoadError> {
    match spec {
        DeviceSpec::Cpu => Ok(Device::Cpu),
        DeviceSpec::Cuda(i) => Device::new_cuda(i).map_err(|e| LoadError::Device {
            device: format!("cuda:{i}"),
            message: format!(
                "{e} (build with `--features cuda` on a machine with a GPU, or use --device cpu)"
            ),
        }),
    }
}

fn dtype(d: DType, device: &Device) -> CandleDType {
    match d {
        DType::Auto if device.is_cuda() => CandleDType::BF16,
        DType::Auto | DType::Float32 => CandleDType::F32,
        DType::BFloat16 => CandleDType::BF16,
        DType::Float16 => CandleDType::F16,
    }
}

impl RealEngine {
    /// Loads the target from `model_dir` (and the drafter: a DFlash model for `DFLASH`, the
    /// checkpoint's `mtp.*` head for `NEXTN`) for sequences of up to `context_length` tokens.
    pub fn load(
        config: &ServeConfig,
        model_dir: &Path,
        context_length: usize,
        eos_token_ids: Vec<u32>,
    ) -> Result<Self, LoadError> {
        let device = device(config.device)?;
        let dtype = dtype(config.dtype, &device);
        let target = Target::load(model_dir, dtype, &device, context_length, OpsMode::Fused)
            .map_err(|e| LoadError::Target {
                dir: model_dir.display().to_string(),
                message: e.to_string(),
            })?;
        let (proposer, algorithm, budget) = match &config.speculative {
            None => (None, Algorithm::Plain, 0),
            Some(spec) => {
                let proposer = match &spec.draft {
                    DraftSource::TargetMtp => mtp_proposer(&target, model_dir, spec)?,
                    DraftSource::Path(_) | DraftSource::ZLab { .. } => {
                        dflash_proposer(&target, spec)?
                    }
                };
                match spec.verify {
                    VerifyMode::Chain => (Some(proposer), Algorithm::Chain, 0),
                    VerifyMode::DDTree { budget } => {
                        (Some(proposer), Algorithm::DDTree { budget }, budget)
                    }
                }
            }
        };
        if let Target::Hybrid(m) = &target {
            log_recurrent_memory(m.config(), dtype, algorithm, proposer.as_deref(), config);
        }
        let engine = Engine::new(
            target,
            proposer,
            EngineConfig {
                max_context: context_length,
                max_ddtree_budget: budget,
                eos_token_ids,
                seed: 0,
            },
        );
        Ok(Self { engine, algorithm })
    }
}

/// Tells the operator what hybrid verification costs beyond the K/V cache: every verified row
/// keeps its own recurrent state until the commit (147 MiB a row at the Qwen3.6-27B shape), and
/// `--max-total-tokens` admission does not count it.
fn log_recurrent_memory(
    cfg: &dflash_common::HybridConfig,
    dtype: CandleDType,
    algorithm: Algorithm,
    proposer: Option<&dyn Proposer>,
    config: &ServeConfig,
) {
    let per_row =
        cfg.num_linear_layers() * cfg.recurrent_state_bytes_per_layer(dtype.size_in_bytes());
    let rows = 1 + match algorithm {
        Algorithm::Plain => 0,
        Algorithm::Chain => proposer.map_or(0, |p| p.max_depth()),
        Algorithm::DDTree { budget } => budget,
    };
    let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
    tracing::info!(
        "hybrid target: {} of {} layers are Gated DeltaNet; a verify keeps {rows} recurrent-state rows of {:.1} MiB per sequence ({:.2} GiB; {:.1} GiB at --max-running-requests {})",
        cfg.num_linear_layers(),
        cfg.num_hidden_layers,
        per_row as f64 / (1u64 << 20) as f64,
        gib(rows * per_row),
        gib(rows * per_row * config.max_running_requests),
        config.max_running_requests,
    );
}

/// The DFlash drafter for either target family; its taps may sit on any target layer,
/// recurrent ones included.
fn dflash_proposer(
    target: &Target,
    spec: &SpeculativeConfig,
) -> Result<Box<dyn Proposer>, LoadError> {
    let (flag, name) = match &spec.draft {
        DraftSource::ZLab { repo } => ("--drafter z-lab", repo.clone()),
        DraftSource::Path(p) => ("--speculative-draft-model-path", p.clone()),
        DraftSource::TargetMtp => ("--speculative-algorithm", "NEXTN".to_string()),
    };
    let err = |message: String| LoadError::Drafter {
        flag,
        spec: name.clone(),
        message,
    };
    let location = dflash_common::resolve_model(&name).map_err(|e| err(e.to_string()))?;
    let drafter = DFlashDrafter::load(&location.dir, target, OpsMode::Fused)
        .map_err(|e| err(e.to_string()))?;
    if let Some(given) = spec.num_draft_tokens {
        if given != drafter.block_size() {
            return Err(LoadError::BlockSize {
                given,
                block_size: drafter.block_size(),
            });
        }
    }
    Ok(Box::new(DFlashProposer::new(drafter)))
}

/// The target checkpoint's own MTP head (`mtp.*`), drafting `num_steps` tokens per round.
fn mtp_proposer(
    target: &Target,
    model_dir: &Path,
    spec: &SpeculativeConfig,
) -> Result<Box<dyn Proposer>, LoadError> {
    let err = |message: String| LoadError::Mtp { message };
    let Target::Hybrid(model) = target else {
        return Err(err(format!(
            "{} is a Qwen3 (dense) checkpoint, which has no built-in MTP head (only Qwen3.5 / Qwen3.6 / Qwen3-Next checkpoints carry mtp.* weights); use --speculative-algorithm DFLASH with a drafter, or NONE",
            model_dir.display()
        )));
    };
    let weights = WeightFiles::open_dir(model_dir).map_err(|e| err(e.to_string()))?;
    let head = MtpHead::load(
        &weights,
        model.config(),
        model.dtype(),
        model.device(),
        OpsMode::Fused,
    )
    .map_err(|e| err(e.to_string()))?;
    Ok(Box::new(MtpProposer::new(
        model.clone(),
        head,
        spec.num_steps,
    )))
}

impl StepEngine for RealEngine {
    fn add(&mut self, req: EngineRequest) -> Result<SeqId, AdmitError> {
        let s = &req.sampling;
        for (field, unset) in [
            ("repetition_penalty", s.repetition_penalty == 1.0),
            ("frequency_penalty", s.frequency_penalty == 0.0),
            ("presence_penalty", s.presence_penalty == 0.0),
        ] {
            if !unset {
                return Err(AdmitError {
                    message: format!("`{field}` is not supported by dflash-serve yet; remove it from the request"),
                });
            }
        }
        let sampling = SamplingParams {
            temperature: s.temperature,
            top_p: s.top_p,
            top_k: s
                .top_k
                .map(|k| k.min(i32::MAX as usize) as i32)
                .unwrap_or(-1),
            min_p: s.min_p,
            seed: s.seed,
        };
        self.engine
            .add(GenerationRequest {
                prompt: req.prompt,
                max_new_tokens: req.max_new_tokens,
                sampling,
                stop_token_ids: req.stop_token_ids,
                ignore_eos: req.ignore_eos,
                algorithm: self.algorithm,
            })
            .map(|id| id as SeqId)
            .map_err(|e| AdmitError {
                message: e.to_string(),
            })
    }

    fn step(&mut self) -> Result<Vec<StepEvent>, StepError> {
        let events = self.engine.step().map_err(|e| StepError {
            message: e.to_string(),
        })?;
        Ok(events
            .into_iter()
            .map(|ev| StepEvent {
                id: ev.id as SeqId,
                tokens: ev.tokens,
                finished: ev.finished.map(|f| match f {
                    FinishReason::Length => EngineFinish::Length,
                    FinishReason::Stop(t) => EngineFinish::Stop(t),
                }),
                accepted_drafts: ev.round.as_ref().map_or(0, |r| r.accepted_drafts),
                verify_rounds: usize::from(
                    ev.round.is_some() && self.algorithm != Algorithm::Plain,
                ),
            })
            .collect())
    }

    fn remove(&mut self, id: SeqId) {
        // Removing a sequence the engine already dropped (it finished in the same step) is fine.
        let _ = self.engine.remove(id as _);
    }

    fn num_active(&self) -> usize {
        self.engine.num_active()
    }

    fn info(&self) -> EngineInfo {
        EngineInfo {
            drafts_per_round: match self.algorithm {
                Algorithm::Plain => 0,
                _ => self.engine.max_depth(),
            },
        }
    }
}
