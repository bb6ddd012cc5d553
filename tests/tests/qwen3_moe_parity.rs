//! Qwen3 MoE target parity against transformers 5.24.0 (`Qwen3MoeForCausalLM`, eager attention,
//! eager experts loop, CPU, float32) on the random 4-layer fixture in
//! `tests/fixtures/qwen3_moe-tiny-random` (`make_qwen3_moe_parity.py`): layers sparse, dense
//! (through `mlp_only_layers`), sparse, sparse; 8 experts of width 32, top-2 renormalised
//! (`norm_topk_prob`), no shared expert; stored as the Qwen3-30B-A3B releases are (one tensor per
//! expert). Every routed token's gap between its 2nd and 3rd router probability is > 2.5e-4, so
//! f32 noise cannot change an expert choice, while a wrong routing (softmax after top-k, missing
//! renormalisation, the dense layer run as sparse) moves the outputs far past the tolerance.
//!
//! Tolerance 1e-4 max abs, as for the other families: transformers' own prefill, decode and
//! two-chunk paths agree with each other to 2.2e-6.

use candle_core::{DType, Device, Tensor};
use dflash_models::{AttnPattern, OpsMode, Qwen3Model, SeqForward, SequenceCache, Target};
use dflash_tests::{fixture, ids, load_expected, max_abs_diff};

const TOL: f32 = 1e-4;
const NAME: &str = "qwen3_moe-tiny-random";

fn model() -> Qwen3Model {
    Qwen3Model::load(
        &fixture(NAME),
        DType::F32,
        &Device::Cpu,
        128,
        OpsMode::Fused,
    )
    .unwrap()
}

fn run(m: &Qwen3Model, cache: &mut SequenceCache, tokens: &[u32]) -> (Tensor, Tensor) {
    // Every layer but the last, whose tap is the final-normed output (`dflash_models::taps`);
    // the fixture's taps are raw layer outputs.
    let layers: Vec<usize> = (0..m.config().num_hidden_layers - 1).collect();
    let start = cache.len() as u32;
    let positions: Vec<u32> = (start..start + tokens.len() as u32).collect();
    let rows: Vec<usize> = (0..tokens.len()).collect();
    let out = m
        .forward(
            &mut [SeqForward {
                cache,
                tokens,
                positions: &positions,
                pattern: &AttnPattern::Causal,
                logit_rows: &rows,
            }],
            &layers,
        )
        .unwrap();
    (out.logits.unwrap(), out.taps.unwrap())
}

/// `[L, T, H]` reference raw layer outputs against our `[T, (L - 1) * H]`.
fn check_taps(ours: &Tensor, theirs: &Tensor, what: &str) {
    let h = theirs.dim(2).unwrap();
    for l in 0..theirs.dim(0).unwrap() - 1 {
        let d = max_abs_diff(&ours.narrow(1, l * h, h).unwrap(), &theirs.get(l).unwrap());
        assert!(d < TOL, "{what}: tap of layer {l} differs by {d}");
    }
}

#[test]
fn the_fixture_mixes_dense_and_sparse_layers_and_loads_as_a_qwen3_target() {
    let m = model();
    let cfg = m.config();
    let kinds: Vec<bool> = (0..cfg.num_hidden_layers)
        .map(|i| cfg.is_sparse(i))
        .collect();
    assert_eq!(kinds, vec![true, false, true, true]);
    let moe = &cfg.moe.as_ref().unwrap().block;
    assert_eq!((moe.num_experts, moe.num_experts_per_tok), (8, 2));
    assert!(moe.norm_topk_prob && moe.shared_expert_intermediate_size.is_none());
    // The family dispatch sends qwen3_moe to the Qwen3 target, not the hybrid one.
    let t = Target::load(&fixture(NAME), DType::F32, &Device::Cpu, 64, OpsMode::Fused).unwrap();
    assert!(t.as_qwen3().is_some());
    assert!(t.supports_prefix_cache());
}

#[test]
fn prefill_logits_and_taps_match_transformers() {
    let exp = load_expected(NAME);
    let tokens = ids(&exp["tokens"]);
    let m = model();
    let mut cache = m.new_cache(128).unwrap();
    let (logits, taps) = run(&m, &mut cache, &tokens);
    let d = max_abs_diff(&logits, &exp["prefill_logits"]);
    assert!(d < TOL, "prefill logits differ by {d}");
    check_taps(&taps, &exp["prefill_taps"], "prefill");
}

#[test]
fn token_by_token_decode_matches_transformers() {
    let exp = load_expected(NAME);
    let tokens = ids(&exp["tokens"]);
    let m = model();
    let mut cache = m.new_cache(128).unwrap();
    run(&m, &mut cache, &tokens[..5]);
    let (mut logits, mut taps) = (Vec::new(), Vec::new());
    for i in 5..17 {
        let (l, t) = run(&m, &mut cache, &tokens[i..i + 1]);
        logits.push(l);
        taps.push(t);
    }
    let d = max_abs_diff(&Tensor::cat(&logits, 0).unwrap(), &exp["decode_logits"]);
    assert!(d < TOL, "decode logits differ by {d}");
    check_taps(
        &Tensor::cat(&taps, 0).unwrap(),
        &exp["decode_taps"],
        "decode",
    );
}

#[test]
fn chunked_prefill_continued_from_the_cache_matches_transformers() {
    let exp = load_expected(NAME);
    let tokens = ids(&exp["tokens"]);
    let m = model();
    let mut cache = m.new_cache(128).unwrap();
    run(&m, &mut cache, &tokens[..40]);
    let (logits, _) = run(&m, &mut cache, &tokens[40..]);
    let d = max_abs_diff(&logits, &exp["chunk2_logits"]);
    assert!(d < TOL, "second chunk's logits differ by {d}");
}

/// Verify forwards batch sequences (and tree nodes) into one matrix; routing is per row, so a
/// batch of two prompts gives each what it gets alone.
#[test]
fn a_batch_of_two_sequences_gives_each_its_own_logits() {
    let exp = load_expected(NAME);
    let tokens = ids(&exp["tokens"]);
    let m = model();
    let (a, b) = (&tokens[..30], &tokens[30..52]);
    let (mut ca, mut cb) = (m.new_cache(64).unwrap(), m.new_cache(64).unwrap());
    let (pa, pb): (Vec<u32>, Vec<u32>) = ((0..30).collect(), (0..22).collect());
    let (ra, rb): (Vec<usize>, Vec<usize>) = ((0..30).collect(), (0..22).collect());
    let out = m
        .forward(
            &mut [
                SeqForward {
                    cache: &mut ca,
                    tokens: a,
                    positions: &pa,
                    pattern: &AttnPattern::Causal,
                    logit_rows: &ra,
                },
                SeqForward {
                    cache: &mut cb,
                    tokens: b,
                    positions: &pb,
                    pattern: &AttnPattern::Causal,
                    logit_rows: &rb,
                },
            ],
            &[],
        )
        .unwrap();
    let logits = out.logits.unwrap();
    let d = max_abs_diff(
        &logits.narrow(0, 0, 30).unwrap(),
        &exp["prefill_logits"].narrow(0, 0, 30).unwrap(),
    );
    assert!(d < TOL, "first sequence differs from the reference by {d}");
    let mut alone = m.new_cache(64).unwrap();
    let (lb, _) = run(&m, &mut alone, b);
    let d = max_abs_diff(&logits.narrow(0, 30, 22).unwrap(), &lb);
    assert!(
        d < 1e-5,
        "second sequence differs from its own forward by {d}"
    );
}

/// A config that disagrees with the weights about which layers are sparse is refused at load,
/// naming the layer and the keys to check, instead of reporting a missing dense tensor.
#[test]
fn a_dense_layer_over_a_router_in_the_checkpoint_is_refused_by_name() {
    let dir = std::env::temp_dir().join(format!("dflash-qwen3-moe-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = fixture(NAME);
    std::fs::copy(src.join("model.safetensors"), dir.join("model.safetensors")).unwrap();
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    cfg["mlp_only_layers"] = serde_json::json!([0, 1]);
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    let e = Qwen3Model::load(&dir, DType::F32, &Device::Cpu, 64, OpsMode::Fused)
        .unwrap_err()
        .to_string();
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(
        e.contains("model.layers.0.mlp") && e.contains("mlp_only_layers"),
        "{e}"
    );
}
