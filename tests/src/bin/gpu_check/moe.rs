//! `gpu-check cuda <out.json> --moe`: the sparse-MoE block on the device (`cuda/moe.rs`)
//! against the plain block (`layers/moe.rs`, routing on the host), all at the
//! Qwen3-Coder-30B-A3B block shape (hidden 2048, 128 experts, top 8 renormalised, width 768)
//! with random weights (bf16, and their exact f32 copy).
//! 1. Routing: the routing kernel on the plain block's own router logits (f32, and bf16 as
//!    the bf16 block makes them) against `layers::moe::route` on the same logits: every row's
//!    experts must be the host's, in order, and the weights within 1e-6.
//! 2. Block, 1 / 2 / 16 / 64 / 100 rows, with a residual: the device experts under the plain
//!    block's routing (only f32 summation order differs: pass at 1e-2 of the largest output),
//!    and the whole device block (its own router GEMV), each against the plain bf16 block
//!    (reported beside both against the plain f32 block: f32 logits route some rows
//!    differently, so that figure is the bf16 noise floor, not a pass criterion); then a
//!    deliberately wrong block (top-k weights not renormalised) that must fail the tolerance.
//! 3. A 4-layer `qwen3_moe` target of that shape (`moe_forward.rs`): its fused forward (eager
//!    and step graphs) against its plain path, and the 48-layer benchmark.

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use dflash_common::MoeConfig;
use dflash_models::cuda::{self, MoeWeights};
use dflash_models::layers::moe::{route, SparseMoe};
use dflash_models::layers::ops::linear;
use dflash_models::random::WeightRng;
use serde_json::{json, Value};

use crate::time_ms;

/// Passing tolerances of a block's output against the plain one: the largest |device - plain|
/// over the largest |plain| (2-4 bf16 ulps of the largest outputs: the expert sums run in
/// another f32 order, which flips some bf16 roundings, and each of the k + 1 rounded additions
/// after them can carry a flip on), and the mean |device - plain| over the mean |plain| (one
/// misrouted expert in one of 16 rows moves it about 5e-3; rounding flips about 2e-4).
pub const TOL: f32 = 2e-2;
pub const MEAN_TOL: f32 = 1e-3;

/// The hybrid block check's bound: the device block's mean rel err against the exact f32
/// block over the plain bf16 block's (see [`hybrid_block_check`]).
pub const HYBRID_MEAN_VS_F32: f32 = 1.25;

pub fn coder_block() -> MoeConfig {
    MoeConfig {
        num_experts: 128,
        num_experts_per_tok: 8,
        moe_intermediate_size: 768,
        shared_expert_intermediate_size: None,
        norm_topk_prob: true,
    }
}

/// max |a - b| / max |b|.
fn rel_err(a: &Tensor, b: &Tensor) -> Result<f32> {
    Ok(errs(a, b)?[0])
}

/// [max |a - b| / max |b|, mean |a - b| / mean |b|].
fn errs(a: &Tensor, b: &Tensor) -> Result<[f32; 2]> {
    let a = a.to_dtype(DType::F32)?;
    let b = b.to_dtype(DType::F32)?;
    let d = (&a - &b)?.abs()?;
    let babs = b.abs()?;
    let max = d.max_all()?.to_scalar::<f32>()? / babs.max_all()?.to_scalar::<f32>()?;
    let mean = d.mean_all()?.to_scalar::<f32>()? / babs.mean_all()?.to_scalar::<f32>()?;
    Ok([max, mean])
}

fn within(e: [f32; 2]) -> bool {
    e[0] <= TOL && e[1] <= MEAN_TOL
}

/// Routing kernel against the host on the same logits: (rows whose top-k differ, largest
/// weight difference).
fn route_check(logits: &Tensor, k: usize, norm: bool) -> Result<(usize, f32)> {
    let dev_routes = if logits.dim(0)? <= cuda::MOE_MAX_ROWS {
        cuda::moe_route(logits, k, norm)?
    } else {
        cuda::moe_route_wide(logits, k, norm)?
    }
    .to_host()?;
    let host_logits = logits.to_dtype(DType::F32)?.to_vec2::<f32>()?;
    let (mut bad, mut werr) = (0, 0f32);
    for (row, got) in host_logits.iter().zip(&dev_routes) {
        let want = route(row, k, norm);
        if want.iter().map(|x| x.0).ne(got.iter().map(|x| x.0)) {
            bad += 1;
        }
        for (w, g) in want.iter().zip(got) {
            werr = werr.max((w.1 - g.1).abs());
        }
    }
    Ok((bad, werr))
}

pub fn block_check(dev: &Device) -> Result<Value> {
    let cfg = coder_block();
    let h = 2048;
    let mut rng = WeightRng::on_device().rounded_to(DType::BF16);
    let f32_block = SparseMoe::random(&mut rng, &cfg, h, DType::F32, dev)?;
    let bf16_block = f32_block.to_dtype(DType::BF16)?;
    let stacked = bf16_block
        .clone()
        .stack_experts()?
        .ok_or_else(|| anyhow::anyhow!("no shared expert here"))?;
    let weights = |norm: bool, k: usize| MoeWeights {
        router: &stacked.router,
        gate_up: &stacked.gate_up,
        down: &stacked.down,
        top_k: k,
        norm_topk_prob: norm,
        shared: None,
    };
    let mut res = serde_json::Map::new();
    let mut pass = true;
    // 100 and 1,000 rows: the wide routing (1,000 x 8 pairs over 128 experts puts more than
    // 64 pairs on most experts: several tiles each).
    for t in [1usize, 2, 16, 64, 100, 1000] {
        let x = rng.normal(&[t, h], 0.0, 1.0, DType::BF16, dev)?;
        let resid = rng.normal(&[t, h], 0.0, 1.0, DType::BF16, dev)?;
        let x32 = x.to_dtype(DType::F32)?;
        let plain = (&resid + bf16_block.forward(&x)?)?;
        let plain32 = (resid.to_dtype(DType::F32)? + f32_block.forward(&x32)?)?;
        let mut row = serde_json::Map::new();
        {
            // 1. Routing on the plain path's own logits.
            let l32 = linear(&x32, f32_block.router())?;
            let l16 = linear(&x, bf16_block.router())?;
            let (bad32, w32) = route_check(&l32, 8, true)?;
            let (bad16, w16) = route_check(&l16, 8, true)?;
            let (bad_nonorm, w_nonorm) = route_check(&l16, 8, false)?;
            pass &= bad32 == 0 && bad16 == 0 && bad_nonorm == 0;
            pass &= w32 <= 1e-6 && w16 <= 1e-6 && w_nonorm <= 1e-6;
            row.insert(
                "routing_rows_differing_f32_bf16_unnormalised".into(),
                json!([bad32, bad16, bad_nonorm]),
            );
            row.insert(
                "routing_max_weight_err_f32_bf16_unnormalised".into(),
                json!([w32, w16, w_nonorm]),
            );
            // 2a. The experts under the plain block's routing.
            let routing = if t <= cuda::MOE_MAX_ROWS {
                cuda::moe_route(&l16, 8, true)?
            } else {
                cuda::moe_route_wide(&l16, 8, true)?
            };
            row.insert("experts_used".into(), json!(routing.experts_used()?));
            let (y, _) =
                cuda::moe_experts(&x, None, &weights(true, 8), &routing, Some(&resid), false)?;
            let e = errs(&y, &plain)?;
            pass &= within(e);
            row.insert(
                "same_routing_max_mean_rel_err_vs_plain_bf16".into(),
                json!(e),
            );
        }
        // 2b. The whole block on the device, its own router GEMV.
        let (y, ss) = cuda::moe_block(&x, None, &weights(true, 8), Some(&resid), t > 1)?;
        let e16 = errs(&y, &plain)?;
        let e32 = errs(&y, &plain32)?;
        let plain_vs_f32 = errs(&plain, &plain32)?;
        // Against f32 only for information: f32 router logits route a few rows differently
        // from bf16 ones (the plain bf16 block shows the same against f32).
        pass &= within(e16);
        row.insert("block_max_mean_rel_err_vs_plain_bf16".into(), json!(e16));
        row.insert("block_max_mean_rel_err_vs_plain_f32".into(), json!(e32));
        row.insert(
            "plain_bf16_max_mean_rel_err_vs_f32".into(),
            json!(plain_vs_f32),
        );
        if let Some(ss) = ss {
            let want = y.to_dtype(DType::F32)?.sqr()?.sum(1)?;
            let e = rel_err(&ss, &want)?;
            pass &= e <= 1e-4;
            row.insert("row_sumsq_rel_err".into(), json!(e));
        }
        // 2c. Deliberately wrong: the weights left unnormalised must fail.
        let (bad, _) = cuda::moe_block(&x, None, &weights(false, 8), Some(&resid), false)?;
        let e_bad = errs(&bad, &plain)?;
        let fails = !within(e_bad);
        pass &= fails;
        row.insert("wrong_unnormalised_rel_err".into(), json!(e_bad));
        row.insert("wrong_case_fails".into(), json!(fails));
        // Timings: the device block against the plain block (host routing).
        if t == 1 || t == 16 || t == 1000 {
            let dev_ms = time_ms(dev, 20, || {
                cuda::moe_block(&x, None, &weights(true, 8), Some(&resid), false)?;
                Ok(())
            })?;
            let plain_ms = time_ms(dev, 5, || {
                (&resid + bf16_block.forward(&x)?)?;
                Ok(())
            })?;
            row.insert("device_ms".into(), json!(dev_ms));
            row.insert("plain_ms".into(), json!(plain_ms));
        }
        // Blocks wide enough for the grouped GEMMs: every expert path (grouped GEMMs with
        // either gather, the 64-pair tiles) against the plain block and timed, whichever the
        // process default is.
        if t >= cuda::MOE_GROUPED_MIN_ROWS {
            let (was, was_gather) = (cuda::moe_grouped_gemm(), cuda::moe_gather_kernel());
            let mut paths = serde_json::Map::new();
            for (name, on, gather) in [
                ("grouped_gemm", true, false),
                ("grouped_gemm_gather_kernel", true, true),
                ("tiles", false, false),
            ] {
                cuda::set_moe_grouped_gemm(on);
                cuda::set_moe_gather_kernel(gather);
                let block = || cuda::moe_block(&x, None, &weights(true, 8), Some(&resid), false);
                let e = errs(&block()?.0, &plain)?;
                pass &= within(e);
                let ms = time_ms(dev, 10, || {
                    block()?;
                    Ok(())
                })?;
                paths.insert(
                    name.into(),
                    json!({"max_mean_rel_err_vs_plain_bf16": e, "device_ms": ms}),
                );
            }
            cuda::set_moe_grouped_gemm(was);
            cuda::set_moe_gather_kernel(was_gather);
            row.insert("expert_paths".into(), Value::Object(paths));
        }
        res.insert(format!("rows_{t}"), Value::Object(row));
    }
    res.insert("tolerance_max_mean_rel".into(), json!([TOL, MEAN_TOL]));
    res.insert("pass".into(), json!(pass));
    Ok(Value::Object(res))
}

/// The hybrid block's pass (see [`hybrid_block_check`]) of `device` against the plain bf16
/// block and the exact f32 one, with the errors as a JSON entry.
fn hybrid_verdict(device: &Tensor, plain: &Tensor, exact: &Tensor) -> Result<(bool, Value)> {
    let e = errs(device, plain)?;
    let (vs_f32, floor) = (errs(device, exact)?, errs(plain, exact)?);
    let pass = e[0] <= TOL && vs_f32[1] <= HYBRID_MEAN_VS_F32 * floor[1];
    Ok((
        pass,
        json!({"pass": pass, "device_vs_plain_bf16": e, "device_vs_plain_f32": vs_f32,
               "plain_bf16_vs_plain_f32": floor}),
    ))
}

/// The hybrids' sparse block (Qwen3.6-35B-A3B shape: hidden 2048, 256 experts, top 8
/// renormalised, width 512, a shared expert of 512 with its sigmoid gate) on the device
/// (`qwen3_5::MoeKernels::apply`: the shared expert beside `cuda::moe_block`, and inside it at
/// one row; `apply_normed` with the norm inside too) against the plain block, `x1 + moe(h)` for
/// 1 / 16 / 64 / 100 rows. The device path rounds `x1 + shared` to
/// bf16 before the routed experts' combine adds to it, where the plain block rounds
/// `routed + shared` first: one more rounding of a unit-size sum, about 1.5e-3 of mean rel err
/// against the plain bf16 block (H100, session 19: 1.40e-3..1.51e-3), above the routed
/// block's [`MEAN_TOL`]. So the pass is against the exact f32 block: the device's max rel err
/// within [`TOL`] of the plain bf16 block, and its mean rel err against f32 at most
/// [`HYBRID_MEAN_VS_F32`] times the plain bf16 block's own (measured 1.04x..1.16x). Wrong case:
/// the shared expert ungated (added at full weight) must fail [`within`] against the device.
pub fn hybrid_block_check(dev: &Device) -> Result<Value> {
    use dflash_models::qwen3_5::MoeKernels;
    let cfg = MoeConfig {
        num_experts: 256,
        num_experts_per_tok: 8,
        moe_intermediate_size: 512,
        shared_expert_intermediate_size: Some(512),
        norm_topk_prob: true,
    };
    let h = 2048;
    let mut rng = WeightRng::on_device().rounded_to(DType::BF16);
    let f32_block = SparseMoe::random(&mut rng, &cfg, h, DType::F32, dev)?;
    let mut bf16_block = f32_block.to_dtype(DType::BF16)?;
    let kernels = MoeKernels::stack(&mut bf16_block)?
        .ok_or_else(|| anyhow::anyhow!("the block did not stack"))?;
    let mut out = serde_json::Map::new();
    let mut all = true;
    // rows_1 runs the shared expert inside the device block (`cuda::set_moe_shared_in_block`);
    // rows_1_shared_apart beside it, as before. The process default is restored at the end.
    let default_in_block = dflash_models::cuda::moe_shared_in_block();
    let cases = [
        (1usize, true),
        (1, false),
        (16, true),
        (64, true),
        (100, true),
        // A prefill's rows: the wide routing, most experts in two or more tiles.
        (1000, true),
    ];
    for (rows, in_block) in cases {
        dflash_models::cuda::set_moe_shared_in_block(in_block);
        let x1 = rng.normal(&[rows, h], 0.0, 1.0, DType::BF16, dev)?;
        let hn = rng.normal(&[rows, h], 0.0, 1.0, DType::BF16, dev)?;
        let plain = (&x1 + bf16_block.forward(&hn)?)?;
        let exact = (x1.to_dtype(DType::F32)? + f32_block.forward(&hn.to_dtype(DType::F32)?)?)?;
        let device = kernels
            .apply(&x1, &hn)?
            .ok_or_else(|| anyhow::anyhow!("the device block refused {rows} rows"))?;
        let (pass, mut entry) = hybrid_verdict(&device, &plain, &exact)?;
        all &= pass;
        entry["device_ms"] = json!(time_ms(dev, 20, || {
            kernels.apply(&x1, &hn)?;
            Ok(())
        })?);
        entry["plain_ms"] = json!(time_ms(dev, 5, || {
            bf16_block.forward(&hn)?;
            Ok(())
        })?);
        let name = match in_block {
            true => format!("rows_{rows}"),
            false => format!("rows_{rows}_shared_apart"),
        };
        out.insert(name, entry);
    }
    // The fused forward's one-row call (`MoeKernels::apply_normed`): the post-attention norm
    // applied inside the block's kernels, against the plain norm then the plain block.
    dflash_models::cuda::set_moe_shared_in_block(true);
    {
        use dflash_models::layers::ops::{rms_norm, OpsMode};
        let x1 = rng.normal(&[1, h], 0.0, 1.0, DType::BF16, dev)?;
        let nw = rng.normal(&[h], 1.0, 0.2, DType::BF16, dev)?;
        let eps = 1e-6;
        let hn = rms_norm(&x1, &nw, eps, OpsMode::Fused)?;
        let plain = (&x1 + bf16_block.forward(&hn)?)?;
        let exact = (x1.to_dtype(DType::F32)? + f32_block.forward(&hn.to_dtype(DType::F32)?)?)?;
        let norm = cuda::RowNorm {
            ss: None,
            weight: &nw,
            eps,
        };
        let device = kernels
            .apply_normed(&x1, norm)?
            .ok_or_else(|| anyhow::anyhow!("the device block refused the normed row"))?;
        let (pass, mut entry) = hybrid_verdict(&device, &plain, &exact)?;
        all &= pass;
        entry["device_ms"] = json!(time_ms(dev, 20, || {
            kernels.apply_normed(&x1, norm)?;
            Ok(())
        })?);
        out.insert("rows_1_normed_inside".into(), entry);
    }
    // Wrong case: the shared expert ungated (sigmoid gate dropped): the plain block with its
    // gated shared expert swapped for the whole one, built from the plain pieces; at 16 rows
    // (shared expert beside the block) and at one (inside it).
    let mut wrong_fails = true;
    for rows in [16usize, 1] {
        let x1 = rng.normal(&[rows, h], 0.0, 1.0, DType::BF16, dev)?;
        let hn = rng.normal(&[rows, h], 0.0, 1.0, DType::BF16, dev)?;
        let device = kernels
            .apply(&x1, &hn)?
            .ok_or_else(|| anyhow::anyhow!("the device block refused {rows} rows"))?;
        let ungated = {
            let (gate_w, shared_gate_up, shared_down) = bf16_block.shared_parts_for_checks()?;
            let gu = linear(&hn, &shared_gate_up)?;
            let s = shared_down.dim(1)?;
            let act = (gu.narrow(1, 0, s)?.silu()? * gu.narrow(1, s, s)?)?;
            let shared = linear(&act, &shared_down)?;
            let g = (linear(&hn, &gate_w)?.neg()?.exp()? + 1.0)?.recip()?;
            let gated = shared.broadcast_mul(&g)?;
            // plain = x1 + routed + gated; the wrong block adds the ungated expert instead.
            ((&x1 + bf16_block.forward(&hn)?)? - gated + shared)?
        };
        let wrong = errs(&device, &ungated)?;
        let fails = !within(wrong);
        wrong_fails &= fails;
        out.insert(
            format!("wrong_shared_expert_ungated_rows_{rows}"),
            json!({"errs": wrong, "fails_as_it_must": fails}),
        );
    }
    dflash_models::cuda::set_moe_shared_in_block(default_in_block);
    out.insert("pass".into(), json!(all && wrong_fails));
    Ok(Value::Object(out))
}

/// The one-row router-and-routing kernel (`cuda::router_route`: the router GEMV and the routing
/// in one launch, decode's path) against the two launches it replaces (`cuda::gemv` then
/// `cuda::moe_route` / `moe_route_shared`), which it must equal **bit for bit**: every row's
/// experts in order and the f32 weights' bits, and the experts' output under either routing
/// (which reads the rest of the metadata: the used experts, each pair's row and expert, each
/// row's pairs in ascending order). 64 random rows per case: the Coder's 128 experts (with
/// and without the renormalisation and the input norm), the 35B-A3B's 256 with the shared gate
/// row, 512 experts top 16. Wrong case: the renormalisation flipped must differ.
pub fn router_route_check(dev: &Device) -> Result<Value> {
    let h = 2048;
    let mut rng = WeightRng::on_device().rounded_to(DType::BF16);
    let nw = rng.normal(&[h], 1.0, 0.2, DType::BF16, dev)?;
    let norm = cuda::RowNorm {
        ss: None,
        weight: &nw,
        eps: 1e-6,
    };
    let mut out = serde_json::Map::new();
    let mut pass = true;
    // (experts, top k, renormalised, shared gate row, input norm)
    let cases = [
        (128usize, 8usize, true, false, false),
        (128, 8, false, false, true),
        (128, 8, true, false, true),
        (256, 8, true, true, true),
        (512, 16, true, false, false),
    ];
    for (e, k, renorm, shared, with_norm) in cases {
        let rows = if shared {
            e + cuda::SHARED_ROUTER_PAD
        } else {
            e
        };
        // Router rows scaled so the logits spread over a few units, as trained routers' do.
        let router = rng.normal(&[rows, h], 0.0, 0.05, DType::BF16, dev)?;
        let nm = with_norm.then_some(norm);
        let (mut differ, mut wrong_differs) = (0usize, 0usize);
        for _ in 0..64 {
            let x = rng.normal(&[1, h], 0.0, 1.0, DType::BF16, dev)?;
            let logits = cuda::gemv(&x, &router, nm)?;
            let want = match shared {
                true => cuda::moe_route_shared(&logits, e, k, renorm)?,
                false => cuda::moe_route(&logits, k, renorm)?,
            };
            let got = cuda::router_route(&x, nm, &router, e, k, renorm, shared)?;
            let bits = |r: &cuda::MoeRouting| -> Result<Vec<Vec<(usize, u32)>>> {
                Ok(r.to_host()?
                    .into_iter()
                    .map(|row| row.into_iter().map(|(i, w)| (i, w.to_bits())).collect())
                    .collect())
            };
            let want_bits = bits(&want)?;
            if want_bits != bits(&got)? || want.experts_used()? != got.experts_used()? {
                differ += 1;
            }
            let wrong = cuda::router_route(&x, nm, &router, e, k, !renorm, shared)?;
            if want_bits != bits(&wrong)? {
                wrong_differs += 1;
            }
        }
        let ok = differ == 0 && wrong_differs == 64;
        pass &= ok;
        out.insert(
            format!("e{e}_k{k}_renorm{renorm}_shared{shared}_norm{with_norm}"),
            json!({"rows": 64, "rows_differing": differ, "wrong_renorm_rows_differing": wrong_differs, "pass": ok}),
        );
    }
    // The experts' output under either routing (Coder block, random experts): bit for bit.
    let cfg = coder_block();
    let block = SparseMoe::random(&mut rng, &cfg, h, DType::BF16, dev)?
        .stack_experts()?
        .ok_or_else(|| anyhow::anyhow!("no shared expert here"))?;
    let w = MoeWeights {
        router: &block.router,
        gate_up: &block.gate_up,
        down: &block.down,
        top_k: 8,
        norm_topk_prob: true,
        shared: None,
    };
    let mut experts_differ = 0usize;
    for _ in 0..16 {
        let x = rng.normal(&[1, h], 0.0, 1.0, DType::BF16, dev)?;
        let resid = rng.normal(&[1, h], 0.0, 1.0, DType::BF16, dev)?;
        let two = cuda::moe_route(&cuda::gemv(&x, w.router, Some(norm))?, 8, true)?;
        let one = cuda::router_route(&x, Some(norm), w.router, 128, 8, true, false)?;
        let (a, _) = cuda::moe_experts(&x, Some(norm), &w, &two, Some(&resid), false)?;
        let (b, _) = cuda::moe_experts(&x, Some(norm), &w, &one, Some(&resid), false)?;
        let d = (a.to_dtype(DType::F32)? - b.to_dtype(DType::F32)?)?
            .abs()?
            .max_all()?
            .to_scalar::<f32>()?;
        experts_differ += (d != 0.0) as usize;
    }
    pass &= experts_differ == 0;
    out.insert(
        "experts_output_rows_differing_of_16".into(),
        json!(experts_differ),
    );
    let x = rng.normal(&[1, h], 0.0, 1.0, DType::BF16, dev)?;
    out.insert(
        "ms_router_then_route".into(),
        json!(time_ms(dev, 50, || {
            cuda::moe_route(&cuda::gemv(&x, w.router, Some(norm))?, 8, true)?;
            Ok(())
        })?),
    );
    out.insert(
        "ms_router_route".into(),
        json!(time_ms(dev, 50, || {
            cuda::router_route(&x, Some(norm), w.router, 128, 8, true, false)?;
            Ok(())
        })?),
    );
    out.insert("pass".into(), json!(pass));
    Ok(Value::Object(out))
}
