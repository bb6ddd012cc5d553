//! `gpu-check cuda out.json --data-parallel`: the data-parallel drafter training path on the
//! GPUs this machine has. Each case prints `data_parallel_<case> {json}` with `pass`:
//! - `nccl_all_reduce` (`nccl` builds): one rank per visible GPU, rank `r` holding distinct
//!   random f32 data (10M + 3 elements, not a multiple of any chunk size): every rank's result
//!   equals the rank-order sum on the host within 1e-6 relative, all ranks bit-identical; a
//!   deliberately mismatched call (one rank's buffer a different length; with one GPU, more
//!   tensors than ranks) must be refused.
//! - `trainer_nccl_one_gpu` (`nccl` builds): the trainer on one GPU (f32 compute) with
//!   `--grad-reducer nccl` (world size 1: flatten, all-reduce, cut back) against
//!   `--grad-reducer in-process`: losses and saved weights identical.
//! - `trainer_two_gpus` (two or more GPUs): `--drafter-device 0,1` against `--drafter-device
//!   0`, both `--grad-accum 2` and f32 compute: losses within 1e-5 relative, weights within
//!   1e-5 (the sums differ by rounding under NCCL's order).

use anyhow::{ensure, Result};
use candle_core::DType;
#[cfg(feature = "nccl")]
use candle_core::{Device, Tensor};
use serde_json::{json, Value};

use super::train_optim::{dataset, file_diff, run_train_on, scratch};

/// The trainer runs every case compares: 4 steps of 2 micro-batches in f32.
const TRAIN_FLAGS: [&str; 6] = [
    "--max-steps",
    "4",
    "--grad-accum",
    "2",
    "--compute-dtype",
    "f32",
];

fn gpu_count() -> Result<usize> {
    Ok(candle_core::cuda_backend::cudarc::driver::CudaContext::device_count()? as usize)
}

pub fn run() -> Result<Value> {
    let gpus = gpu_count()?;
    let mut out = serde_json::Map::new();
    out.insert("gpus".into(), json!(gpus));
    let mut case = |name: &str, r: Result<Value>| {
        let v = r.unwrap_or_else(|e| json!({"pass": false, "error": format!("{e:#}")}));
        println!("data_parallel_{name} {v}");
        out.insert(name.into(), v);
    };
    #[cfg(feature = "nccl")]
    {
        case("nccl_all_reduce", nccl_all_reduce(gpus));
        case("trainer_nccl_one_gpu", trainer_nccl_one_gpu());
    }
    #[cfg(not(feature = "nccl"))]
    case(
        "nccl",
        Ok(json!({"skipped": "built without the nccl feature (cargo build --features nccl)"})),
    );
    if gpus >= 2 {
        case("trainer_two_gpus", trainer_two_gpus());
    } else {
        case(
            "trainer_two_gpus",
            Ok(json!({"skipped": format!("{gpus} GPU visible")})),
        );
    }
    Ok(Value::Object(out))
}

#[cfg(feature = "nccl")]
fn nccl_all_reduce(gpus: usize) -> Result<Value> {
    use dflash_models::cuda::nccl::NcclRanks;
    let devices = (0..gpus)
        .map(Device::new_cuda)
        .collect::<candle_core::Result<Vec<_>>>()?;
    let ranks = NcclRanks::new(&devices)?;
    let n = 10_000_003;
    let inputs = devices
        .iter()
        .enumerate()
        .map(|(r, d)| {
            let host = Tensor::randn(0f32, 1.0 + r as f32, n, &Device::Cpu)?;
            host.to_device(d)
        })
        .collect::<candle_core::Result<Vec<_>>>()?;
    let t0 = std::time::Instant::now();
    let summed = ranks.all_reduce_sum_f32(&inputs)?;
    for d in &devices {
        d.synchronize()?;
    }
    let secs = t0.elapsed().as_secs_f64();
    let mut expect = inputs[0].to_device(&Device::Cpu)?;
    for t in &inputs[1..] {
        expect = (expect + t.to_device(&Device::Cpu)?)?;
    }
    let scale = expect.abs()?.max_all()?.to_scalar::<f32>()?.max(1.0);
    let mut max_rel = 0f32;
    let first = summed[0].to_device(&Device::Cpu)?;
    let mut ranks_equal = true;
    for s in &summed {
        let s = s.to_device(&Device::Cpu)?;
        let d = (&s - &expect)?.abs()?.max_all()?.to_scalar::<f32>()? / scale;
        max_rel = max_rel.max(d);
        ranks_equal &= (&s - &first)?.abs()?.max_all()?.to_scalar::<f32>()? == 0.0;
    }
    // A mismatched call: with two or more ranks one rank's buffer a different length; with
    // one rank (nothing to mismatch against) a tensor more than there are ranks.
    let mut wrong = inputs.clone();
    if wrong.len() > 1 {
        wrong[0] = wrong[0].narrow(0, 0, n - 1)?.contiguous()?;
    } else {
        wrong.push(inputs[0].clone());
    }
    let refused = ranks.all_reduce_sum_f32(&wrong).is_err();
    Ok(json!({
        "pass": max_rel <= 1e-6 && ranks_equal && refused,
        "world_size": ranks.world_size(), "elements": n, "max_rel_err": max_rel,
        "ranks_bit_identical": ranks_equal, "mismatched_lengths_refused": refused,
        "seconds_incl_launch": secs,
    }))
}

#[cfg(feature = "nccl")]
fn trainer_nccl_one_gpu() -> Result<Value> {
    let dir = scratch("dp-nccl1")?;
    let data = dataset(&dir)?;
    let run = |name: &str, reducer: &str| {
        let out = dir.join(name);
        let extra = [&TRAIN_FLAGS[..], &["--grad-reducer", reducer]].concat();
        run_train_on("cuda:0", "cuda:0", &data, &out, &extra).map(|s| (s, out))
    };
    let (a, out_a) = run("in-process", "in-process")?;
    let (b, out_b) = run("nccl", "nccl")?;
    let diff = file_diff(
        &out_a.join("model.safetensors"),
        &out_b.join("model.safetensors"),
    )?;
    let _ = std::fs::remove_dir_all(&dir);
    Ok(json!({
        "pass": a.losses == b.losses && diff == 0.0,
        "losses_in_process": a.losses, "losses_nccl": b.losses, "weights_max_abs_diff": diff,
    }))
}

fn trainer_two_gpus() -> Result<Value> {
    let dir = scratch("dp-two")?;
    let data = dataset(&dir)?;
    let (one_out, two_out) = (dir.join("one"), dir.join("two"));
    let one = run_train_on("cuda:0", "cuda:0", &data, &one_out, &TRAIN_FLAGS)?;
    let two = run_train_on(
        "cuda:0,cuda:1",
        "cuda:0,cuda:1",
        &data,
        &two_out,
        &TRAIN_FLAGS,
    )?;
    ensure!(one.losses.len() == two.losses.len(), "step counts differ");
    let loss_rel = one
        .losses
        .iter()
        .zip(&two.losses)
        .map(|((_, a), (_, b))| (a - b).abs() / a.abs().max(1.0))
        .fold(0.0, f64::max);
    let diff = file_diff(
        &one_out.join("model.safetensors"),
        &two_out.join("model.safetensors"),
    )?;
    let _ = std::fs::remove_dir_all(&dir);
    Ok(json!({
        "pass": loss_rel <= 1e-5 && diff <= 1e-5,
        "losses_one": one.losses, "losses_two": two.losses,
        "loss_max_rel_diff": loss_rel, "weights_max_abs_diff": diff,
        "dtype": format!("{:?}", DType::F32),
    }))
}
