//! `ServeConfig`: the command line parsed once into typed settings. A bad value stops startup
//! with a message naming the flag; SGLang flags we cannot honour are refused by name, and the
//! ones that are harmless no-ops here are accepted with a warning (never silently).

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use crate::cli::{Args, DTypeArg};
use crate::generation::{ReasoningParserKind, ToolParserKind};

mod compat;
mod speculative;

pub use compat::log_filter;

pub use speculative::{
    DraftSource, SpecAlgorithm, SpeculativeConfig, VerifyMode, NEXTN_DEFAULT_STEPS,
};

/// `--max-running-requests` when speculating and not given (SGLang resets it to 48).
pub const SPEC_DEFAULT_MAX_RUNNING: usize = 48;
/// `--prefill-tokens-while-decoding` when not given. Measured on the H200 (Qwen3-8B shape,
/// 16 streams decoding while a 32K-token prompt arrives, deploy/bench/results/h200-2026-12-02):
/// 512-token pieces still stretched their inter-token latency 13.9x (58x with 8192).
pub const DEFAULT_PREFILL_TOKENS_WHILE_DECODING: usize = 256;
/// `--max-running-requests` for plain decoding when not given: the largest batch the
/// batched CUDA graphs capture (SGLang's `--cuda-graph-max-bs` on large GPUs); SGLang's own
/// default is larger (thousands, from its pool), past which a step here runs uncaptured.
pub const PLAIN_DEFAULT_MAX_RUNNING: usize = 256;
/// Where the bundled demo model lives, relative to the serve crate or the executable.
pub const DEMO_MODEL_DIR: &str = "assets/tiny-coder-demo";
/// The demo's DFlash drafter, beside the demo target; used unless speculation is turned off.
pub const DEMO_DRAFTER_DIR: &str = "tiny-coder-demo-dflash";

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ConfigError {
    #[error("{flag} {value}: {reason}")]
    BadValue {
        flag: &'static str,
        value: String,
        reason: String,
    },
    #[error("{flag} is not supported by dflash-serve: {reason}")]
    Unsupported { flag: &'static str, reason: String },
    #[error("no --model-path given and the bundled demo model was not found (looked in {looked}); pass --model-path DIR_OR_REPO")]
    NoDemoModel { looked: String },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DType {
    Auto,
    BFloat16,
    Float16,
    Float32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceSpec {
    Cpu,
    Cuda(usize),
}

#[derive(Debug, Clone, PartialEq)]
pub struct ServeConfig {
    /// As given (a directory or repo id); echoed as `model_path` in /server_info.
    pub model_path: String,
    pub tokenizer_path: Option<PathBuf>,
    pub served_model_name: String,
    pub host: String,
    pub port: u16,
    pub dtype: DType,
    pub device: DeviceSpec,
    pub context_length: Option<usize>,
    pub max_running_requests: usize,
    pub max_queued_requests: usize,
    /// `--max-total-tokens`; `None` sizes it from device memory on CUDA, else from the
    /// context length (see `total_tokens`). On CUDA it caps the memory-sized pool.
    pub max_total_tokens: Option<usize>,
    /// `--chunked-prefill-size`: `None` takes the default for the device, `Some(None)` (-1)
    /// prefills prompts whole.
    pub chunked_prefill_size: Option<Option<usize>>,
    /// `--prefill-tokens-while-decoding`: `None` no bound beyond the chunk size (-1).
    pub prefill_tokens_while_decoding: Option<usize>,
    /// `--mixed-step-budget`: `None` (0) sizes pieces by the bound above alone.
    pub mixed_step_budget: Option<f64>,
    /// `--mem-fraction-static` (SGLang's meaning: weights + K/V pool over GPU memory); `None`
    /// takes SGLang's default for the GPU (`engine::memory`). No effect on the CPU.
    pub mem_fraction_static: Option<f64>,
    /// `--request-timeout`.
    pub request_timeout: Option<std::time::Duration>,
    pub api_key: Option<String>,
    pub chat_template: Option<PathBuf>,
    pub hf_chat_template_name: Option<String>,
    pub default_chat_template_kwargs: Map<String, Value>,
    pub enable_metrics: bool,
    /// `--schedule-conservativeness`.
    pub schedule_conservativeness: f64,
    /// `--disable-radix-cache`: no prefix cache.
    pub disable_radix_cache: bool,
    /// `--disable-mixed-chunk`: prefill chunks in forwards of their own.
    pub disable_mixed_chunk: bool,
    /// `--enable-cache-report`: `prompt_tokens_details.cached_tokens` in OpenAI usage.
    pub enable_cache_report: bool,
    /// `--max-request-body-bytes`; `None` sizes it from the context (see `state::RequestLimits`).
    pub max_request_body_bytes: Option<usize>,
    pub http: HttpTimeouts,
    pub max_sequences_per_request: usize,
    /// `--queued-request-timeout`; `None`: off.
    pub queue_timeout: Option<std::time::Duration>,
    pub decode_log_interval: usize,
    pub log_level: String,
    pub speculative: Option<SpeculativeConfig>,
    /// `--reasoning-parser`: split `<think>` text into `reasoning_content` for chat.
    pub reasoning_parser: Option<ReasoningParserKind>,
    /// `--tool-call-parser`: parse tool calls out of chat answers.
    pub tool_call_parser: Option<ToolParserKind>,
    /// `--grammar-backend`: structured output with llguidance (true) or refused (`none`).
    pub grammar: bool,
    /// `--page-size`: tokens per K/V-cache page, for the paged pool (SGLang's flag; default 64).
    pub page_size: usize,
    /// The command line as given (`launch_command` in /server_info).
    pub launch_command: Vec<String>,
    /// SGLang flags accepted with no effect, as written (named in the start-up warning).
    pub ignored_sglang_flags: Vec<String>,
    /// Run one short generation before announcing readiness (off with --skip-server-warmup).
    pub warmup: bool,
}

/// Connection timeouts (`--header-read-timeout`, `--body-read-timeout`, `--keep-alive-timeout`,
/// `--shutdown-grace-period`); `None` is off.
#[derive(Debug, Clone, PartialEq)]
pub struct HttpTimeouts {
    pub header_read: Option<std::time::Duration>,
    pub body_read: Option<std::time::Duration>,
    pub keep_alive: Option<std::time::Duration>,
    pub shutdown_grace: std::time::Duration,
}

/// A seconds flag: finite and not negative; 0 means off where `zero_is_off`.
fn seconds(
    flag: &'static str,
    secs: f64,
    zero_is_off: bool,
) -> Result<Option<std::time::Duration>, ConfigError> {
    if !secs.is_finite() || !(0.0..=1e9).contains(&secs) {
        return Err(ConfigError::BadValue {
            flag,
            value: secs.to_string(),
            reason: "must be a number of seconds, 0 or more".into(),
        });
    }
    if secs == 0.0 && zero_is_off {
        return Ok(None);
    }
    Ok(Some(std::time::Duration::from_secs_f64(secs)))
}

fn parse_device(s: &str) -> Result<DeviceSpec, ConfigError> {
    let bad = |reason: &str| ConfigError::BadValue {
        flag: "--device",
        value: s.to_string(),
        reason: reason.to_string(),
    };
    match s.to_ascii_lowercase().as_str() {
        "auto" => Ok(auto_device()),
        "cpu" => Ok(DeviceSpec::Cpu),
        "cuda" => Ok(DeviceSpec::Cuda(0)),
        other => match other.strip_prefix("cuda:") {
            Some(n) => n
                .parse()
                .map(DeviceSpec::Cuda)
                .map_err(|_| bad("expected cpu, cuda or cuda:N with N a GPU index")),
            None => Err(bad("expected auto, cpu, cuda or cuda:N")),
        },
    }
}

/// `--device auto`: CUDA device 0 when this binary was built with CUDA and the device opens,
/// else the CPU (SGLang never needs the flag on a GPU machine).
fn auto_device() -> DeviceSpec {
    if candle_core::utils::cuda_is_available() && candle_core::Device::new_cuda(0).is_ok() {
        DeviceSpec::Cuda(0)
    } else {
        DeviceSpec::Cpu
    }
}

/// `Qwen/Qwen3-8B` -> `z-lab/Qwen3-8B-DFlash-b16`; the hybrid Qwen3.5 / Qwen3.6 targets'
/// drafters carry no block-size suffix (`Qwen/Qwen3.6-27B` -> `z-lab/Qwen3.6-27B-DFlash`, mask
/// token 248070 in their configs). z-lab publishes one drafter for the Qwen3-Coder MoE target
/// and its Instruct release alike: `z-lab/Qwen3-Coder-30B-A3B-DFlash`.
pub fn zlab_drafter_repo(target: &str) -> Option<String> {
    let (_, name) = target.split_once('/')?;
    if name.is_empty() || name.contains('/') || Path::new(target).exists() {
        return None;
    }
    if name == "Qwen3-Coder-30B-A3B" || name == "Qwen3-Coder-30B-A3B-Instruct" {
        return Some("z-lab/Qwen3-Coder-30B-A3B-DFlash".to_string());
    }
    if name.starts_with("Qwen3.5-") || name.starts_with("Qwen3.6-") {
        return Some(format!("z-lab/{name}-DFlash"));
    }
    Some(format!("z-lab/{name}-DFlash-b16"))
}

/// The bundled demo: next to this crate's sources (a checkout) or next to the executable.
pub fn find_demo_model() -> Result<PathBuf, ConfigError> {
    let mut candidates = vec![PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(DEMO_MODEL_DIR)];
    if let Some(dir) = std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(Path::to_path_buf))
    {
        candidates.push(dir.join(DEMO_MODEL_DIR));
    }
    candidates
        .iter()
        .find(|p| p.join("config.json").is_file())
        .cloned()
        .ok_or_else(|| ConfigError::NoDemoModel {
            looked: candidates
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", "),
        })
}

fn only_one(flag: &'static str, v: Option<usize>) -> Result<(), ConfigError> {
    match v {
        Some(n) if n != 1 => Err(ConfigError::Unsupported {
            flag,
            reason: format!("dflash-serve runs on one device, so only 1 is allowed (given {n}); remove the flag"),
        }),
        _ => Ok(()),
    }
}

fn refuse(
    flag: &'static str,
    v: &Option<String>,
    allowed: &[&str],
    reason: &str,
) -> Result<(), ConfigError> {
    match v {
        Some(s) if !allowed.iter().any(|a| a.eq_ignore_ascii_case(s)) => {
            Err(ConfigError::Unsupported {
                flag,
                reason: format!("{reason} (given `{s}`); remove the flag"),
            })
        }
        _ => Ok(()),
    }
}

impl ServeConfig {
    pub fn from_args(args: &Args) -> Result<Self, ConfigError> {
        only_one("--tp-size", args.tp_size)?;
        only_one("--dp-size", args.dp_size)?;
        only_one("--pp-size", args.pp_size)?;
        refuse(
            "--quantization",
            &args.quantization,
            &[],
            "quantized weights are not supported",
        )?;
        refuse(
            "--kv-cache-dtype",
            &args.kv_cache_dtype,
            &["auto"],
            "the KV cache uses the model dtype",
        )?;
        let reasoning_parser = match args.reasoning_parser.as_deref() {
            None => None,
            Some(name) => Some(ReasoningParserKind::parse(name).ok_or_else(|| {
                ConfigError::BadValue {
                    flag: "--reasoning-parser",
                    value: name.to_string(),
                    reason: "dflash-serve knows `qwen3` (hybrid thinking) and `qwen3-thinking` (always thinking)".into(),
                }
            })?),
        };
        let tool_call_parser = match args.tool_call_parser.as_deref() {
            None => None,
            Some(name) => Some(ToolParserKind::parse(name).ok_or_else(|| {
                ConfigError::BadValue {
                    flag: "--tool-call-parser",
                    value: name.to_string(),
                    reason:
                        "dflash-serve parses Qwen tool calls: qwen25 (alias hermes) or qwen3_coder"
                            .into(),
                }
            })?),
        };
        let grammar = match args.grammar_backend.as_str() {
            "llguidance" => true,
            "none" => false,
            other => {
                return Err(ConfigError::BadValue {
                    flag: "--grammar-backend",
                    value: other.to_string(),
                    reason: "dflash-serve ships llguidance (the default) for structured output; `none` turns it off (xgrammar and outlines are not built in)".into(),
                })
            }
        };
        if args.page_size == 0 {
            return Err(ConfigError::BadValue {
                flag: "--page-size",
                value: "0".into(),
                reason: "must be at least 1 token".into(),
            });
        }
        log_filter(&args.log_level)?;
        let ignored_sglang_flags = compat::check_sglang_flags(&args.sglang_flags)?;
        compat::warn_no_effect(&ignored_sglang_flags);

        let model_path = match &args.model_path {
            Some(p) => p.clone(),
            None => find_demo_model()?.display().to_string(),
        };
        // With no --model-path the bundled demo pair is served: target plus its drafter.
        let demo_drafter = args
            .model_path
            .is_none()
            .then(|| Path::new(&model_path).with_file_name(DEMO_DRAFTER_DIR))
            .filter(|d| d.join("config.json").is_file());
        let speculative = speculative::from_args(args, &model_path, demo_drafter.as_deref())?;
        let device = parse_device(&args.device)?;
        if let Some(0) = args.context_length {
            return Err(ConfigError::BadValue {
                flag: "--context-length",
                value: "0".into(),
                reason: "must be at least 1".into(),
            });
        }
        let max_running_requests = match args.max_running_requests {
            Some(0) => {
                return Err(ConfigError::BadValue {
                    flag: "--max-running-requests",
                    value: "0".into(),
                    reason: "must be at least 1".into(),
                })
            }
            Some(n) => n,
            None if speculative.is_some() => SPEC_DEFAULT_MAX_RUNNING,
            None => PLAIN_DEFAULT_MAX_RUNNING,
        };
        if let Some(0) = args.max_total_tokens {
            return Err(ConfigError::BadValue {
                flag: "--max-total-tokens",
                value: "0".into(),
                reason: "must be at least 1".into(),
            });
        }
        let chunked_prefill_size = match args.chunked_prefill_size {
            None => None,
            Some(-1) => Some(None),
            Some(n) if n > 0 => Some(Some(n as usize)),
            Some(n) => {
                return Err(ConfigError::BadValue {
                    flag: "--chunked-prefill-size",
                    value: n.to_string(),
                    reason: "must be a positive number of tokens, or -1 to prefill prompts whole"
                        .into(),
                })
            }
        };
        if !(args.schedule_conservativeness.is_finite() && args.schedule_conservativeness > 0.0) {
            return Err(ConfigError::BadValue {
                flag: "--schedule-conservativeness",
                value: args.schedule_conservativeness.to_string(),
                reason: "must be a positive number (1.0 is SGLang's default)".into(),
            });
        }
        let prefill_tokens_while_decoding = match args.prefill_tokens_while_decoding {
            None => Some(DEFAULT_PREFILL_TOKENS_WHILE_DECODING),
            Some(-1) => None,
            Some(n) if n > 0 => Some(n as usize),
            Some(n) => {
                return Err(ConfigError::BadValue {
                    flag: "--prefill-tokens-while-decoding",
                    value: n.to_string(),
                    reason: "must be a positive number of tokens, or -1 for the chunk size".into(),
                })
            }
        };
        let mixed_step_budget = match args.mixed_step_budget {
            None => Some(dflash_models::speculative::DEFAULT_MIXED_STEP_BUDGET),
            Some(0.0) => None,
            Some(b) if b.is_finite() && b > 1.0 => Some(b),
            Some(b) => {
                return Err(ConfigError::BadValue {
                    flag: "--mixed-step-budget",
                    value: b.to_string(),
                    reason: "must be more than 1 (decode steps a mixed step may cost), or 0 for fixed pieces".into(),
                })
            }
        };
        if let Some(f) = args.mem_fraction_static {
            if !(f > 0.0 && f <= 1.0) {
                return Err(ConfigError::BadValue {
                    flag: "--mem-fraction-static",
                    value: f.to_string(),
                    reason: "must be in (0, 1]: the fraction of GPU memory for the weights and the K/V pool".into(),
                });
            }
        }
        let request_timeout = match args.request_timeout {
            None => None,
            Some(secs) if secs.is_finite() && secs > 0.0 => {
                Some(std::time::Duration::from_secs_f64(secs))
            }
            Some(secs) => {
                return Err(ConfigError::BadValue {
                    flag: "--request-timeout",
                    value: secs.to_string(),
                    reason: "must be a positive number of seconds".into(),
                })
            }
        };
        let http = HttpTimeouts {
            header_read: seconds("--header-read-timeout", args.header_read_timeout, true)?,
            body_read: seconds("--body-read-timeout", args.body_read_timeout, true)?,
            keep_alive: seconds("--keep-alive-timeout", args.keep_alive_timeout, true)?,
            shutdown_grace: seconds("--shutdown-grace-period", args.shutdown_grace_period, false)?
                .unwrap_or_default(),
        };
        let queue_timeout = seconds(
            "--queued-request-timeout",
            args.queued_request_timeout,
            true,
        )?;
        for (flag, v) in [
            (
                "--max-sequences-per-request",
                args.max_sequences_per_request,
            ),
            ("--max-queued-requests", args.max_queued_requests),
        ] {
            if v == 0 {
                return Err(ConfigError::BadValue {
                    flag,
                    value: "0".into(),
                    reason: "must be at least 1".into(),
                });
            }
        }
        if args.max_request_body_bytes == Some(0) {
            return Err(ConfigError::BadValue {
                flag: "--max-request-body-bytes",
                value: "0".into(),
                reason: "must be at least 1".into(),
            });
        }
        let default_chat_template_kwargs = match &args.default_chat_template_kwargs {
            None => Map::new(),
            Some(text) => match serde_json::from_str::<Value>(text) {
                Ok(Value::Object(m)) => m,
                _ => {
                    return Err(ConfigError::BadValue {
                        flag: "--default-chat-template-kwargs",
                        value: text.clone(),
                        reason: "expected a JSON object, e.g. '{\"enable_thinking\": false}'"
                            .into(),
                    })
                }
            },
        };
        let served_model_name = args
            .served_model_name
            .clone()
            .unwrap_or_else(|| default_served_name(&model_path, args.model_path.is_none()));
        Ok(Self {
            model_path,
            tokenizer_path: args.tokenizer_path.clone(),
            served_model_name,
            host: args.host.clone(),
            port: args.port,
            dtype: match args.dtype {
                DTypeArg::Auto => DType::Auto,
                DTypeArg::BFloat16 => DType::BFloat16,
                DTypeArg::Float16 => DType::Float16,
                DTypeArg::Float32 => DType::Float32,
            },
            device,
            context_length: args.context_length,
            max_running_requests,
            max_queued_requests: args.max_queued_requests,
            max_total_tokens: args.max_total_tokens,
            mem_fraction_static: args.mem_fraction_static,
            chunked_prefill_size,
            prefill_tokens_while_decoding,
            mixed_step_budget,
            request_timeout,
            api_key: args.api_key.clone(),
            chat_template: args.chat_template.clone(),
            hf_chat_template_name: args.hf_chat_template_name.clone(),
            default_chat_template_kwargs,
            enable_metrics: args.enable_metrics,
            schedule_conservativeness: args.schedule_conservativeness,
            disable_radix_cache: args.disable_radix_cache,
            disable_mixed_chunk: args.disable_mixed_chunk,
            enable_cache_report: args.enable_cache_report,
            max_request_body_bytes: args.max_request_body_bytes,
            http,
            max_sequences_per_request: args.max_sequences_per_request.min(args.max_queued_requests),
            queue_timeout,
            decode_log_interval: args.decode_log_interval,
            log_level: args.log_level.clone(),
            speculative,
            reasoning_parser,
            tool_call_parser,
            grammar,
            page_size: args.page_size,
            launch_command: args.launch_command.clone(),
            ignored_sglang_flags,
            warmup: !args.skip_server_warmup,
        })
    }
}

impl ServeConfig {
    /// SGLang's `speculative_num_draft_tokens` (tokens verified per round: the drafts plus the
    /// bonus token, so a 16-block DFLASH drafter reads 16), one value for /server_info and the
    /// `sglang:spec_num_draft_tokens` gauge; `None` without speculation.
    pub fn spec_num_draft_tokens(&self, drafts_per_round: usize) -> Option<usize> {
        self.speculative
            .as_ref()
            .map(|s| s.num_draft_tokens.unwrap_or(drafts_per_round + 1))
    }

    /// KV-cache tokens all running requests share where the engine did not size a pool from
    /// device memory (the CPU): `--max-total-tokens`, or room for every running slot to hold
    /// a full context.
    pub fn total_tokens(&self, context_length: usize) -> usize {
        self.max_total_tokens
            .unwrap_or(context_length * self.max_running_requests)
    }
}

/// SGLang serves the model path as the name; for the bundled demo that would be a long local
/// path, so it is served as `tiny-coder-demo`.
fn default_served_name(model_path: &str, is_demo: bool) -> String {
    if is_demo {
        return "tiny-coder-demo".into();
    }
    model_path.to_string()
}
