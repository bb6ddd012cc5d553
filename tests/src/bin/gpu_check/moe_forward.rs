//! `gpu-check cuda <out.json> --moe`, the target part: a `qwen3_moe` target of the
//! Qwen3-Coder-30B-A3B shape with random bf16 weights.
//! 1. Four layers: the fused forward (attention kernels + the device MoE block; eager and
//!    replayed from step graphs) against the plain path on the same weights: a 600-token
//!    prefill (past the device block's rows: the plain block inside the fused stack), a decode
//!    step, a 16-token chain verify and eight decode steps in a row.
//! 2. All 48 layers at 1K context: decode and chain-16 verify, fused (graphs, eager) and plain,
//!    against the roofline of the bytes each reads.

use std::time::Instant;

use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor};
use dflash_common::Qwen3Config;
use dflash_models::random::WeightRng;
use dflash_models::{AttnPattern, OpsMode, Qwen3Model, SeqForward, SequenceCache};
use serde_json::{json, Value};

use crate::hybrid_fused::compare;
use crate::time_ms;

/// Qwen3-Coder-30B-A3B-Instruct's config.json (../shared/spec/QWEN_TARGETS.md §2.1) with
/// `layers` layers.
pub fn coder_30b(layers: usize) -> Result<Qwen3Config> {
    let v = json!({
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5472,
        "num_hidden_layers": layers, "num_attention_heads": 32, "num_key_value_heads": 4,
        "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000000.0,
        "max_position_embeddings": 262144, "tie_word_embeddings": false,
        "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
        "norm_topk_prob": true, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "hidden_act": "silu", "eos_token_id": 151645
    });
    let dir = std::env::temp_dir().join(format!("dflash-moe-shape-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("config.json");
    std::fs::write(&path, v.to_string())?;
    Ok(Qwen3Config::from_file(&path)?)
}

fn logits(
    m: &Qwen3Model,
    cache: &mut SequenceCache,
    tokens: &[u32],
    start: usize,
) -> Result<Tensor> {
    let positions: Vec<u32> = (start as u32..(start + tokens.len()) as u32).collect();
    let rows: Vec<usize> = (0..tokens.len()).collect();
    m.forward(
        &mut [SeqForward {
            cache,
            tokens,
            positions: &positions,
            pattern: &AttnPattern::Causal,
            logit_rows: &rows,
        }],
        &[],
    )?
    .logits
    .context("logits")
}

fn toks(n: usize, mul: usize, vocab: usize) -> Vec<u32> {
    (0..n).map(|i| ((i * mul + 11) % vocab) as u32).collect()
}

pub fn forward_check(dev: &Device) -> Result<Value> {
    let cfg = coder_30b(4)?;
    let vocab = cfg.vocab_size;
    let m = Qwen3Model::random_with(
        cfg,
        &mut WeightRng::on_device(),
        DType::BF16,
        dev,
        4096,
        OpsMode::Fused,
    )?;
    anyhow::ensure!(
        m.fast_kernels(),
        "the fused path is not on for the qwen3_moe target"
    );
    let eager = m.clone().with_step_graphs(false);
    let plain = m.clone().with_fast_kernels(false);
    let prompt = toks(600, 31, vocab);
    let mut res = serde_json::Map::new();
    // Each path fills its own cache with the same prompt; the prefill's last rows compared.
    let mut caches = Vec::new();
    let mut pre = Vec::new();
    for model in [&m, &plain] {
        let mut c = model.new_cache(2048)?;
        let l = logits(model, &mut c, &prompt, 0)?;
        pre.push(l.narrow(0, 590, 10)?);
        caches.push(c);
    }
    res.insert(
        "prefill_600_last_10_rows".into(),
        compare(&pre[0], &pre[1])?,
    );
    let start = prompt.len();
    for (name, tokens, one_by_one) in [
        ("decode_1", toks(1, 7919, vocab), false),
        ("verify_chain_16", toks(16, 7919, vocab), false),
        ("decode_8_steps", toks(8, 104729, vocab), true),
    ] {
        let run = |model: &Qwen3Model, cache: &mut SequenceCache| -> Result<Tensor> {
            let out = if one_by_one {
                let mut rows = Vec::new();
                for (i, t) in tokens.iter().enumerate() {
                    rows.push(logits(model, cache, std::slice::from_ref(t), start + i)?);
                }
                Tensor::cat(&rows, 0)?
            } else {
                logits(model, cache, &tokens, start)?
            };
            cache.truncate(start)?;
            Ok(out)
        };
        let (fc, pc) = caches.split_at_mut(1);
        let graph = run(&m, &mut fc[0])?;
        let eager_out = run(&eager, &mut fc[0])?;
        let reference = run(&plain, &mut pc[0])?;
        res.insert(
            name.into(),
            json!({"graph_vs_plain": compare(&graph, &reference)?,
                   "eager_vs_plain": compare(&eager_out, &reference)?,
                   "graph_vs_eager": compare(&graph, &eager_out)?}),
        );
    }
    res.insert("graph_replays".into(), json!(m.graph_replays()));
    Ok(Value::Object(res))
}

/// Bytes a forward of the target reads, besides the experts: attention weights, routers, the
/// LM head and one embedding row per token, and `ctx` rows of K/V.
fn base_bytes(c: &Qwen3Config, ctx: usize, tokens: usize) -> f64 {
    let (h, l) = (c.hidden_size as f64, c.num_hidden_layers as f64);
    let (nq, nkv, d) = (
        c.num_attention_heads as f64,
        c.num_key_value_heads as f64,
        c.head_dim as f64,
    );
    let e = c.moe.as_ref().map_or(0, |m| m.block.num_experts) as f64;
    let attn = (nq * d + 2.0 * nkv * d) * h + h * nq * d;
    let kv = 2.0 * nkv * d * ctx as f64;
    2.0 * (l * (attn + e * h + kv) + c.vocab_size as f64 * h + tokens as f64 * h)
}

/// Expected distinct experts of `t` rows each taking `k` of `e` uniformly (random weights
/// route close to that): `e (1 - (1 - k / e)^t)`.
fn expected_used(e: usize, k: usize, t: usize) -> f64 {
    e as f64 * (1.0 - (1.0 - k as f64 / e as f64).powi(t as i32))
}

pub fn bench(dev: &Device, copy_bw: f64, layers: usize) -> Result<Value> {
    let cfg = coder_30b(layers)?;
    let block = cfg.moe.as_ref().context("moe")?.block.clone();
    let t0 = Instant::now();
    let m = Qwen3Model::random_with(
        cfg.clone(),
        &mut WeightRng::on_device(),
        DType::BF16,
        dev,
        4096,
        OpsMode::Fused,
    )?;
    dev.synchronize()?;
    let init_s = t0.elapsed().as_secs_f64();
    let vocab = cfg.vocab_size;
    let expert_bytes = 2.0 * 3.0 * (cfg.hidden_size * block.moe_intermediate_size) as f64;
    let mut cache = m.new_cache(2048)?;
    let prompt = toks(1024, 31, vocab);
    let t = Instant::now();
    let positions: Vec<u32> = (0..prompt.len() as u32).collect();
    m.forward(
        &mut [SeqForward {
            cache: &mut cache,
            tokens: &prompt,
            positions: &positions,
            pattern: &AttnPattern::Causal,
            logit_rows: &[prompt.len() - 1],
        }],
        &[],
    )?;
    dev.synchronize()?;
    let prefill_1k_ms = t.elapsed().as_secs_f64() * 1e3;
    let start = cache.len();
    let eager = m.clone().with_step_graphs(false);
    let plain = m.clone().with_fast_kernels(false);
    let mut res = serde_json::Map::new();
    for (name, n) in [("decode_1", 1usize), ("verify_chain_16", 16)] {
        let tokens = toks(n, 7919, vocab);
        // A failing path records its error (NaN time) so the others are still measured.
        let mut errors = serde_json::Map::new();
        let mut timed = |model: &Qwen3Model, reps: usize, what: &str| -> Result<f64> {
            let r = time_ms(dev, reps, || {
                logits(model, &mut cache, &tokens, start)?;
                cache.truncate(start)?;
                Ok(())
            });
            match r {
                Ok(ms) => Ok(ms),
                Err(e) => {
                    cache.truncate(start)?;
                    errors.insert(what.into(), json!(format!("{e:#}")));
                    Ok(f64::NAN)
                }
            }
        };
        let graph_ms = timed(&m, 20, "graph")?;
        let eager_ms = timed(&eager, 10, "eager")?;
        let plain_ms = timed(&plain, 3, "plain")?;
        let used = if n == 1 {
            block.num_experts_per_tok as f64
        } else {
            expected_used(block.num_experts, block.num_experts_per_tok, n)
        };
        let bytes = base_bytes(&cfg, start, n) + cfg.num_hidden_layers as f64 * used * expert_bytes;
        let roof = bytes / copy_bw * 1e3;
        res.insert(
            name.into(),
            json!({"graph_ms": graph_ms, "eager_ms": eager_ms, "plain_ms": plain_ms,
                   "roofline_ms": roof, "fraction_of_roofline": roof / graph_ms,
                   "eager_fraction_of_roofline": roof / eager_ms,
                   "speedup_vs_plain": plain_ms / graph_ms,
                   "experts_read_per_layer": used, "bytes_GB": bytes / 1e9,
                   "errors": Value::Object(errors)}),
        );
    }
    if let (Some(d), Some(c)) = (res.get("decode_1"), res.get("verify_chain_16")) {
        let ratio =
            c["graph_ms"].as_f64().unwrap_or(f64::NAN) / d["graph_ms"].as_f64().unwrap_or(f64::NAN);
        res.insert("chain16_over_decode".into(), json!(ratio));
    }
    res.insert("weights_init_s".into(), json!(init_s));
    res.insert("prefill_1k_ms".into(), json!(prefill_1k_ms));
    res.insert("fused_path".into(), json!(m.fast_kernels()));
    res.insert("graph_replays".into(), json!(m.graph_replays()));
    res.insert("copy_bandwidth_GBps".into(), json!(copy_bw / 1e9));
    res.insert(
        "roofline_bytes".into(),
        json!("attention weights + routers + LM head + embedding rows + K/V of the context, plus per layer the experts read: 8 at decode; at chain-16 the expected distinct experts of 16 rows routed uniformly (random weights), e (1 - (1 - k/e)^16) = 82.4 of 128"),
    );
    res.insert(
        "config".into(),
        json!(format!("Qwen3-Coder-30B-A3B shape: {layers} layers, hidden 2048, 128 experts top 8, width 768, 32/4 heads, vocab 151936, bf16 random")),
    );
    Ok(Value::Object(res))
}
