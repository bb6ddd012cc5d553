//! `gpu-check --train`, attention part: the DFlash block-sparse attention forward
//! (`dflash_models::training::attn_dflash`) against the trainer's candle attention (`attend`
//! under `training_mask`, one block at a time: the visibility `train_hidden` uses), for full
//! and sliding-window layers, head_dim 64 and 128, two sequences of different lengths with
//! anchors at the first possible position, mid-sequence and the last one. Tolerances: f32
//! output 1e-5 max abs and log-sum-exp 1e-4 (summation order only); bf16 output 3e-2 max abs
//! (candle rounds the scores and probabilities to bf16, the kernel keeps f32). A wrong
//! visibility (every anchor moved one position later, so a block sees its own anchor's
//! context row) must fail the f32 bound.

use anyhow::Result;
use candle_core::{DType, Device, Tensor, D};
use dflash_models::dflash::train::training_mask;
use dflash_models::layers::attention::attend;
use dflash_models::random::WeightRng;
use dflash_models::training::attn_dflash::{dflash_attention_forward, BlockSpan};
use dflash_models::OpsMode;
use serde_json::{json, Value};

const B: usize = 16;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;

fn max_abs(a: &Tensor, b: &Tensor) -> Result<f32> {
    let d = (a.to_dtype(DType::F32)? - b.to_dtype(DType::F32)?)?.abs()?;
    Ok(d.flatten_all()?.max(0)?.to_scalar::<f32>()?)
}

/// The candle reference, block by block: `(out [R, H * D], lse [H, R])` (lse in f32).
#[allow(clippy::too_many_arguments)]
fn reference(
    q: &Tensor,
    kc: &Tensor,
    vc: &Tensor,
    kb: &Tensor,
    vb: &Tensor,
    spans: &[BlockSpan],
    window: Option<usize>,
) -> Result<(Tensor, Tensor)> {
    let d = q.dim(2)?;
    let (mut outs, mut lses) = (Vec::new(), Vec::new());
    for (b, s) in spans.iter().enumerate() {
        let (off, a) = (s.ctx_offset as usize, s.anchor as usize);
        let keys = Tensor::cat(&[kc.narrow(1, off, a)?, kb.narrow(1, b * B, B)?], 1)?;
        let values = Tensor::cat(&[vc.narrow(1, off, a)?, vb.narrow(1, b * B, B)?], 1)?;
        let mask = training_mask(&[a], a, B, window, q.device())?;
        let qb = q.narrow(1, b * B, B)?;
        outs.push(attend(
            &qb,
            &keys,
            &values,
            Some(&mask),
            OpsMode::Differentiable,
        )?);
        // lse of the masked, scaled f32 scores, per head and row.
        let groups = HEADS / KV_HEADS;
        let keys = keys
            .to_dtype(DType::F32)?
            .unsqueeze(1)?
            .repeat((1, groups, 1, 1))?
            .reshape((HEADS, a + B, d))?;
        let scores = (qb.to_dtype(DType::F32)?.matmul(&keys.t()?)? / (d as f64).sqrt())?
            .broadcast_add(&mask)?;
        let m = scores.max_keepdim(D::Minus1)?;
        let lse = (scores
            .broadcast_sub(&m)?
            .exp()?
            .sum_keepdim(D::Minus1)?
            .log()?
            + m)?;
        lses.push(lse.squeeze(D::Minus1)?);
    }
    Ok((Tensor::cat(&outs, 0)?, Tensor::cat(&lses, 1)?))
}

fn case(dev: &Device, dtype: DType, d: usize, window: Option<usize>) -> Result<Value> {
    // Two sequences (contexts of 150 and 90 rows, one after the other in the context buffer).
    let anchors: [(u32, &[u32]); 2] = [(0, &[1, 40, 77, 149]), (150, &[5, 30, 89])];
    let spans: Vec<BlockSpan> = anchors
        .iter()
        .flat_map(|(off, a)| {
            a.iter().map(|&anchor| BlockSpan {
                ctx_offset: *off,
                anchor,
            })
        })
        .collect();
    let (r, c) = (spans.len() * B, 240);
    let mut rng = WeightRng::new(21);
    let mut draw = |shape: &[usize]| rng.normal(shape, 0.0, 1.0, dtype, dev);
    let q = draw(&[HEADS, r, d])?;
    let (kc, vc) = (draw(&[KV_HEADS, c, d])?, draw(&[KV_HEADS, c, d])?);
    let (kb, vb) = (draw(&[KV_HEADS, r, d])?, draw(&[KV_HEADS, r, d])?);
    let (out, lse) = dflash_attention_forward(&q, &kc, &vc, &kb, &vb, &spans, B, window)?;
    let (ref_out, ref_lse) = reference(&q, &kc, &vc, &kb, &vb, &spans, window)?;
    let out_err = max_abs(&out, &ref_out)?;
    let lse_err = max_abs(&lse, &ref_lse)?;
    let shifted: Vec<BlockSpan> = spans
        .iter()
        .map(|s| BlockSpan {
            anchor: s.anchor + 1,
            ..*s
        })
        .collect();
    let (wrong, _) = dflash_attention_forward(&q, &kc, &vc, &kb, &vb, &shifted, B, window)?;
    let wrong_err = max_abs(&wrong, &ref_out)?;
    let (out_tol, lse_tol) = match dtype {
        DType::F32 => (1e-5, 1e-4),
        _ => (3e-2, 3e-2),
    };
    let pass = out_err <= out_tol && lse_err <= lse_tol && wrong_err > 1e-5;
    Ok(json!({
        "dtype": format!("{dtype:?}"), "head_dim": d, "window": window, "blocks": spans.len(),
        "out_max_abs_err": out_err, "lse_max_abs_err": lse_err,
        "wrong_mask_out_max_abs_err": wrong_err,
        "tolerances": {"out": out_tol, "lse": lse_tol}, "pass": pass,
    }))
}

pub fn run(dev: &Device) -> Result<Value> {
    let mut report = serde_json::Map::new();
    for (dtype, d, window) in [
        (DType::F32, 128, None),
        (DType::F32, 64, Some(24)),
        (DType::F32, 128, Some(7)),
        (DType::BF16, 128, None),
        (DType::BF16, 64, Some(24)),
    ] {
        let key = format!("attn_dflash_{dtype:?}_d{d}_w{}", window.unwrap_or(0));
        let v = case(dev, dtype, d, window)
            .unwrap_or_else(|e| json!({"error": format!("{e:#}"), "pass": false}));
        println!("{key} {v}");
        report.insert(key, v);
    }
    Ok(Value::Object(report))
}
