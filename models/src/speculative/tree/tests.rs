use super::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha20Rng;
use std::collections::BTreeSet;

#[test]
fn padding_keeps_the_real_entries_and_the_chain_shape() {
    let chain = chain_tree(7, &[10, 11, 12]);
    let padded = chain.padded_to(16).unwrap();
    assert_eq!(padded.len(), 16);
    assert!(
        padded.is_chain(),
        "a padded chain is still a chain (causal mask)"
    );
    assert_eq!(&padded.tokens[..4], &chain.tokens[..]);
    assert_eq!(&padded.parents[..4], chain.parents());
    assert!(padded.tokens[4..].iter().all(|&t| t == 12));
    assert_eq!(
        padded.positions(100)[15],
        115,
        "placeholders continue the positions"
    );
    // A tree: placeholders hang under its last entry, after every real one.
    let tree =
        DraftTree::from_parents(vec![1, 2, 3, 4], vec![None, Some(0), Some(0), Some(1)]).unwrap();
    let padded = tree.padded_to(7).unwrap();
    assert_eq!(&padded.parents[4..], &[Some(3), Some(4), Some(5)]);
    assert_eq!(
        padded.children(0),
        tree.children(0),
        "real entries keep their children"
    );
    // Already full: unchanged.
    assert_eq!(tree.padded_to(3).unwrap().tokens, tree.tokens);
}

fn paths(tree: &DraftTree) -> BTreeSet<Vec<u32>> {
    (1..tree.len()).map(|i| tree.path(i)).collect()
}

/// All prefixes of length 1..=L over the full vocabulary with their f64 score, best first.
fn brute_force(full: &TopK, vocab: usize) -> Vec<(f64, Vec<u32>)> {
    let mut logp = vec![vec![0f32; vocab]; full.depths()];
    for (d, row) in logp.iter_mut().enumerate() {
        for &(t, lp) in full.row(d) {
            row[t as usize] = lp;
        }
    }
    let mut all = Vec::new();
    let mut frontier = vec![(0f64, Vec::new())];
    for row in &logp {
        let mut next = Vec::new();
        for (score, path) in &frontier {
            for (t, &lp) in row.iter().enumerate() {
                let mut p: Vec<u32> = path.clone();
                p.push(t as u32);
                next.push((score + f64::from(lp), p));
            }
        }
        all.extend(next.iter().cloned());
        frontier = next;
    }
    all.sort_by(|a, b| b.0.total_cmp(&a.0));
    all
}

#[test]
fn heap_returns_brute_force_top_b_prefixes() {
    let mut rng = ChaCha20Rng::seed_from_u64(7);
    for trial in 0..60 {
        let vocab = 4 + trial % 3;
        let depths = 3 + (trial / 3) % 2;
        let logits: Vec<f32> = (0..vocab * depths)
            .map(|_| rng.random_range(-3.0f32..3.0))
            .collect();
        let ranked = brute_force(&topk_logprobs(&logits, vocab, vocab), vocab);
        for budget in 1..=20 {
            let topk = topk_logprobs(&logits, vocab, budget.min(vocab));
            let tree = build_ddtree(9, &topk, budget);
            let want: BTreeSet<Vec<u32>> =
                ranked.iter().take(budget).map(|(_, p)| p.clone()).collect();
            assert_eq!(paths(&tree), want, "trial {trial} budget {budget}");
            assert_eq!(tree.num_nodes(), budget.min(ranked.len()));
        }
    }
}

#[test]
fn tree_is_topological_with_consistent_depths_and_unique_paths() {
    let mut rng = ChaCha20Rng::seed_from_u64(11);
    let (vocab, depths, budget) = (50, 6, 200);
    let logits: Vec<f32> = (0..vocab * depths)
        .map(|_| rng.random_range(-4.0f32..4.0))
        .collect();
    let topk = topk_logprobs(&logits, vocab, budget.min(vocab));
    let tree = build_ddtree(3, &topk, budget);
    assert_eq!(tree.num_nodes(), budget);
    assert_eq!((tree.parents[0], tree.depths[0], tree.root()), (None, 0, 3));
    let mut prev_score = f64::INFINITY;
    for i in 1..tree.len() {
        let p = tree.parents[i].expect("non-root has a parent");
        assert!(p < i);
        assert_eq!(tree.depths[i], tree.depths[p] + 1);
        assert!(tree.depths[i] <= depths);
        assert_eq!(tree.child(p, tree.tokens[i]), Some(i));
        // Pop order has non-increasing scores.
        let score: f64 = tree
            .path(i)
            .iter()
            .enumerate()
            .map(|(d, &t)| {
                let lp = topk.row(d).iter().find(|e| e.0 == t).map(|e| e.1);
                f64::from(lp.expect("token from top-k"))
            })
            .sum();
        assert!(score <= prev_score + 1e-9);
        prev_score = score;
    }
    assert_eq!(paths(&tree).len(), tree.num_nodes());
    assert_eq!(tree.positions(100)[1..].iter().min(), Some(&101));
    let (vis, n) = (tree.visibility(), tree.len());
    for i in 0..n {
        let ancestors: BTreeSet<usize> =
            std::iter::successors(Some(i), |&c| tree.parents[c]).collect();
        for j in 0..n {
            assert_eq!(vis[i * n + j], ancestors.contains(&j), "({i},{j})");
        }
    }
}

#[test]
fn ddtree_toy_example_pop_order() {
    // Tokens are the letters' ASCII codes, so paths read as strings.
    let row = |xs: [(char, f32); 3]| xs.iter().map(|&(t, p)| (t as u32, p.ln())).collect();
    let topk = TopK::new(vec![
        row([('A', 0.6), ('B', 0.25), ('C', 0.15)]),
        row([('D', 0.5), ('E', 0.35), ('F', 0.15)]),
        row([('G', 0.9), ('H', 0.06), ('I', 0.04)]),
    ]);
    let tree = build_ddtree(99, &topk, 6);
    let order: Vec<String> = (1..tree.len())
        .map(|n| {
            tree.path(n)
                .iter()
                .filter_map(|&t| char::from_u32(t))
                .collect()
        })
        .collect();
    assert_eq!(order, ["A", "AD", "ADG", "B", "AE", "AEG"]);
    assert_eq!(tree.positions(10), vec![10, 11, 12, 13, 11, 12, 13]);
    assert_eq!(build_ddtree(99, &topk, 0), DraftTree::root_only(99));
    assert_eq!(
        build_ddtree(99, &TopK::default(), 5),
        DraftTree::root_only(99)
    );
}

#[test]
fn equal_scores_pop_smaller_rank_tuple_first() {
    // Two equal candidates per depth: ties resolve by token id within a row, then by the
    // rank tuple across prefixes (shorter prefix first, lower rank first).
    let half = 0.5f32.ln();
    let topk = TopK::new(vec![vec![(5, half), (4, half)], vec![(7, 0.0), (6, -1.0)]]);
    let tree = build_ddtree(0, &topk, 4);
    let order: Vec<Vec<u32>> = (1..tree.len()).map(|n| tree.path(n)).collect();
    assert_eq!(order, vec![vec![4], vec![4, 7], vec![5], vec![5, 7]]);
}

#[test]
fn topk_rows_are_canonical_and_a_repeated_token_keeps_its_best_entry() {
    let topk = TopK::new(vec![
        vec![(3, -2.0), (9, -0.5), (3, -0.1), (1, -0.5), (9, -3.0)],
        vec![(8, -1.0), (2, -1.0), (5, 0.0)],
    ]);
    assert_eq!(topk.row(0), &[(3, -0.1), (1, -0.5), (9, -0.5)]);
    assert_eq!(topk.row(1), &[(5, 0.0), (2, -1.0), (8, -1.0)]);
}

#[test]
fn rank_keys_give_back_their_values() {
    for x in [
        0.0f32,
        -0.0,
        1.5,
        -1.5,
        f32::INFINITY,
        f32::NEG_INFINITY,
        1e-40,
        -3e38,
    ] {
        let back = rank_key_value(rank_key(x, 7));
        assert_eq!(back.to_bits(), (x + 0.0).to_bits(), "{x}");
    }
    assert!(rank_key_value(rank_key(f32::NAN, 0)).is_nan());
}

#[test]
fn topk_logprobs_sorts_breaks_ties_by_id_and_normalizes() {
    let logits = [1.0f32, 3.0, 3.0, 0.0, 3.0, -2.0, 0.5, 0.5, 4.0, -0.0];
    let topk = topk_logprobs(&logits, 5, 2);
    assert_eq!(topk.depths(), 2);
    assert_eq!(topk.row(0).iter().map(|e| e.0).collect::<Vec<_>>(), [1, 2]);
    assert_eq!(topk.row(1).iter().map(|e| e.0).collect::<Vec<_>>(), [3, 1]);
    assert_eq!(topk.argmax_tokens(), vec![1, 3]);
    let raw = topk_from_logprobs(&logits, 5, 2);
    assert_eq!(raw.row(1), &[(3, 4.0), (1, 0.5)]);
    let full = topk_logprobs(&logits, 5, 99);
    for d in 0..2 {
        let mass: f64 = full.row(d).iter().map(|e| f64::from(e.1).exp()).sum();
        assert!((mass - 1.0).abs() < 1e-6);
    }
}

fn hand_tree() -> DraftTree {
    // root 0 -> {1: a=10, 2: b=11}; 1 -> {3: c=12}; 2 -> {4: d=13}; 3 -> {5: e=14}
    DraftTree::from_parents(
        vec![0, 10, 11, 12, 13, 14],
        vec![None, Some(0), Some(0), Some(1), Some(2), Some(3)],
    )
    .expect("valid tree")
}

#[test]
fn walk_full_zero_and_sibling_acceptance() {
    let tree = hand_tree();
    assert_eq!(walk(&tree, &[10, 12, 0, 14, 0, 77]), (vec![0, 1, 3, 5], 77));
    assert_eq!(walk(&tree, &[55, 12, 13, 14, 0, 77]), (vec![0], 55));
    assert_eq!(walk(&tree, &[11, 12, 13, 14, 66, 77]), (vec![0, 2, 4], 66));
    assert_eq!(walk(&tree, &[11, 12, 99, 14, 66, 77]), (vec![0, 2], 99));
}

#[test]
fn from_parents_rejects_malformed_trees() {
    use TreeError::*;
    let bad = |t: Vec<u32>, p: Vec<Option<usize>>| DraftTree::from_parents(t, p).err();
    assert_eq!(bad(vec![], vec![]), Some(Empty));
    let mismatch = bad(vec![1], vec![None, None]);
    assert!(matches!(mismatch, Some(LengthMismatch { .. })));
    assert_eq!(bad(vec![1], vec![Some(0)]), Some(RootHasParent(0)));
    let cycle = bad(vec![1, 2], vec![None, Some(1)]);
    assert!(matches!(cycle, Some(NotTopological { node: 1, .. })));
    let orphan = bad(vec![1, 2], vec![None, None]);
    assert!(matches!(orphan, Some(NotTopological { parent: None, .. })));
    let twins = bad(vec![1, 2, 2], vec![None, Some(0), Some(0)]);
    assert!(matches!(twins, Some(DuplicateChild { node: 2, .. })));
    assert!(!hand_tree().is_chain());
    assert!(chain_tree(1, &[2, 3]).is_chain());
}

#[test]
fn chain_walk_is_longest_matching_prefix() {
    let mut rng = ChaCha20Rng::seed_from_u64(3);
    for _ in 0..500 {
        let drafts: Vec<u32> = (0..rng.random_range(0..8))
            .map(|_| rng.random_range(0..3))
            .collect();
        let target: Vec<u32> = (0..=drafts.len()).map(|_| rng.random_range(0..3)).collect();
        let tree = chain_tree(42, &drafts);
        assert_eq!(tree.len(), drafts.len() + 1);
        let streak = drafts
            .iter()
            .zip(&target)
            .take_while(|(d, t)| d == t)
            .count();
        let (accepted, bonus) = walk(&tree, &target);
        assert_eq!(accepted, (0..=streak).collect::<Vec<_>>());
        assert_eq!(bonus, target[streak]);
    }
}
