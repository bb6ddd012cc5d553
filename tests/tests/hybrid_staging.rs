//! The compact staging of rollback-able hybrid forwards (`cache::recurrent`): a tree verify
//! stages the rows' delta-rule inputs, not a state per node, in exactly the bytes
//! `HybridConfig::staged_bytes_per_verified_row_per_layer` reports; committing a deep branch,
//! or extending and truncating an uncommitted chain, rebuilds the state a from-scratch prefill
//! makes (f32, 1e-4); and at the Qwen3.6-27B shape a 64-node tree stages under 1 GB.

use dflash_common::HybridConfig;
use dflash_models::cache::LayerCache;
use dflash_models::{AttnPattern, Qwen35Model, SeqForward, SequenceCache};
use dflash_tests::{max_abs_diff, single_threaded_tensor_ops, tiny_hybrid};

fn fwd(
    m: &Qwen35Model,
    cache: &mut SequenceCache,
    tokens: &[u32],
    positions: &[u32],
    pattern: &AttnPattern,
) {
    m.forward(
        &mut [SeqForward {
            cache,
            tokens,
            positions,
            pattern,
            logit_rows: &[],
        }],
        &[],
    )
    .unwrap();
}

/// Every GDN layer's committed state in `cache` equals a fresh prefill of `tokens`.
fn assert_state_is_recomputed(m: &Qwen35Model, cache: &SequenceCache, tokens: &[u32], what: &str) {
    assert_eq!(cache.len(), tokens.len(), "{what}");
    let mut fresh = m.new_cache(64).unwrap();
    let pos: Vec<u32> = (0..tokens.len() as u32).collect();
    fwd(m, &mut fresh, tokens, &pos, &AttnPattern::Causal);
    let mut gdn = 0;
    for li in 0..cache.num_layers() {
        if let (LayerCache::Recurrent(a), LayerCache::Recurrent(b)) =
            (cache.layer(li), fresh.layer(li))
        {
            let (a, b) = (a.last().unwrap(), b.last().unwrap());
            let d_ssm = max_abs_diff(&a.ssm, &b.ssm);
            let d_conv = max_abs_diff(&a.conv, &b.conv);
            assert!(
                d_ssm < 1e-4 && d_conv < 1e-4,
                "{what}: layer {li} differs from recomputation (ssm {d_ssm}, conv {d_conv})"
            );
            gdn += 1;
        }
    }
    assert!(gdn > 0);
}

const PROMPT: [u32; 5] = [3, 17, 42, 8, 61];

/// A prompt of 5 committed tokens in a cache whose forwards of up to 16 rows stay
/// rollback-able.
fn prefilled(m: &Qwen35Model) -> SequenceCache {
    let mut cache = m.new_cache_with_rollback(64, 16).unwrap();
    fwd(
        m,
        &mut cache,
        &PROMPT,
        &[0, 1, 2, 3, 4],
        &AttnPattern::Causal,
    );
    cache.settle().unwrap();
    cache
}

#[test]
fn a_tree_verify_stages_inputs_only_and_committing_a_deep_branch_rebuilds_its_state() {
    single_threaded_tensor_ops();
    let m = tiny_hybrid(13);
    let cfg = m.config().clone();
    let mut cache = prefilled(&m);
    let start = cache.len();
    // Two depth-6 spines under the root, side children at depths 2, 2 and 4.
    let parents = vec![
        None,
        Some(0),
        Some(1),
        Some(2),
        Some(3),
        Some(4),
        Some(0),
        Some(6),
        Some(7),
        Some(8),
        Some(9),
        Some(10),
        Some(1),
        Some(7),
        Some(3),
    ];
    let t = parents.len();
    let mut depth = vec![0u32; t];
    for i in 0..t {
        depth[i] = parents[i].map_or(0, |p: usize| depth[p] + 1);
    }
    let tokens: Vec<u32> = (0..t as u32).map(|i| (i * 37 + 5) % 96).collect();
    let positions: Vec<u32> = depth.iter().map(|d| start as u32 + d).collect();
    let tree = AttnPattern::Tree {
        parents: parents.clone(),
    };
    fwd(&m, &mut cache, &tokens, &positions, &tree);

    let per_row = cfg.staged_bytes_per_verified_row_per_layer(4);
    let full_state = cfg.recurrent_state_bytes_per_layer(4);
    assert!(per_row < full_state);
    for li in 0..cache.num_layers() {
        if let LayerCache::Recurrent(r) = cache.layer(li) {
            assert_eq!(r.staged_rows(), t, "layer {li}");
            assert_eq!(r.staged_full_states(), 0, "layer {li} staged full states");
            assert_eq!(r.staged_bytes(), t * per_row, "layer {li} staged bytes");
            assert!(
                r.last().is_err(),
                "an uncommitted tree has no single last state"
            );
        }
    }

    // The second spine, to its deepest node.
    let branch = [0usize, 6, 7, 8, 9, 10, 11];
    let keep: Vec<usize> = branch.iter().map(|&n| start + n).collect();
    cache.compact(start, &keep).unwrap();
    for li in 0..cache.num_layers() {
        if let LayerCache::Recurrent(r) = cache.layer(li) {
            assert_eq!(r.staged_rows(), 0, "layer {li} keeps rows after the commit");
            assert_eq!(r.staged_bytes(), 0);
        }
    }
    let mut committed = PROMPT.to_vec();
    committed.extend(branch.iter().map(|&n| tokens[n]));
    assert_state_is_recomputed(&m, &cache, &committed, "deep branch");
}

#[test]
fn an_uncommitted_chain_extends_from_its_rebuilt_state_and_truncates_to_any_row() {
    single_threaded_tensor_ops();
    let m = tiny_hybrid(17);
    let mut cache = prefilled(&m);
    let chain: Vec<u32> = vec![9, 33, 70, 2];
    fwd(&m, &mut cache, &chain, &[5, 6, 7, 8], &AttnPattern::Causal);
    // The next forward continues from the state after row 8, built from the staged inputs.
    fwd(&m, &mut cache, &[55, 12], &[9, 10], &AttnPattern::Causal);
    let mut all = PROMPT.to_vec();
    all.extend(&chain);
    all.extend([55, 12]);
    for li in 0..cache.num_layers() {
        if let LayerCache::Recurrent(r) = cache.layer(li) {
            assert_eq!(r.staged_rows(), 6);
            assert_eq!(r.staged_full_states(), 0);
        }
    }
    // Back into the first forward's rows, then a commit of what is left.
    cache.truncate(7).unwrap();
    cache.compact(7, &[]).unwrap();
    assert_state_is_recomputed(&m, &cache, &all[..7], "truncated chain");
    // A later verify from the commit, settled in full.
    fwd(
        &m,
        &mut cache,
        &[4, 4, 90],
        &[7, 8, 9],
        &AttnPattern::Causal,
    );
    cache.settle().unwrap();
    let mut settled = all[..7].to_vec();
    settled.extend([4, 4, 90]);
    assert_state_is_recomputed(&m, &cache, &settled, "settled chain");
}

#[test]
fn a_chain_longer_than_a_chunk_stages_inputs_and_commits_any_row() {
    single_threaded_tensor_ops();
    let m = tiny_hybrid(19);
    let mut cache = m.new_cache_with_rollback(96, 80).unwrap();
    let tokens: Vec<u32> = (0..75u32).map(|i| (i * 53 + 11) % 96).collect();
    let pos: Vec<u32> = (0..75).collect();
    fwd(&m, &mut cache, &tokens, &pos, &AttnPattern::Causal);
    for li in 0..cache.num_layers() {
        if let LayerCache::Recurrent(r) = cache.layer(li) {
            assert_eq!(r.staged_rows(), 75);
            assert_eq!(r.staged_full_states(), 0);
        }
    }
    cache.compact(40, &[40, 41, 42]).unwrap();
    assert_state_is_recomputed(&m, &cache, &tokens[..43], "long chain");
}

#[test]
fn a_64_node_tree_at_the_qwen3_6_27b_shape_stages_under_1_gb_per_sequence() {
    let layer_types: Vec<&str> = (0..64)
        .map(|i| {
            if (i + 1) % 4 == 0 {
                "full_attention"
            } else {
                "linear_attention"
            }
        })
        .collect();
    let v = serde_json::json!({
        "model_type": "qwen3_5_text", "vocab_size": 248320, "hidden_size": 5120,
        "intermediate_size": 17408, "num_hidden_layers": 64, "num_attention_heads": 24,
        "num_key_value_heads": 4, "head_dim": 256, "linear_num_key_heads": 16,
        "linear_num_value_heads": 48, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4, "layer_types": layer_types, "max_position_embeddings": 262144,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25}
    });
    let cfg = HybridConfig::from_value(std::path::Path::new("qwen3.6-27b-shape"), &v).unwrap();
    assert_eq!(cfg.num_linear_layers(), 48);
    // bf16 pre-conv rows, as served.
    let staged = 64 * cfg.staged_bytes_per_verified_row(2);
    let per_node_state = cfg.num_linear_layers() * cfg.recurrent_state_bytes_per_layer(2);
    assert!(
        staged < 1_000_000_000,
        "a 64-node tree stages {staged} bytes per sequence"
    );
    // The full-state staging this replaces: 147 MiB a node, 9.4 GB for the tree.
    assert!(64 * per_node_state > 9_000_000_000);
    assert!(staged * 50 < 64 * per_node_state);
}
