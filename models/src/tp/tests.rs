//! TP=n computed rank by rank on the CPU against the unsplit model: the in-repo parity fixture
//! (4 query heads, 2 KV heads: TP=2 splits KV heads, TP=4 replicates them) and a seeded random
//! config whose heads split four and eight ways, through a prefill, a decode step and a tree
//! verify. Tolerance 1e-5 on f32 logits: the split only reorders the o_proj and down_proj sums;
//! a wrong split moves logits by far more (checked).

use std::path::Path;

use candle_core::{DType, Device, Tensor};
use dflash_common::{LayerType, Qwen3Config, RopeScaling};

use super::*;
use crate::batch::SeqForward;
use crate::layers::ops::OpsMode;

const TOL: f32 = 1e-5;
const PROMPT: [u32; 5] = [17, 803, 4095, 12, 7000];
const NEXT: u32 = 42;

fn fixture_model() -> Qwen3Model {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/qwen3-tiny-random");
    Qwen3Model::load(&dir, DType::F32, &Device::Cpu, 64, OpsMode::Fused).unwrap()
}

/// 8 query heads, 4 KV heads: TP=2 and 4 split both, TP=8 replicates each KV head twice.
fn random_cfg(heads: usize, kv_heads: usize, intermediate: usize) -> Qwen3Config {
    Qwen3Config {
        vocab_size: 256,
        hidden_size: 64,
        intermediate_size: intermediate,
        num_hidden_layers: 2,
        num_attention_heads: heads,
        num_key_value_heads: kv_heads,
        head_dim: 8,
        rms_norm_eps: 1e-6,
        rope_theta: 10000.0,
        rope_scaling: RopeScaling::Default,
        max_position_embeddings: 64,
        tie_word_embeddings: false,
        eos_token_ids: vec![],
        bos_token_id: None,
        layer_types: vec![LayerType::FullAttention; 2],
        sliding_window: None,
        moe: None,
    }
}

fn random_model() -> Qwen3Model {
    Qwen3Model::random(
        random_cfg(8, 4, 128),
        11,
        DType::F32,
        &Device::Cpu,
        64,
        OpsMode::Fused,
    )
    .unwrap()
}

/// One forward of a sequence: new tokens, their positions, their pattern.
type Step = (Vec<u32>, Vec<u32>, AttnPattern);

/// A prefill of `prompt`, a decode step of `next`, then a DDTree-style verify of four nodes
/// (a root, two children of it, a grandchild under the first) after them.
fn steps(prompt: &[u32], next: u32) -> Vec<Step> {
    let n = prompt.len() as u32;
    let parents = vec![None, Some(0), Some(0), Some(1)];
    vec![
        (prompt.to_vec(), (0..n).collect(), AttnPattern::Causal),
        (vec![next], vec![n], AttnPattern::Causal),
        (
            vec![next + 1, next + 2, next + 3, next + 4],
            vec![n + 1, n + 2, n + 2, n + 3],
            AttnPattern::Tree { parents },
        ),
    ]
}

/// The logits of every row of each step, from the unsplit model.
fn unsplit(model: &Qwen3Model, steps: &[Step]) -> Vec<Tensor> {
    let mut cache = model.new_cache(16).unwrap();
    let mut out = vec![];
    for (tokens, positions, pattern) in steps {
        let rows: Vec<usize> = (0..tokens.len()).collect();
        let mut batch = [SeqForward {
            cache: &mut cache,
            tokens,
            positions,
            pattern,
            logit_rows: &rows,
        }];
        out.push(model.forward(&mut batch, &[]).unwrap().logits.unwrap());
    }
    out
}

/// The same forwards through `shards`, every rank in turn.
fn split(shards: &[RankShard], steps: &[Step]) -> Vec<Tensor> {
    let mut caches: Vec<_> = shards.iter().map(|s| s.new_cache(16).unwrap()).collect();
    let mut out = vec![];
    for (tokens, positions, pattern) in steps {
        let rows: Vec<usize> = (0..tokens.len()).collect();
        let logits =
            forward_sequential(shards, &mut caches, tokens, positions, pattern, &rows).unwrap();
        out.push(logits);
    }
    let len: usize = steps.iter().map(|s| s.0.len()).sum();
    assert!(caches.iter().all(|c| c.len() == len));
    out
}

fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    assert_eq!(a.dims(), b.dims());
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

/// Max difference of the prefill, decode and tree-verify logits between the split and
/// unsplit forwards.
fn split_error(model: &Qwen3Model, shards: &[RankShard], prompt: &[u32], next: u32) -> f32 {
    let steps = steps(prompt, next);
    let full = unsplit(model, &steps);
    // Logits of order one, so 1e-5 is a real bound (the split measures about 2e-6).
    for l in &full {
        let scale = l.abs().unwrap().flatten_all().unwrap().max(0).unwrap();
        assert!(scale.to_scalar::<f32>().unwrap() > 1.0);
    }
    let tp = split(shards, &steps);
    full.iter()
        .zip(&tp)
        .map(|(a, b)| max_diff(a, b))
        .fold(0.0, f32::max)
}

#[test]
fn tp2_and_tp4_of_the_parity_fixture_equal_the_unsplit_model() {
    let model = fixture_model();
    for tp in [1, 2, 4] {
        let shards = shard_model(&model, tp).unwrap();
        let plan = &shards[0].plan;
        assert_eq!(
            (plan.q_heads, plan.intermediate, plan.vocab),
            (4 / tp, 128 / tp, 8192 / tp)
        );
        // 2 KV heads: split at TP=2, each replicated on two ranks at TP=4.
        assert_eq!(plan.kv_replicas, if tp == 4 { 2 } else { 1 });
        let d = split_error(&model, &shards, &PROMPT, NEXT);
        assert!(d < TOL, "tp = {tp}: logits differ by {d}");
    }
}

#[test]
fn tp2_4_8_of_a_random_model_with_divisible_heads_equal_the_unsplit_model() {
    let model = random_model();
    let prompt: Vec<u32> = PROMPT.iter().map(|t| t % 256).collect();
    for tp in [2, 4, 8] {
        let shards = shard_model(&model, tp).unwrap();
        assert_eq!(shards[0].plan.kv_heads, (4 / tp).max(1));
        let d = split_error(&model, &shards, &prompt, NEXT);
        assert!(d < TOL, "tp = {tp}: logits differ by {d}");
    }
}

#[test]
fn a_wrong_split_fails_the_comparison() {
    let model = fixture_model();
    let plan = TpPlan::new(model.config(), 2).unwrap();
    let shards_with = |swap: &'static [&'static str]| -> Vec<RankShard> {
        (0..2)
            .map(|r| {
                RankShard::with_split(&model, &plan, r, |name, t| {
                    // The swapped tensors take the other rank's slice.
                    let from = if swap.contains(&name) { 1 - r } else { r };
                    shard_tensor(&plan, from, name, t)
                })
                .unwrap()
            })
            .collect()
    };
    assert!(split_error(&model, &shards_with(&[]), &PROMPT, NEXT) < TOL);
    // Each rank's heads meet the other rank's o_proj columns.
    let d = split_error(
        &model,
        &shards_with(&["self_attn.o_proj.weight"]),
        &PROMPT,
        NEXT,
    );
    assert!(
        d > 0.1,
        "o_proj columns of the wrong heads pass (differ by {d})"
    );
    // Each rank's query heads read the other rank's KV head.
    let kv = &["self_attn.k_proj.weight", "self_attn.v_proj.weight"];
    let d = split_error(&model, &shards_with(kv), &PROMPT, NEXT);
    assert!(d > 0.1, "the wrong KV heads pass (differ by {d})");
    // down_proj split along its output rows instead of its intermediate columns is refused
    // by shape, not silently computed.
    let e = RankShard::with_split(&model, &plan, 0, |name, t| match name {
        "mlp.down_proj.weight" => Ok(t.narrow(0, 0, 32)?),
        _ => shard_tensor(&plan, 0, name, t),
    })
    .unwrap_err()
    .to_string();
    assert!(e.contains("down_proj"), "{e}");
}

#[test]
fn tp_values_that_cannot_split_the_model_are_refused_saying_why() {
    let model = fixture_model();
    let err = |m: &Qwen3Model, tp| shard_model(m, tp).unwrap_err();
    assert!(matches!(err(&model, 0), TpError::ZeroRanks));
    let e = err(&model, 3);
    assert!(matches!(e, TpError::QueryHeads { tp: 3, heads: 4 }), "{e}");
    assert!(e.to_string().contains("num_attention_heads = 4"), "{e}");
    assert!(matches!(err(&model, 8), TpError::QueryHeads { tp: 8, .. }));
    // 6 query heads, 4 KV heads, TP=3: 3 neither divides 4 nor is a multiple of it.
    let cfg = random_cfg(6, 4, 96);
    let e = TpPlan::new(&cfg, 3).unwrap_err();
    assert!(matches!(e, TpError::KvHeads { tp: 3, kv_heads: 4 }), "{e}");
    assert!(e.to_string().contains("num_key_value_heads = 4"), "{e}");
    let e = TpPlan::new(&random_cfg(8, 4, 100), 8).unwrap_err();
    assert!(e.to_string().contains("intermediate_size = 100"), "{e}");
    // A rank's pieces refuse another plan's rank count.
    let shards = shard_model(&model, 2).unwrap();
    let mut caches = vec![shards[0].new_cache(8).unwrap()];
    let e = forward_sequential(&shards, &mut caches, &[1], &[0], &AttnPattern::Causal, &[0]);
    assert!(matches!(e, Err(TpError::RankCount { what: "caches", .. })));
}
