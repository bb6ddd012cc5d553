//! `gpu-check --train`, trainer part: the fused flat AdamW as the trainer drives it
//! (train/src/train/optimizer.rs), on the given device (CPU too: `gpu-check cpu
//! --trainer-optimizer`). Each case prints one line `trainer_optimizer_<case> {json}` with
//! `pass`:
//! - `resume`: `dflash-train train` on tiny-coder-demo (a one-layer drafter, the CPU resume
//!   test's settings) for 8 steps uninterrupted, and stopped at step 5 then resumed, both with
//!   `--optimizer fused`: the final weights (f32) and the final checkpoint's optimizer state
//!   must be bit-identical (max abs diff 0), and the resumed steps' losses equal.
//! - `nan_skip`: a NaN gradient injected at step 3 (`--inject-nan-grad-at-step`): checkpoint 3
//!   (written after the skipped step) holds the weights and moments of checkpoint 2 exactly,
//!   its update count is checkpoint 2's and one step is counted skipped; resumed, steps 4-6
//!   train (finite losses, weights move, 5 updates in all).
//! - `step_parity`: the trainer's fused optimizer against its reference on the same gradients
//!   (bf16 values, as the fused path's bf16 variables receive them) of a drafter layer's shapes,
//!   over small, clipped, NaN-gradient and NaN-loss steps: masters and moments within 1e-6,
//!   the same run/skip decisions and update counts, the bf16 working weights equal to the
//!   masters rounded. Then, for information only, 4 trainer steps under each optimizer: the
//!   losses and the final weights' max abs difference (rounding grows over steps).
//! - `snapshot`: the fused optimizer's checkpoint snapshot (its flat buffers copied whole into
//!   host staging buffers, page-locked on CUDA, reused), cut per tensor as the checkpoint
//!   writer cuts it, must equal `tensors()` (pageable copies) bit for bit, after a first step
//!   and again after a second (the buffers refilled). On CUDA over 2^28 parameters (3 GiB of
//!   state), with the read-backs timed: round 2's `snapshot_s` is what the loop waits for a
//!   checkpoint (round 1's includes page-locking the buffers).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{ensure, Context, Result};
use candle_core::{DType, Device, Tensor};
use dflash_models::random::WeightRng;
use dflash_tests::demo_model;
use dflash_train::train::checkpoint::{OptimizerTensors, TrainerState};
use dflash_train::train::optim::AdamWConfig;
use dflash_train::train::optimizer::{OptimizerChoice, TrainOptimizer};
use dflash_train::train::{parse_train_args, train, TrainSummary};
use serde_json::{json, Value};

pub(crate) fn scratch(name: &str) -> Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("gpu-check-optim-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

/// The CPU resume test's three conversations.
pub(crate) fn dataset(dir: &Path) -> Result<PathBuf> {
    let record = |task: &str, code: &str| {
        json!({"messages": [
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
    std::fs::write(&path, lines.join("\n"))?;
    Ok(path)
}

fn run_train(dev: &Device, data: &Path, out: &Path, extra: &[&str]) -> Result<TrainSummary> {
    let device = if dev.is_cuda() { "cuda:0" } else { "cpu" };
    run_train_on(device, device, data, out, extra)
}

/// [`run_train`] with the target on `target` and the drafter replicas on `drafters` (flag
/// values, e.g. `cuda:0` and `0,1`).
pub(crate) fn run_train_on(
    target: &str,
    drafters: &str,
    data: &Path,
    out: &Path,
    extra: &[&str],
) -> Result<TrainSummary> {
    let demo = demo_model();
    let mut v: Vec<&str> = vec![
        "--target-model",
        demo.to_str().context("demo path")?,
        "--dataset",
        data.to_str().context("data path")?,
        "--output-dir",
        out.to_str().context("out path")?,
        "--target-devices",
        target,
        "--drafter-device",
        drafters,
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
    ];
    if !extra.contains(&"--optimizer") {
        v.extend(["--optimizer", "fused"]);
    }
    v.extend(extra);
    Ok(train(&parse_train_args(v)?)?)
}

fn load(path: &Path) -> Result<HashMap<String, Tensor>> {
    candle_core::safetensors::load(path, &Device::Cpu).with_context(|| path.display().to_string())
}

/// Max |a - b| over every tensor of two safetensors files with the same names.
pub(crate) fn file_diff(a: &Path, b: &Path) -> Result<f32> {
    let (ta, tb) = (load(a)?, load(b)?);
    ensure!(
        ta.len() == tb.len(),
        "{} vs {}: tensor sets differ",
        a.display(),
        b.display()
    );
    let mut worst = 0f32;
    for (name, x) in &ta {
        let y = tb
            .get(name)
            .with_context(|| format!("{name} missing in {}", b.display()))?;
        worst = worst.max(max_abs(x, y)?);
    }
    Ok(worst)
}

/// Max |a - b|, compared on the host (the fused optimizer's per-tensor state is cut there,
/// the reference's stays on the device).
fn max_abs(a: &Tensor, b: &Tensor) -> Result<f32> {
    let host = |t: &Tensor| t.to_device(&Device::Cpu)?.to_dtype(DType::F32);
    let d = (host(a)? - host(b)?)?.abs()?;
    Ok(d.flatten_all()?.max(0)?.to_scalar::<f32>()?)
}

fn state(ckpt: &Path) -> Result<TrainerState> {
    Ok(serde_json::from_str(&std::fs::read_to_string(
        ckpt.join("trainer_state.json"),
    )?)?)
}

fn resume_case(dev: &Device) -> Result<Value> {
    let dir = scratch("resume")?;
    let data = dataset(&dir)?;
    let (whole, halves) = (dir.join("whole"), dir.join("halves"));
    let plan = ["--max-steps", "8", "--save-every", "3"];
    let reference = run_train(dev, &data, &whole, &plan)?;
    let first = run_train(
        dev,
        &data,
        &halves,
        &[&plan[..], &["--stop-after-steps", "5"]].concat(),
    )?;
    let resume = [&plan[..], &["--resume", halves.to_str().context("path")?]].concat();
    let second = run_train(dev, &data, &halves, &resume)?;
    let weights = file_diff(
        &whole.join("model.safetensors"),
        &halves.join("model.safetensors"),
    )?;
    let last = "checkpoint-00000008/optimizer.safetensors";
    let optimizer = file_diff(&whole.join(last), &halves.join(last))?;
    let losses_equal = second.losses == reference.losses[5..];
    let pass = weights == 0.0
        && optimizer == 0.0
        && losses_equal
        && first.steps == 5
        && second.steps == 8
        && reference.skipped_steps == 0;
    let _ = std::fs::remove_dir_all(&dir);
    Ok(json!({
        "steps": 8, "interrupted_at": 5, "weights_max_abs_diff": weights,
        "optimizer_state_max_abs_diff": optimizer, "resumed_losses_equal": losses_equal,
        "losses": reference.losses, "pass": pass,
    }))
}

fn nan_case(dev: &Device) -> Result<Value> {
    let dir = scratch("nan")?;
    let data = dataset(&dir)?;
    let out = dir.join("out");
    let plan = [
        "--max-steps",
        "6",
        "--save-every",
        "1",
        "--keep-checkpoints",
        "10",
    ];
    let extra = ["--inject-nan-grad-at-step", "3", "--stop-after-steps", "3"];
    let first = run_train(dev, &data, &out, &[&plan[..], &extra].concat())?;
    let (c2, c3, c6) = (
        out.join("checkpoint-00000002"),
        out.join("checkpoint-00000003"),
        out.join("checkpoint-00000006"),
    );
    let unchanged = file_diff(
        &c2.join("optimizer.safetensors"),
        &c3.join("optimizer.safetensors"),
    )?;
    let (s2, s3) = (state(&c2)?, state(&c3)?);
    let resume = [&plan[..], &["--resume", out.to_str().context("path")?]].concat();
    let second = run_train(dev, &data, &out, &resume)?;
    let s6 = state(&c6)?;
    let moved = file_diff(&c3.join("model.safetensors"), &c6.join("model.safetensors"))?;
    let finite_after = second.losses.len() == 3 && second.losses.iter().all(|(_, l)| l.is_finite());
    let pass = unchanged == 0.0
        && s2.adam_t == 2
        && s3.adam_t == 2
        && s3.skipped_steps == 1
        && s3.nonfinite_in_row == 1
        && first.skipped_steps == 1
        && second.steps == 6
        && second.skipped_steps == 1
        && s6.adam_t == 5
        && s6.nonfinite_in_row == 0
        && finite_after
        && moved > 0.0;
    let _ = std::fs::remove_dir_all(&dir);
    Ok(json!({
        "nan_at_step": 3, "skipped_step_state_max_abs_diff": unchanged,
        "adam_t_at_2_3_6": [s2.adam_t, s3.adam_t, s6.adam_t],
        "skipped_steps": second.skipped_steps, "losses_after": second.losses,
        "weights_moved_after_max_abs": moved, "pass": pass,
    }))
}

fn shapes() -> Vec<(String, Vec<usize>)> {
    [
        vec![256, 768],
        vec![256, 256],
        vec![128, 256],
        vec![768, 256],
        vec![256, 768],
        vec![256],
        vec![64],
    ]
    .into_iter()
    .enumerate()
    .map(|(i, s)| (format!("p{i}"), s))
    .collect()
}

fn step_parity(dev: &Device) -> Result<Value> {
    let mut rng = WeightRng::new(5);
    let params = shapes()
        .into_iter()
        .map(|(n, s)| Ok((n, rng.normal(&s, 0.0, 0.02, DType::F32, dev)?)))
        .collect::<Result<Vec<_>>>()?;
    let choice = |fused| OptimizerChoice {
        fused,
        adam: AdamWConfig {
            weight_decay: 0.01,
            ..AdamWConfig::default()
        },
        clip: 1.0,
        compute_dtype: DType::BF16,
    };
    let copy = || -> Result<Vec<(String, Tensor)>> {
        params
            .iter()
            .map(|(n, t)| Ok((n.clone(), t.copy()?)))
            .collect()
    };
    let mut fused = TrainOptimizer::new(choice(true), copy()?, None)?;
    let mut reference = TrainOptimizer::new(choice(false), copy()?, None)?;
    let (mut worst, mut working, mut same) = (0f32, 0f32, true);
    let mut steps = Vec::new();
    // (gradient scale, loss): small, clipped, NaN gradient, NaN loss, small.
    let plan = [
        (1e-3f64, 1.5f32),
        (0.5, 2.0),
        (f64::NAN, 1.0),
        (1e-3, f32::NAN),
        (2e-3, 1.2),
    ];
    for (i, (scale, loss)) in plan.into_iter().enumerate() {
        // bf16 values: what the fused path's bf16 variables receive; the reference gets them
        // as f32 (its f32 variables' gradients are casts of bf16 ones in training too).
        let grads = params
            .iter()
            .map(|(_, p)| {
                Ok((rng.normal(p.dims(), 0.0, 1.0, DType::F32, dev)? * scale)?
                    .to_dtype(DType::BF16)?)
            })
            .collect::<Result<Vec<_>>>()?;
        let loss = Tensor::new(loss, dev)?;
        let lr = 6e-4 * (i + 1) as f64 / 5.0;
        fused.step(grads.iter().cloned().map(Some).collect(), &loss, lr)?;
        let as_f32 = grads
            .iter()
            .map(|g| g.to_dtype(DType::F32).map(Some))
            .collect::<candle_core::Result<Vec<_>>>()?;
        reference.step(as_f32, &loss, lr)?;
        let (of, or) = (fused.outcome()?, reference.outcome()?);
        same &= of.ran == or.ran && of.adam_t == or.adam_t;
        let (tf, tr) = (fused.tensors()?, reference.tensors()?);
        let mut d = 0f32;
        for k in 0..tf.params.len() {
            d = d.max(max_abs(&tf.params[k].1, &tr.params[k].1)?);
            d = d.max(max_abs(&tf.m[k], &tr.m[k])?);
            d = d.max(max_abs(&tf.v[k], &tr.v[k])?);
        }
        for ((_, var), (_, master)) in fused.vars().iter().zip(&tf.params) {
            let rounded = master.to_dtype(DType::BF16)?;
            working = working.max(max_abs(var.as_tensor(), &rounded)?);
        }
        worst = worst.max(d);
        steps.push(json!({"step": i + 1, "ran": [of.ran, or.ran], "norm": [of.norm, or.norm], "adam_t": [of.adam_t, or.adam_t], "max_abs_diff": d}));
    }
    let skipped = fused.device_skipped()?;
    let pass = worst <= 1e-6 && working == 0.0 && same && skipped == Some(2);
    let trainer = end_to_end(dev).unwrap_or_else(|e| json!({"error": format!("{e:#}")}));
    Ok(json!({
        "steps": steps, "max_abs_diff": worst, "tolerance": 1e-6,
        "working_vs_master_rounded": working, "device_skipped": skipped,
        "trainer_4_steps_info": trainer, "pass": pass,
    }))
}

/// For information: 4 trainer steps under each optimizer.
fn end_to_end(dev: &Device) -> Result<Value> {
    let dir = scratch("e2e")?;
    let data = dataset(&dir)?;
    let plan = ["--max-steps", "4", "--save-every", "10"];
    let mut losses = serde_json::Map::new();
    for kind in ["reference", "fused"] {
        let s = run_train(
            dev,
            &data,
            &dir.join(kind),
            &[&plan[..], &["--optimizer", kind]].concat(),
        )?;
        losses.insert(kind.into(), json!(s.losses));
    }
    let d = file_diff(
        &dir.join("reference/model.safetensors"),
        &dir.join("fused/model.safetensors"),
    )?;
    let _ = std::fs::remove_dir_all(&dir);
    Ok(json!({"losses": losses, "final_weights_max_abs_diff": d}))
}

/// Every tensor of `a` and `b` (host tensors) has the same bits.
fn bit_identical(a: &OptimizerTensors, b: &OptimizerTensors) -> Result<bool> {
    let bits = |t: &Tensor| -> Result<Vec<u32>> {
        let v = t.flatten_all()?.to_vec1::<f32>()?;
        Ok(v.iter().map(|x| x.to_bits()).collect())
    };
    let mut same = a.params.len() == b.params.len();
    for (i, ((na, pa), (nb, pb))) in a.params.iter().zip(&b.params).enumerate() {
        same &= na == nb && pa.dims() == pb.dims() && bits(pa)? == bits(pb)?;
        same &= bits(&a.m[i])? == bits(&b.m[i])? && bits(&a.v[i])? == bits(&b.v[i])?;
    }
    Ok(same)
}

fn snapshot_case(dev: &Device) -> Result<Value> {
    let n = if dev.is_cuda() { 1usize << 25 } else { 1 << 10 };
    // Eight tensors, matrices and vectors alternating: segments at offsets that are not the
    // buffer's start, in two ranks.
    let params = (0..8)
        .map(|i| {
            let shape = if i % 2 == 0 {
                vec![n / 256, 256]
            } else {
                vec![n]
            };
            Ok((format!("p{i}"), Tensor::randn(0f32, 0.02, shape, dev)?))
        })
        .collect::<Result<Vec<_>>>()?;
    let choice = OptimizerChoice {
        fused: true,
        adam: AdamWConfig::default(),
        clip: 1.0,
        compute_dtype: if dev.is_cuda() {
            DType::BF16
        } else {
            DType::F32
        },
    };
    let mut opt = TrainOptimizer::new(choice, params, None)?;
    let (mut pass, mut rounds) = (true, Vec::new());
    for round in 1..=2 {
        let grads = opt
            .vars()
            .iter()
            .map(|(_, v)| Ok(Some((v.ones_like()? * (1e-3 * round as f64))?)))
            .collect::<Result<Vec<_>>>()?;
        opt.step(grads, &Tensor::new(1.0f32, dev)?, 1e-3)?;
        ensure!(opt.outcome()?.ran, "round {round}: the step was skipped");
        let t0 = Instant::now();
        let snapshot = opt.snapshot()?;
        let snapshot_s = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        let cut = snapshot.into_tensors()?;
        let cut_s = t1.elapsed().as_secs_f64();
        let t2 = Instant::now();
        let reference = opt.tensors()?;
        let tensors_s = t2.elapsed().as_secs_f64();
        let same = bit_identical(&cut, &reference)?;
        pass &= same;
        rounds.push(
            json!({"round": round, "snapshot_s": snapshot_s, "cut_on_writer_s": cut_s,
                           "pageable_tensors_s": tensors_s, "bit_identical": same}),
        );
    }
    Ok(json!({"parameters": 8 * n, "rounds": rounds, "pass": pass}))
}

/// Runs the cases; one that errors is reported with `pass: false`.
pub fn run(dev: &Device) -> Result<Value> {
    let mut report = serde_json::Map::new();
    for (key, f) in [
        ("resume", resume_case as fn(&Device) -> Result<Value>),
        ("nan_skip", nan_case),
        ("step_parity", step_parity),
        ("snapshot", snapshot_case),
    ] {
        let v = f(dev).unwrap_or_else(|e| json!({"error": format!("{e:#}"), "pass": false}));
        println!("trainer_optimizer_{key} {v}");
        report.insert(key.into(), v);
    }
    Ok(Value::Object(report))
}
