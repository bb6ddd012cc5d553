//! GPU check (not a CI test: CI has no GPU). On the chosen device it
//! 1. re-runs the parity fixtures in f32 and bf16 and reports the max errors;
//! 2. decodes tiny-coder-demo greedily (plain and DDTree with the oracle) in both dtypes and
//!    counts prompts that reproduce transformers' fp32 tokens;
//! 3. times a Qwen3-8B-shaped bf16 model with random weights: copy bandwidth, prefill, batch-1
//!    decode at 1K context, 16-token causal and 64-node tree verify, and a 5-layer drafter block,
//!    each against the memory roofline.
//!
//! Usage: gpu-check [cuda|cpu] [out.json] [--hybrid]
//!
//! With `--hybrid` it runs only the hybrid-target checks and the Qwen3.6-27B-shaped benchmark
//! (see `gpu_check/hybrid.rs`).

#[path = "gpu_check/hybrid.rs"]
mod hybrid;

use std::time::Instant;

use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor};
use dflash_common::{DFlashConfig, LayerType, Qwen3Config, RopeScaling};
use dflash_models::random::WeightRng;
use dflash_models::spec::{
    Algorithm, Engine, EngineConfig, GenerationRequest, OracleProposer, SamplingParams,
};
use dflash_models::{
    AttnPattern, DFlashDrafter, DraftInput, OpsMode, Qwen3Model, SeqForward, SequenceCache,
};
use dflash_tests::{demo_model, fixture, greedy_cases, ids, load_expected, max_abs_diff};
use serde_json::{json, Value};

fn parity(dev: &Device, dtype: DType) -> Result<Value> {
    let target = Qwen3Model::load(
        &fixture("qwen3-tiny-random"),
        dtype,
        dev,
        64,
        OpsMode::Fused,
    )?;
    let exp = load_expected("qwen3-tiny-random");
    let tokens = ids(&exp["input_ids"]);
    let pos: Vec<u32> = (0..12).collect();
    let rows: Vec<usize> = (0..12).collect();
    let mut cache = target.new_cache(64)?;
    let out = target.forward(
        &mut [SeqForward {
            cache: &mut cache,
            tokens: &tokens,
            positions: &pos,
            pattern: &AttnPattern::Causal,
            logit_rows: &rows,
        }],
        &[0, 1],
    )?;
    let logits_err = max_abs_diff(&out.logits.context("logits")?, &exp["logits"].squeeze(0)?);
    let taps = out.taps.context("taps")?;
    let lo = &exp["layer_outputs"];
    let taps_err = max_abs_diff(&taps.narrow(1, 0, 64)?, &lo.get(0)?.squeeze(0)?).max(
        max_abs_diff(&taps.narrow(1, 64, 64)?, &lo.get(1)?.squeeze(0)?),
    );
    let drafter = DFlashDrafter::load(&fixture("dflash-tiny-random"), &target, OpsMode::Fused)?;
    let dexp = load_expected("dflash-tiny-random");
    let mut dcache = drafter.new_cache(64)?;
    let th = dexp["target_hidden"].squeeze(0)?.to_device(dev)?;
    let block = ids(&dexp["block_input_ids"]);
    let hidden = drafter.forward(&mut [DraftInput {
        cache: &mut dcache,
        context: Some(&th),
        block: &block,
    }])?;
    let draft_err = max_abs_diff(&drafter.lm_head(&hidden)?, &dexp["logits"].squeeze(0)?);
    Ok(
        json!({"dtype": format!("{dtype:?}"), "target_logits_max_abs_err": logits_err, "target_taps_max_abs_err": taps_err, "drafter_logits_max_abs_err": draft_err}),
    )
}

fn greedy(dev: &Device, dtype: DType) -> Result<Value> {
    let target = Qwen3Model::load(&demo_model(), dtype, dev, 1024, OpsMode::Fused)?;
    let cfg = EngineConfig {
        max_context: 512,
        max_ddtree_budget: 256,
        eos_token_ids: vec![8188, 8186],
        seed: 0,
    };
    let mut plain = Engine::new(target.clone(), None, cfg.clone());
    let mut tree = Engine::new(
        target.clone(),
        Some(Box::new(OracleProposer::new(
            target.clone(),
            15,
            Some(dflash_models::spec::Noise {
                corrupt_prob: 0.3,
                seed: 3,
            }),
        ))),
        cfg,
    );
    let (mut exact, mut spec_same, mut first_div) = (0, 0, Vec::new());
    for c in greedy_cases("tiny-coder-demo") {
        let req = |algorithm| GenerationRequest {
            prompt: c.input_ids.clone(),
            max_new_tokens: 48,
            sampling: SamplingParams::greedy(),
            stop_token_ids: vec![],
            ignore_eos: false,
            algorithm,
        };
        let (p, _) = plain.generate(req(Algorithm::Plain))?;
        let (t, _) = tree.generate(req(Algorithm::DDTree { budget: 64 }))?;
        if p == c.output_ids {
            exact += 1;
        }
        if t == p {
            spec_same += 1;
        }
        first_div.push(
            p.iter()
                .zip(&c.output_ids)
                .position(|(a, b)| a != b)
                .unwrap_or(48),
        );
    }
    Ok(
        json!({"dtype": format!("{dtype:?}"), "prompts": 10, "plain_equal_to_transformers_fp32": exact, "ddtree64_equal_to_plain": spec_same, "first_divergence_from_fp32": first_div}),
    )
}

fn qwen3_8b() -> Qwen3Config {
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
        max_position_embeddings: 40960,
        tie_word_embeddings: false,
        eos_token_ids: vec![151645],
        bos_token_id: None,
        layer_types: vec![LayerType::FullAttention; 36],
        sliding_window: None,
    }
}

pub(crate) fn time_ms(dev: &Device, reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    f()?;
    dev.synchronize()?;
    let mut v = Vec::new();
    for _ in 0..reps {
        let t = Instant::now();
        f()?;
        dev.synchronize()?;
        v.push(t.elapsed().as_secs_f64() * 1e3);
    }
    v.sort_by(|a, b| a.total_cmp(b));
    Ok(v[v.len() / 2])
}

fn forward_n(m: &Qwen3Model, cache: &mut SequenceCache, n: usize, tree: bool) -> Result<()> {
    let start = cache.len();
    let tokens: Vec<u32> = (0..n as u32).map(|i| (i * 7919) % 151936).collect();
    let (positions, pattern) = if tree {
        // a binary-ish tree: node i's parent is (i-1)/2
        let parents: Vec<Option<usize>> = (0..n)
            .map(|i| if i == 0 { None } else { Some((i - 1) / 2) })
            .collect();
        let mut depth = vec![0u32; n];
        for i in 1..n {
            depth[i] = depth[(i - 1) / 2] + 1;
        }
        (
            depth.iter().map(|d| start as u32 + d).collect::<Vec<_>>(),
            AttnPattern::Tree { parents },
        )
    } else {
        (
            (start as u32..(start + n) as u32).collect(),
            AttnPattern::Causal,
        )
    };
    let rows: Vec<usize> = (0..n).collect();
    m.forward(
        &mut [SeqForward {
            cache,
            tokens: &tokens,
            positions: &positions,
            pattern: &pattern,
            logit_rows: &rows,
        }],
        &[],
    )?;
    cache.truncate(start)?;
    Ok(())
}

/// Copy bandwidth: read + write of a 4 GiB buffer into a preallocated one (no allocation
/// inside the timed region), in bytes per second.
fn copy_bandwidth(dev: &Device) -> Result<f64> {
    let buf = Tensor::zeros(2usize << 30, DType::BF16, dev)?;
    let dst = Tensor::zeros(2usize << 30, DType::BF16, dev)?;
    let copy_ms = time_ms(dev, 5, || {
        dst.slice_set(&buf, 0, 0)?;
        Ok(())
    })?;
    Ok(2.0 * (4u64 << 30) as f64 / (copy_ms / 1e3))
}

fn bench(dev: &Device) -> Result<Value> {
    let bw = copy_bandwidth(dev)?;
    let cfg = qwen3_8b();
    let t0 = Instant::now();
    let m = Qwen3Model::random_with(
        cfg.clone(),
        &mut WeightRng::on_device(),
        DType::BF16,
        dev,
        8192,
        OpsMode::Fused,
    )?;
    dev.synchronize()?;
    let init_s = t0.elapsed().as_secs_f64();
    let (h, i, l, v) = (4096f64, 12288f64, 36f64, 151936f64);
    let layer_params = h * 4096.0 * 2.0 + h * 1024.0 * 2.0 + 3.0 * h * i;
    let step_bytes = 2.0 * (l * layer_params + v * h); // every layer + lm_head; one embedding row
    let kv_bytes_1k = 2.0 * l * 2.0 * 1024.0 * 1024.0;
    let roofline_ms = (step_bytes + kv_bytes_1k) / bw * 1e3;
    let mut cache = m.new_cache(8192)?;
    let prompt: Vec<u32> = (0..1024u32).map(|i| (i * 31) % 151936).collect();
    let pos: Vec<u32> = (0..1024).collect();
    let t = Instant::now();
    m.forward(
        &mut [SeqForward {
            cache: &mut cache,
            tokens: &prompt,
            positions: &pos,
            pattern: &AttnPattern::Causal,
            logit_rows: &[1023],
        }],
        &[],
    )?;
    dev.synchronize()?;
    let prefill_1k_ms = t.elapsed().as_secs_f64() * 1e3;
    let mut res = serde_json::Map::new();
    for (name, n, tree) in [
        ("decode_1", 1, false),
        ("verify_causal_16", 16, false),
        ("verify_tree_64", 64, true),
        ("verify_causal_64", 64, false),
        ("verify_tree_256", 256, true),
    ] {
        let ms = time_ms(dev, 10, || forward_n(&m, &mut cache, n, tree))?;
        res.insert(format!("{name}_ms_at_1k"), json!(ms));
    }
    let decode_ms = res["decode_1_ms_at_1k"].as_f64().unwrap_or(f64::NAN);
    // Drafter: Qwen3-8B-DFlash-b16 shape, 16-token block over 1K of context.
    let dcfg = DFlashConfig::for_target(&cfg, 5, 16, 151669, None);
    let drafter =
        DFlashDrafter::random_with(dcfg, &m, &mut WeightRng::on_device(), OpsMode::Fused)?;
    let mut dc = drafter.new_cache(8192)?;
    let feats = Tensor::randn(0f32, 1.0, (1024, 5 * 4096), dev)?.to_dtype(DType::BF16)?;
    let block: Vec<u32> = std::iter::once(5u32)
        .chain(std::iter::repeat(151669).take(15))
        .collect();
    drafter.forward(&mut [DraftInput {
        cache: &mut dc,
        context: Some(&feats),
        block: &block,
    }])?;
    let draft_ms = time_ms(dev, 10, || {
        drafter.draft_logits(&mut [DraftInput {
            cache: &mut dc,
            context: None,
            block: &block,
        }])?;
        Ok(())
    })?;
    // Prefill of 4096 tokens.
    let mut c2 = m.new_cache(4200)?;
    let p4: Vec<u32> = (0..4096u32).map(|i| (i * 17) % 151936).collect();
    let pos4: Vec<u32> = (0..4096).collect();
    let t = Instant::now();
    m.forward(
        &mut [SeqForward {
            cache: &mut c2,
            tokens: &p4,
            positions: &pos4,
            pattern: &AttnPattern::Causal,
            logit_rows: &[4095],
        }],
        &[],
    )?;
    dev.synchronize()?;
    let prefill_4k_s = t.elapsed().as_secs_f64();
    res.insert("copy_bandwidth_GBps".into(), json!(bw / 1e9));
    res.insert("weights_init_s".into(), json!(init_s));
    res.insert(
        "decode_bytes_per_step_GB".into(),
        json!((step_bytes + kv_bytes_1k) / 1e9),
    );
    res.insert("decode_roofline_ms_at_1k".into(), json!(roofline_ms));
    res.insert(
        "decode_fraction_of_roofline".into(),
        json!(roofline_ms / decode_ms),
    );
    res.insert("decode_tok_per_s_at_1k".into(), json!(1e3 / decode_ms));
    res.insert("prefill_1k_ms".into(), json!(prefill_1k_ms));
    res.insert("prefill_4k_tok_per_s".into(), json!(4096.0 / prefill_4k_s));
    res.insert("drafter_block16_over_1k_ms".into(), json!(draft_ms));
    Ok(Value::Object(res))
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let dev = match args.get(1).map(String::as_str) {
        Some("cpu") => Device::Cpu,
        _ => Device::new_cuda(0)?,
    };
    let mut report = serde_json::Map::new();
    if args.iter().any(|a| a == "--hybrid") {
        for dtype in [DType::F32, DType::BF16] {
            let p = hybrid::parity(&dev, dtype)?;
            println!("hybrid parity {p}");
            report.insert(format!("hybrid_parity_{dtype:?}"), p);
        }
        // On the CPU a scaled-down shape only checks that the benchmark runs.
        let (cfg, key) = if dev.is_cpu() {
            (hybrid::small_for_cpu()?, "hybrid_small_shape_bf16_cpu")
        } else {
            (hybrid::qwen36_27b()?, "qwen3_6_27b_shape_bf16")
        };
        // (No 8 GiB copy probe on the CPU: its roofline figures are meaningless there anyway.)
        let bw = if dev.is_cpu() {
            f64::NAN
        } else {
            copy_bandwidth(&dev)?
        };
        let b = hybrid::bench(&dev, bw, cfg)?;
        println!("hybrid bench {b}");
        report.insert(key.into(), b);
        let out = Value::Object(report).to_string();
        if let Some(path) = args.get(2).filter(|a| !a.starts_with("--")) {
            std::fs::write(path, &out)?;
        }
        println!("{out}");
        return Ok(());
    }
    for dtype in [DType::F32, DType::BF16] {
        let p = parity(&dev, dtype)?;
        println!("parity {p}");
        report.insert(format!("parity_{dtype:?}"), p);
        let g = greedy(&dev, dtype)?;
        println!("greedy {g}");
        report.insert(format!("greedy_{dtype:?}"), g);
    }
    if !dev.is_cpu() {
        let b = bench(&dev)?;
        println!("bench {b}");
        report.insert("qwen3_8b_shape_bf16".into(), b);
    }
    let out = Value::Object(report).to_string();
    if let Some(path) = args.get(2) {
        std::fs::write(path, &out)?;
    }
    println!("{out}");
    Ok(())
}
