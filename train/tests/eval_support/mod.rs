//! Shared setup of the `eval_*` tests: the bundled tiny-coder-demo target in f32 on the CPU, a
//! few chat prompts rendered with its template, and scratch folders.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

use candle_core::{DType, Device};
use dflash_models::{OpsMode, Qwen3Model};
use dflash_train::eval::drafters::demo_target_dir;
use dflash_train::eval::{CacheRequest, CacheSpec};
use serde_json::{json, Map, Value};

pub const CONTEXT: usize = 1024;

pub const PROMPTS: &[(&str, &str)] = &[
    (
        "fib",
        "Write a Python function `fib(n)` that returns the n-th Fibonacci number.",
    ),
    (
        "stack",
        "Implement a stack class in Python with push, pop and peek.",
    ),
    ("reverse", "Write a function that reverses a linked list."),
];

pub fn target() -> Qwen3Model {
    Qwen3Model::load(
        &demo_target_dir(),
        DType::F32,
        &Device::Cpu,
        CONTEXT,
        OpsMode::Fused,
    )
    .expect("the bundled tiny-coder-demo loads")
}

/// A fresh, empty folder under the system temp dir.
pub fn scratch(name: &str) -> PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "dflash-eval-test-{}-{}-{name}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Writes `prompts` as a JSONL chat prompt set into `dir`.
pub fn write_prompts(dir: &Path, prompts: &[(&str, &str)]) -> PathBuf {
    let path = dir.join("prompts.jsonl");
    let lines: Vec<String> = prompts
        .iter()
        .map(|(id, text)| {
            json!({"id": id, "messages": [{"role": "user", "content": text}]}).to_string()
        })
        .collect();
    std::fs::write(&path, lines.join("\n") + "\n").unwrap();
    path
}

pub fn kwargs() -> Map<String, Value> {
    let mut m = Map::new();
    m.insert("enable_thinking".into(), Value::Bool(false));
    m
}

/// The cache spec the CLI would build for `prompts_file` with drafters tapping `taps`.
pub fn spec(prompts_file: &Path, max_new_tokens: usize, taps: Vec<usize>) -> CacheSpec {
    CacheSpec::prepare(CacheRequest {
        target_dir: &demo_target_dir(),
        target_source: "demo",
        dtype: DType::F32,
        prompts: prompts_file,
        limit: None,
        template_kwargs: kwargs(),
        max_new_tokens,
        tap_layer_ids: taps,
    })
    .unwrap()
}
