//! The block (ancestor-mask) form of the delta rule over verify trees,
//! `delta_rule::tree`, equals the token-by-token recurrence `delta_rule::recurrent` (each node
//! from its parent's state) within 1e-4 in f32: every node's output, and the state of any
//! node asked for, on chains, on trees that branch at every depth, on a DDTree-shaped tree
//! and on random trees with several roots. Inputs are shaped like the model's: L2-normalised
//! q and k (q scaled by dk^-1/2), negative log-decays, write strengths in (0, 1), a nonzero
//! committed state.

use candle_core::{DType, Device, Tensor, D};
use dflash_models::qwen3_5::delta_rule::{recurrent, tree, DeltaInputs, Forest};
use dflash_models::random::WeightRng;

const HV: usize = 3;
const DK: usize = 16;
const DV: usize = 8;

fn l2(x: Tensor) -> Tensor {
    let n = x
        .sqr()
        .unwrap()
        .sum_keepdim(D::Minus1)
        .unwrap()
        .sqrt()
        .unwrap();
    x.broadcast_div(&(n + 1e-6).unwrap()).unwrap()
}

fn inputs(t: usize, seed: u64) -> (DeltaInputs, Tensor) {
    let dev = Device::Cpu;
    let mut rng = WeightRng::new(seed);
    let mut n = |shape: &[usize], std: f32| rng.normal(shape, 0.0, std, DType::F32, &dev).unwrap();
    let q = (l2(n(&[t, HV, DK], 1.0)) * (1.0 / (DK as f64).sqrt())).unwrap();
    let k = l2(n(&[t, HV, DK], 1.0));
    let v = n(&[t, HV, DV], 1.0);
    // g = -A * softplus(x): decays in (0, 1) per token, some close to 1, some strong.
    let x = n(&[t, HV], 1.5);
    let g = ((x.exp().unwrap() + 1.0).unwrap().log().unwrap() * -0.7).unwrap();
    let beta = (n(&[t, HV], 1.0).neg().unwrap().exp().unwrap() + 1.0)
        .unwrap()
        .recip()
        .unwrap();
    let initial = n(&[HV, DK, DV], 0.3);
    (DeltaInputs { q, k, v, g, beta }, initial)
}

fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
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

/// Checks every node's output and every node's state (asked all at once) against the
/// recurrence.
fn check(parents: &[Option<usize>], seed: u64) {
    let t = parents.len();
    let (inp, initial) = inputs(t, seed);
    let forest = Forest::new(&[parents], 4, &Device::Cpu).unwrap();
    let (o_ref, s_ref) = recurrent(&inp, &forest, &initial.unsqueeze(0).unwrap()).unwrap();
    let all: Vec<usize> = (0..t).collect();
    let (o, states) = tree(&inp, parents, &initial, &all).unwrap();
    let scale = max_diff(&o_ref, &o_ref.zeros_like().unwrap());
    assert!(scale > 1e-2, "outputs are not trivially zero ({scale})");
    let d = max_diff(&o, &o_ref);
    assert!(d < 1e-4, "outputs differ by {d} (parents {parents:?})");
    for (i, (s, r)) in states.iter().zip(&s_ref).enumerate() {
        let d = max_diff(s, r);
        assert!(
            d < 1e-4,
            "state of node {i} differs by {d} (parents {parents:?})"
        );
    }
}

#[test]
fn a_chain_equals_the_recurrence() {
    let chain: Vec<Option<usize>> = (0..16).map(|i: usize| i.checked_sub(1)).collect();
    check(&chain, 1);
    check(&[None], 2);
}

#[test]
fn a_tree_branching_at_every_depth_equals_the_recurrence() {
    // Complete binary tree of depth 5 (63 nodes): every internal node has two children.
    let binary: Vec<Option<usize>> = (0..63).map(|i| (i > 0).then(|| (i - 1) / 2)).collect();
    check(&binary, 3);
    // Ternary, depth 3 (40 nodes).
    let ternary: Vec<Option<usize>> = (0..40).map(|i| (i > 0).then(|| (i - 1) / 3)).collect();
    check(&ternary, 4);
}

#[test]
fn a_ddtree_shaped_tree_equals_the_recurrence() {
    // A 16-deep spine with three side children under every spine node (64 nodes).
    let parents: Vec<Option<usize>> = (0..64)
        .map(|i| match i {
            0 => None,
            1..=15 => Some(i - 1),
            _ => Some((i - 16) / 3),
        })
        .collect();
    check(&parents, 5);
}

#[test]
fn random_trees_with_several_roots_equal_the_recurrence() {
    for seed in 0..6u64 {
        // Node i picks a parent among the earlier nodes, or starts a new root.
        let mut x = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let parents: Vec<Option<usize>> = (0..24)
            .map(|i| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let r = (x >> 33) as usize;
                (i > 0 && !r.is_multiple_of(5)).then(|| r % i)
            })
            .collect();
        check(&parents, 10 + seed);
    }
}

#[test]
fn only_the_states_asked_for_are_materialised() {
    let parents: Vec<Option<usize>> = (0..15).map(|i| (i > 0).then(|| (i - 1) / 2)).collect();
    let (inp, initial) = inputs(15, 9);
    let (_, states) = tree(&inp, &parents, &initial, &[11]).unwrap();
    assert_eq!(states.len(), 1);
    let forest = Forest::new(&[parents.as_slice()], 4, &Device::Cpu).unwrap();
    let (_, s_ref) = recurrent(&inp, &forest, &initial.unsqueeze(0).unwrap()).unwrap();
    assert!(max_diff(&states[0], &s_ref[11]) < 1e-4);
    // A node that does not exist, or a parent after its child, is refused.
    assert!(tree(&inp, &parents, &initial, &[15]).is_err());
    let mut bad = parents.clone();
    bad[3] = Some(7);
    assert!(tree(&inp, &bad, &initial, &[0]).is_err());
}

#[test]
fn written_values_rebuild_any_nodes_state_and_match_the_chunked_form_on_chains() {
    use dflash_models::qwen3_5::delta_rule::{chunked_writes, state_along, tree_writes};
    // A tree: the state of a deep node rebuilt from the k, u, g of its path alone.
    let parents = vec![
        None,
        Some(0),
        Some(0),
        Some(2),
        Some(1),
        Some(3),
        Some(5),
        Some(4),
    ];
    let (inp, initial) = inputs(parents.len(), 21);
    let (o, u) = tree_writes(&inp, &parents, &initial).unwrap();
    let (o_ref, s_ref) = tree(&inp, &parents, &initial, &[6]).unwrap();
    assert!(max_diff(&o, &o_ref) < 1e-5);
    let path = Tensor::new(&[0u32, 2, 3, 5, 6], &Device::Cpu).unwrap();
    let pick = |x: &Tensor| x.index_select(&path, 0).unwrap();
    let s = state_along(&initial, &pick(&inp.k), &pick(&u), &pick(&inp.g)).unwrap();
    let d = max_diff(&s, &s_ref[0]);
    assert!(d < 1e-4, "rebuilt state differs by {d}");
    // A chain longer than a chunk: the chunked form's written values are the tree form's.
    let t: usize = 70;
    let chain: Vec<Option<usize>> = (0..t).map(|i| i.checked_sub(1)).collect();
    let (inp, initial) = inputs(t, 22);
    let (o_c, s_c, u_c) = chunked_writes(&inp, &initial).unwrap();
    let (o_t, u_t) = tree_writes(&inp, &chain, &initial).unwrap();
    assert!(max_diff(&o_c, &o_t) < 1e-4);
    let d = max_diff(&u_c, &u_t);
    assert!(d < 1e-4, "written values differ by {d}");
    let s = state_along(&initial, &inp.k, &u_c, &inp.g).unwrap();
    let d = max_diff(&s, &s_c);
    assert!(d < 1e-4, "rebuilt final state differs by {d}");
}
