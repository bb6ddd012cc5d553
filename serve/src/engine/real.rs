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
    PeakedProposer, Penalties, Proposer, SamplingParams, SimulatedAcceptance,
};
use dflash_models::{DFlashDrafter, OpsMode, Target};

use super::{
    memory, AdmitError, EngineFinish, EngineInfo, EngineRequest, SeqId, StepEngine, StepError,
    StepEvent,
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
    #[error("{SIMULATE_ACC_LEN}={value}: {message}")]
    SimulateAccLen { value: String, message: String },
}

/// SGLang's benchmark switch: the verify walk accepts this many tokens per round on average
/// (drafts plus the target's bonus token) instead of checking the drafts, so throughput at
/// concurrency can be measured with random weights. Unset or <= 0 (SGLang's -1): off.
pub const SIMULATE_ACC_LEN: &str = "SGLANG_SIMULATE_ACC_LEN";

/// The simulated acceptance length from the environment: `None` when off.
fn simulated_acceptance_length() -> Result<Option<f64>, LoadError> {
    let Ok(value) = std::env::var(SIMULATE_ACC_LEN) else {
        return Ok(None);
    };
    let bad = |message: &str| LoadError::SimulateAccLen {
        value: value.clone(),
        message: message.to_string(),
    };
    let v: f64 = value
        .trim()
        .parse()
        .map_err(|_| bad("expected a number (an acceptance length such as 6.5, or -1 for off)"))?;
    if !v.is_finite() {
        return Err(bad("expected a finite number"));
    }
    if v <= 0.0 {
        return Ok(None);
    }
    if v < 1.0 {
        return Err(bad(
            "an acceptance length counts the bonus token, so it is at least 1 (or <= 0 for off)",
        ));
    }
    Ok(Some(v))
}

pub struct RealEngine {
    engine: Engine,
    algorithm: Algorithm,
    /// The paged K/V pool, in tokens (sized from device memory on CUDA).
    pool_tokens: Option<usize>,
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
        // Recurrent (Gated DeltaNet) state is per sequence, not per token: reserved up front.
        let mut fixed_bytes = 0;
        if let Target::Hybrid(m) = &target {
            fixed_bytes =
                log_recurrent_memory(m.config(), dtype, algorithm, proposer.as_deref(), config);
        }
        let simulate = simulated_acceptance_length()?;
        // A random or untrained drafter's flat distributions build a wide, one-level DDTree
        // whose simulated walk stops after a draft or two; the bench's peaked profile gives
        // the trained drafter's deep main path (same candidates and cost).
        let proposer = match (simulate, algorithm, proposer) {
            (Some(_), Algorithm::DDTree { .. }, Some(p)) => {
                tracing::warn!("{SIMULATE_ACC_LEN}: the DDTree is built from a peaked profile of the drafter's candidates (rank 1 at p = 0.8)");
                Some(Box::new(PeakedProposer::new(p, 0.8)) as Box<dyn Proposer>)
            }
            (_, _, p) => p,
        };
        let mut engine = Engine::new(
            target,
            proposer,
            EngineConfig {
                max_context: context_length,
                max_ddtree_budget: budget,
                eos_token_ids,
                seed: 0,
            },
        );
        match (simulate, algorithm) {
            (None, _) => {}
            (Some(len), Algorithm::Plain) => tracing::warn!(
                "{SIMULATE_ACC_LEN}={len} has no effect: the server decodes without speculation"
            ),
            (Some(len), _) => {
                tracing::warn!(
                    "{SIMULATE_ACC_LEN}={len}: BENCHMARK MODE, every verify accepts {:.2} drafts on average without checking them; the output is NOT the target model's",
                    len - 1.0
                );
                engine.simulate_acceptance(SimulatedAcceptance::new(len - 1.0, 0));
            }
        }
        let memory =
            dflash_models::probe::device_memory(&device).map_err(|e| LoadError::Device {
                device: format!("{device:?}"),
                message: e.to_string(),
            })?;
        let chunk = chunked_prefill(memory, config);
        tracing::info!(
            "chunked prefill: {}",
            chunk.map_or("off (prompts prefilled whole)".to_string(), |c| format!(
                "at most {c} prompt tokens per step"
            ))
        );
        engine.set_chunked_prefill(chunk);
        engine.set_prefill_while_decoding(config.prefill_tokens_while_decoding);
        engine.set_mixed_step_budget(config.mixed_step_budget);
        // Measured step times scale the piece cost model to this device and model.
        engine.calibrate_step_costs(true);
        engine.set_mixed_prefill(!config.disable_mixed_chunk);
        // The prefix cache's drafter features come out of the K/V memory too.
        let feature_bytes = prefix_feature_budget(&engine, memory, config);
        let fixed_bytes = fixed_bytes + feature_bytes;
        let pool_tokens = match kv_pool(&device, memory, &engine, config, fixed_bytes)? {
            Some(t) => t,
            None => cpu_pool_tokens(&engine, config, context_length),
        };
        engine
            .use_kv_pool(pool_tokens)
            .map_err(|e| LoadError::Device {
                device: format!("{device:?}"),
                message: format!(
                    "allocating the K/V pool of {pool_tokens} tokens: {e} (lower --mem-fraction-static or --max-total-tokens)"
                ),
            })?;
        let pool_tokens = engine.kv_pool_tokens();
        // From here on, per-round buffers (verify logits, gathers) are reused from the CUDA
        // pool instead of being mapped again after every read-back; not before the K/V pool's
        // sizing, which must see the memory that loading freed as free.
        #[cfg(feature = "cuda")]
        dflash_models::cuda::keep_freed_memory(&device).map_err(|message| LoadError::Device {
            device: format!("{device:?}"),
            message,
        })?;
        // Before the prefix cache exists, so the warm-up prompts leave nothing behind.
        super::warmup::at_start(&mut engine, &device, chunk).map_err(|message| {
            LoadError::Device {
                device: format!("{device:?}"),
                message,
            }
        })?;
        if config.disable_radix_cache {
            tracing::info!("prefix cache (radix cache): off (--disable-radix-cache)");
        } else {
            match engine.enable_prefix_cache(feature_bytes) {
                Ok(()) => tracing::info!(
                    "prefix cache (radix cache): on, pages of {} tokens shared between requests with a common prefix{}",
                    dflash_models::cache::PAGE_SIZE,
                    if feature_bytes > 0 {
                        format!(
                            "; up to {:.2} GB of cached rows' drafter features",
                            feature_bytes as f64 / (1u64 << 30) as f64
                        )
                    } else {
                        String::new()
                    }
                ),
                Err(e) => tracing::info!("prefix cache (radix cache): off: {e}"),
            }
        }
        if config.page_size != dflash_models::cache::PAGE_SIZE {
            tracing::warn!(
                "--page-size {}: the K/V pool's pages are {} rows (the fused attention kernels' key tile); using {}",
                config.page_size,
                dflash_models::cache::PAGE_SIZE,
                dflash_models::cache::PAGE_SIZE
            );
        }
        Ok(Self {
            engine,
            algorithm,
            pool_tokens,
        })
    }
}

/// `--chunked-prefill-size`, or SGLang's default for the device: its rule for the GPU's
/// memory (8192 tokens on an H200), its 4096-token fallback elsewhere.
fn chunked_prefill(memory: Option<(usize, usize)>, config: &ServeConfig) -> Option<usize> {
    if let Some(given) = config.chunked_prefill_size {
        return given;
    }
    Some(memory.map_or(4096, |(_, total)| {
        memory::default_prefill_and_graph_sizes(total as f64 / (1u64 << 20) as f64).0
    }))
}

/// On CUDA, the K/V pool in tokens that `--mem-fraction-static` of the GPU leaves once the
/// models are loaded (SGLang's sizing, `engine::memory`), capped by `--max-total-tokens`, and
/// SGLang's start-up line stating it. `None` on the CPU (admission counts
/// `ServeConfig::total_tokens` there).
fn kv_pool(
    device: &Device,
    memory: Option<(usize, usize)>,
    engine: &Engine,
    config: &ServeConfig,
    fixed_bytes: usize,
) -> Result<Option<usize>, LoadError> {
    let Some((free, total)) = memory else {
        return Ok(None);
    };
    let mib = total as f64 / (1u64 << 20) as f64;
    let fraction = config.mem_fraction_static.unwrap_or_else(|| {
        let (chunk, graphs) = memory::default_prefill_and_graph_sizes(mib);
        memory::default_mem_fraction_static(mib, chunk, graphs, config.speculative.is_some())
    });
    let per_token = engine.kv_bytes_per_row();
    let pool = memory::pool_tokens(free, total, fraction, fixed_bytes, per_token);
    let tokens = config.max_total_tokens.map_or(pool, |cap| cap.min(pool));
    let gib = |b: f64| b / (1u64 << 30) as f64;
    tracing::info!(
        "KV cache pool: max_total_num_tokens={tokens}, {:.2} GB of K/V at {per_token} bytes/token (target + drafter), mem_fraction_static={fraction}, GPU memory {:.1} GB of which {:.1} GB in use after loading",
        gib(tokens as f64 * per_token as f64),
        gib(total as f64),
        gib(total.saturating_sub(free) as f64),
    );
    if tokens == 0 {
        return Err(LoadError::Device {
            device: format!("{device:?}"),
            message: format!(
                "no GPU memory is left for the K/V cache at --mem-fraction-static {fraction} ({:.1} GB in use after loading the models); raise --mem-fraction-static or use a smaller model",
                gib(total.saturating_sub(free) as f64)
            ),
        });
    }
    Ok(Some(tokens))
}

/// Bytes the prefix cache may keep of cached rows' drafter features (a speculating server
/// whose drafter reads target features; 0 otherwise or with --disable-radix-cache): on CUDA
/// 1/32 of the GPU's memory up to 4 GiB, set aside before the K/V pool is sized; 256 MiB of
/// host memory on the CPU.
fn prefix_feature_budget(
    engine: &Engine,
    memory: Option<(usize, usize)>,
    config: &ServeConfig,
) -> usize {
    if config.disable_radix_cache
        || !engine.proposer_reads_features()
        || !engine.target().supports_prefix_cache()
    {
        return 0;
    }
    match memory {
        Some((_, total)) => (total / 32).min(4 << 30),
        None => 256 << 20,
    }
}

/// Host memory the CPU K/V pool takes at most unless `--max-total-tokens` says otherwise
/// (the CPU has no `--mem-fraction-static` rule; a whole context per running request of a
/// real model would be tens of GB).
const CPU_POOL_BYTES: usize = 512 << 20;

/// The CPU pool in tokens: `--max-total-tokens` when given, else a context per running
/// request up to [`CPU_POOL_BYTES`] (at least one whole context).
fn cpu_pool_tokens(engine: &Engine, config: &ServeConfig, context_length: usize) -> usize {
    let per_row = engine.kv_bytes_per_row().max(1);
    let tokens = config.max_total_tokens.unwrap_or_else(|| {
        (context_length * config.max_running_requests)
            .min(CPU_POOL_BYTES / per_row)
            .max(context_length + 2 * dflash_models::cache::PAGE_SIZE)
    });
    tracing::info!(
        "KV cache pool: max_total_num_tokens={tokens} (host memory, {:.2} GB at {per_row} bytes/token)",
        (tokens * per_row) as f64 / (1u64 << 30) as f64
    );
    tokens
}

/// Tells the operator what hybrid verification costs beyond the K/V cache: every verified row
/// stays staged until the commit, as its delta-rule inputs on the plain path (2.5 MB a row at
/// the Qwen3.6-27B shape) or, for chains on the fused CUDA path, as a full recurrent state
/// (147 MiB a row). Counts the full state for chains (the fused path may take them) and for
/// trees the larger of the compact staging and a chain-shaped tree's full states. Returns those bytes for `--max-running-requests` sequences,
/// which a memory-sized K/V pool sets aside.
fn log_recurrent_memory(
    cfg: &dflash_common::HybridConfig,
    dtype: CandleDType,
    algorithm: Algorithm,
    proposer: Option<&dyn Proposer>,
    config: &ServeConfig,
) -> usize {
    let elem = dtype.size_in_bytes();
    let full_state = cfg.num_linear_layers() * cfg.recurrent_state_bytes_per_layer(elem);
    let chain_rows = 1 + proposer.map_or(0, |p| p.max_depth());
    let (rows, per_row) = match algorithm {
        Algorithm::Plain => (1, full_state),
        Algorithm::Chain => (chain_rows, full_state),
        // A tree stages compactly, but a round whose tree is one chain verifies it as a
        // chain (the fused path, full states): whichever is larger.
        Algorithm::DDTree { budget } => {
            let compact = cfg.staged_bytes_per_verified_row(elem);
            if (1 + budget) * compact >= chain_rows * full_state {
                (1 + budget, compact)
            } else {
                (chain_rows, full_state)
            }
        }
    };
    let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
    tracing::info!(
        "hybrid target: {} of {} layers are Gated DeltaNet; a verify stages {rows} recurrent rows of {:.2} MiB per sequence ({:.2} GiB; {:.1} GiB at --max-running-requests {})",
        cfg.num_linear_layers(),
        cfg.num_hidden_layers,
        per_row as f64 / (1u64 << 20) as f64,
        gib(rows * per_row),
        gib(rows * per_row * config.max_running_requests),
        config.max_running_requests,
    );
    rows * per_row * config.max_running_requests
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

fn lowered(l: dflash_models::speculative::logprobs::TokenLogprob) -> crate::engine::TokenLogprob {
    crate::engine::TokenLogprob {
        token: l.token,
        logprob: l.logprob,
        top: l.top,
    }
}

impl StepEngine for RealEngine {
    fn graph_replays(&self) -> u64 {
        self.engine.target().graph_replays()
    }
    fn last_step(&self) -> Option<String> {
        let r = self.engine.last_step();
        let chunks: Vec<String> = r.chunks.iter().map(|(n, at)| format!("{n}@{at}")).collect();
        Some(format!(
            "{} decoding ({} rows, {} cached), prefill [{}]{}, measured {:.2} ms, estimated {:.2} ms (decode step {:.2} ms)",
            r.decode_seqs,
            r.decode_rows,
            r.cached,
            chunks.join(" "),
            if r.mixed { " mixed" } else { "" },
            r.seconds * 1e3,
            r.estimate * 1e3,
            r.decode_estimate * 1e3
        ))
    }
    fn add(&mut self, req: EngineRequest) -> Result<SeqId, AdmitError> {
        let s = &req.sampling;
        let penalties = Penalties {
            frequency: s.frequency_penalty,
            presence: s.presence_penalty,
            repetition: s.repetition_penalty,
            min_new_tokens: s.min_new_tokens,
            logit_bias: s.logit_bias.clone(),
        };
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
        let logprobs = req.logprobs;
        let grammar = req.grammar;
        let prompt_logprobs = req.prompt_logprobs;
        let id = self
            .engine
            .add(GenerationRequest {
                prompt: req.prompt,
                max_new_tokens: req.max_new_tokens,
                sampling,
                stop_token_ids: req.stop_token_ids,
                ignore_eos: req.ignore_eos,
                algorithm: self.algorithm,
            })
            .map(|id| id as SeqId)
            .map_err(|e| {
                if e.is_client_error() {
                    AdmitError::client(e.to_string())
                } else {
                    AdmitError::server(format!("admitting the request failed: {e}"))
                }
            })?;
        if logprobs.is_some() {
            self.engine
                .set_logprobs(id, logprobs)
                .map_err(|e| AdmitError::server(e.to_string()))?;
        }
        if let Some((start, top)) = prompt_logprobs {
            if let Err(e) = self.engine.set_prompt_logprobs(id, start, top) {
                let _ = self.engine.remove(id);
                return Err(AdmitError::server(e.to_string()));
            }
        }
        if let Some(g) = grammar {
            if let Err(e) = self.engine.set_constraint(id, Box::new(g)) {
                let _ = self.engine.remove(id);
                return Err(AdmitError::server(e.to_string()));
            }
        }
        if penalties.is_active() {
            if let Err(e) = self.engine.set_penalties(id, penalties) {
                // Checked by the routes already; nothing of the request may stay behind.
                let _ = self.engine.remove(id);
                return Err(if e.is_client_error() {
                    AdmitError::client(e.to_string())
                } else {
                    AdmitError::server(e.to_string())
                });
            }
        }
        Ok(id)
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
                logprobs: ev.logprobs.into_iter().map(lowered).collect(),
                prompt_logprobs: ev.prompt_logprobs.into_iter().map(lowered).collect(),
                cached_tokens: ev.stats.cached_tokens,
                retractions: ev.stats.retractions,
                error: ev.error,
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

    fn reservation(&self, prompt_len: usize, max_new_tokens: usize) -> usize {
        self.engine
            .cache_capacity(prompt_len, max_new_tokens, self.algorithm)
    }

    fn kv_pool_tokens(&self) -> Option<usize> {
        self.pool_tokens
    }

    fn retracts(&self) -> bool {
        // Always on the paged pool, which retracts the newest sequences when it runs short.
        self.pool_tokens.is_some()
    }

    fn flush_cache(&mut self) {
        self.engine.flush_prefix_cache();
        tracing::info!("prefix cache flushed");
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
