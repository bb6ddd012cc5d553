//! `gpu-check --train`, attention backward part.
//!
//! 1. Gradient check of the fused DFlash attention op (`training::attn_dflash::
//!    dflash_attention`, CUDA forward + backward kernels) against candle's autograd of the
//!    composition (`composed_attention`: `attend` under `training_mask`, on the GPU) and
//!    against the f32 CPU reference (`training::attn_dflash_ref`), for full and sliding
//!    layers, head_dim 64 and 128, GQA (4 heads over 2), two sequences of different lengths
//!    with anchors at 0, 1, mid-sequence and the last row. Gradient of sum(out * dout) for a
//!    random dout. Tolerance: f32, max abs error 1e-4 of the gradient's largest entry
//!    (summation order only); bf16 3e-2 of it (candle rounds scores and probabilities to
//!    bf16; the bf16 cases run the tensor-core kernels, which round P and dS to bf16 as mma
//!    operands; the f32 cases the scalar ones). A wrong visibility (anchors one later) must
//!    fail it.
//!    Also 8 heads over 2 (4 q-heads per KV head, the 8B drafters' grouping), f32 and bf16.
//! 2. A trainer step, fused vs composed (fused attention and the fused norm / RoPE / SiLU ops
//!    of `layers::train_ops` against the composition of both): a random 2-layer drafter (one sliding, one full layer,
//!    head_dim 64) on the GPU in f32, two sequences, `train_hidden_with` + the trainer's
//!    weighted cross-entropy + backward: the loss (1e-5 relative) and every parameter
//!    tensor's gradient (1e-4 of its largest entry) must agree.
//! 3. Time of one attention forward and of its backward (gradients left on the device),
//!    fused vs composed, with the reference training config's attention (tiny-coder-demo
//!    drafter: 4 heads over 2, head_dim 64, block 16, 256 anchors per sequence), bf16, for 8
//!    sequences of 640 rows; the fused path alone for the trainer's 32 sequences of ~740,
//!    with the tensor-core kernels and with the scalar ones only.
//! 4. The pipelined context dk/dv kernel against the default (bit-identical gradients) and
//!    both backwards' time, at the tiny recipe's shape (also sliding) and the 8B drafter's.

use anyhow::Result;
use candle_core::{DType, Device, Tensor, Var};
use dflash_common::{DFlashConfig, LayerType, Qwen3Config, RopeScaling};
use dflash_models::dflash::train::composed_attention;
use dflash_models::random::WeightRng;
use dflash_models::training::attn_dflash::{dflash_attention, BlockSpan};
use dflash_models::training::attn_dflash_ref::{self as reference, AttnDims};
use dflash_models::{
    DFlashDrafter, OpsMode, Qwen3Model, TargetEmbeddingsAndHead, TrainAttention, TrainSequence,
};
use dflash_train::train::dataset::Example;
use dflash_train::train::loss::{weighted_cross_entropy, BlockTargets};
use serde_json::{json, Value};

use super::time_ms;

const B: usize = 16;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const NAMES: [&str; 5] = ["dq", "dkc", "dvc", "dkb", "dvb"];

fn flat(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?)
}

/// max |a - b| / max |b|.
fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-30);
    let err = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    err / scale
}

type AttnFn<'a> = &'a dyn Fn(&[Tensor], &[BlockSpan]) -> candle_core::Result<Tensor>;

/// Gradients of sum(f(inputs) * dout) with respect to the five inputs, on the device.
fn grads_on_device(
    inputs: &[Tensor],
    dout: &Tensor,
    spans: &[BlockSpan],
    f: AttnFn,
) -> Result<Vec<Tensor>> {
    let vars: Vec<Var> = inputs
        .iter()
        .map(Var::from_tensor)
        .collect::<candle_core::Result<_>>()?;
    let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let out = f(&ts, spans)?;
    let g = (out.to_dtype(DType::F32)? * dout)?.sum_all()?.backward()?;
    vars.iter()
        .map(|v| {
            g.get(v.as_tensor())
                .cloned()
                .ok_or_else(|| anyhow::anyhow!("an input got no gradient"))
        })
        .collect()
}

/// [`grads_on_device`] as flat f32 on the host.
fn grads(
    inputs: &[Tensor],
    dout: &Tensor,
    spans: &[BlockSpan],
    f: AttnFn,
) -> Result<Vec<Vec<f32>>> {
    grads_on_device(inputs, dout, spans, f)?
        .iter()
        .map(flat)
        .collect()
}

fn grad_case(
    dev: &Device,
    dtype: DType,
    d: usize,
    window: Option<usize>,
    (heads, kv_heads): (usize, usize),
) -> Result<Value> {
    let anchors: [(u32, &[u32]); 2] = [(0, &[0, 1, 40, 77, 149]), (150, &[5, 30, 89])];
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
    let mut rng = WeightRng::new(33);
    let mut draw = |shape: &[usize]| rng.normal(shape, 0.0, 1.0, dtype, dev);
    let inputs = vec![
        draw(&[heads, r, d])?,
        draw(&[kv_heads, c, d])?,
        draw(&[kv_heads, c, d])?,
        draw(&[kv_heads, r, d])?,
        draw(&[kv_heads, r, d])?,
    ];
    let dout = draw(&[r, heads * d])?.to_dtype(DType::F32)?;
    let fused: AttnFn = &|t, s| dflash_attention(&t[0], &t[1], &t[2], &t[3], &t[4], s, B, window);
    let composed: AttnFn =
        &|t, s| composed_attention(&t[0], &t[1], &t[2], &t[3], &t[4], s, B, window);
    let g_fused = grads(&inputs, &dout, &spans, fused)?;
    let g_composed = grads(&inputs, &dout, &spans, composed)?;
    // The CPU reference on the same (dtype-rounded) inputs.
    let x: Vec<Vec<f32>> = inputs.iter().map(flat).collect::<Result<_>>()?;
    let dims = AttnDims {
        heads,
        kv_heads,
        rows: r,
        ctx: c,
        head_dim: d,
        block_size: B,
        window,
    };
    let (out, lse) = reference::forward(dims, &x[0], &x[1], &x[2], &x[3], &x[4], &spans);
    let g = reference::backward(
        dims,
        &x[0],
        &x[1],
        &x[2],
        &x[3],
        &x[4],
        &spans,
        &out,
        &flat(&dout)?,
        &lse,
    );
    let g_ref = [g.dq, g.dkc, g.dvc, g.dkb, g.dvb];
    let shifted: Vec<BlockSpan> = spans
        .iter()
        .map(|s| BlockSpan {
            anchor: s.anchor + 1,
            ..*s
        })
        .collect();
    let g_wrong = grads(&inputs, &dout, &shifted, fused)?;
    let tol = if dtype == DType::F32 { 1e-4 } else { 3e-2 };
    let mut pass = true;
    let mut per = serde_json::Map::new();
    for i in 0..5 {
        let vs_composed = rel_err(&g_fused[i], &g_composed[i]);
        let vs_ref = rel_err(&g_fused[i], &g_ref[i]);
        let wrong = rel_err(&g_wrong[i], &g_composed[i]);
        pass &= vs_composed <= tol && vs_ref <= tol;
        per.insert(
            NAMES[i].into(),
            json!({"vs_composed": vs_composed, "vs_cpu_reference": vs_ref, "wrong_mask": wrong}),
        );
    }
    let wrong_fails = (0..5).any(|i| rel_err(&g_wrong[i], &g_composed[i]) > tol);
    Ok(json!({
        "dtype": format!("{dtype:?}"), "heads": heads, "kv_heads": kv_heads, "head_dim": d, "window": window, "blocks": spans.len(),
        "rel_err": per, "tolerance": tol, "wrong_mask_fails": wrong_fails,
        "pass": pass && wrong_fails,
    }))
}

fn tiny_target(dev: &Device) -> Result<Qwen3Model> {
    let cfg = Qwen3Config {
        vocab_size: 512,
        hidden_size: 128,
        intermediate_size: 256,
        num_hidden_layers: 4,
        num_attention_heads: HEADS,
        num_key_value_heads: KV_HEADS,
        head_dim: 64,
        rms_norm_eps: 1e-6,
        rope_theta: 10_000.0,
        rope_scaling: RopeScaling::Default,
        max_position_embeddings: 512,
        tie_word_embeddings: false,
        eos_token_ids: vec![],
        bos_token_id: None,
        layer_types: vec![LayerType::FullAttention; 4],
        sliding_window: None,
        moe: None,
    };
    Ok(Qwen3Model::random(
        cfg,
        1,
        DType::F32,
        dev,
        512,
        OpsMode::Fused,
    )?)
}

/// Each parameter's name and gradient (flat f32).
type NamedGrads = Vec<(String, Vec<f32>)>;

/// A trainer step (forward, weighted CE, backward) of a random drafter: loss and gradients.
fn trainer_step(dev: &Device) -> Result<Value> {
    let target = tiny_target(dev)?;
    let mut cfg = DFlashConfig::for_target(target.config(), 2, B, 511, Some(vec![1, 2]));
    cfg.layers.layer_types = vec![LayerType::SlidingAttention, LayerType::FullAttention];
    cfg.layers.sliding_window = Some(24);
    let init = DFlashDrafter::random(cfg.clone(), &target, 5, OpsMode::Differentiable)?;
    let width = 2 * 128;
    let mut rng = WeightRng::new(8);
    let lens = [200usize, 90];
    let feats: Vec<Tensor> = lens
        .iter()
        .map(|&n| rng.normal(&[n, width], 0.0, 1.0, DType::F32, dev))
        .collect::<candle_core::Result<_>>()?;
    let toks: Vec<Vec<u32>> = lens
        .iter()
        .map(|&n| (0..n as u32).map(|i| (i * 37 + 11) % 500).collect())
        .collect();
    let anchors: [Vec<usize>; 2] = [vec![1, 17, 60, 133, 180], vec![3, 40, 74]];
    let mut targets = BlockTargets::default();
    for (t, a) in toks.iter().zip(&anchors) {
        let ex = Example {
            loss_mask: vec![1; t.len()],
            tokens: t.clone(),
        };
        targets.push(&ex, a, B, 7.0);
    }
    let parts = TargetEmbeddingsAndHead::of(&target);
    let run = |attention: TrainAttention| -> Result<(f32, NamedGrads)> {
        // Fused attention with the fused norm / RoPE / SiLU ops against the composition of
        // everything (the switch is process-wide; left on).
        dflash_models::layers::train_ops::set_fused_train_ops(attention == TrainAttention::Fused);
        let vars: Vec<(String, Var)> = init
            .named_tensors()
            .into_iter()
            .map(|(n, t)| Ok((n, Var::from_tensor(&t)?)))
            .collect::<Result<_>>()?;
        let tensors = vars
            .iter()
            .map(|(n, v)| (n.clone(), v.as_tensor().clone()))
            .collect();
        let d =
            DFlashDrafter::from_tensors(cfg.clone(), &tensors, &parts, OpsMode::Differentiable)?;
        let seqs: Vec<TrainSequence<'_>> = (0..2)
            .map(|i| TrainSequence {
                features: &feats[i],
                tokens: &toks[i],
                anchors: &anchors[i],
            })
            .collect();
        let hidden = d.train_hidden_with(&seqs, attention)?;
        let rows = Tensor::new(targets.rows.as_slice(), dev)?;
        let logits = d.lm_head(&hidden.index_select(&rows, 0)?)?;
        let loss = weighted_cross_entropy(&logits, &targets, targets.total_weight(), dev)?;
        let g = loss.backward()?;
        let grads = vars
            .iter()
            .map(|(n, v)| {
                let t = g
                    .get(v.as_tensor())
                    .ok_or_else(|| anyhow::anyhow!("{attention:?}: no gradient for {n}"))?;
                Ok((n.clone(), flat(t)?))
            })
            .collect::<Result<_>>()?;
        Ok((loss.to_scalar::<f32>()?, grads))
    };
    let (lf, gf) = run(TrainAttention::Fused)?;
    let (lc, gc) = run(TrainAttention::Composed)?;
    dflash_models::layers::train_ops::set_fused_train_ops(true);
    let loss_rel = (lf - lc).abs() / lc.abs();
    let mut worst = (String::new(), 0f32);
    for ((n, a), (_, b)) in gf.iter().zip(&gc) {
        let e = rel_err(a, b);
        if e > worst.1 {
            worst = (n.clone(), e);
        }
    }
    let pass = loss_rel <= 1e-5 && worst.1 <= 1e-4;
    Ok(json!({
        "loss_fused": lf, "loss_composed": lc, "loss_rel_err": loss_rel,
        "params": gf.len(), "worst_grad_rel_err": worst.1, "worst_param": worst.0,
        "tolerance": {"loss": 1e-5, "grad": 1e-4}, "pass": pass,
    }))
}

/// Evenly spaced anchors (`per_seq` per sequence of `len` rows, `seqs` sequences) and random
/// bf16 inputs `[q, kc, vc, kb, vb]` for `heads` q-heads over `kv`, head_dim `d`, with an f32
/// `dout`: the timing cases' workload.
#[allow(clippy::type_complexity)]
fn timing_inputs(
    dev: &Device,
    (heads, kv, d): (usize, usize, usize),
    (seqs, len, per_seq): (usize, usize, usize),
    seed: u64,
) -> Result<(Vec<BlockSpan>, Vec<Tensor>, Tensor)> {
    let mut spans = Vec::new();
    for s in 0..seqs {
        for i in 0..per_seq {
            spans.push(BlockSpan {
                ctx_offset: (s * len) as u32,
                anchor: (1 + i * (len - 1) / per_seq) as u32,
            });
        }
    }
    let (r, c) = (spans.len() * B, seqs * len);
    let mut rng = WeightRng::new(seed);
    let mut draw = |shape: &[usize]| rng.normal(shape, 0.0, 1.0, DType::BF16, dev);
    let inputs = vec![
        draw(&[heads, r, d])?,
        draw(&[kv, c, d])?,
        draw(&[kv, c, d])?,
        draw(&[kv, r, d])?,
        draw(&[kv, r, d])?,
    ];
    let dout = draw(&[r, heads * d])?.to_dtype(DType::F32)?;
    Ok((spans, inputs, dout))
}

/// Forward and forward + backward times (ms) of the fused path (and of the composed one with
/// `composed`) for `seqs` sequences of `len` rows with 256 anchors each.
fn speed(dev: &Device, seqs: usize, len: usize, composed: bool) -> Result<Value> {
    let (per_seq, d) = (256usize, 64usize);
    let (spans, inputs, dout) = timing_inputs(dev, (HEADS, KV_HEADS, d), (seqs, len, per_seq), 3)?;
    let fused: AttnFn = &|t, s| dflash_attention(&t[0], &t[1], &t[2], &t[3], &t[4], s, B, None);
    let composed_fn: AttnFn =
        &|t, s| composed_attention(&t[0], &t[1], &t[2], &t[3], &t[4], s, B, None);
    let mut res = serde_json::Map::new();
    let paths = [("fused", fused), ("composed", composed_fn)];
    for (name, f) in &paths[..if composed { 2 } else { 1 }] {
        let f = *f;
        let fwd = time_ms(dev, 5, || {
            f(&inputs, &spans)?;
            Ok(())
        })?;
        // The backward alone: one forward graph, differentiated again each time.
        let vars: Vec<Var> = inputs
            .iter()
            .map(Var::from_tensor)
            .collect::<candle_core::Result<_>>()?;
        let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        let loss = (f(&ts, &spans)?.to_dtype(DType::F32)? * &dout)?.sum_all()?;
        let bwd = time_ms(dev, 5, || {
            loss.backward()?;
            Ok(())
        })?;
        res.insert(name.to_string(), json!({"fwd_ms": fwd, "bwd_ms": bwd}));
    }
    res.insert(
        "shape".into(),
        json!({"sequences": seqs, "rows_per_seq": len, "anchors_per_seq": per_seq, "block": B,
               "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": d, "dtype": "bf16"}),
    );
    Ok(Value::Object(res))
}

/// The pipelined context dk/dv kernel (`cuda::set_dflash_dkv_pipelined`, the default) against
/// the single-buffered one on the same bf16 inputs: every gradient bit-identical (same blocks, same order), and
/// both backwards timed. `seqs` sequences of `len` rows, `per_seq` anchors each.
fn pipelined_case(
    dev: &Device,
    (heads, kv, d): (usize, usize, usize),
    (seqs, len, per_seq): (usize, usize, usize),
    window: Option<usize>,
) -> Result<Value> {
    let (spans, inputs, dout) = timing_inputs(dev, (heads, kv, d), (seqs, len, per_seq), 9)?;
    let f: AttnFn = &|t, s| dflash_attention(&t[0], &t[1], &t[2], &t[3], &t[4], s, B, window);
    let mut runs = Vec::new();
    let default = dflash_models::cuda::dflash_dkv_pipelined();
    for on in [false, true] {
        dflash_models::cuda::set_dflash_dkv_pipelined(on);
        let got = grads_on_device(&inputs, &dout, &spans, f);
        let vars: Vec<Var> = inputs
            .iter()
            .map(Var::from_tensor)
            .collect::<candle_core::Result<_>>()?;
        let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        let loss = (f(&ts, &spans)?.to_dtype(DType::F32)? * &dout)?.sum_all()?;
        let bwd = time_ms(dev, 5, || {
            loss.backward()?;
            Ok(())
        });
        dflash_models::cuda::set_dflash_dkv_pipelined(default);
        runs.push((got?, bwd?));
    }
    let mut worst = 0f32;
    for (a, b) in runs[0].0.iter().zip(&runs[1].0) {
        let d = (a.to_dtype(DType::F32)? - b.to_dtype(DType::F32)?)?
            .abs()?
            .flatten_all()?
            .max(0)?
            .to_scalar::<f32>()?;
        worst = worst.max(d);
    }
    Ok(json!({
        "shape": {"heads": heads, "kv_heads": kv, "head_dim": d, "sequences": seqs,
                  "rows_per_seq": len, "anchors_per_seq": per_seq, "window": window},
        "bwd_ms_single_buffered": runs[0].1, "bwd_ms_pipelined": runs[1].1,
        "max_abs_diff": worst, "pass": worst == 0.0,
    }))
}

pub fn run(dev: &Device) -> Result<Value> {
    let mut report = serde_json::Map::new();
    let mut record = |key: String, r: Result<Value>| {
        let v = r.unwrap_or_else(|e| json!({"error": format!("{e:#}"), "pass": false}));
        println!("{key} {v}");
        report.insert(key, v);
    };
    // 4 heads over 2, and 8 over 2 (4 q-heads per KV head, as Qwen3-8B-shaped drafters'
    // 32 over 8): the tensor-core kernels give each q-head of a group its own warp.
    for (dtype, d, window, heads) in [
        (DType::F32, 128, None, (HEADS, KV_HEADS)),
        (DType::F32, 64, Some(24), (HEADS, KV_HEADS)),
        (DType::F32, 128, Some(7), (HEADS, KV_HEADS)),
        (DType::BF16, 64, None, (HEADS, KV_HEADS)),
        (DType::BF16, 128, Some(24), (HEADS, KV_HEADS)),
        (DType::F32, 64, None, (8, 2)),
        (DType::BF16, 128, None, (8, 2)),
        (DType::BF16, 64, Some(24), (8, 2)),
    ] {
        record(
            format!(
                "attn_dflash_grad_{dtype:?}_d{d}_w{}_h{}x{}",
                window.unwrap_or(0),
                heads.0,
                heads.1
            ),
            grad_case(dev, dtype, d, window, heads),
        );
    }
    record("attn_dflash_trainer_step".into(), trainer_step(dev));
    record("attn_dflash_speed".into(), speed(dev, 8, 640, true));
    // The trainer's shape: 32 sequences of ~740 rows (the reference run's mean).
    record(
        "attn_dflash_speed_trainer_shape".into(),
        speed(dev, 32, 740, false),
    );
    // The same with the scalar kernels only (the bf16 forward, dq and context dk/dv run on
    // tensor cores by default).
    dflash_models::cuda::set_dflash_tensor_cores(false);
    let scalar = speed(dev, 32, 740, false);
    dflash_models::cuda::set_dflash_tensor_cores(true);
    record("attn_dflash_speed_trainer_shape_scalar".into(), scalar);
    if dev.is_cuda() {
        // The tiny recipe's attention, a sliding variant, and the 8B drafter's (32 heads over
        // 8, head_dim 128, one 2048-row sequence, 512 anchors).
        for (name, heads, rows, window) in [
            ("tiny", (HEADS, KV_HEADS, 64), (32, 740, 256), None),
            (
                "tiny_window",
                (HEADS, KV_HEADS, 64),
                (8, 740, 256),
                Some(100),
            ),
            ("8b", (32, 8, 128), (1, 2048, 512), None),
        ] {
            record(
                format!("attn_dflash_dkv_pipelined_{name}"),
                pipelined_case(dev, heads, rows, window),
            );
        }
    }
    Ok(Value::Object(report))
}
