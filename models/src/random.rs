//! Seeded random weights: for the benchmark (any published shape, no download) and for tests
//! that need a fresh drafter. Generated on the host with ChaCha so every device sees the same
//! values for the same seed.

use candle_core::{DType, Device, Result, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

pub struct WeightRng {
    /// `None`: draw on the device with its own generator (fast for billions of weights, but
    /// not reproducible across devices).
    rng: Option<ChaCha8Rng>,
    /// Draws rounded through this dtype before the one asked (see [`Self::rounded_to`]).
    round: Option<DType>,
}

impl WeightRng {
    pub fn new(seed: u64) -> Self {
        Self {
            rng: Some(ChaCha8Rng::seed_from_u64(seed)),
            round: None,
        }
    }

    /// Weights drawn by the device's generator: for benchmarks of full-size shapes.
    pub fn on_device() -> Self {
        Self {
            rng: None,
            round: None,
        }
    }

    /// Every draw rounded to `dtype` first: an f32 model drawn so holds exactly the weights of
    /// the bf16 model drawn from the same sequence (the benches' bf16 noise floor compares
    /// the two).
    pub fn rounded_to(mut self, dtype: DType) -> Self {
        self.round = Some(dtype);
        self
    }

    fn finish(&self, x: Tensor, dtype: DType) -> Result<Tensor> {
        match self.round {
            Some(r) => x.to_dtype(r)?.to_dtype(dtype),
            None => x.to_dtype(dtype),
        }
    }

    /// Normal(mean, std) entries (Box-Muller), as `dtype` on `device`.
    pub fn normal(
        &mut self,
        shape: &[usize],
        mean: f32,
        std: f32,
        dtype: DType,
        device: &Device,
    ) -> Result<Tensor> {
        let Some(rng) = self.rng.as_mut() else {
            return self.finish(Tensor::randn(mean, std, shape, device)?, dtype);
        };
        let n: usize = shape.iter().product();
        let mut v = Vec::with_capacity(n);
        while v.len() < n {
            let u1: f32 = rng.random::<f32>().max(f32::MIN_POSITIVE);
            let u2: f32 = rng.random::<f32>();
            let r = (-2.0 * u1.ln()).sqrt();
            let th = 2.0 * std::f32::consts::PI * u2;
            v.push(mean + std * r * th.cos());
            if v.len() < n {
                v.push(mean + std * r * th.sin());
            }
        }
        self.finish(Tensor::from_vec(v, shape, &Device::Cpu)?, dtype)?
            .to_device(device)
    }

    /// A linear layer's weight `[out, in]` with entries N(0, 1/in) (unit-variance outputs).
    pub fn linear(
        &mut self,
        out: usize,
        inp: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Tensor> {
        self.normal(&[out, inp], 0.0, 1.0 / (inp as f32).sqrt(), dtype, device)
    }

    /// An RMSNorm weight near one.
    pub fn norm(&mut self, n: usize, dtype: DType, device: &Device) -> Result<Tensor> {
        self.normal(&[n], 1.0, 0.1, dtype, device)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounded_draws_give_an_f32_copy_of_the_bf16_weights() {
        let dev = Device::Cpu;
        let draw = |rounded: bool, dtype: DType| {
            let rng = WeightRng::new(3);
            let mut rng = if rounded {
                rng.rounded_to(DType::BF16)
            } else {
                rng
            };
            rng.linear(8, 64, dtype, &dev)
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
        };
        let bf16 = draw(true, DType::BF16);
        assert_eq!(draw(true, DType::F32), bf16);
        assert_eq!(draw(false, DType::BF16), bf16);
        // Unrounded f32 draws keep bits bf16 drops.
        assert_ne!(draw(false, DType::F32), bf16);
    }
}
