//! The reference against candle: its forward equals [`composed_attention`] (`attend` under
//! `training_mask`, as `dflash/train.rs` runs it) and its backward equals candle's autograd of
//! that composition and central finite differences, for full and sliding layers, anchors at
//! 0, mid-sequence and at a sequence's end, GQA (4 heads over 2 KV heads) and two sequences
//! of different lengths. Tolerances: 2e-5 absolute on values of order 1 (f32 summation order);
//! the finite differences 2e-3 relative to the largest gradient (f32 forward, step 1e-2).

use candle_core::{Device, Tensor, Var};

use super::*;
use crate::dflash::train::composed_attention;
use crate::random::WeightRng;
use crate::training::attn_dflash::dflash_attention;

const B: usize = 4;
const H: usize = 4;
const KV: usize = 2;
const D: usize = 8;

/// Two sequences: contexts of 10 and 7 rows; anchors 0, 3, 9 and 1, 6 (the trainer's anchors
/// are >= 1, a padding block's may be 0).
fn spans() -> Vec<BlockSpan> {
    [(0, 0), (0, 3), (0, 9), (10, 1), (10, 6)]
        .map(|(o, a)| BlockSpan {
            ctx_offset: o,
            anchor: a,
        })
        .to_vec()
}

const CTX: usize = 17;

struct Case {
    dims: AttnDims,
    spans: Vec<BlockSpan>,
    /// q, kc, vc, kb, vb and dout as flat f32.
    x: [Vec<f32>; 6],
}

fn case(window: Option<usize>, seed: u64) -> Case {
    let spans = spans();
    let rows = spans.len() * B;
    let dims = AttnDims {
        heads: H,
        kv_heads: KV,
        rows,
        ctx: CTX,
        head_dim: D,
        block_size: B,
        window,
    };
    let mut rng = WeightRng::new(seed);
    let mut draw = |n: usize| {
        rng.normal(&[n], 0.0, 1.0, candle_core::DType::F32, &Device::Cpu)
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
    };
    let x = [
        draw(H * rows * D),
        draw(KV * CTX * D),
        draw(KV * CTX * D),
        draw(KV * rows * D),
        draw(KV * rows * D),
        draw(rows * H * D),
    ];
    Case { dims, spans, x }
}

fn tensors(c: &Case) -> Vec<Tensor> {
    let (r, cx) = (c.dims.rows, c.dims.ctx);
    let shapes = [(H, r, D), (KV, cx, D), (KV, cx, D), (KV, r, D), (KV, r, D)];
    c.x.iter()
        .zip(shapes)
        .map(|(v, s)| Tensor::from_vec(v.clone(), s, &Device::Cpu).unwrap())
        .collect()
}

fn max_abs(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn flat(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1().unwrap()
}

const WINDOWS: [Option<usize>; 3] = [None, Some(5), Some(3)];

fn ref_forward(c: &Case, spans: &[BlockSpan]) -> (Vec<f32>, Vec<f32>) {
    let [q, kc, vc, kb, vb, _] = &c.x;
    forward(c.dims, q, kc, vc, kb, vb, spans)
}

#[test]
fn forward_equals_the_masked_softmax_composition() {
    for (i, w) in WINDOWS.into_iter().enumerate() {
        let c = case(w, 7 + i as u64);
        let (out, lse) = ref_forward(&c, &c.spans);
        let t = tensors(&c);
        let composed =
            composed_attention(&t[0], &t[1], &t[2], &t[3], &t[4], &c.spans, B, w).unwrap();
        let err = max_abs(&out, &flat(&composed));
        assert!(err < 2e-5, "window {w:?}: out differs by {err}");
        assert!(lse.iter().all(|l| l.is_finite()));
        // A block that sees its anchor's own context row (anchors one later) differs.
        let shifted: Vec<BlockSpan> = c
            .spans
            .iter()
            .map(|s| BlockSpan {
                anchor: s.anchor + 1,
                ..*s
            })
            .collect();
        let (wrong, _) = ref_forward(&c, &shifted);
        assert!(max_abs(&wrong, &out) > 1e-2, "window {w:?}: shift unseen");
    }
}

fn ref_backward(c: &Case) -> AttnGrads {
    let [q, kc, vc, kb, vb, dout] = &c.x;
    let (out, lse) = forward(c.dims, q, kc, vc, kb, vb, &c.spans);
    backward(c.dims, q, kc, vc, kb, vb, &c.spans, &out, dout, &lse)
}

fn grads_as_vecs(g: &AttnGrads) -> [&Vec<f32>; 5] {
    [&g.dq, &g.dkc, &g.dvc, &g.dkb, &g.dvb]
}

/// candle's gradients of `sum(f(q, kc, vc, kb, vb) * dout)`.
fn candle_grads(c: &Case, f: impl Fn(&[Tensor]) -> Tensor) -> Vec<Vec<f32>> {
    let vars: Vec<Var> = tensors(c)
        .iter()
        .map(|t| Var::from_tensor(t).unwrap())
        .collect();
    let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let out = f(&ts);
    let dout = Tensor::from_vec(c.x[5].clone(), out.shape(), &Device::Cpu).unwrap();
    let grads = (out * dout).unwrap().sum_all().unwrap().backward().unwrap();
    vars.iter()
        .map(|v| {
            flat(
                grads
                    .get(v.as_tensor())
                    .expect("every input has a gradient"),
            )
        })
        .collect()
}

#[test]
fn backward_equals_candle_autograd_of_the_composition() {
    for (i, w) in WINDOWS.into_iter().enumerate() {
        let c = case(w, 30 + i as u64);
        let g = ref_backward(&c);
        let want = candle_grads(&c, |t| {
            composed_attention(&t[0], &t[1], &t[2], &t[3], &t[4], &c.spans, B, w).unwrap()
        });
        for (name, (got, want)) in ["dq", "dkc", "dvc", "dkb", "dvb"]
            .iter()
            .zip(grads_as_vecs(&g).into_iter().zip(&want))
        {
            let err = max_abs(got, want);
            assert!(err < 2e-5, "window {w:?}: {name} differs by {err}");
        }
        // Context rows no block sees (row 9 of the first sequence, from anchor 9 on) get
        // no gradient.
        assert!(g.dkc[9 * D..10 * D].iter().all(|&x| x == 0.0));
    }
}

#[test]
fn backward_equals_finite_differences() {
    for (i, w) in WINDOWS.into_iter().enumerate() {
        let c = case(w, 50 + i as u64);
        let g = ref_backward(&c);
        let loss = |x: &[Vec<f32>; 6]| -> f64 {
            let (out, _) = forward(c.dims, &x[0], &x[1], &x[2], &x[3], &x[4], &c.spans);
            out.iter().zip(&x[5]).map(|(o, d)| (o * d) as f64).sum()
        };
        let eps = 1e-2f32;
        for (input, grad) in grads_as_vecs(&g).into_iter().enumerate() {
            let scale = grad.iter().fold(0f32, |m, x| m.max(x.abs()));
            // Every 7th entry: all heads, rows and both kinds of key rows get probed.
            for e in (0..grad.len()).step_by(7) {
                let mut x = c.x.clone();
                x[input][e] += eps;
                let up = loss(&x);
                x[input][e] -= 2.0 * eps;
                let down = loss(&x);
                let fd = ((up - down) / (2.0 * eps as f64)) as f32;
                assert!(
                    (fd - grad[e]).abs() <= 2e-3 * scale,
                    "window {w:?}: input {input} entry {e}: fd {fd} vs {}",
                    grad[e]
                );
            }
        }
    }
}

/// The custom op (on the CPU: this reference) trains as the composition: same output, same
/// gradients of all five inputs through candle's autograd.
#[test]
fn the_custom_op_differentiates_as_the_composition() {
    for (i, w) in WINDOWS.into_iter().enumerate() {
        let c = case(w, 70 + i as u64);
        let fused = candle_grads(&c, |t| {
            dflash_attention(&t[0], &t[1], &t[2], &t[3], &t[4], &c.spans, B, w).unwrap()
        });
        let composed = candle_grads(&c, |t| {
            composed_attention(&t[0], &t[1], &t[2], &t[3], &t[4], &c.spans, B, w).unwrap()
        });
        for (n, (a, b)) in fused.iter().zip(&composed).enumerate() {
            let err = max_abs(a, b);
            assert!(err < 2e-5, "window {w:?}: input {n} differs by {err}");
        }
    }
}
