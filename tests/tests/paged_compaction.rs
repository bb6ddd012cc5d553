//! A tree verify whose rows cross a page boundary of the K/V pool, compacted to its accepted
//! path, leaves the cache as a from-scratch prefill of the committed tokens would (every
//! layer's K and V, and the next step's logits), with the sequence's pages out of order.

use candle_core::{DType, Device};
use dflash_models::cache::PAGE_SIZE;
use dflash_models::{AttnPattern, OpsMode, Qwen3Model, SeqForward, SequenceCache};
use dflash_tests::{demo_model, max_abs_diff};

fn forward(
    t: &Qwen3Model,
    cache: &mut SequenceCache,
    tokens: &[u32],
    positions: &[u32],
    pattern: &AttnPattern,
) -> candle_core::Tensor {
    let rows: Vec<usize> = (0..tokens.len()).collect();
    let out = t
        .forward(
            &mut [SeqForward {
                cache,
                tokens,
                positions,
                pattern,
                logit_rows: &rows,
            }],
            &[],
        )
        .unwrap();
    out.logits.unwrap()
}

#[test]
fn a_tree_path_compacted_across_a_page_boundary_equals_a_fresh_prefill() {
    let t = Qwen3Model::load(
        &demo_model(),
        DType::F32,
        &Device::Cpu,
        1024,
        OpsMode::Fused,
    )
    .unwrap();
    let pool = t.new_kv_pool(16).unwrap();
    // Pages 0 and 2 held while the sequence takes its own: they are 1, 3, 4, 5.
    let hold_a = t.new_cache_in(&pool, PAGE_SIZE).unwrap();
    let gap = t.new_cache_in(&pool, PAGE_SIZE).unwrap();
    let hold_b = t.new_cache_in(&pool, PAGE_SIZE).unwrap();
    drop(gap);
    let mut cache = t.new_cache_in(&pool, 4 * PAGE_SIZE).unwrap();
    assert_eq!(cache.page_table().pages(), &[1, 3, 4, 5]);
    drop((hold_a, hold_b));

    // A prompt ending 6 rows before the first page boundary.
    let start = PAGE_SIZE - 6;
    let prompt: Vec<u32> = (0..start as u32).map(|i| (i * 37 + 11) % 8000).collect();
    let pos: Vec<u32> = (0..start as u32).collect();
    forward(&t, &mut cache, &prompt, &pos, &AttnPattern::Causal);

    // A 12-node tree over rows start..start + 12; the accepted path 0-1-3-6-8-10-11 has depth
    // 6, so its rows end past the page boundary once compacted (start + 6 = PAGE_SIZE).
    let parents = vec![
        None,
        Some(0),
        Some(0),
        Some(1),
        Some(1),
        Some(2),
        Some(3),
        Some(3),
        Some(6),
        Some(6),
        Some(8),
        Some(10),
    ];
    let mut depth = vec![0u32; parents.len()];
    for (i, p) in parents.iter().enumerate() {
        depth[i] = p.map_or(0, |p| depth[p] + 1);
    }
    let tokens: Vec<u32> = (0..parents.len() as u32)
        .map(|i| (i * 611 + 5) % 8000)
        .collect();
    let positions: Vec<u32> = depth.iter().map(|d| start as u32 + d).collect();
    forward(
        &t,
        &mut cache,
        &tokens,
        &positions,
        &AttnPattern::Tree {
            parents: parents.clone(),
        },
    );
    let path = [0usize, 1, 3, 6, 8, 10, 11];
    let keep: Vec<usize> = path.iter().map(|&n| start + n).collect();
    cache.compact(start, &keep).unwrap();
    assert_eq!(cache.len(), start + path.len());

    // The committed tokens prefilled from scratch in a cache of its own.
    let mut committed = prompt.clone();
    committed.extend(path.iter().map(|&n| tokens[n]));
    let mut fresh = t.new_cache(4 * PAGE_SIZE).unwrap();
    let all: Vec<u32> = (0..committed.len() as u32).collect();
    forward(&t, &mut fresh, &committed, &all, &AttnPattern::Causal);
    for li in 0..cache.num_layers() {
        let (ka, va) = cache.view_kv(li, cache.len()).unwrap();
        let (kb, vb) = fresh.view_kv(li, fresh.len()).unwrap();
        let d = max_abs_diff(&ka, &kb).max(max_abs_diff(&va, &vb));
        assert!(d < 1e-4, "layer {li}: K/V differ by {d} after compaction");
    }
    // And the next step reads them alike.
    let next = [77u32];
    let p = [cache.len() as u32];
    let a = forward(&t, &mut cache, &next, &p, &AttnPattern::Causal);
    let b = forward(&t, &mut fresh, &next, &p, &AttnPattern::Causal);
    let d = max_abs_diff(&a, &b);
    assert!(d < 1e-4, "next-step logits differ by {d}");
}
