//! Steps at scale on a random Qwen3-8B (`gpu-check cuda out.json --scale`): the kernel checks
//! and timings of `cuda::check_scale` (prefill pieces over long contexts, the 17..64-row
//! skinny GEMMs against cuBLAS), then whole forwards in one paged pool: batched decode steps
//! (CUDA graphs) with the GEMMs on cuBLAS against the skinny kernels, and mixed steps (16
//! decoding sequences plus a prefill piece of a long prompt, uncaptured, as the engine runs
//! them) against the decode step alone, so a piece's cost is the difference.

use std::time::Instant;

use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor};
use dflash_common::{LayerType, Qwen3Config, RopeScaling};
use dflash_models::cuda::check_scale;
use dflash_models::random::WeightRng;
use dflash_models::{AttnPattern, OpsMode, Qwen3Model, SeqForward, SequenceCache};
use serde_json::{json, Map, Value};

pub(crate) fn qwen3_8b(max_positions: usize) -> Qwen3Config {
    Qwen3Config {
        vocab_size: 151936,
        hidden_size: 4096,
        intermediate_size: 12288,
        num_hidden_layers: 36,
        num_attention_heads: 32,
        num_key_value_heads: 8,
        head_dim: 128,
        rms_norm_eps: 1e-6,
        rope_theta: 1e6,
        rope_scaling: RopeScaling::Default,
        max_position_embeddings: max_positions,
        tie_word_embeddings: false,
        eos_token_ids: vec![],
        bos_token_id: None,
        layer_types: vec![LayerType::FullAttention; 36],
        sliding_window: None,
        moe: None,
    }
}

fn tokens(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i.wrapping_mul(7919).wrapping_add(salt.wrapping_mul(104729))) % 151936)
        .collect()
}

/// One forward over `caches` with `t[s]` causal tokens for cache s (positions from its
/// length); logits of each sequence's last row; the argmax comes to the host, as a step does.
fn step(m: &Qwen3Model, caches: &mut [&mut SequenceCache], t: &[usize], salt: u32) -> Result<()> {
    step_logits(m, caches, t, salt)?
        .argmax(1)?
        .to_vec1::<u32>()?;
    Ok(())
}

/// [`step`]'s forward, returning its logits (`[sequences, vocab]`, the last row of each).
pub(crate) fn step_logits(
    m: &Qwen3Model,
    caches: &mut [&mut SequenceCache],
    t: &[usize],
    salt: u32,
) -> Result<Tensor> {
    let toks: Vec<Vec<u32>> = t
        .iter()
        .enumerate()
        .map(|(s, &n)| tokens(n, salt + s as u32))
        .collect();
    let pos: Vec<Vec<u32>> = caches
        .iter()
        .zip(t)
        .map(|(c, &n)| (c.len() as u32..(c.len() + n) as u32).collect())
        .collect();
    let rows: Vec<Vec<usize>> = t.iter().map(|&n| vec![n - 1]).collect();
    let mut batch: Vec<SeqForward<'_>> = caches
        .iter_mut()
        .enumerate()
        .map(|(s, cache)| SeqForward {
            cache,
            tokens: &toks[s],
            positions: &pos[s],
            pattern: &AttnPattern::Causal,
            logit_rows: &rows[s],
        })
        .collect();
    let out = m.forward(&mut batch, &[])?;
    out.logits.context("no logits")
}

/// Milliseconds per step (median of `reps`, after 3 warm-ups that capture any graph), every
/// cache truncated back after each step.
pub(crate) fn time_step(
    m: &Qwen3Model,
    caches: &mut [&mut SequenceCache],
    t: &[usize],
    reps: usize,
) -> Result<f64> {
    let lens: Vec<usize> = caches.iter().map(|c| c.len()).collect();
    let mut times = Vec::with_capacity(reps);
    for r in 0..reps + 3 {
        m.device().synchronize()?;
        let start = Instant::now();
        step(m, caches, t, r as u32)?;
        m.device().synchronize()?;
        if r >= 3 {
            times.push(start.elapsed().as_secs_f64() * 1e3);
        }
        for (c, &l) in caches.iter_mut().zip(&lens) {
            c.truncate(l)?;
        }
    }
    times.sort_by(|a, b| a.total_cmp(b));
    Ok(times[times.len() / 2])
}

pub(crate) fn fill(m: &Qwen3Model, cache: &mut SequenceCache, n: usize, salt: u32) -> Result<()> {
    while cache.len() < n {
        let k = (n - cache.len()).min(4096);
        let start = cache.len() as u32;
        let toks = tokens(k, salt + start);
        let pos: Vec<u32> = (start..start + k as u32).collect();
        m.forward(
            &mut [SeqForward {
                cache,
                tokens: &toks,
                positions: &pos,
                pattern: &AttnPattern::Causal,
                logit_rows: &[k - 1],
            }],
            &[],
        )?;
    }
    Ok(())
}

pub fn run(dev: &Device, gemm_only: bool) -> Result<Value> {
    let mut out = Map::new();
    let t0 = Instant::now();
    let pieces = if gemm_only {
        Vec::new()
    } else {
        check_scale::piece_attention_errors(dev)?
    };
    for (name, e, s) in pieces {
        println!("scale {name}: max err {e:.3e} of max {s:.3}");
        out.insert(name, json!({"max_abs_err": e, "max_abs_ref": s}));
    }
    for (name, e, s) in check_scale::gemv_wide_errors(dev)? {
        println!("scale {name}: rel err {:.3e}", e / s.max(1e-30));
        out.insert(
            name,
            json!({"max_abs_err": e, "max_abs_ref": s, "rel": e / s.max(1e-30)}),
        );
    }
    println!("scale checks {:.1} s", t0.elapsed().as_secs_f64());
    let piece_times = if gemm_only {
        Vec::new()
    } else {
        check_scale::piece_attention_timings(dev)?
    };
    for (name, ms, step_ms, tflops) in piece_times {
        println!("scale attn {name}: {ms:.4} ms/layer, {step_ms:.2} ms/step, {tflops:.0} TFLOP/s");
        out.insert(
            format!("attn_{name}"),
            json!({"ms_per_layer": ms, "ms_per_step": step_ms, "TFLOPs": tflops}),
        );
    }
    for (name, us, gb) in check_scale::gemv_wide_timings(dev)? {
        let bw = |t: f64| gb / t * 1e6;
        println!(
            "scale gemm {name}: cublas {:.1} us ({:.0} GB/s), lt heuristic {:.1} ({:.0}), lt tuned {:.1} ({:.0}), skinny {:.1} ({:.0}), splitk {:.1} ({:.0}), splitk528 {:.1} ({:.0})",
            us[0], bw(us[0]), us[1], bw(us[1]), us[2], bw(us[2]), us[3], bw(us[3]), us[4], bw(us[4]), us[5], bw(us[5])
        );
        out.insert(
            format!("gemm_{name}"),
            json!({"cublas_us": us[0], "lt_heuristic_us": us[1], "lt_tuned_us": us[2], "skinny_us": us[3], "splitk_us": us[4], "splitk528_us": us[5], "weight_GB": gb}),
        );
    }
    // What the tuner measured per shape (fastest first; L2 evicted before each run).
    for m in [16usize, 24, 32, 48, 64] {
        for (n, k, resid) in [
            (6144usize, 4096usize, false),
            (4096, 4096, true),
            (24576, 4096, false),
            (4096, 12288, true),
            (4096, 4096, false),
            (4096, 12288, false),
        ] {
            let t = dflash_models::cuda::tuned_timings(dev, m, n, k, resid);
            if t.is_empty() {
                continue;
            }
            let cublas = t.iter().find(|c| c.0 == "cublas").map_or(f64::NAN, |c| c.1);
            let top: Vec<String> = t
                .iter()
                .take(4)
                .map(|(l, us)| format!("{l} {us:.1}"))
                .collect();
            println!(
                "scale tuner m{m} n{n} k{k} resid {resid}: {} candidates, cublas {cublas:.1} us, best {}",
                t.len(),
                top.join(", ")
            );
            out.insert(
                format!("tuner_m{m}_n{n}_k{k}_resid{resid}"),
                json!({"candidates": t.len(), "cublas_us": cublas, "top": top}),
            );
        }
    }
    println!("scale kernels done {:.1} s", t0.elapsed().as_secs_f64());

    let long = 32768usize;
    let m = Qwen3Model::random_with(
        qwen3_8b(40960),
        &mut WeightRng::on_device(),
        DType::BF16,
        dev,
        long + 4096,
        OpsMode::Fused,
    )?;
    // Each model of its own graph cache: a graph captured with one GEMM choice is never
    // replayed for the other.
    let graphs = m.clone().with_tuned_rows(0).with_step_graphs(true);
    let tuned = m.clone().with_step_graphs(true);
    let eager = m.clone().with_tuned_rows(0).with_step_graphs(false);
    let skinny = m
        .clone()
        .with_gemv_rows(dflash_models::cuda::GEMV_MAX_ROWS)
        .with_tuned_rows(0)
        .with_step_graphs(true);
    let splitk = m
        .clone()
        .with_splitk_rows(dflash_models::cuda::TUNED_MAX_ROWS)
        .with_step_graphs(true);
    let pool = m.new_kv_pool(64 * 12 + (long + 1024) / 64 + 8)?;
    let ctx = 640usize;
    // Batched decode steps: 32 and 64 sequences at 640 positions (512-token prompts, mean of
    // 256 new tokens), GEMMs on cuBLAS (default) and on the skinny kernels.
    let mut caches = (0..64)
        .map(|_| m.new_cache_in(&pool, ctx + 64))
        .collect::<Result<Vec<_>, _>>()?;
    for (i, c) in caches.iter_mut().enumerate() {
        fill(&m, c, ctx, i as u32)?;
    }
    for b in [16usize, 32, 64] {
        let mut refs: Vec<&mut SequenceCache> = caches.iter_mut().take(b).collect();
        let ones = vec![1usize; b];
        let cublas = time_step(&graphs, &mut refs, &ones, 20)?;
        let lt = time_step(&tuned, &mut refs, &ones, 20)?;
        let sk = time_step(&skinny, &mut refs, &ones, 20)?;
        let spk = if check_scale::splitk_checked() {
            time_step(&splitk, &mut refs, &ones, 20)?
        } else {
            f64::NAN
        };
        let lt_eager = time_step(&tuned.clone().with_step_graphs(false), &mut refs, &ones, 10)?;
        let cublas_eager = time_step(&eager, &mut refs, &ones, 10)?;
        println!(
            "scale decode b{b} ctx{ctx} graph: cublas {cublas:.3} ms, lt tuned {lt:.3} ms, skinny {sk:.3} ms, splitk {spk:.3} ms; eager: cublas {cublas_eager:.3}, lt tuned {lt_eager:.3}"
        );
        out.insert(
            format!("decode_b{b}_ctx{ctx}_graph"),
            json!({"cublas_ms": cublas, "lt_tuned_ms": lt, "skinny_ms": sk, "splitk_ms": spk, "eager_cublas_ms": cublas_eager, "eager_lt_tuned_ms": lt_eager}),
        );
    }
    if gemm_only {
        println!("scale done {:.1} s", t0.elapsed().as_secs_f64());
        return Ok(Value::Object(out));
    }
    // Mixed steps: 16 decoding sequences + one piece of a long prompt.
    let mut long_cache = m.new_cache_in(&pool, long + 1024)?;
    let decode16 = vec![1usize; 16];
    let (dec, _) = caches.split_at_mut(16);
    {
        let mut refs: Vec<&mut SequenceCache> = dec.iter_mut().collect();
        let g = time_step(&graphs, &mut refs, &decode16, 20)?;
        let e = time_step(&eager, &mut refs, &decode16, 10)?;
        println!("scale mixed base: decode-16 graph {g:.3} ms, eager {e:.3} ms");
        out.insert(
            "mixed_base_decode16".into(),
            json!({"graph_ms": g, "eager_ms": e}),
        );
    }
    for c in [8192usize, 16384, long - 512] {
        fill(&m, &mut long_cache, c, 7)?;
        long_cache.truncate(c)?;
        for t in [64usize, 128, 256] {
            let mut refs: Vec<&mut SequenceCache> = dec.iter_mut().collect();
            refs.push(&mut long_cache);
            let mut counts = decode16.clone();
            counts.push(t);
            let mixed = time_step(&eager, &mut refs, &counts, 6)?;
            let alone = time_step(&eager, &mut [&mut long_cache], &[t], 6)?;
            println!("scale mixed c{c} t{t}: mixed step {mixed:.3} ms, piece alone {alone:.3} ms");
            out.insert(
                format!("mixed_c{c}_t{t}"),
                json!({"mixed_ms": mixed, "piece_alone_ms": alone}),
            );
        }
    }
    println!("scale done {:.1} s", t0.elapsed().as_secs_f64());
    Ok(Value::Object(out))
}
