//! Shared helpers for the cross-crate tests: fixture locations and tensor comparisons.

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::{Device, Tensor};

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
