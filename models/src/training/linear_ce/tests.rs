//! The fused linear + cross-entropy against candle's composition (`matmul` → `log_softmax` →
//! `gather`, back-propagated by autograd), f32 on the CPU: loss, argmax and the gradient of
//! the hidden states agree to 1e-5 (both are f32; they differ in summation order only), over
//! several chunks, and the head receives no gradient.

use candle_core::{DType, Device, Tensor, Var, D};

use super::*;
use crate::random::WeightRng;

const ROWS: usize = 7;
const HIDDEN: usize = 12;
const VOCAB: usize = 50;

fn inputs() -> (Var, Var, Tensor, Tensor) {
    let mut rng = WeightRng::new(5);
    let cpu = Device::Cpu;
    let h = rng
        .normal(&[ROWS, HIDDEN], 0.0, 1.0, DType::F32, &cpu)
        .unwrap();
    let w = rng
        .normal(&[VOCAB, HIDDEN], 0.0, 0.5, DType::F32, &cpu)
        .unwrap();
    let labels: Vec<u32> = (0..ROWS as u32)
        .map(|r| (r * 17 + 3) % VOCAB as u32)
        .collect();
    let weights: Vec<f32> = (0..ROWS).map(|r| 1.0 / (1.0 + r as f32)).collect();
    (
        Var::from_tensor(&h).unwrap(),
        Var::from_tensor(&w).unwrap(),
        Tensor::new(labels.as_slice(), &cpu).unwrap(),
        Tensor::new(weights.as_slice(), &cpu).unwrap(),
    )
}

fn max_abs(a: &Tensor, b: &Tensor) -> f32 {
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

#[test]
fn fused_cross_entropy_matches_the_composition_with_its_gradient() {
    let (h, w, labels, weights) = inputs();
    let logits = h.as_tensor().matmul(&w.as_tensor().t().unwrap()).unwrap();
    let logp = candle_nn::ops::log_softmax(&logits, D::Minus1).unwrap();
    let picked = logp
        .gather(&labels.unsqueeze(1).unwrap(), 1)
        .unwrap()
        .squeeze(1)
        .unwrap();
    let ref_rows = picked.neg().unwrap();
    let ref_loss = (&ref_rows * &weights).unwrap().sum_all().unwrap();
    let ref_grads = ref_loss.backward().unwrap();
    let ref_arg = logits.argmax(D::Minus1).unwrap();

    for chunk in [1, 3, ROWS] {
        let ce =
            linear_cross_entropy_in_chunks(h.as_tensor(), w.as_tensor(), &labels, chunk).unwrap();
        assert!(max_abs(&ce.loss, &ref_rows) < 1e-5, "chunk {chunk}");
        assert_eq!(
            ce.argmax.to_vec1::<u32>().unwrap(),
            ref_arg.to_vec1::<u32>().unwrap()
        );
        let loss = (&ce.loss * &weights).unwrap().sum_all().unwrap();
        let grads = loss.backward().unwrap();
        let g = grads.get(h.as_tensor()).expect("hidden gets a gradient");
        let r = ref_grads.get(h.as_tensor()).unwrap();
        assert!(max_abs(g, r) < 1e-5, "chunk {chunk}: {}", max_abs(g, r));
        assert!(grads.get(w.as_tensor()).is_none(), "the head is frozen");
    }
}

#[test]
fn a_wrong_label_changes_loss_and_gradient() {
    // Guards the comparison above against passing for a trivial reason.
    let (h, w, labels, _) = inputs();
    let ce = linear_cross_entropy(h.as_tensor(), w.as_tensor(), &labels).unwrap();
    let shifted: Vec<u32> = labels
        .to_vec1::<u32>()
        .unwrap()
        .iter()
        .map(|l| (l + 1) % VOCAB as u32)
        .collect();
    let shifted = Tensor::new(shifted.as_slice(), &Device::Cpu).unwrap();
    let other = linear_cross_entropy(h.as_tensor(), w.as_tensor(), &shifted).unwrap();
    assert!(max_abs(&ce.loss, &other.loss) > 1e-3);
}

#[test]
fn host_rows_give_lse_argmax_and_softmax_minus_onehot() {
    let mut x = vec![1.0f32, 3.0, 3.0, -1.0];
    let stats = ce_rows_host(&mut x, 4, &[0]);
    let lse = (1f32.exp() + 2.0 * 3f32.exp() + (-1f32).exp()).ln();
    assert!((stats[0] - (lse - 1.0)).abs() < 1e-6);
    assert_eq!(stats[1], 1.0, "ties go to the lower column");
    assert!(
        (x.iter().sum::<f32>()).abs() < 1e-6,
        "softmax - onehot sums to 0"
    );
    assert!((x[0] - ((1.0 - lse).exp() - 1.0)).abs() < 1e-6);
    let mut nan = vec![0.0f32, f32::NAN];
    assert!(ce_rows_host(&mut nan, 2, &[0])[0].is_nan());
}
