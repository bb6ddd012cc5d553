use super::*;

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
