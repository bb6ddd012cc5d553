//! The trainer's optimizer: the reference AdamW (`optim.rs`, per-tensor candle ops, the norm
//! read on the host) or the fused flat AdamW (`dflash_models::training::adamw`), behind one
//! interface the loop drives the same way.
//!
//! Fused, the f32 master weights and both moments live in flat buffers; a step is three
//! launches (norm, plan, update) that clip to the global norm, skip a step whose gradient norm
//! or loss is not finite, count updates and skips, and write the compute-dtype working weights
//! in the same pass, all on the device. The drafter's autograd needs one candle `Var` per
//! tensor (a `Var` cannot be a view of a larger buffer), so the working weights are copied
//! into per-tensor compute-dtype variables after the update, one device copy each: this
//! replaces the reference's per-step re-cast of every f32 master, and the drafter is built
//! once over those variables. The host learns whether the step ran from the device's state,
//! read after the step's loss read-back (which the loop does anyway): no extra host sync.
//!
//! Checkpoints hold the state per tensor whichever optimizer ran ([`OptimizerTensors`]); the
//! fused one converts flat <-> per tensor at save and restore, so a run resumes exactly under
//! either. Its checkpoint snapshot is the flat buffers copied whole into reused host buffers,
//! cut per tensor on the writer thread (`snapshot.rs`), so the loop waits for three copies.

use candle_core::{DType, Device, Tensor, Var};
use dflash_models::training::adamw::{pack_gradients, FlatAdamW, FlatAdamWConfig};

use super::checkpoint::OptimizerTensors;
use super::error::TrainResult;
use super::optim::{global_norm, AdamW, AdamWConfig};
use super::setup;
use super::snapshot::{OptimizerSnapshot, StagingPool};

/// What the run's optimizer is: fused or not, its hyperparameters, and the drafter's compute
/// dtype (of the fused optimizer's working weights).
#[derive(Debug, Clone, Copy)]
pub struct OptimizerChoice {
    pub fused: bool,
    pub adam: AdamWConfig,
    /// Global-norm clip (`--grad-clip`).
    pub clip: f64,
    pub compute_dtype: DType,
}

/// What the host knows of the last step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepOutcome {
    /// Whether the update ran (false: the loss or the gradient norm was not finite).
    pub ran: bool,
    /// The global gradient norm before clipping.
    pub norm: f64,
    /// Updates applied so far.
    pub adam_t: u64,
}

pub struct TrainOptimizer {
    inner: Inner,
    clip: f64,
    last: Option<StepOutcome>,
}

enum Inner {
    Reference(AdamW),
    Fused {
        flat: FlatAdamW,
        /// The drafter's weights: per-tensor copies of the working weights (compute dtype).
        vars: Vec<(String, Var)>,
        /// Host buffers of checkpoint snapshots, reused across the run.
        staging: StagingPool,
    },
}

impl TrainOptimizer {
    /// An optimizer over `params` (f32, checkpoint order) on their device; with `resumed`,
    /// the moments and counters (updates applied, steps skipped) of a checkpoint.
    pub fn new(
        choice: OptimizerChoice,
        params: Vec<(String, Tensor)>,
        resumed: Option<(Vec<Tensor>, Vec<Tensor>, u64, u64)>,
    ) -> TrainResult<Self> {
        let inner = if choice.fused {
            let c = choice.adam;
            let cfg = FlatAdamWConfig {
                beta1: c.beta1,
                beta2: c.beta2,
                eps: c.eps,
                weight_decay: c.weight_decay,
                clip: choice.clip,
            };
            let tensors: Vec<Tensor> = params.iter().map(|(_, t)| t.clone()).collect();
            let working = Some(choice.compute_dtype);
            let flat = match resumed {
                Some((m, v, t, skipped)) => {
                    FlatAdamW::restore(cfg, &tensors, &m, &v, (t, skipped), working)?
                }
                None => FlatAdamW::new(cfg, &tensors, working)?,
            };
            let vars = params
                .iter()
                .zip(flat.working_views()?)
                .map(|((n, _), w)| Ok((n.clone(), Var::from_tensor(&w)?)))
                .collect::<TrainResult<Vec<_>>>()?;
            Inner::Fused {
                flat,
                vars,
                staging: StagingPool::default(),
            }
        } else {
            let mut opt = AdamW::new(choice.adam, setup::to_vars(params)?)?;
            if let Some((m, v, t, _)) = resumed {
                (opt.m, opt.v, opt.t) = (m, v, t);
            }
            Inner::Reference(opt)
        };
        Ok(Self {
            inner,
            clip: choice.clip,
            last: None,
        })
    }

    /// This optimizer's exact state (masters, moments, `(updates, skips)` counters) as a new
    /// optimizer on `device`: another data-parallel rank. Deep copies, also on the same device,
    /// so the ranks never update one storage twice.
    pub fn replicate(
        &self,
        choice: OptimizerChoice,
        device: &Device,
        (adam_t, skipped): (u64, u64),
    ) -> TrainResult<Self> {
        let t = self.tensors()?;
        let copy = |x: &Tensor| x.to_device(device)?.copy();
        let params = t
            .params
            .iter()
            .map(|(n, x)| Ok((n.clone(), copy(x)?)))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let m =
            t.m.iter()
                .map(copy)
                .collect::<candle_core::Result<Vec<_>>>()?;
        let v =
            t.v.iter()
                .map(copy)
                .collect::<candle_core::Result<Vec<_>>>()?;
        Self::new(choice, params, Some((m, v, adam_t, skipped)))
    }

    pub fn is_fused(&self) -> bool {
        matches!(self.inner, Inner::Fused { .. })
    }

    /// The variables the drafter is built from and gradients are taken for: the f32 masters
    /// (reference) or the working weights (fused).
    pub fn vars(&self) -> &[(String, Var)] {
        match &self.inner {
            Inner::Reference(opt) => &opt.params,
            Inner::Fused { vars, .. } => vars,
        }
    }

    /// Whether a drafter built once over [`Self::vars`] in `dtype` sees every update (no
    /// cast between them, so it shares their storage).
    pub fn drafter_shares_storage(&self, dtype: DType) -> bool {
        self.vars().iter().all(|(_, v)| v.dtype() == dtype)
    }

    pub fn num_params(&self) -> usize {
        self.vars().iter().map(|(_, v)| v.elem_count()).sum()
    }

    /// One step with the step's accumulated gradients (`None`: the tensor got none, a zero
    /// gradient), clipped to the global norm, skipped when `loss` (an f32 scalar on the device)
    /// or the norm is not finite. Fused, it is only enqueued: [`Self::outcome`] says what it did.
    pub fn step(&mut self, grads: Vec<Option<Tensor>>, loss: &Tensor, lr: f64) -> TrainResult<()> {
        let vars = self.vars();
        // Gradients arrive in the compute dtype (one micro-batch) or f32 (accumulated); the
        // fused path casts them while packing its flat buffer.
        let fused = matches!(self.inner, Inner::Fused { .. });
        let grads = vars
            .iter()
            .zip(grads)
            .map(|((_, v), g)| match g {
                Some(g) if fused => Ok(g),
                Some(g) => g.to_dtype(DType::F32),
                None => Tensor::zeros(v.shape(), DType::F32, v.device()),
            })
            .collect::<candle_core::Result<Vec<_>>>()?;
        match &mut self.inner {
            Inner::Reference(opt) => {
                let step_loss = loss.to_dtype(DType::F32)?.to_scalar::<f32>()?;
                let norm = global_norm(&grads)?;
                let ran = step_loss.is_finite() && norm.is_finite();
                if ran {
                    // 0 turns clipping off, as in the fused kernel (adamw.cu).
                    let scale = if self.clip > 0.0 && norm > self.clip {
                        self.clip / (norm + 1e-6)
                    } else {
                        1.0
                    };
                    if scale < 1.0 {
                        let clipped = grads
                            .iter()
                            .map(|g| g * scale)
                            .collect::<candle_core::Result<Vec<_>>>()?;
                        opt.step(&clipped, lr)?;
                    } else {
                        opt.step(&grads, lr)?;
                    }
                }
                self.last = Some(StepOutcome {
                    ran,
                    norm,
                    adam_t: opt.t,
                });
            }
            Inner::Fused { flat, vars, .. } => {
                let flat_grad = pack_gradients(&grads)?;
                flat.step(&flat_grad, Some(loss), lr)?;
                // A skipped step left the working weights as they were: copying them is a
                // no-op then, and saves deciding it on the host.
                for ((_, var), w) in vars.iter().zip(flat.working_views()?) {
                    var.set(&w)?;
                }
                self.last = None;
            }
        }
        Ok(())
    }

    /// What the last [`Self::step`] did (fused: one read of the device state, after the step).
    pub fn outcome(&mut self) -> TrainResult<StepOutcome> {
        if let Some(o) = self.last {
            return Ok(o);
        }
        let Inner::Fused { flat, .. } = &self.inner else {
            unreachable!("the reference records its outcome in step")
        };
        let st = flat.read_state()?;
        let o = StepOutcome {
            ran: st.last_ran,
            norm: st.last_norm as f64,
            adam_t: st.steps,
        };
        self.last = Some(o);
        Ok(o)
    }

    /// Steps skipped as the fused optimizer's device counted them (None: reference).
    pub fn device_skipped(&self) -> TrainResult<Option<u64>> {
        match &self.inner {
            Inner::Reference(_) => Ok(None),
            Inner::Fused { flat, .. } => Ok(Some(flat.read_state()?.skipped)),
        }
    }

    /// The state of [`Self::tensors`] on the host, where no later step touches it, for a
    /// checkpoint written while training goes on: the reference optimizer updates its
    /// variables in place, so its tensors are copied; the fused one's flat buffers are copied
    /// whole into its reused staging buffers (returns once the copies are complete), to be cut
    /// per tensor by [`OptimizerSnapshot::into_tensors`] off the loop. Take the next one after
    /// the previous is dropped (the checkpoint writer does), or another set of host buffers is
    /// allocated.
    pub fn snapshot(&self) -> TrainResult<OptimizerSnapshot> {
        let opt = match &self.inner {
            Inner::Reference(opt) => opt,
            Inner::Fused {
                flat,
                vars,
                staging,
            } => {
                let (m, v) = flat.moments();
                let names = vars.iter().map(|(n, _)| n.clone()).collect();
                let segments = flat.segments().to_vec();
                let snap = staging.snapshot([flat.master(), m, v], names, segments)?;
                return Ok(OptimizerSnapshot::Flat(snap));
            }
        };
        let host = |x: &Tensor| -> candle_core::Result<Tensor> {
            if x.device().is_cpu() {
                x.copy()
            } else {
                x.to_device(&Device::Cpu)
            }
        };
        let copies = |xs: &[Tensor]| xs.iter().map(host).collect::<candle_core::Result<Vec<_>>>();
        Ok(OptimizerSnapshot::Tensors(OptimizerTensors {
            params: opt
                .params
                .iter()
                .map(|(n, x)| Ok((n.clone(), host(x.as_tensor())?)))
                .collect::<candle_core::Result<Vec<_>>>()?,
            m: copies(&opt.m)?,
            v: copies(&opt.v)?,
        }))
    }

    /// The f32 master weights per tensor, for the drafter written at the end of a run (fused:
    /// through the snapshot's staging buffers, idle once the last checkpoint is written,
    /// rather than [`Self::tensors`]' pageable copies).
    pub fn host_params(&self) -> TrainResult<Vec<(String, Tensor)>> {
        Ok(match &self.inner {
            Inner::Reference(_) => self.tensors()?.params,
            Inner::Fused { .. } => self.snapshot()?.into_tensors()?.params,
        })
    }

    /// The f32 masters and moments per tensor, as a checkpoint stores them (fused: copied to
    /// pageable host memory once per buffer, then cut per tensor there, all on the caller's
    /// thread; checkpoints take [`Self::snapshot`]).
    pub fn tensors(&self) -> TrainResult<OptimizerTensors> {
        match &self.inner {
            Inner::Reference(opt) => Ok(OptimizerTensors {
                params: opt
                    .params
                    .iter()
                    .map(|(n, v)| (n.clone(), v.as_tensor().clone()))
                    .collect(),
                m: opt.m.clone(),
                v: opt.v.clone(),
            }),
            Inner::Fused { flat, vars, .. } => {
                let (m, v) = flat.moments();
                let cut = |buf: &Tensor| -> TrainResult<Vec<Tensor>> {
                    let host = buf.to_vec1::<f32>()?;
                    flat.segments()
                        .iter()
                        .map(|(off, shape)| {
                            let n = shape.elem_count();
                            Ok(Tensor::from_slice(
                                &host[*off..off + n],
                                shape,
                                &Device::Cpu,
                            )?)
                        })
                        .collect()
                };
                let params = vars
                    .iter()
                    .map(|(n, _)| n.clone())
                    .zip(cut(flat.master())?)
                    .collect();
                Ok(OptimizerTensors {
                    params,
                    m: cut(m)?,
                    v: cut(v)?,
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A checkpoint written while training goes on must hold the state of its step: the
    /// reference optimizer updates its variables in place, so its snapshot is a copy.
    #[test]
    fn a_snapshot_keeps_its_step_while_later_steps_update_the_weights() {
        let choice = OptimizerChoice {
            fused: false,
            adam: AdamWConfig::default(),
            clip: 1.0,
            compute_dtype: DType::F32,
        };
        let w = Tensor::from_slice(&[1.0f32, -2.0], 2, &Device::Cpu).unwrap();
        let mut opt = TrainOptimizer::new(choice, vec![("w".into(), w)], None).unwrap();
        let loss = Tensor::new(1.0f32, &Device::Cpu).unwrap();
        let grad = || Some(Tensor::from_slice(&[0.5f32, -3.0], 2, &Device::Cpu).unwrap());
        opt.step(vec![grad()], &loss, 0.1).unwrap();
        let snap = opt.snapshot().unwrap().into_tensors().unwrap();
        let at_step_one = snap.params[0].1.to_vec1::<f32>().unwrap();
        let m_one = snap.m[0].to_vec1::<f32>().unwrap();
        opt.step(vec![grad()], &loss, 0.1).unwrap();
        assert_eq!(snap.params[0].1.to_vec1::<f32>().unwrap(), at_step_one);
        assert_eq!(snap.m[0].to_vec1::<f32>().unwrap(), m_one);
        let now = opt.tensors().unwrap().params[0].1.to_vec1::<f32>().unwrap();
        assert_ne!(now, at_step_one, "the second step moved the weights");
        // tensors() alone would have aliased them (why snapshot() exists).
        let aliased = opt.tensors().unwrap();
        opt.step(vec![grad()], &loss, 0.1).unwrap();
        assert_ne!(aliased.params[0].1.to_vec1::<f32>().unwrap(), now);
    }
}
