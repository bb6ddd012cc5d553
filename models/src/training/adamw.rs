//! Multi-tensor AdamW over flat f32 buffers, for the training engine: every parameter tensor
//! is a segment of one master buffer (with its two moments alongside) and, under bf16
//! compute, of one bf16 working buffer the update writes in the same pass, so a step is three
//! launches whatever the number of tensors (the per-tensor reference, `dflash-train`'s
//! `AdamW`, is ~15 kernels per tensor plus a re-cast of every weight).
//!
//! The global-norm clip and the non-finite skip are decided on the device (`cuda/adamw.cu`):
//! the step's plan (norm, clip scale, run or skip, bias corrections) and the counters of
//! steps taken and skipped stay in a small device buffer, so a step needs no host read;
//! [`FlatAdamW::read_state`] reads them when the host needs them (logging, checkpoints).
//! The update is PyTorch's AdamW with decoupled weight decay, in the reference's f32
//! arithmetic ([`AdamWConsts`]); on the CPU [`FlatAdamW::step`] runs the same
//! arithmetic on the host, which is the reference the GPU check compares the kernels with.

use candle_core::{DType, Result, Shape, Tensor};

use crate::cuda::AdamWConsts;

/// Hyperparameters (the reference's defaults: betas 0.9 / 0.999, eps 1e-8).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FlatAdamWConfig {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    /// Clip the global gradient norm to this (scale `clip / (norm + 1e-6)`); 0 turns it off.
    pub clip: f64,
}

impl Default for FlatAdamWConfig {
    fn default() -> Self {
        Self {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
            clip: 1.0,
        }
    }
}

/// What the device knows after the last step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FlatAdamWState {
    /// Updates applied (the bias-correction count).
    pub steps: u64,
    /// Steps skipped because the gradient norm or the loss was not finite.
    pub skipped: u64,
    /// The global norm of the last step's gradient (before clipping).
    pub last_norm: f32,
    /// Whether the last step ran.
    pub last_ran: bool,
}

const STATE_WORDS: usize = 7;

pub struct FlatAdamW {
    cfg: FlatAdamWConfig,
    /// `(offset, shape)` of each parameter tensor in the flat buffers.
    segments: Vec<(usize, Shape)>,
    /// f32 `[n]` master weights, first and second moments.
    master: Tensor,
    m: Tensor,
    v: Tensor,
    /// bf16 `[n]` working weights (None: the compute dtype is f32 and the master serves).
    working: Option<Tensor>,
    /// f32 `[7]`: steps, skipped, last norm, last ran, clip scale, 1/bc1, 1/bc2.
    state: Tensor,
    /// f32 scratch for the norm's partial sums (CUDA).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    partials: Option<Tensor>,
}

impl FlatAdamW {
    /// Flat buffers holding `params` (any float dtype, cast to f32) in order, on their device;
    /// `working = Some(BF16)` keeps a bf16 working copy.
    pub fn new(cfg: FlatAdamWConfig, params: &[Tensor], working: Option<DType>) -> Result<Self> {
        let Some(first) = params.first() else {
            candle_core::bail!("FlatAdamW: no parameters")
        };
        let dev = first.device().clone();
        let mut segments = Vec::with_capacity(params.len());
        let mut offset = 0;
        for p in params {
            segments.push((offset, p.shape().clone()));
            offset += p.elem_count();
        }
        let master = flatten(params)?;
        let working = match working {
            None | Some(DType::F32) => None,
            Some(DType::BF16) => Some(master.to_dtype(DType::BF16)?),
            Some(other) => candle_core::bail!("FlatAdamW: working copy in {other:?}; use bf16"),
        };
        let partials = if dev.is_cuda() {
            Some(Tensor::zeros(partials_len(), DType::F32, &dev)?)
        } else {
            None
        };
        Ok(Self {
            cfg,
            segments,
            m: master.zeros_like()?,
            v: master.zeros_like()?,
            master,
            working,
            state: Tensor::zeros(STATE_WORDS, DType::F32, &dev)?,
            partials,
        })
    }

    /// Flat buffers continuing a run (a checkpoint's per-tensor state, laid out as [`Self::new`]
    /// lays out `params`): moments `m` and `v`, `steps` updates applied (the bias-correction
    /// count) and `skipped` steps skipped. The counters live in f32 words on the device: exact
    /// up to 2^24 steps.
    pub fn restore(
        cfg: FlatAdamWConfig,
        params: &[Tensor],
        m: &[Tensor],
        v: &[Tensor],
        (steps, skipped): (u64, u64),
        working: Option<DType>,
    ) -> Result<Self> {
        let mut s = Self::new(cfg, params, working)?;
        let (m, v) = (flatten(m)?, flatten(v)?);
        if m.elem_count() != s.len() || v.elem_count() != s.len() {
            candle_core::bail!(
                "FlatAdamW: moments of {} / {} elements for {} parameters",
                m.elem_count(),
                v.elem_count(),
                s.len()
            )
        }
        (s.m, s.v) = (m, v);
        let mut words = vec![0f32; STATE_WORDS];
        (words[0], words[1]) = (steps as f32, skipped as f32);
        s.state = Tensor::from_vec(words, STATE_WORDS, s.master.device())?;
        Ok(s)
    }

    /// The first and second moments of each parameter, as views in its shape.
    pub fn moment_views(&self) -> Result<(Vec<Tensor>, Vec<Tensor>)> {
        Ok((self.views(&self.m)?, self.views(&self.v)?))
    }

    /// `(offset, shape)` of each parameter in the flat buffers.
    pub fn segments(&self) -> &[(usize, Shape)] {
        &self.segments
    }

    /// The flat f32 master weights (the moments: [`Self::moments`]).
    pub fn master(&self) -> &Tensor {
        &self.master
    }

    pub fn len(&self) -> usize {
        self.master.elem_count()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The master weights of each parameter, as views in its shape.
    pub fn master_views(&self) -> Result<Vec<Tensor>> {
        self.views(&self.master)
    }

    /// The working weights (bf16 views, or the master's under f32 compute).
    pub fn working_views(&self) -> Result<Vec<Tensor>> {
        self.views(self.working.as_ref().unwrap_or(&self.master))
    }

    pub fn moments(&self) -> (&Tensor, &Tensor) {
        (&self.m, &self.v)
    }

    fn views(&self, buf: &Tensor) -> Result<Vec<Tensor>> {
        self.segments
            .iter()
            .map(|(off, shape)| buf.narrow(0, *off, shape.elem_count())?.reshape(shape))
            .collect()
    }

    /// One step with `grad` (f32 `[n]`, e.g. [`flatten`] of the parameters' gradients) at
    /// learning rate `lr`. With `loss` (an f32 scalar on the device), a non-finite loss skips
    /// the step too. Stream-ordered on CUDA: nothing is read back.
    pub fn step(&mut self, grad: &Tensor, loss: Option<&Tensor>, lr: f64) -> Result<()> {
        let c = self.consts(lr);
        let loss = loss
            .map(|l| l.to_dtype(DType::F32)?.reshape(1))
            .transpose()?;
        #[cfg(feature = "cuda")]
        if let Some(partials) = &self.partials {
            return crate::cuda::adamw_step(
                &self.master,
                &self.m,
                &self.v,
                self.working.as_ref(),
                grad,
                loss.as_ref(),
                &self.state,
                partials,
                c,
            );
        }
        self.step_host(grad, loss.as_ref(), c)
    }

    fn consts(&self, lr: f64) -> AdamWConsts {
        let c = self.cfg;
        AdamWConsts {
            lr: lr as f32,
            beta1: c.beta1 as f32,
            one_minus_beta1: (1.0 - c.beta1) as f32,
            beta2: c.beta2 as f32,
            one_minus_beta2: (1.0 - c.beta2) as f32,
            eps: c.eps as f32,
            lr_wd: (lr * c.weight_decay) as f32,
            clip: c.clip as f32,
        }
    }

    /// The host reference of `adamw.cu`: the same plan and the same f32 update.
    fn step_host(&mut self, grad: &Tensor, loss: Option<&Tensor>, c: AdamWConsts) -> Result<()> {
        let n = self.len();
        if grad.dtype() != DType::F32 || grad.elem_count() != n {
            candle_core::bail!("FlatAdamW: the gradient must be f32 with {n} elements")
        }
        let g = grad.flatten_all()?.to_vec1::<f32>()?;
        let mut st = self.state.to_vec1::<f32>()?;
        let total: f64 = g.iter().map(|&x| (x as f64) * (x as f64)).sum();
        let norm = (total as f32).sqrt();
        let loss_ok = match loss {
            Some(l) => l.flatten_all()?.to_vec1::<f32>()?[0].is_finite(),
            None => true,
        };
        let finite = norm.is_finite() && loss_ok;
        st[2] = norm;
        st[3] = if finite { 1.0 } else { 0.0 };
        if !finite {
            st[1] += 1.0;
            self.state = Tensor::from_vec(st, STATE_WORDS, self.state.device())?;
            return Ok(());
        }
        st[0] += 1.0;
        let t = st[0] as f64;
        st[4] = if c.clip > 0.0 && norm > c.clip {
            c.clip / (norm + 1e-6)
        } else {
            1.0
        };
        st[5] = (1.0 / (1.0 - (c.beta1 as f64).powf(t))) as f32;
        st[6] = (1.0 / (1.0 - (c.beta2 as f64).powf(t))) as f32;
        let (scale, inv_bc1, inv_bc2) = (st[4], st[5], st[6]);
        let mut p = self.master.to_vec1::<f32>()?;
        let mut m = self.m.to_vec1::<f32>()?;
        let mut v = self.v.to_vec1::<f32>()?;
        for i in 0..n {
            let gi = g[i] * scale;
            let mi = m[i] * c.beta1 + gi * c.one_minus_beta1;
            let vi = v[i] * c.beta2 + (gi * gi) * c.one_minus_beta2;
            let upd = (mi * inv_bc1) / ((vi * inv_bc2).sqrt() + c.eps);
            let mut next = p[i] - upd * c.lr;
            if c.lr_wd != 0.0 {
                next -= p[i] * c.lr_wd;
            }
            p[i] = next;
            m[i] = mi;
            v[i] = vi;
        }
        let dev = self.master.device().clone();
        self.master = Tensor::from_vec(p, n, &dev)?;
        self.m = Tensor::from_vec(m, n, &dev)?;
        self.v = Tensor::from_vec(v, n, &dev)?;
        if self.working.is_some() {
            self.working = Some(self.master.to_dtype(DType::BF16)?);
        }
        self.state = Tensor::from_vec(st, STATE_WORDS, &dev)?;
        Ok(())
    }

    /// Reads the device state (one small copy: call it when the host needs the numbers).
    pub fn read_state(&self) -> Result<FlatAdamWState> {
        let st = self.state.to_vec1::<f32>()?;
        Ok(FlatAdamWState {
            steps: st[0] as u64,
            skipped: st[1] as u64,
            last_norm: st[2],
            last_ran: st[3] != 0.0,
        })
    }
}

/// The scratch length of the device norm (its partial sums; any length on the CPU).
fn partials_len() -> usize {
    #[cfg(feature = "cuda")]
    {
        crate::cuda::SUMSQ_BLOCKS
    }
    #[cfg(not(feature = "cuda"))]
    {
        1
    }
}

/// `tensors` as one contiguous f32 `[Σ elements]` buffer, in order.
pub fn flatten(tensors: &[Tensor]) -> Result<Tensor> {
    let flat = tensors
        .iter()
        .map(|t| t.to_dtype(DType::F32)?.flatten_all())
        .collect::<Result<Vec<_>>>()?;
    Tensor::cat(&flat, 0)
}

/// Gradients (bf16 or f32) as one contiguous f32 `[Σ elements]` buffer, in order, for
/// [`FlatAdamW::step`]: on CUDA one cast-and-pack pass per tensor into one allocation
/// (`cuda::pack_f32`; exact, a bf16 value is an f32 value), elsewhere [`flatten`].
pub fn pack_gradients(tensors: &[Tensor]) -> Result<Tensor> {
    #[cfg(feature = "cuda")]
    if let Some(first) = tensors.first() {
        if first.device().is_cuda()
            && tensors.iter().all(|t| {
                t.device().same_device(first.device())
                    && matches!(t.dtype(), DType::BF16 | DType::F32)
            })
        {
            return crate::cuda::pack_f32(tensors);
        }
    }
    flatten(tensors)
}
