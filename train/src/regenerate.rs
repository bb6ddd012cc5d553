//! `dflash-train regenerate`: rewrite the final assistant turn of each chat record with the
//! target's own output, so a drafter learns what the target says rather than what a dataset's
//! author wrote (DFLASH.md §3.1).
//!
//! Each record's prompt is rendered exactly as training renders it (`messages[..last]` with the
//! generation prompt), decoded by the decoding core ([`Engine`]: plain, or speculative with
//! `--drafter`, which is lossless at T=0 and samples the target distribution at T>0) until an
//! end-of-sequence token or `--max-new-tokens`; the decoded text (the stop token dropped: the
//! template closes the turn) replaces the last message's content; every other field is kept.
//!
//! Batches are fixed groups of `--batch-size` consecutive input lines, each run to completion
//! before it is written, so batch composition and therefore every output byte are the same
//! whether or not the run was interrupted. Sampling seeds are per line (`--seed` + line
//! number). Resume: `<output>.progress.json` records the input lines done and the output bytes
//! that cover them; it is replaced atomically (temp file, rename) after the output is flushed
//! and synced, and a rerun cuts the output back to that length (dropping a half-written batch)
//! and continues with the next line. Lines that are not usable records are skipped and
//! counted (up to `--max-bad-lines`); so are prompts that do not fit `--context-length`.

use std::io::{Seek, Write};
use std::path::{Path, PathBuf};

use candle_core::{DType, Device};
use dflash_common::chat::{ChatRenderInput, ChatTemplate};
use dflash_common::tokenizer::Tokenizer;
use dflash_models::speculative::{
    Algorithm, DFlashProposer, Engine, EngineConfig, FinishReason, GenerationRequest,
    SamplingParams,
};
use dflash_models::{DFlashDrafter, OpsMode, Qwen3Model};
use indicatif::{ProgressBar, ProgressStyle};
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Flags of `dflash-train regenerate`.
#[derive(Debug, Clone, clap::Args)]
pub struct RegenerateArgs {
    /// Target model directory (its tokenizer and chat template render the prompts).
    #[arg(long, value_name = "DIR")]
    pub target_model: PathBuf,
    /// JSONL chat dataset to rewrite ({"messages": [...]} per line, last message the assistant's),
    /// plain or .xz.
    #[arg(long, value_name = "FILE")]
    pub input: PathBuf,
    /// Where the rewritten JSONL goes; `<output>.progress.json` beside it makes reruns resume.
    #[arg(long, value_name = "FILE")]
    pub output: PathBuf,
    /// Decode speculatively with this drafter (same outputs at T=0, faster on a GPU).
    #[arg(long, value_name = "DIR")]
    pub drafter: Option<PathBuf>,
    /// DDTree budget with --drafter (0: the vanilla DFlash chain).
    #[arg(long, default_value_t = 32)]
    pub ddtree_budget: usize,
    /// Most tokens generated per record.
    #[arg(long, default_value_t = 2048)]
    pub max_new_tokens: usize,
    /// 0 is greedy; above 0 samples (with --top-p / --top-k).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Nucleus sampling threshold (1 disables it).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Sample among the k most likely tokens (-1 disables it).
    #[arg(long, default_value_t = -1)]
    pub top_k: i32,
    /// Sampling seed of line i is seed + i.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Records decoded together (one batch = this many consecutive input lines).
    #[arg(long, default_value_t = 8)]
    pub batch_size: usize,
    /// Prompt plus generated tokens [default: the target's max_position_embeddings]; longer
    /// records are skipped and counted.
    #[arg(long)]
    pub context_length: Option<usize>,
    /// `cpu`, `cuda` or `cuda:N`.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Unusable input lines tolerated (skipped and counted) before the run stops.
    #[arg(long, default_value_t = 100)]
    pub max_bad_lines: usize,
    /// Stop after this many batches (progress kept; rerun to continue).
    #[arg(long, hide = true)]
    pub stop_after_batches: Option<usize>,
}

#[derive(Debug, thiserror::Error)]
pub enum RegenError {
    #[error("cannot read {path}: {message}")]
    Input { path: PathBuf, message: String },
    #[error("cannot write {path}: {message}")]
    Output { path: PathBuf, message: String },
    #[error("{path}: the progress file belongs to another run ({message}); delete it and {output} to start over, or rerun with the same flags")]
    Mismatch {
        path: PathBuf,
        output: String,
        message: String,
    },
    #[error("{path}:{line}: {count} unusable lines, more than --max-bad-lines {limit}; the last: {message}")]
    TooManyBadLines {
        path: PathBuf,
        line: usize,
        count: usize,
        limit: usize,
        message: String,
    },
    #[error("invalid {flag}: {message}")]
    Flag { flag: &'static str, message: String },
    #[error("target {path}: {message}")]
    Target { path: PathBuf, message: String },
    #[error("decoding {path}:{line}: {message}")]
    Decode {
        path: PathBuf,
        line: usize,
        message: String,
    },
}

/// What a rerun must agree on to continue a run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Settings {
    input: String,
    input_bytes: u64,
    target_model: String,
    drafter: Option<String>,
    ddtree_budget: usize,
    max_new_tokens: usize,
    temperature: f32,
    top_p: f32,
    top_k: i32,
    seed: u64,
    batch_size: usize,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Progress {
    settings: Settings,
    /// Input lines consumed (a multiple of the batch size until the last batch).
    lines_done: usize,
    /// Output bytes that hold the records of those lines.
    output_bytes: u64,
    written: usize,
    skipped: usize,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RegenSummary {
    pub lines: usize,
    pub written: usize,
    pub skipped: usize,
    /// False when stopped by --stop-after-batches.
    pub complete: bool,
}

fn progress_path(output: &Path) -> PathBuf {
    let mut name = output.file_name().unwrap_or_default().to_os_string();
    name.push(".progress.json");
    output.with_file_name(name)
}

fn write_progress(path: &Path, p: &Progress) -> Result<(), RegenError> {
    let err = |e: std::io::Error| RegenError::Output {
        path: path.to_path_buf(),
        message: e.to_string(),
    };
    let tmp = path.with_extension("json.tmp");
    let body = serde_json::to_vec_pretty(p).expect("progress serializes");
    let mut f = std::fs::File::create(&tmp).map_err(err)?;
    f.write_all(&body).map_err(err)?;
    f.sync_all().map_err(err)?;
    std::fs::rename(&tmp, path).map_err(err)
}

/// A usable record: the rendered prompt ids and the parsed line.
fn prepare(
    line: &str,
    tok: &Tokenizer,
    template: &ChatTemplate,
) -> Result<(Vec<u32>, Value), String> {
    let value: Value = serde_json::from_str(line).map_err(|e| format!("not valid JSON: {e}"))?;
    let messages = value
        .get("messages")
        .and_then(Value::as_array)
        .ok_or("no `messages` array")?;
    let last = messages.last().ok_or("`messages` is empty")?;
    if last.get("role").and_then(Value::as_str) != Some("assistant") {
        return Err("the last message is not an assistant turn (nothing to regenerate)".into());
    }
    let prompt = template
        .render(&ChatRenderInput {
            messages: &messages[..messages.len() - 1],
            add_generation_prompt: true,
            ..Default::default()
        })
        .map_err(|e| format!("chat template: {e}"))?;
    let ids = tok.encode(&prompt, false).map_err(|e| e.to_string())?;
    Ok((ids, value))
}

/// Generated tokens of one request and why it stopped.
type Decoded = (Vec<u32>, Option<FinishReason>);

/// Decodes the requests of one batch together; outputs in request order.
fn decode_batch(engine: &mut Engine, reqs: Vec<GenerationRequest>) -> Result<Vec<Decoded>, String> {
    let mut ids = Vec::with_capacity(reqs.len());
    for r in reqs {
        ids.push(engine.add(r).map_err(|e| e.to_string())?);
    }
    let mut out: Vec<Decoded> = vec![(Vec::new(), None); ids.len()];
    let mut open = ids.len();
    while open > 0 {
        for e in engine.step().map_err(|e| e.to_string())? {
            if let Some(i) = ids.iter().position(|&id| id == e.id) {
                out[i].0.extend_from_slice(&e.tokens);
                if e.finished.is_some() {
                    out[i].1 = e.finished;
                    open -= 1;
                }
            }
        }
    }
    Ok(out)
}

fn parse_device(s: &str) -> Result<Device, RegenError> {
    let err = |message: String| RegenError::Flag {
        flag: "--device",
        message,
    };
    match s {
        "cpu" => Ok(Device::Cpu),
        _ => {
            let i = s
                .strip_prefix("cuda")
                .map(|r| r.trim_start_matches(':'))
                .ok_or_else(|| err(format!("`{s}`: use cpu, cuda or cuda:N")))?;
            let i = if i.is_empty() {
                0
            } else {
                i.parse().map_err(|_| err(format!("`{s}`")))?
            };
            Device::new_cuda(i).map_err(|e| err(format!("cannot open {s}: {e}")))
        }
    }
}

/// Runs (or resumes) a regeneration.
pub fn regenerate(args: &RegenerateArgs) -> Result<RegenSummary, RegenError> {
    if args.batch_size == 0 {
        return Err(RegenError::Flag {
            flag: "--batch-size",
            message: "must be at least 1".into(),
        });
    }
    let input_err = |message: String| RegenError::Input {
        path: args.input.clone(),
        message,
    };
    let text = crate::train::data::read_text(&args.input).map_err(|e| input_err(e.to_string()))?;
    let lines: Vec<&str> = text.lines().collect();
    let target_err = |message: String| RegenError::Target {
        path: args.target_model.clone(),
        message,
    };
    let tok = Tokenizer::from_dir(&args.target_model).map_err(|e| target_err(e.to_string()))?;
    let template = ChatTemplate::from_model(&args.target_model, tok.config(), None)
        .map_err(|e| target_err(e.to_string()))?;
    let settings = Settings {
        input: args.input.display().to_string(),
        input_bytes: text.len() as u64,
        target_model: args.target_model.display().to_string(),
        drafter: args.drafter.as_ref().map(|d| d.display().to_string()),
        ddtree_budget: args.ddtree_budget,
        max_new_tokens: args.max_new_tokens,
        temperature: args.temperature,
        top_p: args.top_p,
        top_k: args.top_k,
        seed: args.seed,
        batch_size: args.batch_size,
    };
    let ppath = progress_path(&args.output);
    let out_err = |e: std::io::Error| RegenError::Output {
        path: args.output.clone(),
        message: e.to_string(),
    };
    let mut progress = if ppath.exists() {
        let p: Progress = std::fs::read(&ppath)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .ok_or_else(|| RegenError::Mismatch {
                path: ppath.clone(),
                output: args.output.display().to_string(),
                message: "unreadable".into(),
            })?;
        if p.settings != settings {
            return Err(RegenError::Mismatch {
                path: ppath.clone(),
                output: args.output.display().to_string(),
                message: format!("it has {:?}, this run {:?}", p.settings, settings),
            });
        }
        p
    } else {
        Progress {
            settings: settings.clone(),
            lines_done: 0,
            output_bytes: 0,
            written: 0,
            skipped: 0,
        }
    };
    if let Some(dir) = args.output.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(out_err)?;
    }
    let mut out = std::fs::OpenOptions::new()
        .create(true)
        .write(true)
        .truncate(false)
        .open(&args.output)
        .map_err(out_err)?;
    // Anything past the recorded length is a batch that was cut short.
    out.set_len(progress.output_bytes).map_err(out_err)?;
    out.seek(std::io::SeekFrom::End(0)).map_err(out_err)?;
    if progress.lines_done >= lines.len() {
        return Ok(RegenSummary {
            lines: lines.len(),
            written: progress.written,
            skipped: progress.skipped,
            complete: true,
        });
    }

    let device = parse_device(&args.device)?;
    let dtype = if device.is_cuda() {
        DType::BF16
    } else {
        DType::F32
    };
    let cfg = dflash_common::Qwen3Config::from_file(args.target_model.join("config.json"))
        .map_err(|e| target_err(e.to_string()))?;
    let context = args.context_length.unwrap_or(cfg.max_position_embeddings);
    let target = Qwen3Model::load(&args.target_model, dtype, &device, context, OpsMode::Fused)
        .map_err(|e| target_err(e.to_string()))?;
    let (proposer, algorithm) = match &args.drafter {
        Some(dir) => {
            let d = DFlashDrafter::load(dir, &target, OpsMode::Fused).map_err(|e| {
                RegenError::Flag {
                    flag: "--drafter",
                    message: format!("{}: {e}", dir.display()),
                }
            })?;
            let alg = match args.ddtree_budget {
                0 => Algorithm::Chain,
                b => Algorithm::DDTree { budget: b },
            };
            (Some(Box::new(DFlashProposer::new(d)) as _), alg)
        }
        None => (None, Algorithm::Plain),
    };
    let mut eos = tok.eos_token_ids().to_vec();
    if eos.is_empty() {
        eos = cfg.eos_token_ids.clone();
    }
    let mut engine = Engine::new(
        target,
        proposer,
        EngineConfig {
            max_context: context,
            max_ddtree_budget: args.ddtree_budget.max(1),
            eos_token_ids: eos,
            seed: args.seed,
        },
    );

    if device.is_cuda() {
        use_kv_pool(
            &mut engine,
            &device,
            args.batch_size,
            context,
            &args.target_model,
        )?;
    }
    let bar = ProgressBar::new(lines.len() as u64);
    let on_terminal = std::io::IsTerminal::is_terminal(&std::io::stderr());
    if on_terminal {
        bar.set_style(
            ProgressStyle::with_template(
                "{bar:30} {pos}/{len} records [{elapsed_precise} < {eta_precise}] {msg}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
    } else {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    bar.set_position(progress.lines_done as u64);
    let mut bad = 0usize;
    let mut batches = 0usize;
    let started = std::time::Instant::now();
    let mut new_tokens = 0usize;
    while progress.lines_done < lines.len() {
        if args.stop_after_batches.is_some_and(|n| batches >= n) {
            bar.finish_and_clear();
            return Ok(RegenSummary {
                lines: lines.len(),
                written: progress.written,
                skipped: progress.skipped,
                complete: false,
            });
        }
        let start = progress.lines_done;
        let end = (start + args.batch_size).min(lines.len());
        let mut records = Vec::new();
        let mut reqs = Vec::new();
        for (i, line) in lines[start..end].iter().enumerate() {
            let lineno = start + i + 1;
            if line.trim().is_empty() {
                continue;
            }
            let fits = |(ids, v): (Vec<u32>, Value)| {
                if ids.len() + args.max_new_tokens > context {
                    Err(format!(
                        "prompt ({} tokens) + --max-new-tokens {} exceeds --context-length {context}",
                        ids.len(),
                        args.max_new_tokens
                    ))
                } else {
                    Ok((ids, v))
                }
            };
            match prepare(line, &tok, &template).and_then(fits) {
                Ok((ids, value)) => {
                    reqs.push(GenerationRequest {
                        prompt: ids,
                        max_new_tokens: args.max_new_tokens,
                        sampling: SamplingParams {
                            temperature: args.temperature,
                            top_p: args.top_p,
                            top_k: args.top_k,
                            seed: Some(args.seed.wrapping_add(lineno as u64)),
                            ..SamplingParams::default()
                        },
                        stop_token_ids: Vec::new(),
                        ignore_eos: false,
                        algorithm,
                    });
                    records.push((lineno, value));
                }
                Err(message) => {
                    bad += 1;
                    progress.skipped += 1;
                    if bad > args.max_bad_lines {
                        return Err(RegenError::TooManyBadLines {
                            path: args.input.clone(),
                            line: lineno,
                            count: bad,
                            limit: args.max_bad_lines,
                            message,
                        });
                    }
                    bar.suspend(|| {
                        tracing::warn!("{}:{lineno}: skipped: {message}", args.input.display())
                    });
                }
            }
        }
        let outputs = decode_batch(&mut engine, reqs).map_err(|message| RegenError::Decode {
            path: args.input.clone(),
            line: records.first().map_or(start + 1, |r| r.0),
            message,
        })?;
        let mut chunk = Vec::new();
        for ((lineno, mut value), (mut ids, finish)) in records.into_iter().zip(outputs) {
            new_tokens += ids.len();
            if matches!(finish, Some(FinishReason::Stop(_))) {
                ids.pop();
            }
            let text = tok.decode(&ids, false).map_err(|e| RegenError::Decode {
                path: args.input.clone(),
                line: lineno,
                message: e.to_string(),
            })?;
            if let Some(last) = value
                .get_mut("messages")
                .and_then(Value::as_array_mut)
                .and_then(|m| m.last_mut())
            {
                last["content"] = Value::String(text);
            }
            chunk.extend_from_slice(value.to_string().as_bytes());
            chunk.push(b'\n');
            progress.written += 1;
        }
        out.write_all(&chunk).map_err(out_err)?;
        out.sync_data().map_err(out_err)?;
        progress.output_bytes += chunk.len() as u64;
        progress.lines_done = end;
        write_progress(&ppath, &progress)?;
        batches += 1;
        bar.set_position(end as u64);
        let rate = new_tokens as f64 / started.elapsed().as_secs_f64().max(1e-9);
        bar.set_message(format!("{rate:.0} tok/s, {} skipped", progress.skipped));
        if !on_terminal {
            tracing::info!(
                "{end}/{} records, {rate:.0} generated tok/s, {} skipped",
                lines.len(),
                progress.skipped
            );
        }
    }
    bar.finish_and_clear();
    Ok(RegenSummary {
        lines: lines.len(),
        written: progress.written,
        skipped: progress.skipped,
        complete: true,
    })
}

/// On CUDA the batch decodes in a paged K/V pool (as the server does), so its rounds run as
/// batched steps instead of one forward per sequence. Sized for the whole batch at full
/// context, capped at half the free device memory (logits and activations beside it); the
/// engine retracts and resumes sequences if a batch ever needs more.
fn use_kv_pool(
    engine: &mut Engine,
    device: &Device,
    batch: usize,
    context: usize,
    target: &Path,
) -> Result<(), RegenError> {
    let per_row = engine.kv_bytes_per_row().max(1);
    let free = dflash_models::probe::device_memory(device)
        .map_err(|e| RegenError::Target {
            path: target.to_path_buf(),
            message: format!("reading free device memory: {e}"),
        })?
        .map_or(0, |(free, _)| free);
    let tokens = batch.saturating_mul(context).min(free / 2 / per_row);
    engine.use_kv_pool(tokens).map_err(|e| RegenError::Target {
        path: target.to_path_buf(),
        message: format!("allocating a K/V pool of {tokens} tokens: {e} (lower --batch-size or --context-length)"),
    })?;
    tracing::info!(
        "K/V pool: {} tokens ({:.2} GB) for batches of {batch}",
        engine.kv_pool_tokens().unwrap_or(0),
        (engine.kv_pool_tokens().unwrap_or(0) * per_row) as f64 / 1e9
    );
    Ok(())
}

pub fn run(args: RegenerateArgs) -> anyhow::Result<()> {
    let s = regenerate(&args)?;
    println!(
        "{} {} records of {} lines into {} ({} skipped)",
        if s.complete {
            "regenerated"
        } else {
            "stopped after"
        },
        s.written,
        s.lines,
        args.output.display(),
        s.skipped
    );
    Ok(())
}
