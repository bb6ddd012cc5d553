//! `truncate` and `compact` leave the cache exactly as a from-scratch prefill of the committed
//! tokens would: the next forward's logits and the cached K/V agree to f32 noise.

use candle_core::{DType, Device, Tensor};
use dflash_models::{AttnPattern, OpsMode, Qwen3Model, SeqForward, SequenceCache};
use dflash_tests::{demo_model, max_abs_diff};

fn model() -> Qwen3Model {
    Qwen3Model::load(&demo_model(), DType::F32, &Device::Cpu, 256, OpsMode::Fused).unwrap()
}

fn run(
    m: &Qwen3Model,
    cache: &mut SequenceCache,
    tokens: &[u32],
    positions: &[u32],
    pattern: &AttnPattern,
) -> Tensor {
    let rows: Vec<usize> = (0..tokens.len()).collect();
    m.forward(
        &mut [SeqForward {
            cache,
            tokens,
            positions,
            pattern,
            logit_rows: &rows,
        }],
        &[],
    )
    .unwrap()
    .logits
    .unwrap()
}

fn scratch(m: &Qwen3Model, tokens: &[u32]) -> SequenceCache {
    let mut c = m.new_cache(128).unwrap();
    let pos: Vec<u32> = (0..tokens.len() as u32).collect();
    run(m, &mut c, tokens, &pos, &AttnPattern::Causal);
    c
}

fn probe(m: &Qwen3Model, cache: &mut SequenceCache) -> Tensor {
    let p = cache.len() as u32;
    run(
        m,
        cache,
        &[42, 7, 1999],
        &[p, p + 1, p + 2],
        &AttnPattern::Causal,
    )
}

const PROMPT: [u32; 9] = [8187, 1723, 198, 1865, 324, 921, 621, 480, 43];

#[test]
fn truncate_equals_recompute_from_scratch() {
    let m = model();
    let mut c = scratch(&m, &PROMPT);
    let pos: Vec<u32> = (9..15).collect();
    run(&m, &mut c, &[5, 6, 7, 8, 9, 10], &pos, &AttnPattern::Causal);
    c.truncate(11).unwrap();
    let mut committed = PROMPT.to_vec();
    committed.extend_from_slice(&[5, 6]);
    let mut fresh = scratch(&m, &committed);
    let d = max_abs_diff(&probe(&m, &mut c), &probe(&m, &mut fresh));
    assert!(d < 1e-4, "logits after truncate differ by {d}");
    assert!(
        c.truncate(99).is_err(),
        "truncating beyond the live rows is refused"
    );
}

#[test]
fn compact_of_accepted_tree_path_equals_recompute_from_scratch() {
    let m = model();
    let mut c = scratch(&m, &PROMPT);
    // root(100) -> {a(200), b(300)}; a -> c(400); b -> d(500) -> e(600)
    let tokens = [100, 200, 300, 400, 500, 600];
    let parents = vec![None, Some(0), Some(0), Some(1), Some(2), Some(4)];
    let depth = [0u32, 1, 1, 2, 2, 3];
    let pos: Vec<u32> = depth.iter().map(|d| 9 + d).collect();
    let logits = run(&m, &mut c, &tokens, &pos, &AttnPattern::Tree { parents });
    // Accept root -> b -> d -> e (rows 9, 11, 13, 14 in the cache).
    c.compact(9, &[9, 11, 13, 14]).unwrap();
    assert_eq!(c.len(), 13);
    let mut committed = PROMPT.to_vec();
    committed.extend_from_slice(&[100, 300, 500, 600]);
    let mut fresh = scratch(&m, &committed);
    // The tree forward's logits on the accepted path equal a causal pass over that path.
    let rows = Tensor::new(&[0u32, 2, 4, 5], &Device::Cpu).unwrap();
    let fresh_tail = {
        let mut f = scratch(&m, &PROMPT);
        run(
            &m,
            &mut f,
            &[100, 300, 500, 600],
            &[9, 10, 11, 12],
            &AttnPattern::Causal,
        )
    };
    assert!(max_abs_diff(&logits.index_select(&rows, 0).unwrap(), &fresh_tail) < 1e-4);
    let d = max_abs_diff(&probe(&m, &mut c), &probe(&m, &mut fresh));
    assert!(d < 1e-4, "logits after compaction differ by {d}");
    assert!(
        c.compact(9, &[12, 10]).is_err(),
        "non-ascending rows are refused"
    );
}
