//! The drafter's training forward (`DFlashDrafter::train_hidden`, all anchors of a sequence in
//! one pass under the sparse block mask) against two references:
//!
//! 1. the inference forward of the models crate (`draft_logits` with fused kernels and a cache
//!    holding exactly the context before the anchor), per anchor, for full-attention and for
//!    mixed sliding/full drafters. f32 on the CPU; tolerance 1e-4 max abs on logits, the same
//!    bound as the z-lab parity test (the two paths differ only in kernel choice and
//!    summation order, ~1e-6 here).
//! 2. central finite differences of the training loss, for every parameter tensor (fc,
//!    hidden_norm, each layer's q/k/v/o projections, q/k norms, both layer norms, the three MLP
//!    matrices, the final norm). Each tensor is checked along one direction that mixes its
//!    gradient direction with a random one, in f32 with step 1e-2: truncation (~eps^2) and f32
//!    round-off of the loss (~1e-6 / eps) each stay near 1e-4 (measured: at most 1.3e-4 on
//!    derivatives of 0.03-1.5), so the bound is 0.5% relative plus 1e-4 absolute, far below
//!    what a wrong or missing gradient produces.

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor, Var};
use dflash_common::{DFlashConfig, LayerType, Qwen3Config, RopeScaling};
use dflash_models::{
    DFlashDrafter, DraftInput, OpsMode, Qwen3Model, TargetEmbeddingsAndHead, TrainAttention,
    TrainSequence,
};
use dflash_train::train::dataset::Example;
use dflash_train::train::loss::{weighted_cross_entropy, BlockTargets};

const VOCAB: usize = 64;
const MASK: u32 = 63;

fn target_cfg() -> Qwen3Config {
    Qwen3Config {
        vocab_size: VOCAB,
        hidden_size: 16,
        intermediate_size: 24,
        num_hidden_layers: 4,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 8,
        rms_norm_eps: 1e-6,
        rope_theta: 10_000.0,
        rope_scaling: RopeScaling::Default,
        max_position_embeddings: 128,
        tie_word_embeddings: false,
        eos_token_ids: vec![],
        bos_token_id: None,
        layer_types: vec![LayerType::FullAttention; 4],
        sliding_window: None,
        moe: None,
    }
}

fn drafter_cfg(sliding: bool) -> DFlashConfig {
    let mut cfg = DFlashConfig::for_target(&target_cfg(), 2, 4, MASK, Some(vec![1, 2]));
    if sliding {
        cfg.layers.layer_types = vec![LayerType::SlidingAttention, LayerType::FullAttention];
        cfg.layers.sliding_window = Some(3);
    }
    cfg
}

fn target() -> Qwen3Model {
    Qwen3Model::random(
        target_cfg(),
        1,
        DType::F32,
        &Device::Cpu,
        64,
        OpsMode::Fused,
    )
    .unwrap()
}

fn max_abs(a: &Tensor, b: &Tensor) -> f32 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar()
        .unwrap()
}

fn sequence(len: usize) -> (Tensor, Vec<u32>) {
    let features = Tensor::randn(0f32, 1.0, (len, 32), &Device::Cpu).unwrap();
    let tokens = (0..len as u32).map(|i| (i * 7 + 3) % 60).collect();
    (features, tokens)
}

fn check_against_inference(sliding: bool) {
    let target = target();
    let inference =
        DFlashDrafter::random(drafter_cfg(sliding), &target, 5, OpsMode::Fused).unwrap();
    let tensors: HashMap<String, Tensor> = inference.named_tensors().into_iter().collect();
    let training = DFlashDrafter::from_tensors(
        drafter_cfg(sliding),
        &tensors,
        &TargetEmbeddingsAndHead::of(&target),
        OpsMode::Differentiable,
    )
    .unwrap();
    let (features, tokens) = sequence(12);
    let anchors = [1, 2, 5, 9, 11];
    let logits = training
        .train_draft_logits(&[TrainSequence {
            features: &features,
            tokens: &tokens,
            anchors: &anchors,
        }])
        .unwrap();
    assert_eq!(logits.dims(), &[anchors.len() * 3, VOCAB]);
    for (n, &a) in anchors.iter().enumerate() {
        let mut cache = inference.new_cache(32).unwrap();
        let context = features.narrow(0, 0, a).unwrap();
        let block = [tokens[a], MASK, MASK, MASK];
        let want = inference
            .draft_logits(&mut [DraftInput {
                cache: &mut cache,
                context: Some(&context),
                block: &block,
            }])
            .unwrap();
        let got = logits.narrow(0, n * 3, 3).unwrap();
        let d = max_abs(&got, &want);
        assert!(
            d < 1e-4,
            "anchor {a} (sliding: {sliding}): logits differ by {d}"
        );
    }
}

#[test]
fn training_forward_matches_inference_for_every_anchor() {
    check_against_inference(false);
}

#[test]
fn training_forward_matches_inference_with_sliding_layers() {
    check_against_inference(true);
}

#[test]
fn two_sequences_in_one_batch_equal_two_single_batches() {
    let target = target();
    let d = DFlashDrafter::random(drafter_cfg(false), &target, 5, OpsMode::Differentiable).unwrap();
    let (f1, t1) = sequence(10);
    let (f2, t2) = sequence(7);
    let (a1, a2) = ([3usize, 8], [1usize, 4, 6]);
    let s1 = TrainSequence {
        features: &f1,
        tokens: &t1,
        anchors: &a1,
    };
    let s2 = TrainSequence {
        features: &f2,
        tokens: &t2,
        anchors: &a2,
    };
    let both = d.train_hidden(&[s1, s2]).unwrap();
    let one = d.train_hidden(&[s1]).unwrap();
    let two = d.train_hidden(&[s2]).unwrap();
    let split = Tensor::cat(&[&one, &two], 0).unwrap();
    assert!(max_abs(&both, &split) < 1e-5);
}

fn loss_of(
    cfg: &DFlashConfig,
    tensors: &HashMap<String, Tensor>,
    parts: &TargetEmbeddingsAndHead,
    ex: &Example,
    features: &Tensor,
    anchors: &[usize],
    targets: &BlockTargets,
) -> Tensor {
    let d =
        DFlashDrafter::from_tensors(cfg.clone(), tensors, parts, OpsMode::Differentiable).unwrap();
    let hidden = d
        .train_hidden(&[TrainSequence {
            features,
            tokens: &ex.tokens,
            anchors,
        }])
        .unwrap();
    let rows = Tensor::new(targets.rows.as_slice(), &Device::Cpu).unwrap();
    let logits = d.lm_head(&hidden.index_select(&rows, 0).unwrap()).unwrap();
    weighted_cross_entropy(&logits, targets, targets.total_weight(), &Device::Cpu).unwrap()
}

#[test]
fn training_loss_gradients_match_finite_differences_for_every_parameter() {
    let target = target();
    let cfg = drafter_cfg(true);
    let parts = TargetEmbeddingsAndHead::of(&target);
    let init = DFlashDrafter::random(cfg.clone(), &target, 9, OpsMode::Differentiable).unwrap();
    let vars: Vec<(String, Var)> = init
        .named_tensors()
        .into_iter()
        .map(|(n, t)| (n, Var::from_tensor(&t).unwrap()))
        .collect();
    assert_eq!(
        vars.len(),
        3 + 2 * 11,
        "every drafter tensor is a parameter"
    );
    let (features, tokens) = sequence(14);
    let ex = Example {
        loss_mask: vec![1; tokens.len()],
        tokens,
    };
    let anchors = [2usize, 6, 10, 12];
    let mut targets = BlockTargets::default();
    targets.push(&ex, &anchors, cfg.block_size, 7.0);

    let tensors: HashMap<String, Tensor> = vars
        .iter()
        .map(|(n, v)| (n.clone(), v.as_tensor().clone()))
        .collect();
    let loss = loss_of(&cfg, &tensors, &parts, &ex, &features, &anchors, &targets);
    let grads = loss.backward().unwrap();
    let eps = 1e-2f64;
    for (name, var) in &vars {
        let g = grads
            .get(var.as_tensor())
            .unwrap_or_else(|| panic!("no gradient reaches `{name}`"));
        let g_unit = (g / g
            .sqr()
            .unwrap()
            .sum_all()
            .unwrap()
            .sqrt()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap() as f64)
            .unwrap();
        let r = Tensor::randn(0f32, 1.0, g.shape(), &Device::Cpu).unwrap();
        let r_unit = (&r
            / r.sqr()
                .unwrap()
                .sum_all()
                .unwrap()
                .sqrt()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap() as f64)
            .unwrap();
        let u = (g_unit + r_unit).unwrap();
        let analytic = (g * &u)
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap() as f64;
        let at = |sign: f64| {
            let mut t = tensors.clone();
            let moved = (var.as_tensor().detach() + (&u * (sign * eps)).unwrap()).unwrap();
            t.insert(name.clone(), moved);
            loss_of(&cfg, &t, &parts, &ex, &features, &anchors, &targets)
                .to_scalar::<f32>()
                .unwrap() as f64
        };
        let numeric = (at(1.0) - at(-1.0)) / (2.0 * eps);
        let err = (analytic - numeric).abs();
        assert!(
            err < 5e-3 * analytic.abs().max(numeric.abs()) + 1e-4,
            "`{name}`: autograd {analytic:.6} vs finite differences {numeric:.6}"
        );
    }
}

/// The fused attention op (`TrainAttention::Fused`; on the CPU its f32 reference) trains as
/// the composed grouped attention: the same loss and the same gradient of every parameter
/// tensor to 1e-5 (relative to the tensor's largest entry; f32 summation order only), for a
/// drafter of one sliding and one full layer and two sequences of different lengths in one
/// batch.
#[test]
fn fused_attention_gives_the_composed_loss_and_gradients() {
    let target = target();
    let cfg = drafter_cfg(true);
    let init = DFlashDrafter::random(cfg.clone(), &target, 11, OpsMode::Differentiable).unwrap();
    let (f1, t1) = sequence(14);
    let (f2, t2) = sequence(9);
    let (a1, a2) = ([1usize, 6, 10, 12], [2usize, 5, 8]);
    let mut targets = BlockTargets::default();
    for (t, a) in [(&t1, &a1[..]), (&t2, &a2[..])] {
        let ex = Example {
            loss_mask: vec![1; t.len()],
            tokens: t.clone(),
        };
        targets.push(&ex, a, cfg.block_size, 7.0);
    }
    let run = |attention: TrainAttention| {
        let vars: Vec<(String, Var)> = init
            .named_tensors()
            .into_iter()
            .map(|(n, t)| (n, Var::from_tensor(&t).unwrap()))
            .collect();
        let tensors: HashMap<String, Tensor> = vars
            .iter()
            .map(|(n, v)| (n.clone(), v.as_tensor().clone()))
            .collect();
        let d = DFlashDrafter::from_tensors(
            cfg.clone(),
            &tensors,
            &TargetEmbeddingsAndHead::of(&target),
            OpsMode::Differentiable,
        )
        .unwrap();
        let seqs = [
            TrainSequence {
                features: &f1,
                tokens: &t1,
                anchors: &a1,
            },
            TrainSequence {
                features: &f2,
                tokens: &t2,
                anchors: &a2,
            },
        ];
        let hidden = d.train_hidden_with(&seqs, attention).unwrap();
        let rows = Tensor::new(targets.rows.as_slice(), &Device::Cpu).unwrap();
        let logits = d.lm_head(&hidden.index_select(&rows, 0).unwrap()).unwrap();
        let loss = weighted_cross_entropy(&logits, &targets, targets.total_weight(), &Device::Cpu)
            .unwrap();
        let grads = loss.backward().unwrap();
        let g: Vec<(String, Tensor)> = vars
            .iter()
            .map(|(n, v)| {
                let g = grads
                    .get(v.as_tensor())
                    .unwrap_or_else(|| panic!("{attention:?}: no gradient reaches `{n}`"));
                (n.clone(), g.clone())
            })
            .collect();
        (loss.to_scalar::<f32>().unwrap(), g)
    };
    let (fused_loss, fused) = run(TrainAttention::Fused);
    let (composed_loss, composed) = run(TrainAttention::Composed);
    assert!(
        (fused_loss - composed_loss).abs() <= 1e-5 * composed_loss.abs(),
        "loss: fused {fused_loss} vs composed {composed_loss}"
    );
    for ((name, a), (_, b)) in fused.iter().zip(&composed) {
        let scale = b.abs().unwrap().flatten_all().unwrap().max(0).unwrap();
        let scale = scale.to_scalar::<f32>().unwrap().max(1e-6);
        let err = max_abs(a, b);
        assert!(
            err <= 2e-5 * scale + 1e-7,
            "`{name}`: fused and composed gradients differ by {err} (largest {scale})"
        );
    }
}
