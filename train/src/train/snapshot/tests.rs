use super::*;
use crate::train::optim::AdamWConfig;
use crate::train::optimizer::{OptimizerChoice, TrainOptimizer};
use candle_core::DType;

/// The fused optimizer on the CPU (its host reference), over a matrix and a vector.
fn fused() -> TrainOptimizer {
    let choice = OptimizerChoice {
        fused: true,
        adam: AdamWConfig::default(),
        clip: 1.0,
        compute_dtype: DType::F32,
    };
    let w = Tensor::arange(0f32, 6.0, &Device::Cpu)
        .unwrap()
        .reshape((2, 3))
        .unwrap();
    let b = Tensor::from_slice(&[1.0f32, -2.0, 3.0, -4.0], 4, &Device::Cpu).unwrap();
    TrainOptimizer::new(choice, vec![("w".into(), w), ("b".into(), b)], None).unwrap()
}

fn step(opt: &mut TrainOptimizer) {
    let grads = vec![
        Some(Tensor::full(0.25f32, (2, 3), &Device::Cpu).unwrap()),
        Some(Tensor::from_slice(&[0.5f32, -3.0, 0.0, 1.0], 4, &Device::Cpu).unwrap()),
    ];
    let loss = Tensor::new(1.0f32, &Device::Cpu).unwrap();
    opt.step(grads, &loss, 0.1).unwrap();
}

/// Names, shapes and the exact bits of every tensor.
type Bits = Vec<(String, Vec<usize>, Vec<u32>)>;

fn bits(t: &OptimizerTensors) -> Bits {
    let one = |name: String, x: &Tensor| {
        let v = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        (
            name,
            x.dims().to_vec(),
            v.iter().map(|f| f.to_bits()).collect(),
        )
    };
    let mut out = Vec::new();
    for (i, (n, p)) in t.params.iter().enumerate() {
        out.push(one(format!("param.{n}"), p));
        out.push(one(format!("m.{n}"), &t.m[i]));
        out.push(one(format!("v.{n}"), &t.v[i]));
    }
    out
}

/// A checkpoint written while training goes on must hold the state of its step: the fused
/// snapshot is host copies of the flat buffers, cut (on the writer thread) into exactly the
/// tensors `tensors()` gave at that step.
#[test]
fn a_fused_snapshot_cuts_to_the_state_of_its_step_while_later_steps_go_on() {
    let mut opt = fused();
    step(&mut opt);
    let expected = bits(&opt.tensors().unwrap());
    let snap = opt.snapshot().unwrap();
    assert!(matches!(snap, OptimizerSnapshot::Flat(_)));
    step(&mut opt);
    assert_ne!(
        bits(&opt.tensors().unwrap()),
        expected,
        "the second step moved the state"
    );
    assert_eq!(bits(&snap.into_tensors().unwrap()), expected);
    // The next snapshot (the buffers reused) holds the second step.
    let now = bits(&opt.tensors().unwrap());
    assert_eq!(bits(&opt.snapshot().unwrap().into_tensors().unwrap()), now);
}

fn flat(values: &[f32]) -> Tensor {
    Tensor::from_slice(values, values.len(), &Device::Cpu).unwrap()
}

fn segments() -> Vec<(usize, Shape)> {
    vec![(0, Shape::from(2)), (2, Shape::from((1, 3)))]
}

fn names() -> Vec<String> {
    vec!["a".into(), "b".into()]
}

#[test]
fn the_buffers_come_back_when_a_snapshot_is_dropped_and_serve_the_next() {
    let pool = StagingPool::default();
    let (master, m, v) = (
        flat(&[1.0, 2.0, 3.0, 4.0, 5.0]),
        flat(&[0.1; 5]),
        flat(&[0.2; 5]),
    );
    let snap = pool
        .snapshot([&master, &m, &v], names(), segments())
        .unwrap();
    assert!(!pool.is_idle(), "the snapshot holds the buffers");
    let t = snap.into_tensors().unwrap();
    assert!(pool.is_idle(), "cut: the buffers are back");
    assert_eq!(t.params[0].0, "a");
    assert_eq!(t.params[0].1.to_vec1::<f32>().unwrap(), [1.0, 2.0]);
    assert_eq!(t.params[1].0, "b");
    assert_eq!(t.params[1].1.dims(), [1, 3]);
    assert_eq!(t.m[1].to_vec2::<f32>().unwrap(), [[0.1f32; 3]]);
    assert_eq!(t.v[0].to_vec1::<f32>().unwrap(), [0.2f32; 2]);
    // Sequential snapshots share one set.
    let master = flat(&[9.0; 5]);
    let again = pool
        .snapshot([&master, &m, &v], names(), segments())
        .unwrap()
        .into_tensors()
        .unwrap();
    assert_eq!(again.params[1].1.to_vec2::<f32>().unwrap(), [[9.0f32; 3]]);
    assert_eq!(pool.sets_allocated(), 1);
    // One taken while another is held gets its own set; the pool keeps one afterwards.
    let held = pool
        .snapshot([&master, &m, &v], names(), segments())
        .unwrap();
    let second = pool
        .snapshot([&master, &m, &v], names(), segments())
        .unwrap();
    assert_eq!(pool.sets_allocated(), 2);
    drop(held);
    drop(second);
    assert!(pool.is_idle());
}

#[test]
fn a_failed_snapshot_gives_its_buffers_back() {
    let pool = StagingPool::default();
    let ok = flat(&[1.0; 5]);
    let not_f32 = Tensor::from_slice(&[1u32; 5], 5, &Device::Cpu).unwrap();
    assert!(pool
        .snapshot([&ok, &not_f32, &ok], names(), segments())
        .is_err());
    assert!(pool.is_idle());
    pool.snapshot([&ok, &ok, &ok], names(), segments())
        .unwrap()
        .into_tensors()
        .unwrap();
    assert_eq!(pool.sets_allocated(), 1);
}

#[test]
fn a_segment_past_the_buffer_is_an_error_not_a_panic() {
    let pool = StagingPool::default();
    let short = flat(&[1.0; 4]);
    let err = pool
        .snapshot([&short, &short, &short], names(), segments())
        .unwrap()
        .into_tensors()
        .err()
        .expect("the second segment ends past 4 elements");
    assert!(err.to_string().contains("past a buffer of 4"), "{err}");
}
