//! The bf16 noise floor of the hybrid's plain path beside the fused-vs-plain difference
//! (`gpu-check cuda --hybrid`), so that the whole-model figure of `hybrid_fused.rs` can be
//! judged. A 27B-shaped model cut to its first `layers` layers (an f32 copy of the full 64
//! would not fit beside the bf16 one), drawn twice from the same device seed with every weight
//! rounded through bf16: the bf16 and the f32 model hold the same weights. Both prefill the
//! same prompt (plain path: longer than a chain), then from that prefix: a decode step and a
//! 16-token chain verify, on the bf16 model fused and plain (one cache) and on the f32 model
//! plain (its own cache). Reported: plain bf16 vs plain f32 (the floor), fused bf16 vs plain
//! bf16, fused bf16 vs plain f32, in `hybrid_fused::compare`'s terms.

use anyhow::{Context, Result};
use candle_core::{DType, Device};
use dflash_common::HybridConfig;
use dflash_models::random::WeightRng;
use dflash_models::{AttnPattern, OpsMode, Qwen35Model, SeqForward};
use serde_json::{json, Value};

use crate::hybrid_fused::{compare, logits};

const SEED: u64 = 20261203;

fn model(cfg: &HybridConfig, dtype: DType, dev: &Device) -> Result<Qwen35Model> {
    dev.set_seed(SEED)?;
    Ok(Qwen35Model::random(
        cfg.clone(),
        &mut WeightRng::on_device().rounded_to(DType::BF16),
        dtype,
        dev,
        2048,
        OpsMode::Fused,
    )?)
}

pub fn noise_floor(
    dev: &Device,
    full: &HybridConfig,
    layers: usize,
    prompt: usize,
) -> Result<Value> {
    let mut cfg = full.clone();
    cfg.num_hidden_layers = layers;
    cfg.layer_types.truncate(layers);
    let vocab = cfg.vocab_size as u32;
    // The two models hold the same weights only if re-seeding repeats the device's draws.
    let draw = || -> Result<Vec<f32>> {
        dev.set_seed(SEED)?;
        Ok(candle_core::Tensor::randn(0f32, 1.0, 4096, dev)?.to_vec1::<f32>()?)
    };
    let seeded_draws_repeat = draw()? == draw()?;
    let bf = model(&cfg, DType::BF16, dev)?;
    anyhow::ensure!(bf.fast_kernels(), "the fused hybrid path is not on");
    let plain_bf = bf.clone().with_fast_kernels(false);
    let f32m = model(&cfg, DType::F32, dev)?;
    let toks: Vec<u32> = (0..prompt as u32).map(|i| (i * 31 + 5) % vocab).collect();
    let prefill = |m: &Qwen35Model| -> Result<dflash_models::SequenceCache> {
        let mut cache = m.new_cache_with_rollback(prompt + 64, 16)?;
        let pos: Vec<u32> = (0..prompt as u32).collect();
        m.forward(
            &mut [SeqForward {
                cache: &mut cache,
                tokens: &toks,
                positions: &pos,
                pattern: &AttnPattern::Causal,
                logit_rows: &[],
            }],
            &[],
        )?;
        cache.settle()?;
        Ok(cache)
    };
    let mut cache_bf = prefill(&bf)?;
    let mut cache_f32 = prefill(&f32m)?;
    let mut res = serde_json::Map::new();
    for (name, n) in [("decode_1", 1u32), ("verify_chain_16", 16)] {
        let tokens: Vec<u32> = (0..n).map(|i| (i * 7919 + 11) % vocab).collect();
        let fused = logits(&bf, &mut cache_bf, &tokens, prompt)?;
        cache_bf.truncate(prompt)?;
        let plain = logits(&plain_bf, &mut cache_bf, &tokens, prompt)?;
        cache_bf.truncate(prompt)?;
        let reference = logits(&f32m, &mut cache_f32, &tokens, prompt)?;
        cache_f32.truncate(prompt)?;
        res.insert(
            name.into(),
            json!({
                "plain_bf16_vs_plain_f32 (noise floor)": compare(&plain, &reference)?,
                "fused_bf16_vs_plain_bf16": compare(&fused, &plain)?,
                "fused_bf16_vs_plain_f32": compare(&fused, &reference)?,
            }),
        );
    }
    res.insert("seeded_draws_repeat".into(), json!(seeded_draws_repeat));
    res.insert(
        "model".into(),
        json!(format!(
            "the 27B shape cut to {layers} layers ({} GDN), bf16-representable weights, {prompt}-token prefix",
            cfg.num_linear_layers()
        )),
    );
    drop((bf, plain_bf, f32m));
    dev.synchronize().context("after the noise-floor models")?;
    Ok(Value::Object(res))
}
