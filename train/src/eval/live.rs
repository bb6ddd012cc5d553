//! Live evaluation: real greedy speculative decoding through the engine, one prompt at a time
//! (batch 1, the paper's setting), timed against plain decoding of the same prompts with the
//! same `max_new_tokens` in the same run. Every configuration is warmed up first (one short
//! generation) so kernel compilation and allocator growth stay out of the timings.

use std::time::Instant;

use dflash_models::speculative::{
    Algorithm, Engine, EngineConfig, GenerationRequest, Proposer, SamplingParams, SeqStats,
};
use dflash_models::Qwen3Model;
use serde::{Deserialize, Serialize};

use super::error::EvalError;
use super::prompts::TokenizedPrompt;

#[derive(Debug, Clone)]
pub struct LiveOptions {
    pub max_new_tokens: usize,
    /// Tokens of the warm-up generation (first prompt) before each timed configuration.
    pub warmup_tokens: usize,
    pub eos_token_ids: Vec<u32>,
    /// Per-sequence context the engine reserves (longest prompt + max_new_tokens suffices).
    pub max_context: usize,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LivePrompt {
    pub id: String,
    pub tokens: usize,
    pub seconds: f64,
    pub rounds: usize,
    pub tau: f64,
}

/// One decoding configuration over every prompt.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LiveRun {
    /// `plain`, `chain` or `ddtree-B`.
    pub mode: String,
    pub tokens: usize,
    pub seconds: f64,
    pub tokens_per_second: f64,
    pub rounds: usize,
    pub accepted: usize,
    /// Tokens per verify round, bonus included (1 for plain decoding).
    pub tau: f64,
    /// tokens/s over plain decoding's tokens/s in the same run.
    pub speedup: Option<f64>,
    /// Prompts whose output equals plain decoding's (greedy is lossless up to numerics).
    pub matches_plain: Option<usize>,
    pub per_prompt: Vec<LivePrompt>,
    #[serde(skip, default)]
    pub outputs: Vec<Vec<u32>>,
}

pub fn algorithm_label(a: Algorithm) -> String {
    match a {
        Algorithm::Plain => "plain".into(),
        Algorithm::Chain => "chain".into(),
        Algorithm::DDTree { budget } => format!("ddtree-{budget}"),
    }
}

/// Decodes every prompt with plain decoding: the baseline the speculative runs compare with.
pub fn run_plain(
    target: &Qwen3Model,
    prompts: &[TokenizedPrompt],
    opts: &LiveOptions,
) -> Result<LiveRun, EvalError> {
    let mut engine = Engine::new(target.clone(), None, engine_config(opts, 1));
    run_one(&mut engine, Algorithm::Plain, prompts, opts, None)
}

/// Decodes every prompt with `proposer` under each algorithm, comparing with `plain`.
pub fn run_speculative(
    target: &Qwen3Model,
    proposer: Box<dyn Proposer>,
    algorithms: &[Algorithm],
    prompts: &[TokenizedPrompt],
    opts: &LiveOptions,
    plain: &LiveRun,
) -> Result<Vec<LiveRun>, EvalError> {
    let max_budget = algorithms
        .iter()
        .map(|a| match a {
            Algorithm::DDTree { budget } => *budget,
            _ => 1,
        })
        .max()
        .unwrap_or(1);
    let mut engine = Engine::new(
        target.clone(),
        Some(proposer),
        engine_config(opts, max_budget),
    );
    algorithms
        .iter()
        .map(|&a| run_one(&mut engine, a, prompts, opts, Some(plain)))
        .collect()
}

fn engine_config(opts: &LiveOptions, max_ddtree_budget: usize) -> EngineConfig {
    EngineConfig {
        max_context: opts.max_context,
        max_ddtree_budget,
        eos_token_ids: opts.eos_token_ids.clone(),
        seed: 0,
    }
}

fn request(prompt: &[u32], max_new_tokens: usize, algorithm: Algorithm) -> GenerationRequest {
    GenerationRequest {
        prompt: prompt.to_vec(),
        max_new_tokens,
        sampling: SamplingParams::greedy(),
        stop_token_ids: Vec::new(),
        ignore_eos: false,
        algorithm,
    }
}

fn run_one(
    engine: &mut Engine,
    algorithm: Algorithm,
    prompts: &[TokenizedPrompt],
    opts: &LiveOptions,
    plain: Option<&LiveRun>,
) -> Result<LiveRun, EvalError> {
    if let (Some(first), true) = (prompts.first(), opts.warmup_tokens > 0) {
        engine.generate(request(&first.tokens, opts.warmup_tokens, algorithm))?;
    }
    let mut per_prompt = Vec::with_capacity(prompts.len());
    let mut outputs = Vec::with_capacity(prompts.len());
    let mut total = SeqStats::default();
    for p in prompts {
        let t0 = Instant::now();
        let (tokens, stats) =
            engine.generate(request(&p.tokens, opts.max_new_tokens, algorithm))?;
        let seconds = t0.elapsed().as_secs_f64();
        total.rounds += stats.rounds;
        total.accepted_drafts += stats.accepted_drafts;
        per_prompt.push(LivePrompt {
            id: p.id.clone(),
            tokens: tokens.len(),
            seconds,
            rounds: stats.rounds,
            tau: if algorithm == Algorithm::Plain {
                1.0
            } else {
                stats.tau()
            },
        });
        outputs.push(tokens);
    }
    let tokens: usize = per_prompt.iter().map(|p| p.tokens).sum();
    let seconds: f64 = per_prompt.iter().map(|p| p.seconds).sum();
    let tokens_per_second = if seconds > 0.0 {
        tokens as f64 / seconds
    } else {
        0.0
    };
    Ok(LiveRun {
        mode: algorithm_label(algorithm),
        tokens,
        seconds,
        tokens_per_second,
        rounds: total.rounds,
        accepted: total.accepted_drafts,
        tau: if algorithm == Algorithm::Plain {
            1.0
        } else {
            total.tau()
        },
        speedup: plain.map(|b| {
            if b.tokens_per_second > 0.0 {
                tokens_per_second / b.tokens_per_second
            } else {
                0.0
            }
        }),
        matches_plain: plain.map(|b| {
            b.outputs
                .iter()
                .zip(&outputs)
                .filter(|(a, b)| a == b)
                .count()
        }),
        per_prompt,
        outputs,
    })
}
