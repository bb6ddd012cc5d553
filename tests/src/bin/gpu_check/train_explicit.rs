//! `gpu-check --train-explicit`: the explicit training engine
//! (`DFlashDrafter::train_forward_explicit` / `train_backward_explicit`, with the fused
//! RMSNorm, q/k-norm + RoPE and SiLU-gate kernels of `layers::train_ops` and the fused DFlash
//! attention) against candle's autograd on the GPU.
//!
//! 1. Gradient check, f32: a random 2-layer drafter (one sliding layer, window 24, one full;
//!    head_dim 64 and 128, so the fused q/k kernel runs), two sequences of different lengths
//!    with anchors at 1, mid-sequence and near the end; the gradient of `sum(out * probe)` for
//!    a random probe. Explicit (fused kernels) against autograd of the composition (composed
//!    attention, composed ops): the output within 1e-5 and every parameter's gradient within
//!    1e-4 of its largest entry (summation order only).
//! 2. The same in bf16: both engines' errors against the f32 autograd reference; the explicit
//!    engine passes when its worst relative error is at most 1.5x autograd's (bf16 with the
//!    fused kernels) plus 1e-3.
//! 3. Time of one forward + backward of each engine (bf16, fused kernels for both) at the
//!    tiny recipe's drafter shape (tiny-coder-demo target, 2 layers, block 16, 256 anchors per
//!    sequence, 8 sequences of 740 rows) and at the 8B recipe's (Qwen3-8B-shaped, 5 layers, 512
//!    anchors over one 2048-row sequence), and the device memory each holds at its peak
//!    between forward and backward.

use std::collections::HashMap;

use anyhow::{anyhow, Result};
use candle_core::{DType, Device, Tensor, Var};
use dflash_common::{DFlashConfig, LayerType, Qwen3Config, RopeScaling};
use dflash_models::layers::train_ops::set_fused_train_ops;
use dflash_models::random::WeightRng;
use dflash_models::{
    DFlashDrafter, OpsMode, Qwen3Model, TargetEmbeddingsAndHead, TrainAttention, TrainSequence,
};
use serde_json::{json, Value};

use super::time_ms;
use crate::train::used_bytes;
use crate::train_ops::{flat, rel_err};

const B: usize = 16;

/// Per parameter: name and flat f32 gradient.
type Grads = Vec<(String, Vec<f32>)>;

fn target_config(hidden: usize, heads: (usize, usize), d: usize, inter: usize) -> Qwen3Config {
    Qwen3Config {
        vocab_size: 512,
        hidden_size: hidden,
        intermediate_size: inter,
        num_hidden_layers: 4,
        num_attention_heads: heads.0,
        num_key_value_heads: heads.1,
        head_dim: d,
        rms_norm_eps: 1e-6,
        rope_theta: 1_000_000.0,
        rope_scaling: RopeScaling::Default,
        max_position_embeddings: 4096,
        tie_word_embeddings: false,
        eos_token_ids: vec![],
        bos_token_id: None,
        layer_types: vec![LayerType::FullAttention; 4],
        sliding_window: None,
        moe: None,
    }
}

/// A random drafter's initial weights and its batch (features, tokens, anchors per sequence).
struct Case {
    cfg: DFlashConfig,
    init: Vec<(String, Tensor)>,
    parts: TargetEmbeddingsAndHead,
    feats: Vec<Tensor>,
    toks: Vec<Vec<u32>>,
    anchors: Vec<Vec<usize>>,
}

fn case(
    dev: &Device,
    tcfg: Qwen3Config,
    layers: usize,
    sliding: bool,
    lens: &[usize],
    per_seq: usize,
) -> Result<Case> {
    let hidden = tcfg.hidden_size;
    let target = Qwen3Model::random(tcfg, 1, DType::F32, dev, 4096, OpsMode::Fused)?;
    let mut cfg = DFlashConfig::for_target(target.config(), layers, B, 511, Some(vec![1, 2]));
    if sliding {
        cfg.layers.layer_types[0] = LayerType::SlidingAttention;
        cfg.layers.sliding_window = Some(24);
    }
    let init =
        DFlashDrafter::random(cfg.clone(), &target, 5, OpsMode::Differentiable)?.named_tensors();
    let mut rng = WeightRng::new(8);
    let feats = lens
        .iter()
        .map(|&n| rng.normal(&[n, 2 * hidden], 0.0, 1.0, DType::F32, dev))
        .collect::<candle_core::Result<_>>()?;
    let toks = lens
        .iter()
        .map(|&n| (0..n as u32).map(|i| (i * 37 + 11) % 500).collect())
        .collect();
    let anchors = lens
        .iter()
        .map(|&n| {
            (0..per_seq)
                .map(|i| 1 + i * (n - B - 1) / per_seq.max(1))
                .collect()
        })
        .collect();
    Ok(Case {
        cfg,
        init,
        parts: TargetEmbeddingsAndHead::of(&target),
        feats,
        toks,
        anchors,
    })
}

impl Case {
    fn feats(&self, dtype: DType) -> Result<Vec<Tensor>> {
        Ok(self
            .feats
            .iter()
            .map(|f| f.to_dtype(dtype))
            .collect::<candle_core::Result<_>>()?)
    }

    /// The f32 variables and a drafter over them in `dtype` (tracked: autograd reaches the
    /// variables through the cast; detached: the explicit engine's).
    fn drafter(&self, dtype: DType, tracked: bool) -> Result<(Vec<(String, Var)>, DFlashDrafter)> {
        let vars: Vec<(String, Var)> = self
            .init
            .iter()
            .map(|(n, t)| Ok((n.clone(), Var::from_tensor(t)?)))
            .collect::<Result<_>>()?;
        let tensors: HashMap<String, Tensor> = vars
            .iter()
            .map(|(n, v)| {
                let t = if tracked {
                    v.as_tensor().clone()
                } else {
                    v.as_tensor().detach()
                };
                Ok((n.clone(), t.to_dtype(dtype)?))
            })
            .collect::<Result<_>>()?;
        let parts = TargetEmbeddingsAndHead {
            embed_tokens: self.parts.embed_tokens.to_dtype(dtype)?,
            lm_head: self.parts.lm_head.to_dtype(dtype)?,
            max_positions: self.parts.max_positions,
        };
        let d = DFlashDrafter::from_tensors(
            self.cfg.clone(),
            &tensors,
            &parts,
            OpsMode::Differentiable,
        )?;
        Ok((vars, d))
    }

    /// Output and per-parameter gradients of `sum(out * probe)` under autograd (`attention`
    /// and the process-wide ops switch as set) or the explicit engine.
    fn grads(
        &self,
        dtype: DType,
        explicit: bool,
        attention: TrainAttention,
        probe: &Tensor,
    ) -> Result<(Vec<f32>, Grads)> {
        let (vars, d) = self.drafter(dtype, !explicit)?;
        let feats = self.feats(dtype)?;
        let seqs = self.seqs(&feats);
        let probe = probe.to_dtype(dtype)?;
        if explicit {
            let (out, tape) = d.train_forward_explicit(&seqs)?;
            let named = d.train_backward_explicit(&tape, &probe)?;
            let named: HashMap<String, Tensor> = named.into_iter().collect();
            let grads = vars
                .iter()
                .map(|(n, _)| {
                    Ok((
                        n.clone(),
                        flat(
                            named
                                .get(n)
                                .ok_or_else(|| anyhow!("explicit: no gradient for {n}"))?,
                        )?,
                    ))
                })
                .collect::<Result<_>>()?;
            return Ok((flat(&out)?, grads));
        }
        let out = d.train_hidden_with(&seqs, attention)?;
        let g = (out.to_dtype(DType::F32)? * probe.to_dtype(DType::F32)?)?
            .sum_all()?
            .backward()?;
        let grads = vars
            .iter()
            .map(|(n, v)| {
                Ok((
                    n.clone(),
                    flat(
                        g.get(v.as_tensor())
                            .ok_or_else(|| anyhow!("autograd: no gradient for {n}"))?,
                    )?,
                ))
            })
            .collect::<Result<_>>()?;
        Ok((flat(&out)?, grads))
    }

    fn seqs<'a>(&'a self, feats: &'a [Tensor]) -> Vec<TrainSequence<'a>> {
        (0..feats.len())
            .map(|i| TrainSequence {
                features: &feats[i],
                tokens: &self.toks[i],
                anchors: &self.anchors[i],
            })
            .collect()
    }

    fn rows(&self) -> usize {
        self.anchors.iter().map(Vec::len).sum::<usize>() * B
    }
}

fn worst(a: &Grads, b: &Grads) -> (String, f32) {
    let mut w = (String::new(), 0f32);
    for ((n, x), (_, y)) in a.iter().zip(b) {
        let e = rel_err(x, y);
        if e > w.1 {
            w = (n.clone(), e);
        }
    }
    w
}

/// Checks 1 and 2 for head_dim `d`.
fn grad_case(dev: &Device, d: usize) -> Result<Value> {
    let c = case(
        dev,
        target_config(128, (4, 2), d, 256),
        2,
        true,
        &[200, 90],
        4,
    )?;
    let mut rng = WeightRng::new(13);
    let probe = rng.normal(&[c.rows(), 128], 0.0, 1.0, DType::F32, dev)?;
    // The reference: autograd of the composition, f32.
    set_fused_train_ops(false);
    let (out_ref, g_ref) = c.grads(DType::F32, false, TrainAttention::Composed, &probe)?;
    set_fused_train_ops(true);
    let (out_x, g_x) = c.grads(DType::F32, true, TrainAttention::Fused, &probe)?;
    let out_err = rel_err(&out_x, &out_ref);
    let f32_worst = worst(&g_x, &g_ref);
    let f32_pass = out_err <= 1e-5 && f32_worst.1 <= 1e-4 && g_x.len() == g_ref.len();
    let (_, g_xb) = c.grads(DType::BF16, true, TrainAttention::Fused, &probe)?;
    let (_, g_ab) = c.grads(DType::BF16, false, TrainAttention::Fused, &probe)?;
    let (xb, ab) = (worst(&g_xb, &g_ref), worst(&g_ab, &g_ref));
    let bf16_pass = xb.1 <= 1.5 * ab.1 + 1e-3;
    Ok(json!({
        "head_dim": d, "params": g_ref.len(),
        "f32": {"out_rel_err": out_err, "worst_grad_rel_err": f32_worst.1, "worst_param": f32_worst.0,
                "tolerance": {"out": 1e-5, "grad": 1e-4}, "pass": f32_pass},
        "bf16": {"explicit_worst_vs_f32": xb.1, "explicit_worst_param": xb.0,
                 "autograd_worst_vs_f32": ab.1, "autograd_worst_param": ab.0,
                 "criterion": "explicit <= 1.5 x autograd + 1e-3", "pass": bf16_pass},
        "pass": f32_pass && bf16_pass,
    }))
}

/// Check 3 at one shape: forward + backward ms of each engine (bf16, fused kernels).
fn speed(dev: &Device, name: &str, c: Case) -> Result<Value> {
    set_fused_train_ops(true);
    let hidden = c.cfg.layers.hidden_size;
    let mut rng = WeightRng::new(17);
    let probe = rng.normal(&[c.rows(), hidden], 0.0, 1.0, DType::BF16, dev)?;
    let feats = c.feats(DType::BF16)?;
    let seqs = c.seqs(&feats);
    let mut res = serde_json::Map::new();
    for explicit in [true, false] {
        let (_vars, d) = c.drafter(DType::BF16, !explicit)?;
        let step = || -> Result<()> {
            if explicit {
                let (_, tape) = d.train_forward_explicit(&seqs)?;
                drop(d.train_backward_explicit(&tape, &probe)?);
            } else {
                let out = d.train_hidden_with(&seqs, TrainAttention::Fused)?;
                let loss = (out.to_dtype(DType::F32)? * probe.to_dtype(DType::F32)?)?.sum_all()?;
                drop(loss.backward()?);
            }
            Ok(())
        };
        // Memory held by the forward's saved state (an untimed step; the pool returns what is
        // free at a sync).
        let base = used_bytes(dev)?;
        let held = if explicit {
            let (_, tape) = d.train_forward_explicit(&seqs)?;
            let peak = used_bytes(dev)?;
            drop(tape);
            peak
        } else {
            let out = d.train_hidden_with(&seqs, TrainAttention::Fused)?;
            let peak = used_bytes(dev)?;
            drop(out);
            peak
        }
        .saturating_sub(base);
        step()?;
        let ms = time_ms(dev, 3, step)?;
        res.insert(
            if explicit { "explicit" } else { "autograd" }.into(),
            json!({"fwd_bwd_ms": ms, "held_after_forward_gib": held as f64 / (1u64 << 30) as f64}),
        );
    }
    let (x, a) = (
        res["explicit"]["fwd_bwd_ms"].as_f64(),
        res["autograd"]["fwd_bwd_ms"].as_f64(),
    );
    if let (Some(x), Some(a)) = (x, a) {
        res.insert("autograd_over_explicit".into(), json!(a / x));
    }
    res.insert(
        "shape".into(),
        json!({"name": name, "layers": c.cfg.layers.num_hidden_layers, "hidden": hidden,
               "sequences": c.feats.len(), "anchors_per_seq": c.anchors[0].len(), "block_rows": c.rows()}),
    );
    Ok(Value::Object(res))
}

pub fn run(dev: &Device) -> Result<Value> {
    let mut report = serde_json::Map::new();
    let mut record = |key: &str, r: Result<Value>| {
        let v = r.unwrap_or_else(|e| json!({"error": format!("{e:#}"), "pass": false}));
        println!("{key} {v}");
        report.insert(key.to_string(), v);
    };
    record("explicit_grad_d64", grad_case(dev, 64));
    record("explicit_grad_d128", grad_case(dev, 128));
    let tiny = target_config(256, (4, 2), 64, 768);
    record(
        "explicit_speed_tiny_recipe",
        case(dev, tiny, 2, false, &[740; 8], 256).and_then(|c| speed(dev, "tiny recipe", c)),
    );
    let eight_b = target_config(4096, (32, 8), 128, 12288);
    record(
        "explicit_speed_8b_recipe",
        case(dev, eight_b, 5, false, &[2048], 512).and_then(|c| speed(dev, "8B recipe", c)),
    );
    Ok(Value::Object(report))
}
