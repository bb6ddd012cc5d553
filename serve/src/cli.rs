//! The command line, in SGLang's spelling (`python -m sglang.launch_server` flags), so launch
//! lines can be pasted unchanged. Unique prefixes work as with argparse (`--speculative-algo`).
//! Parsed once into [`crate::config::ServeConfig`]; nothing else reads these fields.

use std::collections::HashSet;
use std::path::PathBuf;

use clap::{Parser, ValueEnum};

pub mod sglang;

pub use sglang::PassedFlag;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DTypeArg {
    Auto,
    #[value(name = "bfloat16")]
    BFloat16,
    #[value(name = "float16", alias = "half")]
    Float16,
    #[value(name = "float32", alias = "float")]
    Float32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum VerifyArg {
    /// Verify a tree of draft candidates (DDTree); wider, higher acceptance.
    Ddtree,
    /// Verify the drafter's single most likely continuation.
    Chain,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DrafterArg {
    /// The drafter z-lab publishes for the target (Qwen/Qwen3-8B -> z-lab/Qwen3-8B-DFlash-b16),
    /// from the Hugging Face cache.
    #[value(name = "z-lab")]
    ZLab,
}

#[derive(Debug, Clone, Parser)]
#[command(
    name = "dflash-serve",
    version,
    infer_long_args = true,
    about = "SGLang- and OpenAI-compatible server for Qwen3, Qwen3.5 and Qwen3.6 targets with DFlash (or built-in MTP) speculative decoding.",
    long_about = "SGLang- and OpenAI-compatible server for Qwen3, Qwen3.5 and Qwen3.6 targets with DFlash (or built-in MTP) speculative decoding.\n\nWith no arguments it serves the bundled tiny-coder-demo model on CPU at http://127.0.0.1:30000.\nFlags use SGLang's spelling, so `python -m sglang.launch_server` lines work unchanged; flags SGLang has\nthat dflash-serve cannot honour are refused by name, the ones with no effect here accepted with a warning."
)]
pub struct Args {
    /// Model directory or Hugging Face repo id [default: the bundled tiny-coder-demo]
    #[arg(long = "model-path", visible_alias = "model", help_heading = "Model")]
    pub model_path: Option<String>,
    /// Tokenizer directory [default: the model directory]
    #[arg(long, help_heading = "Model")]
    pub tokenizer_path: Option<PathBuf>,
    /// Weight dtype; auto uses bfloat16 on CUDA and float32 on CPU
    #[arg(long, value_enum, default_value = "auto", help_heading = "Model")]
    pub dtype: DTypeArg,
    /// Device: auto (the first CUDA device when built with CUDA and a GPU is present, else the
    /// CPU, as SGLang needs no flag), cpu, cuda or cuda:N
    #[arg(long, default_value = "auto", help_heading = "Model")]
    pub device: String,
    /// Context length [default: the model's max_position_embeddings]
    #[arg(long, help_heading = "Model")]
    pub context_length: Option<usize>,
    /// Name returned by /v1/models and used in metric labels [default: the model path]
    #[arg(long, help_heading = "Model")]
    pub served_model_name: Option<String>,
    /// Chat template file (Jinja) overriding the tokenizer's
    #[arg(long, help_heading = "Model")]
    pub chat_template: Option<PathBuf>,
    /// Which of several named templates in tokenizer_config.json to use
    #[arg(long, help_heading = "Model")]
    pub hf_chat_template_name: Option<String>,
    /// JSON object of chat-template variables for every request, e.g. '{"enable_thinking": false}'
    #[arg(long, help_heading = "Model")]
    pub default_chat_template_kwargs: Option<String>,

    /// Address to bind
    #[arg(long, default_value = "127.0.0.1", help_heading = "HTTP")]
    pub host: String,
    #[arg(long, default_value_t = 30000, help_heading = "HTTP")]
    pub port: u16,
    /// Require `Authorization: Bearer KEY` (health and metrics stay open)
    #[arg(long, help_heading = "HTTP")]
    pub api_key: Option<String>,
    /// Serve Prometheus metrics at /metrics
    #[arg(long, help_heading = "HTTP")]
    pub enable_metrics: bool,
    /// Largest accepted request body, in bytes [default: what a full-context prompt can take,
    /// 4 x context length x the longest token's bytes, at least 1 MiB]
    #[arg(long, help_heading = "HTTP")]
    pub max_request_body_bytes: Option<usize>,
    /// Close a connection whose request headers have not fully arrived this many seconds after
    /// it began waiting for them (slowloris); 0 turns it off
    #[arg(
        long,
        value_name = "SECONDS",
        default_value_t = 10.0,
        help_heading = "HTTP"
    )]
    pub header_read_timeout: f64,
    /// Answer 408 and close when a request body has not fully arrived this many seconds after
    /// its headers; 0 turns it off
    #[arg(
        long,
        value_name = "SECONDS",
        default_value_t = 30.0,
        help_heading = "HTTP"
    )]
    pub body_read_timeout: f64,
    /// Close a keep-alive connection idle this long between requests (uvicorn's default, 5);
    /// 0 turns it off
    #[arg(
        long,
        value_name = "SECONDS",
        default_value_t = 5.0,
        help_heading = "HTTP"
    )]
    pub keep_alive_timeout: f64,
    /// On SIGTERM, once running requests are done, how long connections still open (a response
    /// being written, a half-sent request) get before they are closed
    #[arg(
        long,
        value_name = "SECONDS",
        default_value_t = 5.0,
        help_heading = "HTTP"
    )]
    pub shutdown_grace_period: f64,

    /// Sequences decoded together [default: 48 when speculating, else 64]
    #[arg(long, help_heading = "Scheduling")]
    pub max_running_requests: Option<usize>,
    /// KV-cache tokens shared by all running requests; each reserves its cache (prompt +
    /// max_new_tokens rounded up) and waits until that fits [default: sized from GPU memory
    /// with --mem-fraction-static on CUDA; context length x max running requests on the CPU]
    #[arg(long, help_heading = "Scheduling")]
    pub max_total_tokens: Option<usize>,
    /// Most prompt tokens prefilled per step, so long prompts are prefilled in chunks between
    /// the running requests' decode steps; -1 prefills every prompt whole [default: SGLang's
    /// rule for the GPU (8192 on an H200), 4096 on the CPU]
    #[arg(long, allow_negative_numbers = true, help_heading = "Scheduling")]
    pub chunked_prefill_size: Option<i64>,
    /// While other requests decode, at most this many prompt tokens of a prompt per step
    /// (the pieces --mixed-step-budget sizes; with --mixed-step-budget 0 a prompt longer
    /// than this goes in pieces of this many, fewer past 4096 positions, and a shorter one
    /// whole); -1: only --chunked-prefill-size bounds a step [default: 256]
    #[arg(long, allow_negative_numbers = true, help_heading = "Scheduling")]
    pub prefill_tokens_while_decoding: Option<i64>,
    /// While other requests decode, a step that prefills a prompt beside them gets as many of
    /// its tokens as keep the step's estimated cost (weights and rows, attention's positions x
    /// tokens; calibrated from measured steps) within this many of their decode steps, so a
    /// long prompt arriving at a busy server stretches their inter-token latency about this
    /// much; 0: pieces of --prefill-tokens-while-decoding only [default: 2.0]
    #[arg(long, allow_negative_numbers = true, help_heading = "Scheduling")]
    pub mixed_step_budget: Option<f64>,
    /// Prefill in a forward of its own instead of in the running requests' decode and
    /// verify forward (SGLang's mixed chunk, which is on by default here:
    /// --enable-mixed-chunk is accepted and changes nothing)
    #[arg(long, help_heading = "Scheduling")]
    pub disable_mixed_chunk: bool,
    /// Scales the share of max_new_tokens admission expects a request to still generate
    /// (SGLang's new-token ratio, from 0.7 x this down to 0.098 x this; a retraction resets
    /// it); higher admits fewer requests at once and retracts less
    #[arg(long, default_value_t = 1.0, help_heading = "Scheduling")]
    pub schedule_conservativeness: f64,
    /// Do not share K/V pages between requests with a common prompt prefix (the prefix
    /// cache is on by default for Qwen3 targets; hybrid targets never use it)
    #[arg(long, help_heading = "Scheduling")]
    pub disable_radix_cache: bool,
    /// Report the prompt tokens found in the prefix cache in OpenAI usage
    /// (`prompt_tokens_details.cached_tokens`); /generate's meta_info always has them
    #[arg(long, help_heading = "HTTP")]
    pub enable_cache_report: bool,
    /// End a request that has not finished this many seconds after it arrived (finish reason
    /// `abort`, with the text generated so far) [default: no limit]
    #[arg(long, value_name = "SECONDS", help_heading = "Scheduling")]
    pub request_timeout: Option<f64>,
    /// Sequences (prompts x n) allowed to wait for a slot before new requests get 503
    #[arg(long, default_value_t = 1024, help_heading = "Scheduling")]
    pub max_queued_requests: usize,
    /// Most sequences (prompts x n) one request may ask for; more is a 400 naming this flag
    /// (capped by --max-queued-requests, since a larger request could never be queued)
    #[arg(long, default_value_t = 256, help_heading = "Scheduling")]
    pub max_sequences_per_request: usize,
    /// End a request still waiting for a running slot this many seconds after it arrived
    /// (finish reason `abort`, no output); 0 turns it off
    #[arg(
        long,
        value_name = "SECONDS",
        default_value_t = 300.0,
        help_heading = "Scheduling"
    )]
    pub queued_request_timeout: f64,
    /// Log a decode line every N engine steps
    #[arg(long, default_value_t = 40, help_heading = "Scheduling")]
    pub decode_log_interval: usize,
    /// Log level when RUST_LOG is not set, in SGLang's (Python's) names: critical, error,
    /// warning, info, debug (and trace)
    #[arg(long, default_value = "info", help_heading = "Scheduling")]
    pub log_level: String,

    /// DFLASH, NEXTN (alias MTP: the target's built-in MTP head, Qwen3.5 / Qwen3.6 /
    /// Qwen3-Next) or NONE (case-insensitive)
    #[arg(long, help_heading = "Speculative decoding")]
    pub speculative_algorithm: Option<String>,
    /// DFlash drafter directory or Hugging Face repo id
    #[arg(
        long,
        visible_aliases = ["speculative-draft-model", "speculative-draft"],
        help_heading = "Speculative decoding"
    )]
    pub speculative_draft_model_path: Option<String>,
    /// Use a published drafter instead of a path
    #[arg(long, value_enum, help_heading = "Speculative decoding")]
    pub drafter: Option<DrafterArg>,
    /// DFLASH: block size [default: the drafter's block_size]. NEXTN: verify width
    /// (steps + 1 for a chain; tree nodes + 1 with --speculative-eagle-topk above 1)
    #[arg(long, help_heading = "Speculative decoding")]
    pub speculative_num_draft_tokens: Option<usize>,
    /// DFLASH alias of --speculative-num-draft-tokens (must agree with it when both are given)
    #[arg(long, help_heading = "Speculative decoding")]
    pub speculative_dflash_block_size: Option<usize>,
    /// How drafts are verified [default: ddtree for DFLASH; for NEXTN chain, or ddtree with
    /// --speculative-eagle-topk above 1]
    #[arg(long, value_enum, help_heading = "Speculative decoding")]
    pub speculative_verify: Option<VerifyArg>,
    /// Tree nodes verified per round with --speculative-verify ddtree (NEXTN trees take
    /// --speculative-num-draft-tokens - 1 when it is given)
    #[arg(long, default_value_t = 32, help_heading = "Speculative decoding")]
    pub speculative_ddtree_budget: usize,
    /// NEXTN drafts per round [default: 3]; forced to 1 for DFLASH, as in SGLang
    #[arg(long, help_heading = "Speculative decoding")]
    pub speculative_num_steps: Option<usize>,
    /// NEXTN: 1 verifies a chain, more a DDTree [default: 1]; forced to 1 for DFLASH
    #[arg(long, help_heading = "Speculative decoding")]
    pub speculative_eagle_topk: Option<usize>,

    /// Accepted for compatibility; only 1 is supported
    #[arg(long, visible_aliases = ["tensor-parallel-size", "tp"], help_heading = "SGLang compatibility")]
    pub tp_size: Option<usize>,
    /// Accepted for compatibility; only 1 is supported
    #[arg(long, help_heading = "SGLang compatibility")]
    pub dp_size: Option<usize>,
    /// Accepted for compatibility; only 1 is supported
    #[arg(long, help_heading = "SGLang compatibility")]
    pub pp_size: Option<usize>,
    /// Refused: dflash-serve loads bf16/f16/f32 weights only
    #[arg(long, help_heading = "SGLang compatibility")]
    pub quantization: Option<String>,
    /// Only `auto` is supported
    #[arg(long, help_heading = "SGLang compatibility")]
    pub kv_cache_dtype: Option<String>,
    /// Separate `<think>` reasoning into `reasoning_content` in chat answers: qwen3 or qwen3-thinking
    #[arg(long, help_heading = "Chat")]
    pub reasoning_parser: Option<String>,
    /// Parse tool calls out of chat answers into `tool_calls`: qwen25 (also hermes: the
    /// `<tool_call>{json}</tool_call>` format) or qwen3_coder (`<function=...>` XML)
    #[arg(long, help_heading = "Chat")]
    pub tool_call_parser: Option<String>,
    /// Structured output (`response_format`, `json_schema`, `regex`, `ebnf`, `tool_choice`
    /// required/named): `llguidance` (built in) or `none` (refuse such requests); SGLang's
    /// `xgrammar` and `outlines` are not shipped
    #[arg(long, default_value = "llguidance", help_heading = "Chat")]
    pub grammar_backend: String,
    /// Fraction of GPU memory for the weights plus the K/V pool (SGLang's meaning) [default: SGLang's rule for the GPU, 0.892 on an H200 with a drafter]; no effect on the CPU
    #[arg(long, help_heading = "SGLang compatibility")]
    pub mem_fraction_static: Option<f64>,
    /// Tokens per K/V-cache page (SGLang's default for this server, 64); kept for the paged pool
    #[arg(long, default_value_t = 64, help_heading = "Scheduling")]
    pub page_size: usize,
    /// Announce readiness without first running one short warm-up generation
    #[arg(long, help_heading = "Scheduling")]
    pub skip_server_warmup: bool,

    /// The SGLang flags taken out of the command line before clap ([`sglang::split`]).
    #[arg(skip)]
    pub sglang_flags: Vec<PassedFlag>,
    /// The command line as given (SGLang's `launch_command` in /server_info).
    #[arg(skip)]
    pub launch_command: Vec<String>,
}

impl Args {
    /// Parses an SGLang launch line: SGLang flags without a clap argument are set aside for
    /// [`crate::config::ServeConfig::from_args`] to warn about or refuse; the rest is clap's.
    pub fn try_parse_sglang_from<I, T>(argv: I) -> Result<Self, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<String>,
    {
        let argv: Vec<String> = argv.into_iter().map(Into::into).collect();
        let command = <Self as clap::CommandFactory>::command();
        let clap_names: HashSet<String> = command
            .get_arguments()
            .flat_map(|a| {
                a.get_long()
                    .into_iter()
                    .chain(a.get_all_aliases().unwrap_or_default())
                    .map(|n| format!("--{n}"))
            })
            .chain(["--help".to_string(), "--version".to_string()])
            .collect();
        let (clap_argv, sglang_flags) = sglang::split(argv.clone(), &clap_names);
        let mut args = Self::try_parse_from(clap_argv)?;
        args.sglang_flags = sglang_flags;
        args.launch_command = argv;
        Ok(args)
    }

    /// [`Args::try_parse_sglang_from`] on this process's arguments; exits on a clap error as
    /// `Args::parse` does.
    pub fn parse_sglang() -> Self {
        Self::try_parse_sglang_from(std::env::args()).unwrap_or_else(|e| e.exit())
    }
}
