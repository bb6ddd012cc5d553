//! End-to-end decoding of several concurrent requests in one engine on a paged K/V pool, as
//! the server runs them (`bench --e2e-batch N`): plain and the DFlash chain with a simulated
//! acceptance length, tokens/s over all requests, and with `--e2e-profile` where a round's
//! time goes (the same phases as the batch-1 runs), so the batched round's cost can be split
//! into drafting, verifying and committing without a trained drafter.

use std::time::Instant;

use anyhow::{anyhow, Result};
use dflash_models::speculative::{profile, Algorithm, Engine, GenerationRequest, SamplingParams};
use serde_json::{json, Map, Value};

use super::e2e::E2eSetup;
use super::measure::tokens;

/// `n` requests of `s`'s prompt and length in one engine: plain and chain, twice each (the
/// second pass reuses the first one's graphs, as a serving engine does), then, with
/// `s.profile`, a profiled pass.
pub fn run(s: &E2eSetup<'_>, n: usize) -> Result<Value> {
    let mut out = Map::new();
    let mut plain_tps = f64::NAN;
    for (name, algorithm) in [("plain", Algorithm::Plain), ("chain", Algorithm::Chain)] {
        let mut engine = new_engine(s, algorithm, n)?;
        let (_, _) = decode_all(&mut engine, s, algorithm, n)?;
        let (tps, rounds) = decode_all(&mut engine, s, algorithm, n)?;
        let mut entry = json!({"tok_per_s": tps, "steps": rounds});
        if algorithm == Algorithm::Plain {
            plain_tps = tps;
        } else {
            entry["speedup_vs_plain"] = json!(tps / plain_tps);
        }
        if s.profile {
            profile::enable(true);
            let profiled = decode_all(&mut engine, s, algorithm, n);
            let phases = profile::snapshot();
            profile::enable(false);
            let (ptps, steps) = profiled?;
            let mut p = Map::new();
            for (phase, t) in phases {
                p.insert(
                    phase.into(),
                    json!({"count": t.count, "ms_per_step": t.total.as_secs_f64() * 1e3 / steps.max(1) as f64,
                           "mean_ms": t.mean_ms(), "max_ms": t.max.as_secs_f64() * 1e3}),
                );
            }
            p.insert(
                "run".into(),
                json!({"tok_per_s": ptps, "steps": steps,
                       "note": "the device waited for at every phase boundary (slower than the timed pass)"}),
            );
            entry["phases"] = Value::Object(p);
        }
        out.insert(name.into(), entry);
    }
    out.insert(
        "setup".into(),
        json!({"requests": n, "prompt_len": s.prompt_len, "new_tokens": s.new_tokens,
               "simulated_tau": s.tau, "note": "all requests added at once; tok/s over the steps after the first (which prefills them all)"}),
    );
    Ok(Value::Object(out))
}

fn new_engine(s: &E2eSetup<'_>, algorithm: Algorithm, n: usize) -> Result<Engine> {
    let mut engine = super::e2e::new_engine(s, algorithm);
    // Room for every request with a page to spare each.
    let per = engine.cache_capacity(s.prompt_len, s.new_tokens, algorithm) + 64;
    engine
        .use_kv_pool(n * per)
        .map_err(|e| anyhow!("K/V pool for {n} requests: {e}"))?;
    Ok(engine)
}

/// Adds `n` requests and steps until all finish: (tokens/s after the first step, steps).
fn decode_all(
    engine: &mut Engine,
    s: &E2eSetup<'_>,
    algorithm: Algorithm,
    n: usize,
) -> Result<(f64, usize)> {
    let vocab = dflash_models::DraftTarget::vocab_size(s.target);
    for k in 0..n {
        engine
            .add(GenerationRequest {
                prompt: tokens(s.prompt_len, 5 + k as u32, vocab),
                max_new_tokens: s.new_tokens,
                sampling: SamplingParams::greedy(),
                stop_token_ids: vec![],
                ignore_eos: true,
                algorithm,
            })
            .map_err(|e| anyhow!("{e}"))?;
    }
    let mut left = n;
    let mut steps = 0;
    let mut timed_tokens = 0;
    let mut t = Instant::now();
    while left > 0 {
        for e in engine.step().map_err(|e| anyhow!("{e}"))? {
            if steps > 0 {
                timed_tokens += e.tokens.len();
            }
            if e.finished.is_some() {
                left -= 1;
            }
        }
        if steps == 0 {
            t = Instant::now();
        }
        steps += 1;
    }
    Ok((timed_tokens as f64 / t.elapsed().as_secs_f64(), steps))
}
