//! `gpu-check --train`, fused norm / RoPE / SiLU part.
//!
//! 1. Gradient check of each fused trainable op of `dflash_models::layers::train_ops` (CUDA
//!    forward and backward kernels, reached through `layers::ops` in `OpsMode::Differentiable`
//!    with the switch on) against candle's autograd of the composition (the same functions
//!    with `set_fused_train_ops(false)`), on the GPU: RMSNorm over hidden 256 and 4096 (input
//!    and weight gradients), per-head q/k RMSNorm + RoPE to the head-major layout at head_dim
//!    64 and 128 (input and weight gradients; positions 0..4095 so large angles are covered),
//!    and the SiLU-gate product (both inputs). Gradient of sum(out * probe) for a random probe.
//!    The error is max |a - b| / max |b| per output and gradient, against the composition in
//!    f32 on the same inputs (for bf16 inputs: upcast; the bf16 composition is reported too).
//!    Tolerance: f32 1e-4 (summation order only); bf16 2e-2 (outputs and gradients rounded to
//!    bf16, and the rounding of the normed value the kernels copy from the composition). A deliberately wrong case must fail: the
//!    composition evaluated with the weight shifted by one element (norms), positions shifted
//!    by one (RoPE), or with `up` for `gate` swapped (SiLU).
//! 2. Time of forward + backward of each fused op and of its composition at the reference
//!    trainer's shape (131,072 block rows: hidden 256, 4 q-heads of 64, intermediate 768; bf16).

use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var};
use dflash_models::layers::ops::{qk_norm_rope, rms_norm, silu_mul};
use dflash_models::layers::train_ops::set_fused_train_ops;
use dflash_models::random::WeightRng;
use dflash_models::OpsMode;
use serde_json::{json, Value};

use super::time_ms;

const EPS: f64 = 1e-6;
const DIFF: OpsMode = OpsMode::Differentiable;

type OpFn<'a> = &'a dyn Fn(&[Tensor]) -> candle_core::Result<Tensor>;

pub(crate) fn flat(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?)
}

/// max |a - b| / max |b|.
pub(crate) fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-30);
    let err = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    err / scale
}

/// The output and the gradients of sum(f(inputs) * probe) for the first `tracked` inputs,
/// flat f32, with the fused ops on or off.
fn out_and_grads(
    fused: bool,
    inputs: &[Tensor],
    tracked: usize,
    probe: &Tensor,
    f: OpFn,
) -> Result<Vec<Vec<f32>>> {
    set_fused_train_ops(fused);
    let vars: Vec<Var> = inputs[..tracked]
        .iter()
        .map(Var::from_tensor)
        .collect::<candle_core::Result<_>>()?;
    let mut ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    ts.extend(inputs[tracked..].iter().cloned());
    let out = f(&ts);
    set_fused_train_ops(true);
    let out = out?;
    let g = (out.to_dtype(DType::F32)? * probe)?.sum_all()?.backward()?;
    let mut res = vec![flat(&out)?];
    for v in &vars {
        let gi = g
            .get(v.as_tensor())
            .ok_or_else(|| anyhow::anyhow!("an input got no gradient"))?;
        res.push(flat(gi)?);
    }
    Ok(res)
}

/// Compares the fused op with the composition (`f`), and the fused op with the wrong
/// composition (`wrong`); `names` label the output and the tracked inputs' gradients.
fn compare(
    dtype: DType,
    inputs: &[Tensor],
    tracked: usize,
    probe: &Tensor,
    names: &[&str],
    f: OpFn,
    wrong: OpFn,
) -> Result<Value> {
    let fused = out_and_grads(true, inputs, tracked, probe, f)?;
    // The reference: the composition in f32 on the same (dtype-rounded) inputs; for bf16 the
    // bf16 composition is reported beside it (its own rounding, candle's bf16 reductions).
    let upcast: Vec<Tensor> = inputs
        .iter()
        .map(|t| t.to_dtype(DType::F32))
        .collect::<candle_core::Result<_>>()?;
    let composed = out_and_grads(false, &upcast, tracked, probe, f)?;
    let composed_same = if dtype == DType::F32 {
        None
    } else {
        Some(out_and_grads(false, inputs, tracked, probe, f)?)
    };
    let bad = out_and_grads(false, &upcast, tracked, probe, wrong)?;
    let tol = if dtype == DType::F32 { 1e-4 } else { 2e-2 };
    let mut per = serde_json::Map::new();
    let (mut pass, mut wrong_fails) = (true, false);
    for (i, name) in names.iter().enumerate() {
        let e = rel_err(&fused[i], &composed[i]);
        let w = rel_err(&fused[i], &bad[i]);
        pass &= e <= tol && e.is_finite();
        wrong_fails |= w > tol;
        let mut entry = json!({"vs_composed_f32": e, "vs_wrong": w});
        if let Some(c) = &composed_same {
            entry["vs_composed_same_dtype"] = json!(rel_err(&fused[i], &c[i]));
            entry["composed_same_dtype_vs_f32"] = json!(rel_err(&c[i], &composed[i]));
        }
        per.insert(name.to_string(), entry);
    }
    Ok(
        json!({"dtype": format!("{dtype:?}"), "rel_err": per, "tolerance": tol,
              "wrong_case_fails": wrong_fails, "pass": pass && wrong_fails}),
    )
}

fn rms_case(dev: &Device, dtype: DType, rows: usize, n: usize) -> Result<Value> {
    let mut rng = WeightRng::new(21);
    let x = rng.normal(&[rows, n], 0.0, 1.5, dtype, dev)?;
    let w = rng.normal(&[n], 1.0, 0.3, dtype, dev)?;
    let probe = rng.normal(&[rows, n], 0.0, 1.0, DType::F32, dev)?;
    let f: OpFn = &|t| rms_norm(&t[0], &t[1], EPS, DIFF);
    let wrong: OpFn = &|t| {
        let w = t[1].narrow(0, 1, n - 1)?;
        let w = Tensor::cat(&[&w, &t[1].narrow(0, 0, 1)?], 0)?;
        rms_norm(&t[0], &w, EPS, DIFF)
    };
    let mut v = compare(dtype, &[x, w], 2, &probe, &["out", "dx", "dw"], f, wrong)?;
    v["shape"] = json!([rows, n]);
    Ok(v)
}

fn rope_tables(dev: &Device, t: usize, d: usize, shift: u32) -> Result<(Tensor, Tensor)> {
    // HF's default inverse frequencies for theta 1e6, positions spread over 0..4095.
    let half = d / 2;
    let mut cos = Vec::with_capacity(t * half);
    let mut sin = Vec::with_capacity(t * half);
    for i in 0..t as u32 {
        let p = (i.wrapping_mul(2_654_435_761) % 4096 + shift) as f64;
        for j in 0..half {
            let inv = 1e6f64.powf(-((2 * j) as f64) / d as f64);
            cos.push((p * inv).cos() as f32);
            sin.push((p * inv).sin() as f32);
        }
    }
    Ok((
        Tensor::from_vec(cos, (t, half), dev)?,
        Tensor::from_vec(sin, (t, half), dev)?,
    ))
}

fn qk_case(dev: &Device, dtype: DType, t: usize, h: usize, d: usize) -> Result<Value> {
    let mut rng = WeightRng::new(22);
    let x = rng.normal(&[t, h, d], 0.0, 1.5, dtype, dev)?;
    let w = rng.normal(&[d], 1.0, 0.3, dtype, dev)?;
    let probe = rng.normal(&[h, t, d], 0.0, 1.0, DType::F32, dev)?;
    let (cos, sin) = rope_tables(dev, t, d, 0)?;
    let (cos1, sin1) = rope_tables(dev, t, d, 1)?;
    let f: OpFn = &|a| qk_norm_rope(&a[0], &a[1], &a[2], &a[3], EPS, DIFF);
    let wrong: OpFn = &|a| qk_norm_rope(&a[0], &a[1], &cos1, &sin1, EPS, DIFF);
    let mut v = compare(
        dtype,
        &[x, w, cos, sin],
        2,
        &probe,
        &["out", "dx", "dw"],
        f,
        wrong,
    )?;
    v["shape"] = json!([t, h, d]);
    Ok(v)
}

fn silu_case(dev: &Device, dtype: DType, rows: usize, n: usize) -> Result<Value> {
    let mut rng = WeightRng::new(23);
    let g = rng.normal(&[rows, n], 0.0, 3.0, dtype, dev)?;
    let u = rng.normal(&[rows, n], 0.0, 1.0, dtype, dev)?;
    let probe = rng.normal(&[rows, n], 0.0, 1.0, DType::F32, dev)?;
    let f: OpFn = &|t| silu_mul(&t[0], &t[1], DIFF);
    let wrong: OpFn = &|t| silu_mul(&t[1], &t[0], DIFF);
    let mut v = compare(
        dtype,
        &[g, u],
        2,
        &probe,
        &["out", "dgate", "dup"],
        f,
        wrong,
    )?;
    v["shape"] = json!([rows, n]);
    Ok(v)
}

/// Forward + backward ms of `f` over `inputs` (all tracked), fused and composed.
fn time_both(dev: &Device, inputs: &[Tensor], f: OpFn) -> Result<Value> {
    let mut res = serde_json::Map::new();
    for fused in [true, false] {
        set_fused_train_ops(fused);
        let vars: Vec<Var> = inputs
            .iter()
            .map(Var::from_tensor)
            .collect::<candle_core::Result<_>>()?;
        let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        let ms = time_ms(dev, 5, || {
            f(&ts)?.sum_all()?.backward()?;
            Ok(())
        });
        set_fused_train_ops(true);
        res.insert(
            if fused {
                "fused_fwd_bwd_ms"
            } else {
                "composed_fwd_bwd_ms"
            }
            .into(),
            json!(ms?),
        );
    }
    Ok(Value::Object(res))
}

fn speed(dev: &Device) -> Result<Value> {
    let rows = 32 * 256 * 16;
    let mut rng = WeightRng::new(24);
    let bf = DType::BF16;
    let x = rng.normal(&[rows, 256], 0.0, 1.0, bf, dev)?;
    let w = rng.normal(&[256], 1.0, 0.2, bf, dev)?;
    let rms = time_both(dev, &[x, w], &|t| rms_norm(&t[0], &t[1], EPS, DIFF))?;
    let q = rng.normal(&[rows, 4, 64], 0.0, 1.0, bf, dev)?;
    let wq = rng.normal(&[64], 1.0, 0.2, bf, dev)?;
    let (cos, sin) = rope_tables(dev, rows, 64, 0)?;
    let qk = time_both(dev, &[q, wq], &|t| {
        qk_norm_rope(&t[0], &t[1], &cos, &sin, EPS, DIFF)
    })?;
    let g = rng.normal(&[rows, 768], 0.0, 1.0, bf, dev)?;
    let u = rng.normal(&[rows, 768], 0.0, 1.0, bf, dev)?;
    let silu = time_both(dev, &[g, u], &|t| silu_mul(&t[0], &t[1], DIFF))?;
    Ok(json!({"rows": rows, "dtype": "bf16",
              "rms_norm_h256": rms, "qk_norm_rope_4x64": qk, "silu_mul_768": silu}))
}

pub fn run(dev: &Device) -> Result<Value> {
    let mut report = serde_json::Map::new();
    let mut record = |key: String, r: Result<Value>| {
        let v = r.unwrap_or_else(|e| json!({"error": format!("{e:#}"), "pass": false}));
        println!("{key} {v}");
        report.insert(key, v);
    };
    for dtype in [DType::F32, DType::BF16] {
        record(
            format!("rms_norm_{dtype:?}_h256"),
            rms_case(dev, dtype, 3000, 256),
        );
        record(
            format!("rms_norm_{dtype:?}_h4096"),
            rms_case(dev, dtype, 300, 4096),
        );
        record(
            format!("qk_norm_rope_{dtype:?}_d64"),
            qk_case(dev, dtype, 1500, 4, 64),
        );
        record(
            format!("qk_norm_rope_{dtype:?}_d128"),
            qk_case(dev, dtype, 700, 8, 128),
        );
        record(
            format!("silu_mul_{dtype:?}"),
            silu_case(dev, dtype, 1000, 768),
        );
    }
    if dev.is_cuda() {
        record("train_ops_speed".into(), speed(dev));
    }
    Ok(Value::Object(report))
}
