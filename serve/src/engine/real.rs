//! The real engine behind the boundary: `dflash_models::spec::Engine` with the Qwen3 target and,
//! when speculating, the DFlash drafter as its proposer. Only this file knows both sides' types.

use std::path::Path;

use candle_core::{DType as CandleDType, Device};
use dflash_models::spec::{
    Algorithm, DFlashProposer, Engine, EngineConfig, FinishReason, GenerationRequest, Proposer,
    SamplingParams,
};
use dflash_models::{DFlashDrafter, OpsMode, Qwen3Model};

use super::{
    AdmitError, EngineFinish, EngineInfo, EngineRequest, SeqId, StepEngine, StepError, StepEvent,
};
use crate::config::{DType, DeviceSpec, DraftSource, ServeConfig, VerifyMode};

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
    /// Loads the target from `model_dir` (and the drafter, when `--speculative-algorithm
    /// DFLASH`) for sequences of up to `context_length` tokens.
    pub fn load(
        config: &ServeConfig,
        model_dir: &Path,
        context_length: usize,
        eos_token_ids: Vec<u32>,
    ) -> Result<Self, LoadError> {
        let device = device(config.device)?;
        let dtype = dtype(config.dtype, &device);
        let target = Qwen3Model::load(model_dir, dtype, &device, context_length, OpsMode::Fused)
            .map_err(|e| LoadError::Target {
                dir: model_dir.display().to_string(),
                message: e.to_string(),
            })?;
        let (proposer, algorithm, budget) = match &config.speculative {
            None => (None, Algorithm::Plain, 0),
            Some(spec) => {
                let (flag, name) = match &spec.draft {
                    DraftSource::Path(p) => ("--speculative-draft-model-path", p.clone()),
                    DraftSource::ZLab { repo } => ("--drafter z-lab", repo.clone()),
                };
                let err = |message: String| LoadError::Drafter {
                    flag,
                    spec: name.clone(),
                    message,
                };
                let location =
                    dflash_common::resolve_model(&name).map_err(|e| err(e.to_string()))?;
                let drafter = DFlashDrafter::load(&location.dir, &target, OpsMode::Fused)
                    .map_err(|e| err(e.to_string()))?;
                if let Some(given) = spec.num_draft_tokens {
                    if given != drafter.block_size() {
                        return Err(LoadError::BlockSize {
                            given,
                            block_size: drafter.block_size(),
                        });
                    }
                }
                let proposer: Box<dyn Proposer> = Box::new(DFlashProposer::new(drafter));
                match spec.verify {
                    VerifyMode::Chain => (Some(proposer), Algorithm::Chain, 0),
                    VerifyMode::DDTree { budget } => {
                        (Some(proposer), Algorithm::DDTree { budget }, budget)
                    }
                }
            }
        };
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
