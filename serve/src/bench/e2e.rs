//! End-to-end decoding through the real engine: plain, and speculative with a random-weight
//! DFlash drafter whose walk accepts a simulated number of drafts (SGLang's
//! SGLANG_SIMULATE_ACC_LEN), so the whole system cost (draft, tree build, verify, commit,
//! host work) is measured without a trained drafter.

use std::time::Instant;

use anyhow::{anyhow, Result};
use dflash_models::speculative::{
    profile, Algorithm, DFlashProposer, Engine, EngineConfig, GenerationRequest, PeakedProposer,
    SamplingParams, SimulatedAcceptance,
};
use dflash_models::{DFlashDrafter, DraftTarget, Target};
use serde_json::{json, Value};

use super::measure::tokens;

pub struct E2eSetup<'a> {
    pub target: &'a Target,
    pub drafter: &'a DFlashDrafter,
    pub prompt_len: usize,
    pub new_tokens: usize,
    /// Simulated acceptance length tau (tokens per round, bonus included).
    pub tau: f64,
    /// Also decode once more with phase profiling on (`dflash_models::speculative::profile`).
    pub profile: bool,
}

/// Decodes the request twice on one engine and returns (tokens/s of the first request's
/// decode phase, the engine's stats as JSON with a `warm` entry for the second request). The
/// first request pays for capturing its step graphs and runs its first rounds uncaptured; the
/// second reuses the first one's caches and so its graphs, as a serving engine does from its
/// second request on. With `s.profile` a third request runs with phase profiling (`phases`).
fn run_one(s: &E2eSetup<'_>, algorithm: Algorithm) -> Result<(f64, Value)> {
    let mut engine = new_engine(s, algorithm);
    let (tps, mut stats, _) = decode_on(&mut engine, s, algorithm)?;
    let (warm_tps, warm, _) = decode_on(&mut engine, s, algorithm)?;
    stats["warm"] = json!({"tok_per_s": warm_tps, "draft_ms_per_round": warm["draft_ms_per_round"],
        "verify_ms_per_round": warm["verify_ms_per_round"], "commit_ms_per_round": warm["commit_ms_per_round"],
        "note": "a second request on the same engine (reusing the first one's caches and graphs)"});
    if s.profile {
        profile::enable(true);
        let profiled = decode_on(&mut engine, s, algorithm);
        let phases = profile::snapshot();
        profile::enable(false);
        let (ptps, pstats, _) = profiled?;
        let rounds = pstats["rounds"].as_f64().unwrap_or(1.0).max(1.0);
        let mut p = serde_json::Map::new();
        for (name, t) in phases {
            p.insert(
                name.into(),
                json!({"count": t.count, "ms_per_round": t.total.as_secs_f64() * 1e3 / rounds,
                       "mean_ms": t.mean_ms(), "max_ms": t.max.as_secs_f64() * 1e3}),
            );
        }
        p.insert(
            "run".into(),
            json!({"tok_per_s": ptps, "rounds": rounds, "note": "a third request on the same engine with the device waited for at every phase boundary (slower than the timed runs); ms_per_round = phase total / rounds; *_capture spans are included in their enclosing phase; *_uncaptured count forwards that ran without a graph"}),
        );
        stats["phases"] = Value::Object(p);
    }
    Ok((tps, stats))
}

/// Plain greedy decoding's tokens/s on a warm engine (the second request of [`run_one`]).
pub fn plain_warm_tok_per_s(s: &E2eSetup<'_>) -> Result<f64> {
    let (_, stats) = run_one(s, Algorithm::Plain)?;
    stats["warm"]["tok_per_s"]
        .as_f64()
        .ok_or_else(|| anyhow!("plain decoding reported no warm tokens/s"))
}

/// Decodes the e2e request with the step graphs of target and drafter (`s`) and without them
/// (`uncaptured`, the same target with graphs off, and the drafter likewise): plain greedy
/// decoding must give the same tokens; for the chain the drafts come from a drafter whose
/// graph splits its attention differently (f32 summation order), so equality is reported.
pub fn graph_check(s: &E2eSetup<'_>, uncaptured: &Target) -> Result<Value> {
    let drafter = s.drafter.clone().with_step_graphs(false);
    let off = E2eSetup {
        target: uncaptured,
        drafter: &drafter,
        prompt_len: s.prompt_len,
        new_tokens: s.new_tokens,
        tau: s.tau,
        profile: false,
    };
    let mut out = serde_json::Map::new();
    for (name, algorithm) in [("plain", Algorithm::Plain), ("chain", Algorithm::Chain)] {
        let (_, _, with) = decode(s, algorithm)?;
        let (_, _, without) = decode(&off, algorithm)?;
        let same = with
            .iter()
            .zip(&without)
            .take_while(|(a, b)| a == b)
            .count();
        out.insert(
            name.into(),
            json!({"tokens": with.len(), "equal_prefix": same, "identical": with == without}),
        );
    }
    Ok(Value::Object(out))
}

/// One request on a fresh engine: (tokens/s after the first step, engine stats, every
/// emitted token).
fn decode(s: &E2eSetup<'_>, algorithm: Algorithm) -> Result<(f64, Value, Vec<u32>)> {
    decode_on(&mut new_engine(s, algorithm), s, algorithm)
}

/// An engine for the e2e request: random-weight drafter with peaked log-probs, simulated
/// acceptance.
pub(super) fn new_engine(s: &E2eSetup<'_>, algorithm: Algorithm) -> Engine {
    let config = EngineConfig {
        max_context: s.prompt_len + s.new_tokens + 512,
        max_ddtree_budget: 256,
        eos_token_ids: vec![],
        seed: 0,
    };
    let proposer = (algorithm != Algorithm::Plain).then(|| {
        Box::new(PeakedProposer::new(
            DFlashProposer::new(s.drafter.clone()),
            0.8,
        )) as Box<dyn dflash_models::speculative::Proposer>
    });
    let mut engine = Engine::new(s.target.clone(), proposer, config);
    engine.simulate_acceptance(SimulatedAcceptance::new(s.tau - 1.0, 7));
    engine
}

/// Decodes the e2e request on `engine`: (tokens/s after the first step, engine stats, every
/// emitted token).
fn decode_on(
    engine: &mut Engine,
    s: &E2eSetup<'_>,
    algorithm: Algorithm,
) -> Result<(f64, Value, Vec<u32>)> {
    let id = engine
        .add(GenerationRequest {
            prompt: tokens(s.prompt_len, 5, s.target.vocab_size()),
            max_new_tokens: s.new_tokens,
            sampling: SamplingParams::greedy(),
            stop_token_ids: vec![],
            ignore_eos: true,
            algorithm,
        })
        .map_err(|e| anyhow!("{e}"))?;
    // The first step prefills and runs one round; time from the second step on.
    let mut generated = 0;
    let mut emitted = Vec::new();
    let mut finished = false;
    let mut stats = None;
    let mut first = true;
    let mut t = Instant::now();
    let mut timed_tokens = 0;
    while !finished {
        for e in engine.step().map_err(|e| anyhow!("{e}"))? {
            if e.id != id {
                continue;
            }
            generated += e.tokens.len();
            emitted.extend_from_slice(&e.tokens);
            if !first {
                timed_tokens += e.tokens.len();
            }
            finished = e.finished.is_some();
            stats = Some(e.stats);
        }
        if first {
            first = false;
            t = Instant::now();
        }
    }
    let secs = t.elapsed().as_secs_f64();
    let st = stats.ok_or_else(|| anyhow!("no events"))?;
    let per_round = |d: std::time::Duration| d.as_secs_f64() * 1e3 / st.rounds.max(1) as f64;
    Ok((
        timed_tokens as f64 / secs,
        json!({
            "generated": generated,
            "rounds": st.rounds,
            "tau": st.tau(),
            "mean_tree_nodes": st.tree_nodes as f64 / st.rounds.max(1) as f64,
            "draft_ms_per_round": per_round(st.draft_time),
            "verify_ms_per_round": per_round(st.verify_time),
            "commit_ms_per_round": per_round(st.commit_time),
            "target_graphs_held": s.target.step_graphs_held(),
            "drafter_graphs_held": s.drafter.step_graphs_held(),
        }),
        emitted,
    ))
}

/// Plain, chain and DDTree at `budgets`, each with its speedup over plain.
pub fn run(s: &E2eSetup<'_>, budgets: &[usize]) -> Result<Value> {
    let (plain, plain_stats) = run_one(s, Algorithm::Plain)?;
    let warm = |st: &Value| st["warm"]["tok_per_s"].as_f64().unwrap_or(f64::NAN);
    let mut out = serde_json::Map::new();
    out.insert(
        "plain".into(),
        json!({"tok_per_s": plain, "warm_tok_per_s": warm(&plain_stats), "engine": plain_stats}),
    );
    let mut algos = vec![("chain".to_string(), Algorithm::Chain)];
    for &b in budgets {
        algos.push((format!("ddtree_{b}"), Algorithm::DDTree { budget: b }));
    }
    let plain_warm = warm(&plain_stats);
    for (name, a) in algos {
        let (tps, st) = run_one(s, a)?;
        out.insert(
            name,
            json!({"tok_per_s": tps, "speedup_vs_plain": tps / plain,
                   "warm_tok_per_s": warm(&st), "warm_speedup_vs_plain": warm(&st) / plain_warm,
                   "engine": st}),
        );
    }
    out.insert(
        "setup".into(),
        json!({"prompt_len": s.prompt_len, "new_tokens": s.new_tokens, "simulated_tau": s.tau,
               "note": "walk accepts floor/ceil(tau-1) drafts along the rank-1 path (not lossless); drafter = random weights, log-probs replaced by a peaked profile (top 0.8) so DDTree builds a deep main path"}),
    );
    Ok(Value::Object(out))
}

/// The greedy selection kernels (`dflash_models::speculative::greedy`) on `[rows, vocab]` logits with
/// bf16-rounded values (ties are common) and a planted tie at each row's maximum: columns and
/// log-probs against the host scan, and the time of one selection (result on the host) against
/// candle's argmax and the old chain selection (log-softmax, argmax, gather, two copies).
pub fn greedy_select(dev: &candle_core::Device, vocab: usize) -> Result<Value> {
    use candle_core::{DType, Tensor, D};
    use dflash_models::speculative::greedy::row_argmax_logprob;
    let mut out = serde_json::Map::new();
    for rows in [1usize, 15, 16, 480] {
        let mut v: Vec<f32> = (0..rows * vocab)
            .map(|i| ((i as u64 * 2654435761 % 1000003) as f32 / 1000003.0 - 0.5) * 20.0)
            .collect();
        for r in 0..rows {
            // Two equal maxima: the lower column must win.
            let (a, b) = (r * 997 % vocab, vocab - 1 - r);
            v[r * vocab + a.min(b)] = 30.0;
            v[r * vocab + a.max(b)] = 30.0;
        }
        let t = Tensor::from_vec(v, (rows, vocab), dev)?
            .to_dtype(DType::BF16)?
            .to_dtype(DType::F32)?;
        let got = row_argmax_logprob(&t)?;
        let want = row_argmax_logprob(&t.to_device(&candle_core::Device::Cpu)?)?;
        // The same values in bf16 (exact: they were rounded to bf16 above), read by the bf16
        // kernel without an f32 copy: equal to the f32 path bit for bit.
        let t16 = t.to_dtype(DType::BF16)?;
        let got16 = row_argmax_logprob(&t16)?;
        let bf16_equal = got16
            .iter()
            .zip(&got)
            .all(|(a, b)| a.0 == b.0 && a.1.to_bits() == b.1.to_bits());
        let bf16_ms = super::measure::time_ms(dev, 20, || {
            row_argmax_logprob(&t16)?;
            Ok(())
        })?;
        let bf16_via_f32_ms = super::measure::time_ms(dev, 20, || {
            row_argmax_logprob(&t16.to_dtype(DType::F32)?)?;
            Ok(())
        })?;
        let same = got.iter().zip(&want).filter(|(a, b)| a.0 == b.0).count();
        let lp_err = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a.1 - b.1).abs())
            .fold(0f32, f32::max);
        let ms = super::measure::time_ms(dev, 20, || {
            row_argmax_logprob(&t)?;
            Ok(())
        })?;
        let candle_ms = super::measure::time_ms(dev, 20, || {
            t.argmax(1)?.to_vec1::<u32>()?;
            Ok(())
        })?;
        let old_chain_ms = super::measure::time_ms(dev, 20, || {
            // candle_nn::ops::log_softmax, as the old selection called it.
            let max = t.max_keepdim(D::Minus1)?;
            let diff = t.broadcast_sub(&max)?;
            let lse = diff.exp()?.sum_keepdim(D::Minus1)?.log()?;
            let logp = diff.broadcast_sub(&lse)?;
            let arg = logp.argmax_keepdim(1)?;
            logp.gather(&arg, 1)?.flatten_all()?.to_vec1::<f32>()?;
            arg.flatten_all()?.to_vec1::<u32>()?;
            Ok(())
        })?;
        out.insert(
            format!("rows_{rows}"),
            json!({"columns_equal_to_host": same, "rows": rows, "max_logprob_err": lp_err,
                   "ms": ms, "candle_argmax_ms": candle_ms, "old_chain_select_ms": old_chain_ms,
                   "bf16_equal_to_f32_path": bf16_equal, "bf16_ms": bf16_ms,
                   "bf16_via_f32_copy_ms": bf16_via_f32_ms}),
        );
    }
    Ok(Value::Object(out))
}
