//! Bad input stops a run with a message that names what to fix, and never costs the last good
//! checkpoint: unreadable dataset lines past the threshold, a dataset with nothing to
//! supervise, a drafter that does not fit the target, an unwritable output directory and a
//! corrupt checkpoint on resume.

use std::path::{Path, PathBuf};

use dflash_train::train::{parse_train_args, train, TrainArgs, TrainEngineArg};

fn demo_target() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../serve/assets/tiny-coder-demo")
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("dflash-bad-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

const GOOD: &str = r#"{"messages": [{"role": "user", "content": "Write a function."}, {"role": "assistant", "content": "def add(a, b):\n    \"\"\"Return the sum of a and b.\"\"\"\n    return a + b\n\n\ndef sub(a, b):\n    \"\"\"Return the difference of a and b.\"\"\"\n    return a - b\n"}]}"#;

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
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    v.extend(extra.iter().map(|s| s.to_string()));
    parse_train_args(v).expect("valid flags")
}

fn error_of(a: &TrainArgs) -> String {
    match train(a) {
        Ok(_) => panic!("the run should have been refused"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn unreadable_lines_are_skipped_until_the_threshold_then_named() {
    let dir = scratch("lines");
    let data = dir.join("data.jsonl");
    let lines = [
        GOOD,
        "{not json",
        GOOD,
        r#"{"messages": []}"#,
        r#"{"text": "no messages"}"#,
    ];
    std::fs::write(&data, lines.join("\n")).unwrap();
    // Two bad lines are tolerated: the run trains on the two good ones.
    let ok = train(&args(
        &data,
        &dir.join("out"),
        &["--max-bad-lines", "3", "--max-steps", "2"],
    ))
    .unwrap();
    assert_eq!(ok.steps, 2);
    let msg = error_of(&args(&data, &dir.join("out2"), &["--max-bad-lines", "2"]));
    assert!(msg.contains(&format!("{}:5", data.display())), "{msg}");
    assert!(msg.contains("--max-bad-lines 2"), "{msg}");
}

#[test]
fn records_without_a_final_assistant_turn_are_counted_apart_from_unreadable_lines() {
    let dir = scratch("prompts");
    let data = dir.join("data.jsonl");
    let prompt = r#"{"messages": [{"role": "user", "content": "Write a function."}]}"#;
    std::fs::write(
        &data,
        [GOOD, prompt, "{not json", prompt, prompt].join("\n"),
    )
    .unwrap();
    // Three prompts and one bad line: only the bad line counts against --max-bad-lines 1.
    let out = dir.join("out");
    let s = train(&args(
        &data,
        &out,
        &["--max-bad-lines", "1", "--max-steps", "1"],
    ))
    .unwrap();
    assert_eq!(s.steps, 1);
    let log: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("training_log.json")).unwrap())
            .unwrap();
    assert_eq!(log["data"]["bad_lines"], 1, "{}", log["data"]);
    assert_eq!(log["data"]["no_final_assistant_turn"], 3, "{}", log["data"]);
    assert_eq!(log["data"]["records"], 1, "{}", log["data"]);
}

#[test]
fn dataset_with_no_supervised_tokens_is_refused_naming_the_file() {
    let dir = scratch("nosup");
    let data = dir.join("short.jsonl");
    let rec = r#"{"messages": [{"role": "user", "content": "Say ok."}, {"role": "assistant", "content": "ok"}]}"#;
    std::fs::write(&data, format!("{rec}\n{rec}\n")).unwrap();
    let msg = error_of(&args(&data, &dir.join("out"), &["--min-supervised", "40"]));
    assert!(msg.contains("no usable training sequence"), "{msg}");
    assert!(msg.contains(&data.display().to_string()), "{msg}");
}

#[test]
fn drafter_that_does_not_fit_the_target_is_refused() {
    let dir = scratch("fit");
    let data = dir.join("data.jsonl");
    std::fs::write(&data, GOOD).unwrap();
    let msg = error_of(&args(
        &data,
        &dir.join("out"),
        &["--target-layer-ids", "1,7"],
    ));
    assert!(
        msg.contains("--target-layer-ids") && msg.contains("layer 7"),
        "{msg}"
    );
    let msg = error_of(&args(&data, &dir.join("out"), &["--mask-token-id", "9000"]));
    assert!(msg.contains("--mask-token-id 9000"), "{msg}");
    // A z-lab config made for another target (hidden 64, not 256).
    let other = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/dflash-tiny-random/config.json");
    let msg = error_of(&args(
        &data,
        &dir.join("out"),
        &["--drafter-config", other.to_str().unwrap()],
    ));
    assert!(
        msg.contains(&other.display().to_string()) && msg.contains("hidden_size"),
        "{msg}"
    );
}

#[test]
fn unwritable_output_directory_is_refused_before_training() {
    let dir = scratch("outdir");
    let data = dir.join("data.jsonl");
    std::fs::write(&data, GOOD).unwrap();
    let blocker = dir.join("a-file");
    std::fs::write(&blocker, "").unwrap();
    let out = blocker.join("out");
    let msg = error_of(&args(&data, &out, &[]));
    assert!(
        msg.contains(&out.display().to_string()) && msg.contains("not writable"),
        "{msg}"
    );
}

#[test]
fn corrupt_checkpoint_on_resume_is_named_and_left_in_place() {
    let dir = scratch("corrupt");
    let data = dir.join("data.jsonl");
    std::fs::write(&data, [GOOD, GOOD, GOOD].join("\n")).unwrap();
    let out = dir.join("out");
    let run = [
        "--max-steps",
        "4",
        "--save-every",
        "2",
        "--stop-after-steps",
        "2",
    ];
    let first = train(&args(&data, &out, &run)).unwrap();
    let ckpt = first.last_checkpoint.expect("a checkpoint was written");
    let resume = [&run[..4], &["--resume", out.to_str().unwrap()]].concat();

    let opt = ckpt.join("optimizer.safetensors");
    let bytes = std::fs::read(&opt).unwrap();
    std::fs::write(&opt, &bytes[..bytes.len() / 2]).unwrap();
    let msg = error_of(&args(&data, &out, &resume));
    assert!(msg.contains(&opt.display().to_string()), "{msg}");
    assert!(
        ckpt.join("model.safetensors").exists(),
        "the checkpoint is left as it was"
    );
    std::fs::write(&opt, &bytes).unwrap();

    let state = ckpt.join("trainer_state.json");
    std::fs::write(&state, "{\"step\": ").unwrap();
    let msg = error_of(&args(&data, &out, &resume));
    assert!(msg.contains(&state.display().to_string()), "{msg}");
}

#[test]
fn non_finite_steps_are_skipped_then_stop_the_run_naming_the_last_checkpoint() {
    let dir = scratch("nonfinite");
    let data = dir.join("data.jsonl");
    std::fs::write(&data, [GOOD, GOOD, GOOD].join("\n")).unwrap();
    let out = dir.join("out");
    // AdamW's first update moves every weight by ~lr: with lr 1e30 the next forward overflows,
    // and since skipped steps change nothing, every later step is non-finite too.
    let a = args(
        &data,
        &out,
        &[
            "--lr",
            "1e30",
            "--warmup-ratio",
            "0",
            "--max-steps",
            "20",
            "--save-every",
            "1",
            "--max-nonfinite-steps",
            "3",
        ],
    );
    let msg = error_of(&a);
    assert!(msg.contains("3 steps in a row"), "{msg}");
    let ckpt = out.join("checkpoint-00000001");
    assert!(msg.contains(&ckpt.display().to_string()), "{msg}");
    assert!(
        ckpt.join("model.safetensors").exists(),
        "the last checkpoint is kept"
    );
}

#[test]
fn data_parallel_device_lists_that_cannot_split_a_step_are_refused_naming_the_flag() {
    let dir = scratch("dp-flags");
    std::fs::create_dir_all(&dir).unwrap();
    let data = dir.join("data.jsonl");
    std::fs::write(&data, format!("{GOOD}\n")).unwrap();
    let out = dir.join("out");
    let uneven = error_of(&args(
        &data,
        &out,
        &["--drafter-device", "cpu,cpu", "--grad-accum", "3"],
    ));
    assert!(
        uneven.contains("--grad-accum") && uneven.contains("--grad-accum 4"),
        "{uneven}"
    );
    let mixed = error_of(&args(
        &data,
        &out,
        &["--drafter-device", "cpu,0", "--grad-accum", "2"],
    ));
    assert!(
        mixed.contains("--drafter-device") && mixed.contains("mixes"),
        "{mixed}"
    );
    // Refused before any GPU is opened, so this runs on a CPU-only machine too.
    let twice = error_of(&args(
        &data,
        &out,
        &["--drafter-device", "0,0", "--grad-accum", "2"],
    ));
    assert!(twice.contains("cuda:0 twice"), "{twice}");
    let nccl_on_cpu = error_of(&args(&data, &out, &["--grad-reducer", "nccl"]));
    assert!(nccl_on_cpu.contains("--grad-reducer"), "{nccl_on_cpu}");
    assert!(!out.join("model.safetensors").exists());
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `--train-engine explicit` with `--train-attention composed` is refused before anything
/// runs, naming the flag and both ways out; the default attention is accepted.
#[test]
fn explicit_engine_with_composed_attention_is_refused_naming_the_fix() {
    let dir = scratch("engine-flags");
    std::fs::create_dir_all(&dir).unwrap();
    let data = dir.join("data.jsonl");
    std::fs::write(&data, format!("{GOOD}\n")).unwrap();
    let out = dir.join("out");
    let e = error_of(&args(
        &data,
        &out,
        &[
            "--train-engine",
            "explicit",
            "--train-attention",
            "composed",
        ],
    ));
    assert!(
        e.contains("--train-engine")
            && e.contains("drop --train-attention composed")
            && e.contains("--train-engine autograd"),
        "{e}"
    );
    assert!(!out.join("model.safetensors").exists());
    let ok = args(&data, &out, &["--train-engine", "explicit"]);
    assert!(ok.check_engine().is_ok());
    // Unnamed, the engine follows the attention: explicit by default, autograd for composed.
    let default = args(&data, &out, &[]);
    assert!(default.check_engine().is_ok());
    assert_eq!(default.engine(), TrainEngineArg::Explicit);
    let composed = args(&data, &out, &["--train-attention", "composed"]);
    assert!(composed.check_engine().is_ok());
    assert_eq!(composed.engine(), TrainEngineArg::Autograd);
    std::fs::remove_dir_all(&dir).unwrap();
}
