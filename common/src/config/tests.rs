use super::*;
use crate::config_moe::tests::coder_30b_a3b;
use serde_json::json;

#[test]
fn default_layer_rule_matches_published_drafters() {
    for rule in [zlab_target_layer_ids, default_target_layer_ids] {
        assert_eq!(rule(36, 5), vec![1, 9, 17, 25, 33]);
        assert_eq!(rule(32, 5), vec![1, 8, 15, 22, 29]);
        assert_eq!(rule(40, 5), vec![1, 10, 19, 28, 37]);
        assert_eq!(rule(64, 5), vec![1, 16, 31, 46, 61]);
        assert_eq!(rule(36, 1), vec![18]);
        assert_eq!(rule(8, 5), vec![1, 2, 3, 4, 5]);
    }
}

#[test]
fn shallow_targets_get_distinct_taps_below_the_last_layer() {
    // The published rule repeats layer 1 on the 4-layer demo target.
    assert_eq!(zlab_target_layer_ids(4, 2), vec![1, 1]);
    assert_eq!(default_target_layer_ids(4, 2), vec![1, 2]);
    assert_eq!(default_target_layer_ids(4, 3), vec![0, 1, 2]);
    assert_eq!(default_target_layer_ids(7, 5), vec![1, 2, 3, 4, 5]);
    assert_eq!(default_target_layer_ids(3, 2), vec![0, 1]);
    assert_eq!(default_target_layer_ids(2, 1), vec![0]);
    assert_eq!(default_target_layer_ids(4, 1), vec![2]);
    for l in 2..12 {
        for n in 1..l {
            let ids = default_target_layer_ids(l, n);
            assert_eq!(ids.len(), n);
            assert!(
                ids.iter().all(|&i| i + 1 < l),
                "{l} layers, {n} taps: {ids:?}"
            );
            assert!(
                ids.windows(2).all(|w| w[0] < w[1]),
                "{l} layers, {n} taps: {ids:?}"
            );
        }
    }
    // No room below the last layer: every layer, the last included.
    assert_eq!(default_target_layer_ids(2, 2), vec![0, 1]);
}

#[test]
fn round_half_even_matches_python() {
    assert_eq!(round_half_even(2.5), 2.0);
    assert_eq!(round_half_even(3.5), 4.0);
    assert_eq!(round_half_even(1.2), 1.0);
}

/// The MoE keys reach the target config through `Qwen3Config::from_file`, by `model_type`.
#[test]
fn the_whole_target_config_parses_through_qwen3_config() {
    let dir = std::env::temp_dir().join(format!("dflash-moe-cfg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("config.json");
    std::fs::write(&file, coder_30b_a3b().to_string()).unwrap();
    let c = Qwen3Config::from_file(&file).unwrap();
    assert_eq!(c.intermediate_size, 6144);
    assert!(c.is_sparse(0) && c.is_sparse(47) && !c.is_sparse(48));
    // A drafter made for the MoE target has dense layers of the target's intermediate_size.
    let d = DFlashConfig::for_target(&c, 1, 16, 151669, None);
    assert!(d.layers.moe.is_none() && !d.layers.is_sparse(0));
    let mut dense = coder_30b_a3b();
    dense["model_type"] = json!("qwen3");
    std::fs::write(&file, dense.to_string()).unwrap();
    let e = Qwen3Config::from_file(&file).unwrap_err().to_string();
    assert!(e.contains("num_experts") && e.contains("qwen3_moe"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}
