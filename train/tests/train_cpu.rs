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

/// The fused head loss (the default) trains as candle's composition does: the same losses
/// over six steps to 1e-5 relative (f32: they differ in summation order only), so the gradient
/// it feeds back through the drafter is the composition's too.
#[test]
fn fused_and_composed_head_losses_train_alike() {
    let (a, b) = (scratch("head-fused"), scratch("head-composed"));
    let steps = ["--max-steps", "6", "--save-every", "1000", "--lr", "2e-3"];
    let fused = train(&tiny_run(
        &a,
        &[&steps[..], &["--head-loss", "fused"]].concat(),
    ))
    .unwrap();
    let composed = train(&tiny_run(
        &b,
        &[&steps[..], &["--head-loss", "composed"]].concat(),
    ))
    .unwrap();
    assert_eq!(fused.losses.len(), 6);
    for ((s, x), (_, y)) in fused.losses.iter().zip(&composed.losses) {
        assert!(
            (x - y).abs() <= 1e-5 * y.abs(),
            "step {s}: fused {x} vs composed {y}"
        );
    }
    std::fs::remove_dir_all(&a).unwrap();
    std::fs::remove_dir_all(&b).unwrap();
}

/// The explicit engine (forward and backward written out) trains as candle's autograd does:
/// over six steps with two micro-batches each, the same losses to 1e-4 relative (f32; the
/// explicit step runs the fused DFlash attention's CPU reference where autograd runs the
/// composed masked softmax, so they differ in summation order only) and saved weights within
/// 1e-3 of each tensor's largest entry (AdamW's normalised step magnifies f32 rounding in
/// near-zero gradients to ~2e-4 here; a wrong gradient moves a weight by up to lr = 2e-3 per
/// step, 1e-2 over the run). The gradients themselves are checked tensor by tensor in
/// `dflash_models::dflash::train_explicit`'s tests.
#[test]
fn explicit_and_autograd_engines_train_alike() {
    let (a, b) = (scratch("engine-explicit"), scratch("engine-autograd"));
    let steps = [
        "--max-steps",
        "6",
        "--save-every",
        "6",
        "--lr",
        "2e-3",
        "--grad-accum",
        "2",
    ];
    let explicit = train(&tiny_run(
        &a,
        &[&steps[..], &["--train-engine", "explicit"]].concat(),
    ))
    .unwrap();
    let autograd = train(&tiny_run(
        &b,
        &[&steps[..], &["--train-engine", "autograd"]].concat(),
    ))
    .unwrap();
    assert_eq!(explicit.losses.len(), 6);
    for ((s, x), (_, y)) in explicit.losses.iter().zip(&autograd.losses) {
        assert!(
            (x - y).abs() <= 1e-4 * y.abs(),
            "step {s}: explicit {x} vs autograd {y}"
        );
    }
    let load = |dir: &Path| {
        candle_core::safetensors::load(dir.join("model.safetensors"), &candle_core::Device::Cpu)
            .unwrap()
    };
    let (we, wa) = (load(&a), load(&b));
    assert_eq!(we.len(), wa.len());
    for (name, x) in &we {
        let y = &wa[name];
        let diff = (x - y).unwrap().abs().unwrap().max_all().unwrap();
        let scale = y.abs().unwrap().max_all().unwrap();
        let (d, m) = (
            diff.to_scalar::<f32>().unwrap(),
            scale.to_scalar::<f32>().unwrap(),
        );
        assert!(d <= 1e-3 * m.max(1e-3), "{name}: max diff {d} (scale {m})");
    }
    std::fs::remove_dir_all(&a).unwrap();
    std::fs::remove_dir_all(&b).unwrap();
}

/// `--serialize-target` (profiling: target and drafter one after the other) trains on the same
/// batches as the overlapped pipeline, so the losses are identical; and the trainer then waits
/// for every batch, at least as long as the target computed it.
#[test]
fn serialized_target_trains_the_same_batches_and_waits_for_each() {
    let (a, b) = (scratch("overlapped"), scratch("serialized"));
    let steps = ["--max-steps", "6", "--save-every", "1000"];
    // Two micro-batches per step: the held credits pass from one to the next.
    let overlapped = train(&tiny_run(
        &a,
        &[&steps[..], &["--grad-accum", "2"]].concat(),
    ))
    .unwrap();
    let serialized = train(&tiny_run(
        &b,
        &[&steps[..], &["--grad-accum", "2", "--serialize-target"]].concat(),
    ))
    .unwrap();
    assert_eq!(serialized.losses.len(), 6);
    assert_eq!(
        serialized.losses, overlapped.losses,
        "same batches, same losses"
    );
    for w in jsonl(&b.join("metrics.jsonl"), "window") {
        let (wait, target) = (
            w["queue_wait_s"].as_f64().unwrap(),
            w["target_forward_s"].as_f64().unwrap(),
        );
        assert!(target > 0.0, "{w}");
        // The wait spans the target's forward (less the worker's own bookkeeping after it).
        assert!(
            wait >= 0.9 * target,
            "waited {wait} s for a {target} s target forward"
        );
        assert!(w["queue_depth"].as_f64().unwrap() <= 2.0, "{w}");
    }
    std::fs::remove_dir_all(&a).unwrap();
    std::fs::remove_dir_all(&b).unwrap();
}

fn jsonl(path: &Path, kind: &str) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v["kind"] == kind)
        .collect()
}

fn tensorboard_tags(out: &Path) -> Vec<(i64, String, f32)> {
    let dir = out.join("tensorboard");
    let file = std::fs::read_dir(&dir)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    dflash_train::observe::tfevents::read_scalars(&file)
        .unwrap()
        .into_iter()
        .map(|(s, t, v, _)| (s, t, v))
        .collect()
}

/// Throughput path: a random-weight target of a published shape with synthetic tokens (no
/// tokenizer) trains, and the window metrics (tokens/s, stage times, FLOPs, MFU against the
/// given peak, queue) reach metrics.jsonl and TensorBoard.
#[test]
fn random_target_with_synthetic_data_reports_throughput_stages_and_mfu() {
    let out = scratch("random");
    let argv = [
        "--target-model",
        "random:tiny,seed=3",
        "--dataset",
        "synthetic:len=48..96,n=24,prompt=4",
        "--output-dir",
        out.to_str().unwrap(),
        "--num-draft-layers",
        "1",
        "--block-size",
        "4",
        "--num-anchors",
        "6",
        "--max-steps",
        "6",
        "--batch-size",
        "2",
        "--min-ready",
        "4",
        "--max-depth",
        "8",
        "--log-every",
        "3",
        "--peak-tflops",
        "0.5",
    ];
    let s = train(&parse_train_args(argv).unwrap()).unwrap();
    assert_eq!(s.steps, 6);
    assert!(s.losses.iter().all(|l| l.1.is_finite()));
    let steps = jsonl(&out.join("metrics.jsonl"), "step");
    assert_eq!(steps.len(), 6);
    let windows = jsonl(&out.join("metrics.jsonl"), "window");
    assert_eq!(windows.len(), 2, "a window every 3 steps");
    for w in &windows {
        for k in [
            "tokens_per_s",
            "stage_drafter_forward_s",
            "stage_drafter_backward_s",
            "stage_optimizer_s",
            "target_forward_s",
            "drafter_tflops",
            "mfu",
            "mfu_drafter",
        ] {
            let v = w[k]
                .as_f64()
                .unwrap_or_else(|| panic!("{k} missing in {w}"));
            assert!(v > 0.0 && v.is_finite(), "{k} = {v}");
        }
        assert!(w["queue_depth"].as_f64().is_some());
        // MFU is the FLOP rate over the peak given.
        let rate = w["drafter_tflops"].as_f64().unwrap() + w["target_tflops"].as_f64().unwrap();
        assert!((w["mfu"].as_f64().unwrap() - rate / 0.5).abs() < 1e-9);
    }
    let tags = tensorboard_tags(&out);
    let loss: Vec<_> = tags.iter().filter(|t| t.1 == "train/loss").collect();
    assert_eq!(loss.iter().map(|t| t.0).collect::<Vec<_>>(), vec![3, 6]);
    let first = windows[0]["loss"].as_f64().unwrap() as f32;
    assert!((loss[0].2 - first).abs() <= 1e-6 * first.abs());
    assert!(tags.iter().any(|t| t.1 == "train/mfu"));
    std::fs::remove_dir_all(&out).unwrap();
}

/// A random target has no tokenizer: a chat dataset is refused naming the flag and the fix.
#[test]
fn random_target_refuses_chat_datasets_with_the_fix() {
    let out = scratch("random-chat");
    let data = corpus();
    let argv = [
        "--target-model",
        "random:tiny",
        "--dataset",
        data.to_str().unwrap(),
        "--output-dir",
        out.to_str().unwrap(),
    ];
    let e = train(&parse_train_args(argv).unwrap())
        .unwrap_err()
        .to_string();
    assert!(e.contains("--dataset") && e.contains("synthetic:"), "{e}");
    let _ = std::fs::remove_dir_all(&out);
}

/// Periodic evaluation: every N steps (and at the end) the current weights are replayed on a
/// cache built once at startup; vanilla and DDTree tau land in metrics.jsonl and TensorBoard,
/// and the last one equals `offline_eval` of the saved drafter on the same cache. The run
/// fine-tunes the bundled demo drafter (`--init-drafter`), so tau is well above 1 and a stale
/// or wrong drafter in the periodic eval would show.
#[test]
fn eval_every_logs_chain_and_ddtree_tau_equal_to_offline_eval_of_the_saved_drafter() {
    use dflash_train::eval::{offline_eval, EvalCache, Verify};
    let out = scratch("eval-every");
    std::fs::create_dir_all(&out).unwrap();
    let prompts = out.join("prompts.jsonl");
    std::fs::write(
        &prompts,
        "{\"id\":\"fib\",\"messages\":[{\"role\":\"user\",\"content\":\"Write a Python function fib(n).\"}]}\n\
         {\"id\":\"rev\",\"messages\":[{\"role\":\"user\",\"content\":\"Reverse a list in Python.\"}]}\n",
    )
    .unwrap();
    let demo_drafter = demo_target().join("../tiny-coder-demo-dflash");
    let s = train(&tiny_run(
        &out,
        &[
            "--init-drafter",
            demo_drafter.to_str().unwrap(),
            "--lr",
            "2e-3",
            "--max-steps",
            "4",
            "--eval-every",
            "2",
            "--eval-prompts",
            prompts.to_str().unwrap(),
            "--eval-max-new-tokens",
            "32",
            "--eval-budgets",
            "4,8",
        ],
    ))
    .unwrap();
    assert_eq!(s.steps, 4);
    let evals = jsonl(&out.join("metrics.jsonl"), "eval");
    assert_eq!(
        evals
            .iter()
            .map(|e| e["step"].as_u64().unwrap())
            .collect::<Vec<_>>(),
        vec![2, 4]
    );
    let tau =
        |e: &serde_json::Value, k: &str| e[k].as_f64().unwrap_or_else(|| panic!("{k} in {e}"));
    for e in &evals {
        for k in ["tau_chain", "tau_ddtree4", "tau_ddtree8"] {
            assert!((1.0..=16.0).contains(&tau(e, k)), "{k} = {}", tau(e, k));
        }
        // The bundled drafter accepts drafts on these prompts (chain tau 1.37 on the coding set).
        assert!(tau(e, "tau_ddtree8") > 1.1, "{e}");
    }
    // Steps 2 and 4 evaluate different weights (at the demo drafter's own lr; at 3e-4 the
    // CPU-trained demo drafter's tau did not move in two steps).
    assert_ne!(
        evals[0]["tau_ddtree8"], evals[1]["tau_ddtree8"],
        "{evals:?}"
    );
    let tags = tensorboard_tags(&out);
    assert!(tags.iter().any(|t| t.0 == 4 && t.1 == "eval/tau_ddtree8"));
    // The logged tau is the saved drafter's (f32 weights, so exactly the trained ones).
    let target = dflash_models::Qwen3Model::load(
        &demo_target(),
        candle_core::DType::F32,
        &candle_core::Device::Cpu,
        512,
        dflash_models::OpsMode::Fused,
    )
    .unwrap();
    let d =
        dflash_models::DFlashDrafter::load(&out, &target, dflash_models::OpsMode::Fused).unwrap();
    let cache = EvalCache::load(&out.join("eval-cache")).unwrap();
    let verifies = Verify::chain_and_budgets(&[4, 8]);
    let summary = offline_eval(&target, &d, &cache, &verifies).unwrap();
    let last = &evals[1];
    assert!((summary.tau(Verify::Chain).unwrap() - tau(last, "tau_chain")).abs() < 1e-9);
    assert!(
        (summary.tau(Verify::DDTree { budget: 8 }).unwrap() - tau(last, "tau_ddtree8")).abs()
            < 1e-9
    );
    std::fs::remove_dir_all(&out).unwrap();
}

/// Data parallelism, simulated with two CPU replicas: with one micro-batch per replica the
/// all-reduce sums the gradients in a single device's accumulation order, so two replicas at
/// `--grad-accum 2` end bit for bit where one device does (losses and saved weights), the
/// replicas agreeing at every checkpoint (the trainer checks it before each save).
#[test]
fn two_replicas_train_bit_for_bit_like_one_device_at_the_same_global_batch() {
    let (a, b) = (scratch("dp-one"), scratch("dp-two"));
    let steps = ["--max-steps", "6", "--save-every", "3", "--grad-accum", "2"];
    let one = train(&tiny_run(&a, &steps)).unwrap();
    let two = train(&tiny_run(
        &b,
        &[&steps[..], &["--drafter-device", "cpu,cpu"]].concat(),
    ))
    .unwrap();
    assert_eq!(two.steps, 6);
    assert_eq!(two.losses, one.losses, "same global batches, same losses");
    let wa = std::fs::read(a.join("model.safetensors")).unwrap();
    let wb = std::fs::read(b.join("model.safetensors")).unwrap();
    assert!(wa == wb, "two replicas' weights differ from one device's");
    std::fs::remove_dir_all(&a).unwrap();
    std::fs::remove_dir_all(&b).unwrap();
}

/// Two micro-batches per replica: the sum runs in another order than one device's
/// (`(g0 + g1) + (g2 + g3)`), so the runs agree to f32 rounding; a resume under two replicas
/// restores every replica from the checkpoint and ends where the uninterrupted run does.
#[test]
fn two_replicas_with_accumulation_match_one_device_to_rounding_and_resume_exactly() {
    let (a, b, c) = (
        scratch("dp-acc-one"),
        scratch("dp-acc-two"),
        scratch("dp-acc-halves"),
    );
    let steps = ["--max-steps", "6", "--save-every", "2", "--grad-accum", "4"];
    let dp = [&steps[..], &["--drafter-device", "cpu,cpu"]].concat();
    let one = train(&tiny_run(&a, &steps)).unwrap();
    let two = train(&tiny_run(&b, &dp)).unwrap();
    assert_eq!(two.losses.len(), one.losses.len());
    for ((s, l1), (_, l2)) in one.losses.iter().zip(&two.losses) {
        assert!(
            (l1 - l2).abs() <= 1e-5 * l1.abs().max(1.0),
            "step {s}: one device {l1}, two replicas {l2}"
        );
    }
    let first = train(&tiny_run(
        &c,
        &[&dp[..], &["--stop-after-steps", "3"]].concat(),
    ))
    .unwrap();
    assert!(first.stopped_early);
    let second = train(&tiny_run(
        &c,
        &[&dp[..], &["--resume", c.to_str().unwrap()]].concat(),
    ))
    .unwrap();
    assert_eq!(second.steps, 6);
    assert_eq!(two.losses[3..], second.losses[..]);
    let wb = std::fs::read(b.join("model.safetensors")).unwrap();
    let wc = std::fs::read(c.join("model.safetensors")).unwrap();
    assert!(
        wb == wc,
        "a resumed two-replica run differs from an uninterrupted one"
    );
    for d in [a, b, c] {
        std::fs::remove_dir_all(&d).unwrap();
    }
}
