//! Loading datasets: chat JSONL (`{"messages": [...]}` per line), plain or `.xz`, rendered with the
//! target's chat template and tokenized, with a loss mask on the final assistant turn.
//!
//! The mask follows `shared/fixtures/scripts/tokenize_corpus.py`, which made the tiny targets'
//! training data: `prompt = template(messages[..last], add_generation_prompt=True)`,
//! `completion = template(messages)[len(prompt)..]`, both encoded separately (as at inference,
//! where the prompt is encoded alone) and concatenated; the mask is 1 on the completion except
//! what follows its last end-of-turn token (the template's trailing newline).
//!
//! A line that cannot be used (bad JSON, no messages, a template error) is skipped and counted;
//! past `max_bad_lines` the load stops with the file and line. A well-formed record whose last
//! message is not an assistant turn (a prompt) is not damage: it is skipped and counted apart.
//! [`load_specs`] loads every `--dataset` value, chat files and synthetic specs alike, into one
//! [`Dataset`] (the types in `dataset.rs`).

use std::io::Read;
use std::path::{Path, PathBuf};

use dflash_common::chat::{ChatRenderInput, ChatTemplate};
use dflash_common::tokenizer::Tokenizer;
use serde_json::Value;

use super::dataset::{DataOptions, DataStats, Dataset, Example};
use super::error::{TrainError, TrainResult};
use super::synthetic::DatasetSpec;
use super::target::Target;

/// Reads a whole dataset file, decompressing `.xz`.
pub fn read_text(path: &Path) -> TrainResult<String> {
    let err = |message: String| TrainError::DatasetRead {
        path: path.to_path_buf(),
        message,
    };
    let mut raw = Vec::new();
    std::fs::File::open(path)
        .and_then(|mut f| f.read_to_end(&mut raw))
        .map_err(|e| err(e.to_string()))?;
    if path.extension().is_some_and(|e| e == "xz") {
        let mut out = Vec::new();
        lzma_rs::xz_decompress(&mut raw.as_slice(), &mut out)
            .map_err(|e| err(format!("not a valid .xz file: {e}")))?;
        raw = out;
    }
    String::from_utf8(raw).map_err(|e| err(format!("not UTF-8: {e}")))
}

/// Why a line gives no example.
enum Skip {
    /// A well-formed conversation that ends on another role than the assistant.
    NoFinalAssistantTurn,
    /// What is wrong with the line.
    Unreadable(String),
}

impl From<String> for Skip {
    fn from(message: String) -> Self {
        Self::Unreadable(message)
    }
}

impl From<&str> for Skip {
    fn from(message: &str) -> Self {
        Self::Unreadable(message.into())
    }
}

/// Renders and tokenizes one record.
fn encode_record(
    line: &str,
    tok: &Tokenizer,
    template: &ChatTemplate,
    eos: &[u32],
) -> Result<Example, Skip> {
    let value: Value = serde_json::from_str(line).map_err(|e| format!("not valid JSON: {e}"))?;
    let messages = value
        .get("messages")
        .and_then(Value::as_array)
        .ok_or("no `messages` array")?;
    let last = messages.last().ok_or("`messages` is empty")?;
    if messages
        .iter()
        .any(|m| m.get("content").and_then(Value::as_str).is_none())
    {
        return Err("a message has no string `content`".into());
    }
    if last.get("role").and_then(Value::as_str) != Some("assistant") {
        return Err(Skip::NoFinalAssistantTurn);
    }
    let render = |msgs: &[Value], gen: bool| {
        template
            .render(&ChatRenderInput {
                messages: msgs,
                add_generation_prompt: gen,
                ..Default::default()
            })
            .map_err(|e| format!("chat template: {e}"))
    };
    let prompt = render(&messages[..messages.len() - 1], true)?;
    let full = render(messages, false)?;
    let completion = full.strip_prefix(prompt.as_str()).ok_or(
        "the rendered conversation does not start with the rendered prompt; this template rewrites earlier turns",
    )?;
    let encode = |t: &str| tok.encode(t, false).map_err(|e| e.to_string());
    let p = encode(&prompt)?;
    let c = encode(completion)?;
    let supervised_end = c
        .iter()
        .rposition(|t| eos.contains(t))
        .map_or(c.len(), |i| i + 1);
    let mut loss_mask = vec![0u8; p.len()];
    loss_mask.extend((0..c.len()).map(|i| u8::from(i < supervised_end)));
    let mut tokens = p;
    tokens.extend(c);
    Ok(Example { tokens, loss_mask })
}

/// Loads every file in order. Errors name the file (and line, for bad lines).
pub fn load_datasets(
    paths: &[PathBuf],
    tok: &Tokenizer,
    template: &ChatTemplate,
    opts: &DataOptions,
) -> TrainResult<Dataset> {
    let eos = tok.eos_token_ids().to_vec();
    let mut stats = DataStats::default();
    let mut examples = Vec::new();
    'files: for path in paths {
        let text = read_text(path)?;
        for (i, line) in text.lines().enumerate() {
            if opts.max_records.is_some_and(|m| stats.records >= m) {
                break 'files;
            }
            if line.trim().is_empty() {
                continue;
            }
            match encode_record(line, tok, template, &eos) {
                Err(Skip::NoFinalAssistantTurn) => stats.no_final_assistant_turn += 1,
                Err(Skip::Unreadable(message)) => {
                    stats.bad_lines += 1;
                    if stats.bad_lines > opts.max_bad_lines {
                        return Err(TrainError::TooManyBadLines {
                            path: path.clone(),
                            line: i + 1,
                            count: stats.bad_lines,
                            limit: opts.max_bad_lines,
                            message,
                        });
                    }
                    if stats.bad_lines <= 5 {
                        tracing::warn!("{}:{}: skipped: {message}", path.display(), i + 1);
                    }
                }
                Ok(mut ex) => {
                    stats.records += 1;
                    if ex.tokens.len() > opts.max_len {
                        stats.truncated += 1;
                        ex.tokens.truncate(opts.max_len);
                        ex.loss_mask.truncate(opts.max_len);
                    }
                    if ex.supervised() < opts.min_supervised.max(1)
                        || ex.anchor_candidates().is_empty()
                    {
                        stats.too_little_supervision += 1;
                        continue;
                    }
                    stats.tokens += ex.tokens.len();
                    stats.supervised_tokens += ex.supervised();
                    examples.push(ex);
                }
            }
        }
    }
    if stats.bad_lines > 0 {
        tracing::warn!("skipped {} unreadable lines", stats.bad_lines);
    }
    if stats.no_final_assistant_turn > 0 {
        tracing::info!(
            "skipped {} records whose last message is not an assistant turn (nothing to supervise)",
            stats.no_final_assistant_turn
        );
    }
    if examples.is_empty() {
        let paths = paths
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", ");
        return Err(TrainError::NoSupervisedTokens {
            paths,
            detail: format!(
                "{} records read ({} unreadable lines, {} without a final assistant turn); {} had fewer than {} supervised (assistant) tokens after the cut to --max-len {}",
                stats.records, stats.bad_lines, stats.no_final_assistant_turn, stats.too_little_supervision, opts.min_supervised.max(1), opts.max_len
            ),
        });
    }
    Ok(Dataset { examples, stats })
}

/// Loads every `--dataset` value: chat files through the target's tokenizer and template,
/// synthetic specs as random tokens over its vocabulary (never `mask`).
pub fn load_specs(
    specs: &[DatasetSpec],
    target: &Target,
    mask: u32,
    opts: &DataOptions,
) -> TrainResult<Dataset> {
    let files: Vec<PathBuf> = specs
        .iter()
        .filter_map(|s| match s {
            DatasetSpec::File(p) => Some(p.clone()),
            DatasetSpec::Synthetic(_) => None,
        })
        .collect();
    let mut parts = Vec::new();
    if !files.is_empty() {
        let Some((tok, template)) = &target.text else {
            return Err(TrainError::Flag {
                flag: "--dataset",
                message: format!(
                    "chat datasets need the target's tokenizer, but --target-model is {}; use --dataset synthetic:len=L,n=N",
                    target.spec
                ),
            });
        };
        parts.push(load_datasets(&files, tok, template, opts)?);
    }
    for s in specs {
        if let DatasetSpec::Synthetic(syn) = s {
            parts.push(syn.generate(target.config.vocab_size, mask, opts.max_len)?);
        }
    }
    let mut all = Dataset {
        examples: Vec::new(),
        stats: DataStats::default(),
    };
    for d in parts {
        let (a, b) = (&mut all.stats, d.stats);
        a.records += b.records;
        a.bad_lines += b.bad_lines;
        a.no_final_assistant_turn += b.no_final_assistant_turn;
        a.too_little_supervision += b.too_little_supervision;
        a.truncated += b.truncated;
        a.tokens += b.tokens;
        a.supervised_tokens += b.supervised_tokens;
        all.examples.extend(d.examples);
    }
    Ok(all)
}
