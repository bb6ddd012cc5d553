//! Shared helpers for the cross-crate tests: fixture locations and tensor comparisons.

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::{Device, Tensor};

pub mod spec_harness;

/// This crate's directory; `DFLASH_TESTS_DIR` overrides it where a binary built here runs from
/// another checkout (the GPU machine).
fn tests_dir() -> PathBuf {
    std::env::var_os("DFLASH_TESTS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")))
}

/// `tests/fixtures/<name>` in this repository.
pub fn fixture(name: &str) -> PathBuf {
    tests_dir().join("fixtures").join(name)
}

/// The bundled demo target, `serve/assets/tiny-coder-demo`.
pub fn demo_model() -> PathBuf {
    tests_dir().join("../serve/assets/tiny-coder-demo")
}

/// A model from the large shared fixture set. Panics with the fix when `DFLASH_FIXTURES` is
/// unset: tests that call this are `#[ignore]`d and only run on purpose.
pub fn shared_model(name: &str) -> PathBuf {
    let root = std::env::var("DFLASH_FIXTURES").unwrap_or_else(|_| {
        panic!("DFLASH_FIXTURES is not set: point it at shared/fixtures (e.g. DFLASH_FIXTURES=../shared/fixtures) to run this test")
    });
    let dir = PathBuf::from(root).join("models").join(name);
    assert!(
        dir.is_dir(),
        "{} does not exist: DFLASH_FIXTURES must point at shared/fixtures",
        dir.display()
    );
    dir
}

pub fn load_expected(dir: &str) -> HashMap<String, Tensor> {
    let path = fixture(dir).join("expected.safetensors");
    candle_core::safetensors::load(&path, &Device::Cpu)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Max |a - b| over all elements (both converted to f32 on the CPU).
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    assert_eq!(a.dims(), b.dims(), "shapes differ");
    let a = a
        .to_device(&Device::Cpu)
        .unwrap()
        .to_dtype(candle_core::DType::F32)
        .unwrap();
    let b = b
        .to_device(&Device::Cpu)
        .unwrap()
        .to_dtype(candle_core::DType::F32)
        .unwrap();
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

#[derive(Debug, Clone, serde::Deserialize)]
pub struct GreedyCase {
    pub id: String,
    pub input_ids: Vec<u32>,
    pub output_ids: Vec<u32>,
}

/// The transformers greedy continuations for `model` (tiny-coder-demo or tiny-coder-small).
pub fn greedy_cases(model: &str) -> Vec<GreedyCase> {
    let path = fixture("greedy/coding-prompts.json");
    let text = std::fs::read_to_string(&path).unwrap();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    serde_json::from_value(v["models"][model].clone()).unwrap()
}

/// Token ids stored as an integer tensor (the fixtures use i64).
pub fn ids(t: &Tensor) -> Vec<u32> {
    let v = t
        .flatten_all()
        .and_then(|t| t.to_dtype(candle_core::DType::I64))
        .and_then(|t| t.to_vec1::<i64>());
    v.unwrap_or_else(|e| panic!("token id tensor: {e}"))
        .into_iter()
        .map(|x| x as u32)
        .collect()
}

/// Argmax of each row of a `[rows, vocab]` f32 tensor.
pub fn argmax_rows(logits: &Tensor) -> Vec<u32> {
    logits.argmax(1).unwrap().to_vec1::<u32>().unwrap()
}

/// Upper p-quantile of chi-square with `df` degrees of freedom (Wilson-Hilferty), z for 1e-4.
pub fn chi2_bound(df: usize) -> f64 {
    let z = 3.719;
    let d = df as f64;
    d * (1.0 - 2.0 / (9.0 * d) + z * (2.0 / (9.0 * d)).sqrt()).powi(3)
}

/// Two-sample chi-square statistic and degrees of freedom over categorical outcomes.
pub fn two_sample_chi2<K: std::hash::Hash + Eq + Clone>(a: &[K], b: &[K]) -> (f64, usize) {
    let mut counts: HashMap<K, (f64, f64)> = HashMap::new();
    for k in a {
        counts.entry(k.clone()).or_default().0 += 1.0;
    }
    for k in b {
        counts.entry(k.clone()).or_default().1 += 1.0;
    }
    let (mut cells, mut other) = (Vec::new(), (0.0, 0.0));
    for (_, c) in counts {
        if c.0 + c.1 >= 10.0 {
            cells.push(c);
        } else {
            other.0 += c.0;
            other.1 += c.1;
        }
    }
    if other.0 + other.1 > 0.0 {
        cells.push(other);
    }
    let (na, nb) = (a.len() as f64, b.len() as f64);
    let stat = cells
        .iter()
        .map(|&(x, y)| (x * (nb / na).sqrt() - y * (na / nb).sqrt()).powi(2) / (x + y))
        .sum();
    (stat, cells.len().saturating_sub(1).max(1))
}

/// Asserts that `spec`'s continuations have plain sampling's distribution: a two-sample
/// chi-square test (bound at p = 1e-4) for every position after the first (which comes from
/// prefill and involves no drafts) and for the pair of positions 2 and 3. `name` labels the
/// failure.
pub fn assert_same_distribution(name: &str, plain: &[Vec<u32>], spec: &[Vec<u32>]) {
    let positions = plain.first().map_or(0, Vec::len);
    for pos in 1..positions {
        let a: Vec<u32> = plain.iter().map(|s| s[pos]).collect();
        let b: Vec<u32> = spec.iter().map(|s| s[pos]).collect();
        let (stat, df) = two_sample_chi2(&a, &b);
        assert!(
            stat < chi2_bound(df),
            "{name}: token {} distribution differs: chi2 {stat:.1} > bound {:.1} (df {df})",
            pos + 1,
            chi2_bound(df)
        );
    }
    if positions >= 3 {
        let a: Vec<(u32, u32)> = plain.iter().map(|s| (s[1], s[2])).collect();
        let b: Vec<(u32, u32)> = spec.iter().map(|s| (s[1], s[2])).collect();
        let (stat, df) = two_sample_chi2(&a, &b);
        assert!(
            stat < chi2_bound(df),
            "{name}: joint (2, 3) differs: chi2 {stat:.1} > bound {:.1} (df {df})",
            chi2_bound(df)
        );
    }
}

/// A tiny random Qwen3.5-shaped hybrid target in f32 on the CPU (4 layers: GDN, gated
/// attention, GDN, GDN; vocab 96, hidden 32) for the speculative-decoding tests.
pub fn tiny_hybrid(seed: u64) -> dflash_models::Qwen35Model {
    let cfg = serde_json::json!({
        "model_type": "qwen3_5_text", "vocab_size": 96, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 16,
        "layer_types": ["linear_attention", "full_attention", "linear_attention", "linear_attention"],
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 8,
        "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    });
    let cfg = dflash_common::HybridConfig::from_value(std::path::Path::new("tiny-hybrid"), &cfg)
        .unwrap_or_else(|e| panic!("tiny hybrid config: {e}"));
    let mut rng = dflash_models::random::WeightRng::new(seed);
    dflash_models::Qwen35Model::random(
        cfg,
        &mut rng,
        candle_core::DType::F32,
        &Device::Cpu,
        256,
        dflash_models::OpsMode::Fused,
    )
    .unwrap_or_else(|e| panic!("tiny hybrid model: {e}"))
}

/// The tiny hybrid tests run thousands of forwards over 32-wide tensors, where handing each op
/// to a thread pool costs more than the op (4x slower on the 2-core CI machine). Call first in
/// such a test, before any tensor op creates candle's pool.
pub fn single_threaded_tensor_ops() {
    std::env::set_var("RAYON_NUM_THREADS", "1");
}

/// Draws `samples` seeded T=0.8, top-k 6 continuations of `new_tokens` tokens of `prompt` with
/// `algorithm`, 100 sequences per engine batch, in seed order (seed `seed_base + i`); also
/// returns the draft tokens accepted, to show speculation took part.
pub fn sample_continuations(
    engine: &mut dflash_models::speculative::Engine,
    prompt: &[u32],
    algorithm: dflash_models::speculative::Algorithm,
    samples: usize,
    new_tokens: usize,
    seed_base: u64,
) -> (Vec<Vec<u32>>, usize) {
    use dflash_models::speculative::{GenerationRequest, SamplingParams};
    let mut out = Vec::with_capacity(samples);
    let mut accepted = 0;
    for chunk in 0..samples / 100 {
        let mut got: HashMap<u64, Vec<u32>> = HashMap::new();
        for i in 0..100 {
            let sampling = SamplingParams {
                temperature: 0.8,
                top_k: 6,
                seed: Some(seed_base + (chunk * 100 + i) as u64),
                ..SamplingParams::default()
            };
            let id = engine
                .add(GenerationRequest {
                    prompt: prompt.to_vec(),
                    max_new_tokens: new_tokens,
                    sampling,
                    stop_token_ids: vec![],
                    ignore_eos: true,
                    algorithm,
                })
                .unwrap();
            got.insert(id, Vec::new());
        }
        while engine.num_active() > 0 {
            for ev in engine.step().unwrap() {
                accepted += ev.round.as_ref().map_or(0, |r| r.accepted_drafts);
                got.get_mut(&ev.id).unwrap().extend_from_slice(&ev.tokens);
            }
        }
        let mut ids: Vec<_> = got.into_iter().collect();
        ids.sort();
        out.extend(ids.into_iter().map(|(_, v)| v));
    }
    (out, accepted)
}
