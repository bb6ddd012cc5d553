//! Drafter training (`dflash-train train`): a frozen target computes tapped hidden states, a
//! bounded buffer hands mixed-length batches to the trainer, and the trainer fits a DFlash
//! drafter with the block-diffusion objective of DFLASH.md §3.
//!
//! Stages: [`data`] (chat JSONL -> tokens and loss masks), [`plan`] (which sequences form each
//! batch, deterministically), [`pipeline`] (target workers and the host-RAM buffer), [`loss`]
//! (anchors, labels, decayed cross-entropy), [`optim`] (AdamW, schedule, clipping), [`optimizer`]
//! (the trainer's choice of it: the reference or the fused flat AdamW),
//! [`checkpoint`] (z-lab layout plus resume state, checked by its [`manifest`], written from a
//! [`snapshot`] by the [`ckpt_writer`] beside training), [`resume`]
//! (which checkpoint `--resume` continues from) and [`trainer`] (the loop). The model math
//! is `dflash_models`' drafter, run with `OpsMode::Differentiable`.

pub mod checkpoint;
pub mod ckpt_writer;
pub mod data;
pub mod dataset;
pub mod error;
pub mod flops;
pub mod loss;
pub mod manifest;
pub mod optim;
pub mod optimizer;
pub mod periodic_eval;
pub mod pipeline;
pub mod plan;
pub mod replicas;
pub mod resume;
pub mod setup;
pub mod snapshot;
pub mod synthetic;
pub mod target;
pub mod trainer;
pub mod window;

use std::path::PathBuf;
use std::str::FromStr;

pub use error::{TrainError, TrainResult};
pub use synthetic::DatasetSpec;
pub use target::TargetSpec;
pub use trainer::{train, TrainSummary};

/// A device flag value: `cpu`, `cuda:N` or a bare GPU index `N`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceSpec {
    Cpu,
    Cuda(usize),
}

impl FromStr for DeviceSpec {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let s = s.trim();
        if s.eq_ignore_ascii_case("cpu") {
            return Ok(Self::Cpu);
        }
        let idx = s.strip_prefix("cuda:").unwrap_or(s);
        idx.parse()
            .map(Self::Cuda)
            .map_err(|_| format!("`{s}` is not a device; use cpu, cuda:N or N"))
    }
}

impl std::fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Cpu => write!(f, "cpu"),
            Self::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

impl DeviceSpec {
    /// The device, opened once per process and GPU: every flag naming `cuda:N` gets the same
    /// candle device (one id), so tensors of the target workers and the trainer on one GPU
    /// can be shared (the embedding and head, the tapped features) instead of copied.
    /// (`Device::new_cuda` called twice gives two devices with different ids.)
    pub fn open(&self, flag: &'static str) -> TrainResult<candle_core::Device> {
        use std::collections::HashMap;
        use std::sync::{Mutex, OnceLock};
        static OPENED: OnceLock<Mutex<HashMap<usize, candle_core::Device>>> = OnceLock::new();
        match self {
            Self::Cpu => Ok(candle_core::Device::Cpu),
            Self::Cuda(i) => {
                let mut opened = OPENED
                    .get_or_init(Default::default)
                    .lock()
                    .expect("device table lock");
                if let Some(d) = opened.get(i) {
                    return Ok(d.clone());
                }
                let d = candle_core::Device::new_cuda(*i).map_err(|e| TrainError::Flag {
                    flag,
                    message: format!("cannot open cuda:{i}: {e}"),
                })?;
                #[cfg(feature = "cuda")]
                dflash_models::cuda::keep_freed_memory(&d)
                    .map_err(|message| TrainError::Flag { flag, message })?;
                // Every kernel module's PTX compiled now, not in the first steps.
                #[cfg(feature = "cuda")]
                {
                    let (n, took) =
                        dflash_models::cuda::preload_kernel_modules(&d).map_err(|e| {
                            TrainError::Flag {
                                flag,
                                message: format!("cuda:{i}: {e}"),
                            }
                        })?;
                    tracing::info!(
                        "cuda:{i}: loaded {n} kernel modules in {:.2} s",
                        took.as_secs_f64()
                    );
                }
                opened.insert(*i, d.clone());
                Ok(d)
            }
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ComputeDtype {
    /// f32 on CPU, bf16 on GPU.
    Auto,
    F32,
    Bf16,
}

/// How the LM head's cross-entropy is computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum HeadLoss {
    /// Fused linear + cross-entropy in row chunks (`dflash_models::training::linear_ce`): no
    /// `[rows, vocab]` tensor kept, no gradient for the frozen head.
    Fused,
    /// candle's composition (head matmul, f32 log-softmax, autograd): the reference.
    Composed,
}

/// How the drafter's attention runs in training.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum TrainAttentionArg {
    /// The flash-style DFlash attention op (`dflash_models::training::attn_dflash`: online
    /// softmax, log-sum-exp saved, scores recomputed in the backward). CUDA only: the CPU
    /// always runs `composed`.
    Fused,
    /// The fused op with its scalar CUDA kernels only (no tensor cores in bf16): for
    /// comparisons.
    FusedScalar,
    /// candle's grouped masked-softmax attention (autograd): the reference.
    Composed,
}

impl TrainAttentionArg {
    /// The path on `device`: the fused op on CUDA only (selecting its kernels: the switch is
    /// process-wide, and a run has one setting).
    pub fn on(self, device: &candle_core::Device) -> dflash_models::TrainAttention {
        match self {
            Self::Fused | Self::FusedScalar if device.is_cuda() => {
                dflash_models::cuda::set_dflash_tensor_cores(self == Self::Fused);
                dflash_models::TrainAttention::Fused
            }
            _ => dflash_models::TrainAttention::Composed,
        }
    }
}

/// How the drafter's norms, RoPE and SiLU-gate run in training.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum TrainOpsArg {
    /// Fused custom ops with backward kernels (`dflash_models::layers::train_ops`). CUDA only.
    Fused,
    /// candle's compositions (autograd): the reference.
    Composed,
}

/// How the drafter's training step computes its gradients.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum TrainEngineArg {
    /// candle's autograd over the drafter's training forward (`--train-attention` and
    /// `--train-ops` choose its pieces): the reference.
    Autograd,
    /// The forward and backward written out (`DFlashDrafter::train_forward_explicit` /
    /// `train_backward_explicit`): each gradient produced once, no zero-and-add per graph edge;
    /// the fused DFlash attention always, the fused norm/RoPE/SiLU kernels on CUDA under
    /// `--train-ops fused`. Autograd runs only over the head's loss.
    Explicit,
}

/// How data-parallel replicas sum their gradients.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum GradReducerArg {
    /// NCCL for several GPUs in a build with the `nccl` feature, else in-process.
    Auto,
    /// In rank order through the first replica's device.
    InProcess,
    /// NCCL, also for a single GPU (world size 1: checks the path on one device).
    Nccl,
}

impl TrainArgs {
    /// The drafter's training paths on `device`: sets the process-wide kernel switches of
    /// `--train-ops` and `--train-attention` (a run has one setting) and returns the attention.
    pub fn train_paths(&self, device: &candle_core::Device) -> dflash_models::TrainAttention {
        dflash_models::layers::train_ops::set_fused_train_ops(self.train_ops == TrainOpsArg::Fused);
        self.train_attention.on(device)
    }
}

/// Which AdamW the trainer steps with (both keep f32 masters and moments, and save the same
/// checkpoint: a run may resume under the other).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OptimizerArg {
    /// Fused on a CUDA drafter device, reference on the CPU.
    Auto,
    /// The flat multi-tensor AdamW (`dflash_models::training::adamw`): three launches a step,
    /// clipping and the non-finite skip decided on the device, the working weights written in
    /// the same pass. On the CPU it runs its host reference (for tests).
    Fused,
    /// Per-tensor candle ops with the norm read on the host (`optim::AdamW`).
    Reference,
}

impl OptimizerArg {
    /// Whether the run uses the fused optimizer on `device`.
    pub fn fused_on(self, device: &candle_core::Device) -> bool {
        match self {
            Self::Auto => device.is_cuda(),
            Self::Fused => true,
            Self::Reference => false,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SaveDtype {
    Bf16,
    F32,
}

/// Flags of `dflash-train train`.
#[derive(Debug, Clone, clap::Args)]
pub struct TrainArgs {
    /// Target model directory (Hugging Face Qwen3 checkpoint with tokenizer and chat template),
    /// or random weights for throughput runs: `random:<shape>[,seed=N]` with a shape of
    /// tiny, qwen3-0.6b, qwen3-1.7b, qwen3-4b, qwen3-8b, qwen3-14b, or a config.json path
    /// (random targets have no tokenizer: use --dataset synthetic:...).
    #[arg(long, value_name = "DIR|random:SHAPE", help_heading = "Models")]
    pub target_model: TargetSpec,
    /// Resume from a checkpoint directory, or from the newest checkpoint in an output directory;
    /// it is verified against its manifest.json first. A directory with no checkpoint yet starts
    /// a fresh run, so a wrapper can always pass this flag.
    #[arg(long, value_name = "DIR", help_heading = "Models")]
    pub resume: Option<PathBuf>,
    /// When the checkpoint to resume fails verification, resume from the newest older one that
    /// passes; the failing ones are renamed checkpoint-N.corrupt. Without it the run stops and
    /// names the damaged file.
    #[arg(long, requires = "resume", help_heading = "Models")]
    pub resume_fallback: bool,
    /// Start a fresh drafter from this z-lab config.json instead of the shape flags below.
    #[arg(
        long,
        value_name = "FILE",
        help_heading = "Models",
        conflicts_with = "resume"
    )]
    pub drafter_config: Option<PathBuf>,
    /// Start from the weights of this z-lab drafter directory (config.json + model.safetensors),
    /// e.g. to fine-tune a published drafter on your data; its config replaces the shape flags
    /// (ignored with --resume, whose checkpoint holds the weights).
    #[arg(
        long,
        value_name = "DIR",
        help_heading = "Models",
        conflicts_with_all = ["drafter_config", "init_from_target_layers"]
    )]
    pub init_drafter: Option<PathBuf>,
    /// Draft layers of a fresh drafter.
    #[arg(long, default_value_t = 5, help_heading = "Models")]
    pub num_draft_layers: usize,
    /// MLP width of a fresh drafter [default: the target's].
    #[arg(long, help_heading = "Models")]
    pub draft_intermediate_size: Option<usize>,
    /// Block size B: the bonus token plus B-1 drafts.
    #[arg(long, default_value_t = 16, help_heading = "Models")]
    pub block_size: usize,
    /// Mask token id [default: the tokenizer's `<|MASK|>`].
    #[arg(long, help_heading = "Models")]
    pub mask_token_id: Option<u32>,
    /// Warm start (not the published recipe): draft layer i copies target layer N_i, e.g. 0,1,
    /// and the final norm copies the target's; fc and hidden_norm stay fresh.
    #[arg(long, value_delimiter = ',', help_heading = "Models")]
    pub init_from_target_layers: Option<Vec<usize>>,
    /// Target layers whose outputs feed the drafter, e.g. 1,2 [default: the z-lab rule].
    #[arg(long, value_delimiter = ',', help_heading = "Models")]
    pub target_layer_ids: Option<Vec<usize>>,

    /// JSONL chat datasets ({"messages": [...]} per line), plain or .xz; repeat or
    /// comma-separate. Or random tokens for throughput runs:
    /// `synthetic:len=L|A..B,n=N[,prompt=P,seed=S]` (P unsupervised leading tokens).
    #[arg(
        long = "dataset",
        value_name = "FILE|synthetic:...",
        required = true,
        help_heading = "Data"
    )]
    pub datasets: Vec<String>,
    /// Sequences are cut to this many tokens.
    #[arg(long, default_value_t = 3072, help_heading = "Data")]
    pub max_len: usize,
    /// Drop sequences with fewer supervised tokens [default: 2 x block size].
    #[arg(long, help_heading = "Data")]
    pub min_supervised: Option<usize>,
    /// Use only the first N records.
    #[arg(long, help_heading = "Data")]
    pub max_records: Option<usize>,
    /// Unreadable dataset lines tolerated (skipped and counted) before the run stops.
    #[arg(long, default_value_t = 100, help_heading = "Data")]
    pub max_bad_lines: usize,

    /// Anchors (blocks) per sequence.
    #[arg(long, default_value_t = 512, help_heading = "Objective")]
    pub num_anchors: usize,
    /// Loss decay gamma in exp(-(k-1)/gamma) [default: 7 for B=16, scaled for other B].
    #[arg(long, help_heading = "Objective")]
    pub loss_gamma: Option<f64>,
    /// How the head's cross-entropy runs: fused (chunked, no head gradient) or composed
    /// (candle autograd; the reference it is checked against).
    #[arg(long, value_enum, default_value_t = HeadLoss::Fused, help_heading = "Objective")]
    pub head_loss: HeadLoss,
    /// How the drafter's attention runs: fused (flash-style forward and backward kernels; CUDA
    /// only, the CPU always runs composed) or composed (candle's masked softmax, autograd).
    #[arg(long, value_enum, default_value_t = TrainAttentionArg::Fused, help_heading = "Objective")]
    pub train_attention: TrainAttentionArg,
    /// How the drafter's RMSNorms, q/k-norm + RoPE and SiLU-gate run: fused (one forward and
    /// one backward kernel each; CUDA only, the CPU always runs composed) or composed (candle's
    /// elementwise ops, autograd).
    #[arg(long, value_enum, default_value_t = TrainOpsArg::Fused, help_heading = "Objective")]
    pub train_ops: TrainOpsArg,
    /// How the drafter's gradients are computed: explicit (the backward written out, no
    /// general autograd on the hot path; checked against autograd by the CPU tests and
    /// `gpu_check --train-explicit`) or autograd (candle's backprop over the training forward,
    /// the reference). Default: explicit (1.16x autograd's tokens/s on the 8B recipe, 1.08x on
    /// the tiny one, less memory: H100, session 21), autograd under `--train-attention
    /// composed` (the composed attention is autograd's alone).
    #[arg(long, value_enum, help_heading = "Objective")]
    pub train_engine: Option<TrainEngineArg>,

    /// Sequences per micro-batch.
    #[arg(long, default_value_t = 4, help_heading = "Optimisation")]
    pub batch_size: usize,
    /// Micro-batches per optimizer step.
    #[arg(long, default_value_t = 1, help_heading = "Optimisation")]
    pub grad_accum: usize,
    /// Passes over the data (ignored when --max-steps is given).
    #[arg(long, default_value_t = 6, help_heading = "Optimisation")]
    pub epochs: usize,
    /// Optimizer steps in the run (the schedule spans them).
    #[arg(long, help_heading = "Optimisation")]
    pub max_steps: Option<usize>,
    /// Stop after this many steps with a checkpoint, schedule unchanged (resume continues).
    #[arg(long, help_heading = "Optimisation")]
    pub stop_after_steps: Option<usize>,
    /// Peak learning rate.
    #[arg(long, default_value_t = 6e-4, help_heading = "Optimisation")]
    pub lr: f64,
    /// Fraction of the steps spent in linear warmup before the cosine decay.
    #[arg(long, default_value_t = 0.04, help_heading = "Optimisation")]
    pub warmup_ratio: f64,
    #[arg(long, default_value_t = 0.0, help_heading = "Optimisation")]
    pub weight_decay: f64,
    /// Global gradient-norm clip; 0 turns clipping off.
    #[arg(long, default_value_t = 1.0, help_heading = "Optimisation")]
    pub grad_clip: f64,
    /// Seed of the initialisation, the shuffles and the anchors.
    #[arg(long, default_value_t = 0, help_heading = "Optimisation")]
    pub seed: u64,
    /// Non-finite steps in a row (skipped) after which the run stops.
    #[arg(long, default_value_t = 10, help_heading = "Optimisation")]
    pub max_nonfinite_steps: usize,
    /// Which AdamW steps: fused (flat buffers, device-side clip and skip) or reference
    /// (per-tensor candle ops) [default: fused on CUDA, reference on the CPU].
    #[arg(long, value_enum, default_value_t = OptimizerArg::Auto, help_heading = "Optimisation")]
    pub optimizer: OptimizerArg,
    /// Fault injection for tests: the gradient of step N (1-based) is made NaN, so that step
    /// must be skipped.
    #[arg(long, hide = true, value_name = "N")]
    pub inject_nan_grad_at_step: Option<usize>,

    /// Devices running the frozen target, one worker each: cpu, cuda:N or N (comma-separated).
    #[arg(
        long,
        default_value = "cpu",
        value_delimiter = ',',
        help_heading = "Pipeline"
    )]
    pub target_devices: Vec<DeviceSpec>,
    /// Device training the drafter: cpu, cuda:N or N. Several (comma-separated, e.g. 0,1,2,3)
    /// train data-parallel replicas: each step's --grad-accum micro-batches are split evenly
    /// over them (so --grad-accum must be a multiple of their number) and the gradients summed
    /// across them, so the global batch and the loss curve are one device's.
    #[arg(
        long = "drafter-device",
        visible_alias = "drafter-devices",
        default_value = "cpu",
        value_delimiter = ',',
        help_heading = "Pipeline"
    )]
    pub drafter_devices: Vec<DeviceSpec>,
    /// How the replicas of --drafter-device sum their gradients each step.
    #[arg(long, value_enum, default_value_t = GradReducerArg::Auto, help_heading = "Pipeline")]
    pub grad_reducer: GradReducerArg,
    /// Drafter compute dtype (master weights and moments are always f32).
    #[arg(long, value_enum, default_value_t = ComputeDtype::Auto, help_heading = "Pipeline")]
    pub compute_dtype: ComputeDtype,
    /// Sequences the length-bucket buffer holds before it releases a batch.
    #[arg(long, default_value_t = 30, help_heading = "Pipeline")]
    pub min_ready: usize,
    /// Computed sequences held in host RAM at most (backpressure on the target workers).
    #[arg(long, default_value_t = 90, help_heading = "Pipeline")]
    pub max_depth: usize,
    /// Width of a length bucket, in tokens.
    #[arg(long, default_value_t = 256, help_heading = "Pipeline")]
    pub bucket_width: usize,
    /// Run the target forward and the drafter step one after the other instead of
    /// overlapping them: the target computes the next batch only once the trainer is done
    /// with the previous one, so `target_forward_s` is the target alone and the drafter's
    /// stages (and `step_s - queue_wait_s`) the drafter alone. For profiling; slower.
    #[arg(long, help_heading = "Pipeline")]
    pub serialize_target: bool,

    /// Checkpoints and the final drafter go here.
    #[arg(long, value_name = "DIR", help_heading = "Output")]
    pub output_dir: PathBuf,
    /// Write a checkpoint every N steps (and at the end).
    #[arg(long, default_value_t = 500, help_heading = "Output")]
    pub save_every: usize,
    /// Checkpoints kept (oldest removed first).
    #[arg(long, default_value_t = 2, help_heading = "Output")]
    pub keep_checkpoints: usize,
    /// Write each checkpoint before the next step instead of beside the following steps
    /// (a host snapshot is taken either way; the background write is atomic as well).
    #[arg(long, help_heading = "Output")]
    pub sync_checkpoints: bool,
    /// dtype of model.safetensors (the optimizer state is f32 regardless).
    #[arg(long, value_enum, default_value_t = SaveDtype::Bf16, help_heading = "Output")]
    pub save_dtype: SaveDtype,
    /// Log a progress line (and window metrics: throughput, stage times, MFU, queue, GPU) every
    /// N steps; the last step of each window synchronises the device between stages to time them.
    #[arg(long, default_value_t = 10, help_heading = "Output")]
    pub log_every: usize,
    /// Peak TFLOP/s of one device for MFU [default: 989 (H200 bf16 dense) on CUDA; none on CPU].
    #[arg(long, help_heading = "Output")]
    pub peak_tflops: Option<f64>,
    /// Seconds between GPU telemetry samples (NVML; skipped without a GPU).
    #[arg(long, default_value_t = 1.0, help_heading = "Output")]
    pub gpu_sample_secs: f64,

    /// Evaluate the drafter every N steps (and at the end): offline tau on --eval-prompts.
    #[arg(
        long,
        default_value_t = 0,
        help_heading = "Evaluation",
        requires = "eval_prompts"
    )]
    pub eval_every: usize,
    /// Prompt set for --eval-every (JSONL chat records; keep it small, e.g. 8 prompts).
    #[arg(long, value_name = "FILE", help_heading = "Evaluation")]
    pub eval_prompts: Option<PathBuf>,
    /// Target tokens generated per eval prompt (cached once at startup).
    #[arg(long, default_value_t = 64, help_heading = "Evaluation")]
    pub eval_max_new_tokens: usize,
    /// DDTree budgets of the periodic eval (vanilla chain tau is always reported).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "8,32",
        help_heading = "Evaluation"
    )]
    pub eval_budgets: Vec<usize>,
}

impl TrainArgs {
    /// The engine this run uses: `--train-engine` when given, else explicit, or autograd under
    /// `--train-attention composed`.
    pub fn engine(&self) -> TrainEngineArg {
        match (self.train_engine, self.train_attention) {
            (Some(engine), _) => engine,
            (None, TrainAttentionArg::Composed) => TrainEngineArg::Autograd,
            (None, _) => TrainEngineArg::Explicit,
        }
    }

    /// Refuses `--train-engine explicit` with `--train-attention composed` (the explicit step's
    /// attention is the fused op, whose backward it calls).
    pub fn check_engine(&self) -> TrainResult<()> {
        if self.train_engine == Some(TrainEngineArg::Explicit)
            && self.train_attention == TrainAttentionArg::Composed
        {
            return Err(TrainError::Flag {
                flag: "--train-engine",
                message: "explicit runs the fused DFlash attention (its backward written out); \
                          drop --train-attention composed, or use --train-engine autograd for \
                          the composed attention"
                    .into(),
            });
        }
        Ok(())
    }

    /// The `--dataset` values, synthetic specs kept whole.
    pub fn dataset_specs(&self) -> TrainResult<Vec<DatasetSpec>> {
        let mut out = Vec::new();
        for v in &self.datasets {
            out.extend(
                DatasetSpec::parse_list(v).map_err(|message| TrainError::Flag {
                    flag: "--dataset",
                    message,
                })?,
            );
        }
        if out.is_empty() {
            return Err(TrainError::Flag {
                flag: "--dataset",
                message: "no dataset given".into(),
            });
        }
        Ok(out)
    }
}

/// Parses `dflash-train train` flags from an argument list (for tests and embedding).
pub fn parse_train_args<I, T>(args: I) -> Result<TrainArgs, clap::Error>
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    use clap::Parser;
    #[derive(Parser)]
    #[command(name = "dflash-train train")]
    struct Wrapper {
        #[command(flatten)]
        args: TrainArgs,
    }
    let w = Wrapper::try_parse_from(
        std::iter::once("train".into()).chain(args.into_iter().map(Into::into)),
    )?;
    Ok(w.args)
}

pub fn run(args: TrainArgs) -> anyhow::Result<()> {
    let summary = train(&args)?;
    println!(
        "{} {} steps in {:.0} s; loss {:.4} -> {:.4}; drafter in {}",
        if summary.stopped_early {
            "stopped after"
        } else {
            "trained"
        },
        summary.steps,
        summary.elapsed_s,
        summary.first_loss,
        summary.last_loss,
        summary.output.display()
    );
    Ok(())
}
