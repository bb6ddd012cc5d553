//! End-to-end training runs on the CPU against the bundled demo target
//! (`serve/assets/tiny-coder-demo`) and the first records of the shared code corpus
//! (`tests/fixtures/corpus-head300.jsonl.xz`): the loss falls, and a run stopped at a
//! checkpoint and resumed ends with exactly the weights of a run that never stopped.

use std::path::{Path, PathBuf};

use dflash_train::train::{parse_train_args, train, TrainArgs};

fn demo_target() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../serve/assets/tiny-coder-demo")
}

fn corpus() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/corpus-head300.jsonl.xz")
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("dflash-train-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// A one-layer drafter, 4 anchors of block 8 per sequence, sequences cut to 128 tokens.
fn tiny_run(out: &Path, extra: &[&str]) -> TrainArgs {
    let mut args: Vec<String> = [
        "--target-model",
        demo_target().to_str().unwrap(),
        "--dataset",
        corpus().to_str().unwrap(),
        "--output-dir",
        out.to_str().unwrap(),
        "--num-draft-layers",
        "1",
        "--draft-intermediate-size",
        "256",
        "--target-layer-ids",
        "1,2",
        "--block-size",
        "8",
        "--num-anchors",
        "4",
        "--max-len",
        "96",
        "--batch-size",
        "2",
        "--min-ready",
        "8",
        "--max-depth",
        "16",
        "--max-records",
        "120",
        "--save-dtype",
        "f32",
        "--log-every",
        "50",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    args.extend(extra.iter().map(|s| s.to_string()));
    parse_train_args(args).expect("valid flags")
}

#[test]
fn loss_falls_well_below_its_start_on_the_demo_target() {
    let out = scratch("loss");
    let s = train(&tiny_run(
        &out,
        &["--max-steps", "250", "--lr", "2e-3", "--save-every", "1000"],
    ))
    .unwrap();
    assert_eq!(s.steps, 250);
    let mean = |xs: &[(usize, f64)]| xs.iter().map(|x| x.1).sum::<f64>() / xs.len() as f64;
    let start = mean(&s.losses[..5]);
    let end = mean(&s.losses[s.losses.len() - 30..]);
    eprintln!(
        "loss {start:.3} -> {end:.3} in {:.0} s ({:.0} tokens/s)",
        s.elapsed_s, s.tokens_per_s
    );
    assert!(
        end < 0.5 * start,
        "loss fell only from {start:.3} to {end:.3}"
    );
    // And well below a uniform guess over the 8192-token vocabulary (9.01 nats).
    assert!(end < 7.0, "final loss {end:.3} is not below 7 nats");
    // The result is a z-lab drafter directory the models crate loads.
    let target = dflash_models::Qwen3Model::load(
        &demo_target(),
        candle_core::DType::F32,
        &candle_core::Device::Cpu,
        256,
        dflash_models::OpsMode::Fused,
    )
    .unwrap();
    let d =
        dflash_models::DFlashDrafter::load(&out, &target, dflash_models::OpsMode::Fused).unwrap();
    assert_eq!(d.block_size(), 8);
    assert_eq!(d.target_layer_ids(), &[1, 2]);
    std::fs::remove_dir_all(&out).unwrap();
}

#[test]
fn resumed_run_ends_with_the_weights_of_an_uninterrupted_one() {
    let (a, b) = (scratch("whole"), scratch("halves"));
    let steps = ["--max-steps", "10", "--save-every", "3"];
    let whole = train(&tiny_run(&a, &steps)).unwrap();
    assert!(!whole.stopped_early);
    let first = train(&tiny_run(
        &b,
        &[&steps[..], &["--stop-after-steps", "5"]].concat(),
    ))
    .unwrap();
    assert!(first.stopped_early);
    assert_eq!(first.steps, 5);
    let second = train(&tiny_run(
        &b,
        &[&steps[..], &["--resume", b.to_str().unwrap()]].concat(),
    ))
    .unwrap();
    assert_eq!(second.steps, 10);
    let wa = std::fs::read(a.join("model.safetensors")).unwrap();
    let wb = std::fs::read(b.join("model.safetensors")).unwrap();
    assert!(
        wa == wb,
        "resumed weights differ from the uninterrupted run's"
    );
    // The last losses agree too (same batches, same anchors).
    assert_eq!(whole.losses[5..], second.losses[..]);
    std::fs::remove_dir_all(&a).unwrap();
    std::fs::remove_dir_all(&b).unwrap();
}
