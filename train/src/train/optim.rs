//! AdamW with f32 master weights and f32 moments, the warmup + cosine schedule and global-norm
//! clipping (DFLASH.md §3.6: lr 6e-4, 4% warmup, clip 1.0).
//!
//! candle-nn's `AdamW` keeps its moments private and in the parameter's dtype, so it can be
//! neither checkpointed for an exact resume nor kept in f32 under bf16 compute; this one is the
//! same update (PyTorch `AdamW`) with its state in the open.

use candle_core::{DType, Tensor, Var};

#[derive(Debug, Clone, Copy, serde::Serialize, serde::Deserialize, PartialEq)]
pub struct AdamWConfig {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        Self {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        }
    }
}

pub struct AdamW {
    pub cfg: AdamWConfig,
    /// Named f32 parameters, in checkpoint order.
    pub params: Vec<(String, Var)>,
    pub m: Vec<Tensor>,
    pub v: Vec<Tensor>,
    /// Updates applied so far (bias correction).
    pub t: u64,
}

impl AdamW {
    pub fn new(cfg: AdamWConfig, params: Vec<(String, Var)>) -> candle_core::Result<Self> {
        let zeros = |p: &Var| p.as_tensor().zeros_like();
        let m = params
            .iter()
            .map(|(_, p)| zeros(p))
            .collect::<Result<_, _>>()?;
        let v = params
            .iter()
            .map(|(_, p)| zeros(p))
            .collect::<Result<_, _>>()?;
        Ok(Self {
            cfg,
            params,
            m,
            v,
            t: 0,
        })
    }

    /// One update with `grads[i]` for `params[i]`, already clipped.
    pub fn step(&mut self, grads: &[Tensor], lr: f64) -> candle_core::Result<()> {
        self.t += 1;
        let c = self.cfg;
        let bc1 = 1.0 - c.beta1.powi(self.t as i32);
        let bc2 = 1.0 - c.beta2.powi(self.t as i32);
        for (i, (_, p)) in self.params.iter().enumerate() {
            let g = grads[i].to_dtype(DType::F32)?;
            let m = ((&self.m[i] * c.beta1)? + (&g * (1.0 - c.beta1))?)?;
            let v = ((&self.v[i] * c.beta2)? + (g.sqr()? * (1.0 - c.beta2))?)?;
            let update = ((&m / bc1)? / ((&v / bc2)?.sqrt()? + c.eps)?)?;
            let mut next = (p.as_tensor() - (update * lr)?)?;
            if c.weight_decay != 0.0 {
                next = (next - (p.as_tensor() * (lr * c.weight_decay))?)?;
            }
            p.set(&next)?;
            self.m[i] = m;
            self.v[i] = v;
        }
        Ok(())
    }
}

/// Linear warmup over `warmup` steps, then cosine decay to zero at `total`.
pub fn learning_rate(step: usize, total: usize, warmup: usize, peak: f64) -> f64 {
    if step < warmup {
        return peak * (step + 1) as f64 / warmup as f64;
    }
    let span = total.saturating_sub(warmup).max(1) as f64;
    let progress = ((step - warmup) as f64 / span).min(1.0);
    peak * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos())
}

/// The global L2 norm of `grads` (one host read).
pub fn global_norm(grads: &[Tensor]) -> candle_core::Result<f64> {
    let mut sq = Vec::with_capacity(grads.len());
    for g in grads {
        sq.push(g.to_dtype(DType::F32)?.sqr()?.sum_all()?);
    }
    let total = Tensor::stack(&sq, 0)?.sum_all()?.to_scalar::<f32>()?;
    Ok((total as f64).sqrt())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn schedule_warms_up_then_decays_to_zero() {
        assert!((learning_rate(0, 100, 4, 1.0) - 0.25).abs() < 1e-12);
        assert!((learning_rate(3, 100, 4, 1.0) - 1.0).abs() < 1e-12);
        assert!((learning_rate(4, 100, 4, 1.0) - 1.0).abs() < 1e-12);
        assert!(learning_rate(99, 100, 4, 1.0) < 1e-3);
    }

    #[test]
    fn first_adamw_step_moves_each_weight_by_lr() {
        // With bias correction the first update is lr * g / (|g| + eps) = lr * sign(g).
        let p = Var::from_slice(&[1.0f32, -2.0], 2, &Device::Cpu).unwrap();
        let mut opt = AdamW::new(AdamWConfig::default(), vec![("w".into(), p.clone())]).unwrap();
        let g = Tensor::from_slice(&[0.5f32, -3.0], 2, &Device::Cpu).unwrap();
        opt.step(&[g], 0.1).unwrap();
        let w = p.as_tensor().to_vec1::<f32>().unwrap();
        assert!(
            (w[0] - 0.9).abs() < 1e-5 && (w[1] + 1.9).abs() < 1e-5,
            "{w:?}"
        );
    }

    /// The engine's flat AdamW (its host reference, which the GPU check compares the kernels
    /// with) against this AdamW driven as the trainer drives it: global norm, clip to 1.0,
    /// skip on a non-finite gradient. Over steps with small, clipped and NaN gradients and
    /// weight decay, the weights agree to 1e-6 (both are f32 with the same constants; only
    /// the norm's summation order differs) and the skip leaves the state untouched.
    #[test]
    fn flat_adamw_matches_this_adamw_with_clipping_and_skips() {
        use dflash_models::training::adamw::{flatten, FlatAdamW, FlatAdamWConfig};
        let cpu = Device::Cpu;
        let shapes: [&[usize]; 3] = [&[3, 4], &[5], &[2, 2, 2]];
        let init: Vec<Tensor> = shapes
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let n: usize = s.iter().product();
                let v: Vec<f32> = (0..n).map(|j| ((i * 7 + j) as f32 * 0.37).sin()).collect();
                Tensor::from_vec(v, *s, &cpu).unwrap()
            })
            .collect();
        let cfg = AdamWConfig {
            weight_decay: 0.01,
            ..AdamWConfig::default()
        };
        let vars = init
            .iter()
            .enumerate()
            .map(|(i, t)| (format!("p{i}"), Var::from_tensor(t).unwrap()))
            .collect();
        let mut reference = AdamW::new(cfg, vars).unwrap();
        let mut flat = FlatAdamW::new(
            FlatAdamWConfig {
                weight_decay: 0.01,
                clip: 1.0,
                ..FlatAdamWConfig::default()
            },
            &init,
            None,
        )
        .unwrap();
        // Gradient scales: small (no clip), large (clipped), NaN (skipped), small again.
        for (step, scale) in [0.05f32, 30.0, f32::NAN, 0.2].into_iter().enumerate() {
            let grads: Vec<Tensor> = init
                .iter()
                .map(|t| {
                    let n = t.elem_count();
                    let v: Vec<f32> = (0..n)
                        .map(|j| scale * ((step * 13 + j) as f32 * 0.91).cos())
                        .collect();
                    Tensor::from_vec(v, t.shape(), &cpu).unwrap()
                })
                .collect();
            let lr = 1e-2 * (step + 1) as f64;
            let norm = global_norm(&grads).unwrap();
            if norm.is_finite() {
                let s = if norm > 1.0 { 1.0 / (norm + 1e-6) } else { 1.0 };
                let clipped: Vec<Tensor> = grads.iter().map(|g| (g * s).unwrap()).collect();
                reference.step(&clipped, lr).unwrap();
            }
            flat.step(&flatten(&grads).unwrap(), None, lr).unwrap();
            let st = flat.read_state().unwrap();
            assert_eq!(st.last_ran, norm.is_finite(), "step {step}");
            assert_eq!(st.steps, reference.t, "step {step}");
            for (a, (_, b)) in flat.master_views().unwrap().iter().zip(&reference.params) {
                let d = (a - b.as_tensor())
                    .unwrap()
                    .abs()
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .max(0)
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap();
                assert!(d < 1e-6, "step {step}: {d}");
            }
        }
        assert_eq!(flat.read_state().unwrap().skipped, 1);
    }
}
