use super::{route, SparseMoe};
use crate::random::WeightRng;
use candle_core::{DType, Device};
use dflash_common::MoeConfig;

/// The gather-based combine equals the per-expert `index_add` it replaced bit for bit
/// (bf16 and f32; three experts a row, so the order of the additions shows in bf16),
/// including experts no row picks.
#[test]
fn the_combine_equals_index_add_per_expert() {
    for (experts, rows) in [(6usize, 37usize), (16, 3)] {
        let cfg = MoeConfig {
            num_experts: experts,
            num_experts_per_tok: 3,
            moe_intermediate_size: 8,
            shared_expert_intermediate_size: None,
            norm_topk_prob: false,
        };
        for dtype in [DType::BF16, DType::F32] {
            let mut rng = WeightRng::new(5);
            let m = SparseMoe::random(&mut rng, &cfg, 16, dtype, &Device::Cpu).unwrap();
            let x = rng
                .normal(&[rows, 16], 0.0, 1.0, dtype, &Device::Cpu)
                .unwrap();
            let logits = crate::layers::ops::linear(&x, m.router())
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap()
                .to_vec2::<f32>()
                .unwrap();
            let mut by_expert = vec![Vec::new(); experts];
            let mut wts = vec![Vec::new(); experts];
            for (t, row) in logits.iter().enumerate() {
                for (e, w) in route(row, 3, false) {
                    by_expert[e].push(t as u32);
                    wts[e].push(w);
                }
            }
            // The replaced form: one index_add per expert, ascending.
            let mut want = x.zeros_like().unwrap();
            for (e, expert) in m.experts.iter().enumerate() {
                if by_expert[e].is_empty() {
                    continue;
                }
                let idx = candle_core::Tensor::new(by_expert[e].as_slice(), &Device::Cpu).unwrap();
                let w = candle_core::Tensor::new(wts[e].as_slice(), &Device::Cpu)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap()
                    .unsqueeze(1)
                    .unwrap();
                let y = expert
                    .forward(&x.index_select(&idx, 0).unwrap())
                    .unwrap()
                    .broadcast_mul(&w)
                    .unwrap();
                want = want.index_add(&idx, &y, 0).unwrap();
            }
            let got = m.combine(&x, &by_expert, &wts).unwrap();
            let bits = |t: &candle_core::Tensor| -> Vec<u32> {
                t.to_dtype(DType::F32)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap()
                    .iter()
                    .map(|v| v.to_bits())
                    .collect()
            };
            assert_eq!(
                bits(&got),
                bits(&want),
                "{experts} experts, {rows} rows, {dtype:?}"
            );
            if experts == 16 {
                assert!(by_expert.iter().any(Vec::is_empty), "some expert unused");
            }
        }
    }
}

/// Verify forwards batch a tree's rows; each must come out as if run alone.
#[test]
fn a_batch_of_rows_gives_each_row_its_own_routing() {
    let moe = MoeConfig {
        num_experts: 6,
        num_experts_per_tok: 2,
        moe_intermediate_size: 8,
        shared_expert_intermediate_size: Some(8),
        norm_topk_prob: false,
    };
    // With a shared expert (the hybrids) and without (qwen3_moe, renormalised).
    let without = MoeConfig {
        shared_expert_intermediate_size: None,
        norm_topk_prob: true,
        ..moe.clone()
    };
    for cfg in [moe, without] {
        let mut rng = WeightRng::new(3);
        let m = SparseMoe::random(&mut rng, &cfg, 16, DType::F32, &Device::Cpu).unwrap();
        let x = rng
            .normal(&[10, 16], 0.0, 1.0, DType::F32, &Device::Cpu)
            .unwrap();
        let all = m.forward(&x).unwrap();
        for t in 0..10 {
            let one = m.forward(&x.narrow(0, t, 1).unwrap()).unwrap();
            let d = (one - all.narrow(0, t, 1).unwrap())
                .unwrap()
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            assert!(d < 1e-6, "row {t} differs by {d} when batched");
        }
    }
}

/// The device kernels read the stacked experts; the plain forward must not change when the
/// experts become views of the stacks.
#[test]
fn stacking_the_experts_keeps_the_block() {
    let cfg = MoeConfig {
        num_experts: 4,
        num_experts_per_tok: 2,
        moe_intermediate_size: 8,
        shared_expert_intermediate_size: None,
        norm_topk_prob: true,
    };
    let mut rng = WeightRng::new(5);
    let mut m = SparseMoe::random(&mut rng, &cfg, 16, DType::F32, &Device::Cpu).unwrap();
    let x = rng
        .normal(&[3, 16], 0.0, 1.0, DType::F32, &Device::Cpu)
        .unwrap();
    let before = m.forward(&x).unwrap().to_vec2::<f32>().unwrap();
    let (g, u, d) = m.experts[2].weights();
    let (g, u, d) = (g.clone(), u.clone(), d.clone());
    let s = m.stack_experts().unwrap().unwrap();
    assert_eq!(s.gate_up.dims(), &[4, 16, 16]);
    assert_eq!(s.down.dims(), &[4, 16, 8]);
    let same = |a: &candle_core::Tensor, b: &candle_core::Tensor| {
        a.to_vec2::<f32>().unwrap() == b.to_vec2::<f32>().unwrap()
    };
    let gu = s.gate_up.get(2).unwrap();
    assert!(same(&gu.narrow(0, 0, 8).unwrap(), &g));
    assert!(same(&gu.narrow(0, 8, 8).unwrap(), &u));
    assert!(same(&s.down.get(2).unwrap(), &d));
    assert_eq!(m.forward(&x).unwrap().to_vec2::<f32>().unwrap(), before);
    assert!(m.stack_shared().unwrap().is_none());
    // A block with a shared expert (the hybrids'): the routed experts stack the same way,
    // the shared one separately, and the block's forward stays bit-identical.
    let shared = MoeConfig {
        shared_expert_intermediate_size: Some(8),
        ..cfg
    };
    let mut h = SparseMoe::random(&mut rng, &shared, 16, DType::F32, &Device::Cpu).unwrap();
    let before = h.forward(&x).unwrap().to_vec2::<f32>().unwrap();
    let s = h.stack_experts().unwrap().unwrap();
    assert_eq!(s.gate_up.dims(), &[4, 16, 16]);
    let sh = h.stack_shared().unwrap().unwrap();
    assert_eq!(sh.gate_up.dims(), &[16, 16]);
    assert_eq!(sh.down.dims(), &[16, 8]);
    assert_eq!(sh.gate.dims(), &[1, 16]);
    assert_eq!(h.forward(&x).unwrap().to_vec2::<f32>().unwrap(), before);
}

#[test]
fn routing_takes_the_top_k_with_ties_to_the_lower_index_and_renormalises() {
    let r = route(&[0.0, 2.0, 1.0, 2.0], 2, true);
    assert_eq!(r.iter().map(|x| x.0).collect::<Vec<_>>(), vec![1, 3]);
    assert!((r[0].1 - 0.5).abs() < 1e-7 && (r[1].1 - 0.5).abs() < 1e-7);
    let r = route(&[0.0, 1.0, 3.0], 1, false);
    let p = 3f32.exp() / (1.0 + 1f32.exp() + 3f32.exp());
    assert_eq!(r[0].0, 2);
    assert!((r[0].1 - p).abs() < 1e-6, "{} vs {p}", r[0].1);
}
