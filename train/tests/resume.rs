//! Resume never trains on a damaged checkpoint and never repeats a step in the record: every
//! checkpoint carries a manifest (size and SHA-256 of each file) that a resume checks first; a
//! damaged newest checkpoint is named, and passed over for the previous one only with
//! `--resume-fallback`, which then ends byte for byte where an uninterrupted run ends; `--resume`
//! before the first checkpoint starts fresh; `metrics.jsonl` keeps one record per step across
//! resumes; the fused optimizer's flat snapshots resume as exactly. CPU, the bundled demo
//! target, a one-layer drafter.

use std::path::{Path, PathBuf};

use dflash_train::train::checkpoint::newest_verified;
use dflash_train::train::{parse_train_args, train, TrainArgs};

fn demo_target() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../serve/assets/tiny-coder-demo")
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("dflash-resume-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Three different conversations, so consecutive steps train on different sequences.
fn dataset(dir: &Path) -> PathBuf {
    let record = |task: &str, code: &str| {
        serde_json::json!({"messages": [
            {"role": "user", "content": task},
            {"role": "assistant", "content": code},
        ]})
        .to_string()
    };
    let lines = [
        record("Write add.", "def add(a, b):\n    \"\"\"Return a + b.\"\"\"\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n"),
        record("Write fib.", "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n"),
        record("Reverse a list.", "def reverse(xs):\n    out = []\n    for x in xs:\n        out.insert(0, x)\n    return out\n"),
    ];
    let path = dir.join("data.jsonl");
    std::fs::write(&path, lines.join("\n")).unwrap();
    path
}

fn args(data: &Path, out: &Path, extra: &[&str]) -> TrainArgs {
    let mut v: Vec<String> = [
        "--target-model",
        demo_target().to_str().unwrap(),
        "--dataset",
        data.to_str().unwrap(),
        "--output-dir",
        out.to_str().unwrap(),
        "--num-draft-layers",
        "1",
        "--draft-intermediate-size",
        "64",
        "--target-layer-ids",
        "1,2",
        "--block-size",
        "4",
        "--num-anchors",
        "4",
        "--max-len",
        "96",
        "--batch-size",
        "1",
        "--min-ready",
        "1",
        "--max-depth",
        "4",
        "--save-dtype",
        "f32",
        "--log-every",
        "2",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    v.extend(extra.iter().map(|s| s.to_string()));
    parse_train_args(v).expect("valid flags")
}

fn with(base: &[&str], more: &[&str]) -> Vec<String> {
    base.iter().chain(more).map(|s| s.to_string()).collect()
}

fn run(data: &Path, out: &Path, extra: &[String]) -> dflash_train::train::TrainSummary {
    let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
    train(&args(data, out, &extra)).unwrap()
}

fn error_of(data: &Path, out: &Path, extra: &[String]) -> String {
    let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
    match train(&args(data, out, &extra)) {
        Ok(s) => panic!(
            "the run should have been refused, but ran {} steps",
            s.steps
        ),
        Err(e) => e.to_string(),
    }
}

/// Flips one bit in the middle of `path` (same size, other content); returns the original.
fn flip_byte(path: &Path) -> Vec<u8> {
    let original = std::fs::read(path).unwrap();
    let mut bytes = original.clone();
    bytes[original.len() / 2] ^= 0x40;
    std::fs::write(path, &bytes).unwrap();
    original
}

/// The steps of the `kind` records in metrics.jsonl, in file order.
fn metric_steps(out: &Path, kind: &str) -> Vec<u64> {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v["kind"] == kind)
        .map(|v| v["step"].as_u64().unwrap())
        .collect()
}

#[test]
fn flipped_byte_and_truncated_file_in_the_newest_checkpoint_are_named_on_resume() {
    let dir = scratch("damage");
    let (data, out) = (dataset(&dir), dir.join("out"));
    let plan = ["--max-steps", "6", "--save-every", "2"];
    run(&data, &out, &with(&plan, &["--stop-after-steps", "4"]));
    let (older, newest) = (
        out.join("checkpoint-00000002"),
        out.join("checkpoint-00000004"),
    );
    assert!(older.is_dir() && newest.is_dir());
    // The manifest is an extra file: the checkpoint still loads as a plain z-lab drafter.
    let target = dflash_models::Qwen3Model::load(
        &demo_target(),
        candle_core::DType::F32,
        &candle_core::Device::Cpu,
        128,
        dflash_models::OpsMode::Fused,
    )
    .unwrap();
    dflash_models::DFlashDrafter::load(&newest, &target, dflash_models::OpsMode::Fused).unwrap();
    assert_eq!(newest_verified(&out), Some(newest.clone()));
    let resume = with(&plan, &["--resume", out.to_str().unwrap()]);

    // One flipped bit in the middle of the optimizer state: same size, a different digest.
    let opt = newest.join("optimizer.safetensors");
    let original = flip_byte(&opt);
    let msg = error_of(&data, &out, &resume);
    assert!(msg.contains(&opt.display().to_string()), "{msg}");
    assert!(msg.contains("SHA-256"), "{msg}");
    assert!(
        msg.contains("--resume-fallback") && msg.contains(&older.display().to_string()),
        "the fix names the flag and the checkpoint it would fall back to: {msg}"
    );
    // "The last good checkpoint" is the newest one that verifies, not the newest one.
    assert_eq!(newest_verified(&out), Some(older.clone()));
    assert_eq!(
        std::fs::read(&opt).unwrap().len(),
        original.len(),
        "left in place"
    );
    std::fs::write(&opt, &original).unwrap();

    // A model.safetensors cut short (which a resume never reads) is named too.
    let model = newest.join("model.safetensors");
    let original = std::fs::read(&model).unwrap();
    std::fs::write(&model, &original[..original.len() - 100]).unwrap();
    let msg = error_of(&data, &out, &resume);
    assert!(
        msg.contains(&model.display().to_string()) && msg.contains("truncated"),
        "{msg}"
    );
    std::fs::write(&model, &original).unwrap();

    // Without its manifest a checkpoint cannot be verified, and is not trusted.
    let manifest = newest.join("manifest.json");
    let kept = std::fs::read(&manifest).unwrap();
    std::fs::remove_file(&manifest).unwrap();
    let msg = error_of(&data, &out, &resume);
    assert!(msg.contains(&manifest.display().to_string()), "{msg}");
    std::fs::write(&manifest, kept).unwrap();

    // Repaired, it resumes.
    assert_eq!(run(&data, &out, &resume).steps, 6);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn fallback_past_a_damaged_checkpoint_ends_with_the_weights_of_an_uninterrupted_run() {
    let dir = scratch("fallback");
    let data = dataset(&dir);
    let (whole, halves) = (dir.join("whole"), dir.join("halves"));
    let plan = ["--max-steps", "8", "--save-every", "3"];
    let reference = run(&data, &whole, &with(&plan, &[]));
    run(&data, &halves, &with(&plan, &["--stop-after-steps", "7"]));
    let damaged = halves.join("checkpoint-00000007");
    flip_byte(&damaged.join("optimizer.safetensors"));
    let resume = with(&plan, &["--resume", halves.to_str().unwrap()]);
    // Refused without the flag (and nothing moved)...
    let msg = error_of(&data, &halves, &resume);
    assert!(msg.contains("--resume-fallback"), "{msg}");
    assert!(damaged.is_dir());
    // ...and with it, the run goes back to checkpoint 6 and trains steps 7 and 8 again.
    let second = run(
        &data,
        &halves,
        &[resume.clone(), vec!["--resume-fallback".into()]].concat(),
    );
    assert_eq!(second.steps, 8);
    assert_eq!(second.losses, reference.losses[6..]);
    let wa = std::fs::read(whole.join("model.safetensors")).unwrap();
    let wb = std::fs::read(halves.join("model.safetensors")).unwrap();
    assert!(
        wa == wb,
        "resumed weights differ from the uninterrupted run's"
    );
    // The damaged checkpoint is kept for inspection, outside rotation and resume.
    assert!(!damaged.exists());
    assert!(halves.join("checkpoint-00000007.corrupt").is_dir());
    assert_eq!(
        newest_verified(&halves),
        Some(halves.join("checkpoint-00000008"))
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The fused optimizer (on the CPU, its host reference) checkpoints through its flat snapshot,
/// one set of host buffers reused from checkpoint to checkpoint: stopped and resumed, the run
/// ends byte for byte where an uninterrupted one ends, optimizer state included.
#[test]
fn a_fused_optimizer_run_resumes_to_the_bytes_of_an_uninterrupted_one() {
    let dir = scratch("fused");
    let data = dataset(&dir);
    let (whole, halves) = (dir.join("whole"), dir.join("halves"));
    let plan = [
        "--max-steps",
        "8",
        "--save-every",
        "3",
        "--optimizer",
        "fused",
    ];
    let reference = run(&data, &whole, &with(&plan, &[]));
    run(&data, &halves, &with(&plan, &["--stop-after-steps", "5"]));
    let resume = with(&plan, &["--resume", halves.to_str().unwrap()]);
    let second = run(&data, &halves, &resume);
    assert_eq!(second.steps, 8);
    assert_eq!(second.losses, reference.losses[5..]);
    for file in [
        "model.safetensors",
        "checkpoint-00000008/model.safetensors",
        "checkpoint-00000008/optimizer.safetensors",
    ] {
        let (a, b) = (whole.join(file), halves.join(file));
        assert!(
            std::fs::read(a).unwrap() == std::fs::read(b).unwrap(),
            "{file} differs from the uninterrupted run's"
        );
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn metrics_jsonl_has_one_record_per_step_after_two_resumes() {
    let dir = scratch("metrics");
    let (data, out) = (dataset(&dir), dir.join("out"));
    let plan = ["--max-steps", "8", "--save-every", "3"];
    let resume = with(&plan, &["--resume", out.to_str().unwrap()]);
    run(&data, &out, &with(&plan, &["--stop-after-steps", "5"]));
    // As if the run died after step 5 before its checkpoint: steps 4 and 5 run again.
    std::fs::remove_dir_all(out.join("checkpoint-00000005")).unwrap();
    run(
        &data,
        &out,
        &[resume.clone(), with(&["--stop-after-steps", "7"], &[])].concat(),
    );
    // A damaged checkpoint 7: the fallback to checkpoint 6 runs step 7 again.
    flip_byte(&out.join("checkpoint-00000007/model.safetensors"));
    run(
        &data,
        &out,
        &[resume, vec!["--resume-fallback".into()]].concat(),
    );
    assert_eq!(metric_steps(&out, "step"), (1..=8).collect::<Vec<_>>());
    // Windows close every 2 steps and at each stop; those of the steps run again (5, 7) are cut.
    assert_eq!(metric_steps(&out, "window"), vec![2, 4, 6, 8]);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn resume_before_the_first_checkpoint_starts_fresh() {
    let dir = scratch("fresh");
    let data = dataset(&dir);
    let (plain, wrapped) = (dir.join("plain"), dir.join("wrapped"));
    let plan = ["--max-steps", "3", "--save-every", "10"];
    run(&data, &plain, &with(&plan, &[]));
    // A wrapper that always passes --resume, relaunched after a crash before the first
    // checkpoint: the crashed attempt's records are dropped, the run starts from step 0.
    std::fs::create_dir_all(&wrapped).unwrap();
    std::fs::write(
        wrapped.join("metrics.jsonl"),
        "{\"kind\":\"step\",\"step\":1,\"loss\":9.0}\n",
    )
    .unwrap();
    let s = run(
        &data,
        &wrapped,
        &with(&plan, &["--resume", wrapped.to_str().unwrap()]),
    );
    assert_eq!(s.steps, 3);
    assert_eq!(metric_steps(&wrapped, "step"), vec![1, 2, 3]);
    let wa = std::fs::read(plain.join("model.safetensors")).unwrap();
    let wb = std::fs::read(wrapped.join("model.safetensors")).unwrap();
    assert!(
        wa == wb,
        "a fresh start under --resume differs from a plain run"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn resume_refuses_a_mistyped_checkpoint_and_a_fresh_start_over_existing_checkpoints() {
    let dir = scratch("refuse");
    let (data, out) = (dataset(&dir), dir.join("out"));
    let plan = ["--max-steps", "4", "--save-every", "2"];
    run(&data, &out, &with(&plan, &["--stop-after-steps", "2"]));
    let typo = out.join("checkpoint-00000020");
    let msg = error_of(
        &data,
        &out,
        &with(&plan, &["--resume", typo.to_str().unwrap()]),
    );
    assert!(
        msg.contains(&typo.display().to_string()) && msg.contains("no such checkpoint"),
        "{msg}"
    );
    // An empty --resume directory would start fresh, and rotate --output-dir's checkpoints away.
    let empty = dir.join("empty");
    let msg = error_of(
        &data,
        &out,
        &with(&plan, &["--resume", empty.to_str().unwrap()]),
    );
    assert!(
        msg.contains("--resume") && msg.contains(&out.display().to_string()),
        "{msg}"
    );
    assert!(out.join("checkpoint-00000002").is_dir());
    std::fs::remove_dir_all(&dir).unwrap();
}
