//! The Gated DeltaNet token mixer of `linear_attention` layers (HF `Qwen3_5GatedDeltaNet`,
//! `Qwen3NextGatedDeltaNet`): one projection to q|k|v (short causal depthwise conv + SiLU),
//! z (output gate), b (write strength) and a (decay), the delta rule per value head, then a
//! gated RMSNorm and `out_proj`.
//!
//! The conv and the recurrence follow each token's *path*: a token's conv window is its
//! ancestors' inputs (or the cached window once the path reaches the committed prefix), and its
//! state starts from its parent's. For a causal chunk that is the ordinary sequence; for a
//! verify tree it keeps sibling branches apart.

use candle_core::{DType, Device, Result, Tensor, D};
use dflash_common::{HybridConfig, WeightFiles};

use crate::cache::{GdnState, RowInputs, StagedState};
use crate::error::{ModelError, ModelResult};
use crate::layers::decoder_layer::linear;
use crate::layers::ops::{rms_norm, OpsMode};
use crate::qwen3_5::delta_rule::{
    chunked, chunked_writes, recurrent, tree_writes, DeltaInputs, Forest, CHUNK,
};
use crate::random::WeightRng;

#[cfg(feature = "cuda")]
mod tree;

/// Which delta-rule form a forward that settles uses (tests pin one to compare them);
/// rollback-able forwards always take the tree form (the chunked one for chains longer than a
/// chunk), see [`GatedDeltaNet::mix_staged`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeltaForm {
    /// Chunked for multi-token forwards, recurrent for single tokens (HF's choice: recurrent
    /// only for cached single-token steps).
    #[default]
    Auto,
    Recurrent,
    Chunked,
}

#[derive(Debug, Clone)]
pub struct GatedDeltaNet {
    /// `[q | k | v | z | b | a]` rows stacked: one GEMM for all six projections.
    pub(crate) in_proj: Tensor,
    /// Depthwise conv taps `[K, conv_dim]` (tap K-1 multiplies the current token).
    conv_taps: Tensor,
    /// `-exp(A_log)` and `dt_bias`, f32 `[Hv]`.
    neg_a: Tensor,
    dt_bias: Tensor,
    norm: Tensor,
    pub(crate) out_proj: Tensor,
    hk: usize,
    hv: usize,
    dk: usize,
    dv: usize,
    pub(crate) kernel: usize,
    eps: f64,
}

fn werr(e: candle_core::Error) -> ModelError {
    ModelError::Candle(e)
}

impl GatedDeltaNet {
    fn dims(cfg: &HybridConfig) -> (usize, usize, usize, usize, usize) {
        (
            cfg.linear_num_key_heads,
            cfg.linear_num_value_heads,
            cfg.linear_key_head_dim,
            cfg.linear_value_head_dim,
            cfg.linear_conv_kernel_dim,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn assemble(
        cfg: &HybridConfig,
        qkv: Tensor,
        z: Tensor,
        b: Tensor,
        a: Tensor,
        conv: Tensor,
        a_log: Tensor,
        dt_bias: Tensor,
        norm: Tensor,
        out_proj: Tensor,
    ) -> Result<Self> {
        let (hk, hv, dk, dv, kernel) = Self::dims(cfg);
        let conv_dim = cfg.conv_dim();
        Ok(Self {
            in_proj: Tensor::cat(&[&qkv, &z, &b, &a], 0)?,
            conv_taps: conv.reshape((conv_dim, kernel))?.t()?.contiguous()?,
            neg_a: a_log.to_dtype(DType::F32)?.exp()?.neg()?,
            dt_bias: dt_bias.to_dtype(DType::F32)?,
            norm,
            out_proj,
            hk,
            hv,
            dk,
            dv,
            kernel,
            eps: cfg.rms_norm_eps,
        })
    }

    /// Loads `{p}.linear_attn.*` in the Qwen3.5 split layout (`in_proj_qkv`, `in_proj_z`,
    /// `in_proj_b`, `in_proj_a`) or the Qwen3-Next fused one (`in_proj_qkvz`, `in_proj_ba`,
    /// interleaved per key-head group), which is de-interleaved here into the split order.
    pub fn load(
        w: &WeightFiles,
        p: &str,
        cfg: &HybridConfig,
        dtype: DType,
        device: &Device,
    ) -> ModelResult<Self> {
        let (hk, hv, dk, dv, kernel) = Self::dims(cfg);
        let h = cfg.hidden_size;
        let conv_dim = cfg.conv_dim();
        let t =
            |name: &str, shape: &[usize]| w.tensor(&format!("{p}.{name}"), shape, dtype, device);
        let f32t = |name: &str, shape: &[usize]| {
            w.tensor(&format!("{p}.{name}"), shape, DType::F32, device)
        };
        let split = w.contains(&format!("{p}.in_proj_qkv.weight"));
        let fused = w.contains(&format!("{p}.in_proj_qkvz.weight"));
        let (qkv, z, b, a) = match (split, fused) {
            (true, false) => (
                t("in_proj_qkv.weight", &[conv_dim, h])?,
                t("in_proj_z.weight", &[hv * dv, h])?,
                t("in_proj_b.weight", &[hv, h])?,
                t("in_proj_a.weight", &[hv, h])?,
            ),
            (false, true) => {
                let r = hv / hk;
                let qkvz = t("in_proj_qkvz.weight", &[2 * hk * dk + 2 * hv * dv, h])?
                    .reshape((hk, 2 * dk + 2 * r * dv, h))
                    .map_err(werr)?;
                let ba = t("in_proj_ba.weight", &[2 * hv, h])?
                    .reshape((hk, 2 * r, h))
                    .map_err(werr)?;
                let part = |x: &Tensor, from: usize, n: usize| -> Result<Tensor> {
                    x.narrow(1, from, n)?.contiguous()?.reshape((hk * n, h))
                };
                let q = part(&qkvz, 0, dk).map_err(werr)?;
                let k = part(&qkvz, dk, dk).map_err(werr)?;
                let v = part(&qkvz, 2 * dk, r * dv).map_err(werr)?;
                let z = part(&qkvz, 2 * dk + r * dv, r * dv).map_err(werr)?;
                let qkv = Tensor::cat(&[&q, &k, &v], 0).map_err(werr)?;
                (
                    qkv,
                    z,
                    part(&ba, 0, r).map_err(werr)?,
                    part(&ba, r, r).map_err(werr)?,
                )
            }
            (true, true) => {
                return Err(ModelError::Inconsistent(format!(
                    "{}: `{p}` has both the split (in_proj_qkv) and the fused (in_proj_qkvz) Gated DeltaNet projections; the checkpoint mixes two layouts",
                    w.dir().display()
                )))
            }
            (false, false) => {
                return Err(ModelError::Inconsistent(format!(
                    "{}: `{p}` has neither in_proj_qkv (Qwen3.5 layout) nor in_proj_qkvz (Qwen3-Next layout), but config.json says this layer is linear_attention{}",
                    w.dir().display(),
                    if w.contains(&format!("{}.self_attn.q_proj.weight", p.trim_end_matches(".linear_attn"))) {
                        "; the checkpoint has full-attention weights here, so layer_types does not match the weights"
                    } else {
                        ""
                    }
                )))
            }
        };
        Ok(Self::assemble(
            cfg,
            qkv,
            z,
            b,
            a,
            t("conv1d.weight", &[conv_dim, 1, kernel])?,
            f32t("A_log", &[hv])?,
            f32t("dt_bias", &[hv])?,
            t("norm.weight", &[dv])?,
            t("out_proj.weight", &[h, hv * dv])?,
        )?)
    }

    pub fn random(
        rng: &mut WeightRng,
        cfg: &HybridConfig,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let (_, hv, _, dv, kernel) = Self::dims(cfg);
        let h = cfg.hidden_size;
        let conv_dim = cfg.conv_dim();
        Self::assemble(
            cfg,
            rng.linear(conv_dim, h, dtype, device)?,
            rng.linear(hv * dv, h, dtype, device)?,
            rng.linear(hv, h, dtype, device)?,
            rng.linear(hv, h, dtype, device)?,
            rng.normal(&[conv_dim, 1, kernel], 0.0, 0.5, dtype, device)?,
            // A = exp(A_log) around e: decays well inside (0, 1) per token.
            rng.normal(&[hv], 1.0, 0.5, DType::F32, device)?,
            rng.normal(&[hv], 1.0, 0.3, DType::F32, device)?,
            rng.norm(dv, dtype, device)?,
            rng.linear(h, hv * dv, dtype, device)?,
        )
    }

    /// The same layer with its model-dtype weights cast to `dtype` (the f32 decay terms stay
    /// as they are): a bf16 layer's exact f32 copy, the reference of the kernel checks.
    pub fn to_dtype(&self, dtype: DType) -> Result<Self> {
        Ok(Self {
            in_proj: self.in_proj.to_dtype(dtype)?,
            conv_taps: self.conv_taps.to_dtype(dtype)?,
            neg_a: self.neg_a.clone(),
            dt_bias: self.dt_bias.clone(),
            norm: self.norm.to_dtype(dtype)?,
            out_proj: self.out_proj.to_dtype(dtype)?,
            ..*self
        })
    }

    pub fn conv_dim(&self) -> usize {
        2 * self.hk * self.dk + self.hv * self.dv
    }

    /// A zero state (a fresh sequence) for this layer.
    pub fn zero_state(&self, dtype: DType, device: &Device) -> Result<GdnState> {
        GdnState::zeros(
            self.kernel - 1,
            self.conv_dim(),
            (self.hv, self.dk, self.dv),
            dtype,
            device,
        )
    }

    /// All projections of already-normed rows `x: [rows, hidden]` in one GEMM.
    pub fn project(&self, x: &Tensor) -> Result<Tensor> {
        linear(x, &self.in_proj)
    }

    /// `out_proj` of the gated-norm outputs `[rows, Hv * dv]`.
    pub fn out(&self, y: &Tensor) -> Result<Tensor> {
        linear(y, &self.out_proj)
    }

    /// Whether a forward of `t` tokens that keeps no per-token state runs the chunked form.
    pub fn use_chunked(t: usize, keep_rows: bool, form: DeltaForm) -> bool {
        !keep_rows
            && match form {
                DeltaForm::Auto => t > 1,
                DeltaForm::Chunked => true,
                DeltaForm::Recurrent => false,
            }
    }

    /// The token mixer for the sequences (segments) of `forest`. `proj` holds their rows of
    /// [`Self::project`] in the forest's combined order; `states` and `keep_rows` are per
    /// segment. With `chunked` (one segment only) the chunked form runs; otherwise the
    /// recurrence steps all segments' tokens of one depth together. Returns the gated-norm
    /// output `[t, Hv * dv]` (before `out_proj`) and each segment's states to stage: one per
    /// row where `keep_rows`, else only the final one.
    pub fn mix(
        &self,
        proj: &Tensor,
        forest: &Forest,
        states: &[&GdnState],
        keep_rows: &[bool],
        chunked_form: bool,
    ) -> Result<(Tensor, Vec<StagedState>)> {
        let t = forest.len();
        let dtype = proj.dtype();
        let kernel = self.kernel;
        let Front {
            inp,
            ext,
            gathered,
            z,
            ..
        } = self.front(proj, forest, states)?;
        let (o, staged) = if chunked_form {
            if states.len() != 1 {
                candle_core::bail!("the chunked delta rule runs one sequence at a time");
            }
            let (o, s) = chunked(&inp, &states[0].ssm)?;
            // A compact copy, so that the window does not keep the whole chunk's input alive
            // (candle's `copy()` would clone the whole buffer behind the view).
            let conv = ext.narrow(0, t, kernel - 1)?.force_contiguous()?;
            (o, vec![StagedState::Final(GdnState { conv, ssm: s })])
        } else {
            let initial = if states.len() == 1 {
                states[0].ssm.unsqueeze(0)?
            } else {
                let ssm: Vec<&Tensor> = states.iter().map(|s| &s.ssm).collect();
                Tensor::stack(&ssm, 0)?
            };
            let (o, row_states) = recurrent(&inp, forest, &initial)?;
            // A token's window after it is its own last K-1 taps.
            let windows = gathered.narrow(1, 1, kernel - 1)?;
            let mut staged = Vec::with_capacity(states.len());
            for (&(off, len), &keep) in forest.segments.iter().zip(keep_rows) {
                staged.push(if keep {
                    StagedState::Rows(
                        (off..off + len)
                            .map(|i| {
                                Ok(GdnState {
                                    conv: windows.get(i)?,
                                    ssm: row_states[i].clone(),
                                })
                            })
                            .collect::<Result<Vec<_>>>()?,
                    )
                } else {
                    let last = off + len - 1;
                    StagedState::Final(GdnState {
                        conv: windows.get(last)?.force_contiguous()?,
                        ssm: row_states[last].force_contiguous()?,
                    })
                });
            }
            (o, staged)
        };
        let y = self.gated_norm(&o.to_dtype(dtype)?, &z)?;
        Ok((y.reshape((t, self.hv * self.dv))?, staged))
    }

    /// Everything before the delta rule, shared by [`Self::mix`] and [`Self::mix_staged`].
    fn front(&self, proj: &Tensor, forest: &Forest, states: &[&GdnState]) -> Result<Front> {
        let t = forest.len();
        let (hk, hv, dk, dv, kernel) = (self.hk, self.hv, self.dk, self.dv, self.kernel);
        let conv_dim = self.conv_dim();
        let mixed = proj.narrow(1, 0, conv_dim)?.contiguous()?;
        let z = proj.narrow(1, conv_dim, hv * dv)?;
        let b = proj.narrow(1, conv_dim + hv * dv, hv)?;
        let a = proj.narrow(1, conv_dim + hv * dv + hv, hv)?;

        // Short causal conv along each token's path, then SiLU. Each segment's block is its
        // cached window followed by its new rows.
        let mut blocks = Vec::with_capacity(2 * forest.segments.len());
        for (state, &(off, len)) in states.iter().zip(&forest.segments) {
            blocks.push(state.conv.clone());
            blocks.push(mixed.narrow(0, off, len)?);
        }
        let ext = Tensor::cat(&blocks, 0)?;
        let gathered = ext
            .index_select(&forest.conv_taps, 0)?
            .reshape((t, kernel, conv_dim))?;
        let u = gathered
            .broadcast_mul(&self.conv_taps.unsqueeze(0)?)?
            .sum(1)?
            .silu()?;

        let v = u.narrow(1, 2 * hk * dk, hv * dv)?.reshape((t, hv, dv))?;
        // q and k of every key head side by side: one L2 normalisation (in f32) for both.
        let qk = u
            .narrow(1, 0, 2 * hk * dk)?
            .reshape((t, 2 * hk, dk))?
            .to_dtype(DType::F32)?;
        let inv = (qk.sqr()?.sum_keepdim(D::Minus1)? + 1e-6)?
            .sqrt()?
            .recip()?;
        let qk = qk.broadcast_mul(&inv)?;
        let key_heads = qk.narrow(1, hk, hk)?;
        let q = expand_heads((qk.narrow(1, 0, hk)? * (1.0 / (dk as f64).sqrt()))?, hv)?;
        let k = expand_heads(key_heads.clone(), hv)?;
        let v = v.to_dtype(DType::F32)?;
        let beta = candle_nn::ops::sigmoid(&b.to_dtype(DType::F32)?.contiguous()?)?;
        let g = softplus(&a.to_dtype(DType::F32)?.broadcast_add(&self.dt_bias)?)?
            .broadcast_mul(&self.neg_a)?;
        Ok(Front {
            inp: DeltaInputs { q, k, v, g, beta },
            key_heads,
            mixed,
            ext,
            gathered,
            z: z.reshape((t, hv, dv))?,
        })
    }

    /// The token mixer of one sequence's rollback-able forward (a chain or tree verify of
    /// `parents`, the forest's one segment, from `state`): every row's output from the tree
    /// (ancestor-mask) form of the delta rule (the chunked form for chains longer than a
    /// chunk), and instead of a state per row the rows'
    /// [`RowInputs`], from which the commit rebuilds the accepted row's state (see
    /// [`crate::cache::recurrent`]). Returns the gated-norm output `[t, Hv * dv]`.
    pub fn mix_staged(
        &self,
        proj: &Tensor,
        forest: &Forest,
        parents: &[Option<usize>],
        state: &GdnState,
    ) -> Result<(Tensor, StagedState)> {
        let t = forest.len();
        let dtype = proj.dtype();
        let f = self.front(proj, forest, &[state])?;
        // Chains longer than a chunk take the chunked form (prefill's numerics, memory linear
        // in t); trees and short chains the tree form (a tree cannot be chunked).
        let chain = parents
            .iter()
            .enumerate()
            .all(|(i, &p)| p == i.checked_sub(1));
        let (o, writes) = if chain && t > CHUNK {
            let (o, _, u) = chunked_writes(&f.inp, &state.ssm)?;
            (o, u)
        } else {
            tree_writes(&f.inp, parents, &state.ssm)?
        };
        let staged = StagedState::Inputs(RowInputs {
            pre_conv: f.mixed,
            k: f.key_heads.contiguous()?,
            writes,
            g: f.inp.g,
        });
        let y = self.gated_norm(&o.to_dtype(dtype)?, &f.z)?;
        Ok((y.reshape((t, self.hv * self.dv))?, staged))
    }

    /// The fused CUDA form of [`Self::mix`] for one sequence's causal chain of `t <=`
    /// [`crate::cuda::GDN_MAX_CHAIN`] rows (`proj` `[t, P]` bf16, from `state`): the gated-norm
    /// output `[t, Hv * dv]`, the states and the conv window rows `out` asks for
    /// ([`crate::cuda::ChainOut`]: every row's, where rows `i+1 .. i+K` of
    /// `[state.conv; new q|k|v rows]` are row i's window, or the last row's).
    #[cfg(feature = "cuda")]
    pub fn mix_fused(
        &self,
        proj: &Tensor,
        state: &GdnState,
        out: crate::cuda::ChainOut,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let w = self.kernel_weights();
        crate::cuda::gdn_chain(&state.conv, proj, &state.ssm, &w, out)
    }

    /// The split fused form (`cuda/gdn_split.cu`: prologue, warp-shuffle scan, gated norm) of
    /// [`Self::mix_fused`], reading the conv window from `state` and the new rows from `proj`
    /// directly; the states it writes and whether it writes each row's `u` are the caller's
    /// choice (see [`crate::cuda::gdn_split`]).
    #[cfg(feature = "cuda")]
    pub fn mix_split(
        &self,
        proj: &Tensor,
        state: &GdnState,
        states: crate::cuda::ScanStates,
        writes: bool,
    ) -> Result<crate::cuda::SplitOut> {
        let w = self.kernel_weights();
        crate::cuda::gdn_split(&state.conv, proj, &state.ssm, &w, states, writes)
    }

    /// The layer's weights as the CUDA kernels take them.
    #[cfg(feature = "cuda")]
    fn kernel_weights(&self) -> crate::cuda::GdnWeights<'_> {
        crate::cuda::GdnWeights {
            conv_taps: &self.conv_taps,
            neg_a: &self.neg_a,
            dt_bias: &self.dt_bias,
            norm: &self.norm,
            hk: self.hk,
            hv: self.hv,
            eps: self.eps,
        }
    }

    /// Whether the split / tree kernels take `proj` (`[t, P]`) from `state`: CUDA bf16 rows
    /// with an f32 state, head size 128, a conv kernel they hold, up to their token limit.
    #[cfg(feature = "cuda")]
    fn kernels_apply(&self, proj: &Tensor, state: &GdnState) -> Result<bool> {
        Ok(proj.device().is_cuda()
            && proj.dtype() == DType::BF16
            && state.ssm.dtype() == DType::F32
            && self.dk == crate::cuda::GDN_HEAD_DIM
            && self.dv == crate::cuda::GDN_HEAD_DIM
            && self.kernel <= crate::cuda::GDN_MAX_CONV
            && (1..=crate::cuda::GDN_SPLIT_MAX_T).contains(&proj.dim(0)?)
            && proj.is_contiguous())
    }

    /// A prefill's mixer (one sequence, no per-row state kept) on the split kernels
    /// (`cuda/gdn_split.cu`: the exact recurrence with the state in registers, tokens staged
    /// 16 at a time) instead of the chunked form's many small ops (2.6 s for a 4K-token
    /// prefill at the 27B shape, H100: 0.11 of the matmul rate). `None` where the kernels do
    /// not apply (not CUDA bf16 with f32 state, head size not 128, too many tokens); the caller
    /// then runs [`Self::mix`].
    #[cfg(feature = "cuda")]
    pub fn mix_prefill_split(
        &self,
        proj: &Tensor,
        state: &GdnState,
    ) -> Result<Option<(Tensor, StagedState)>> {
        let t = proj.dim(0)?;
        let w1 = self.kernel - 1;
        if !self.kernels_apply(proj, state)? {
            return Ok(None);
        }
        let out = self.mix_split(proj, state, crate::cuda::ScanStates::Last, false)?;
        let ssm = match out.states {
            Some(s) => s.get(0)?,
            None => candle_core::bail!("gdn_split returned no last state"),
        };
        // The window after the last row: the last K-1 rows of [cached window; new rows].
        let rows = proj.narrow(1, 0, self.conv_dim())?;
        let conv = if t >= w1 {
            rows.narrow(0, t - w1, w1)?.contiguous()?
        } else {
            Tensor::cat(&[&state.conv.narrow(0, t, w1 - t)?, &rows], 0)?
        };
        Ok(Some((out.y, StagedState::Final(GdnState { conv, ssm }))))
    }

    /// HF `Qwen3_5RMSNormGated`: RMS-normalise (f32 inside), times the plain (not zero-centred)
    /// weight, times `silu(z)` in f32, cast back.
    fn gated_norm(&self, o: &Tensor, z: &Tensor) -> Result<Tensor> {
        let dtype = o.dtype();
        let normed = rms_norm(&o.contiguous()?, &self.norm, self.eps, OpsMode::Fused)?;
        (normed.to_dtype(DType::F32)? * z.to_dtype(DType::F32)?.silu()?)?.to_dtype(dtype)
    }
}

/// What [`GatedDeltaNet::front`] makes of the projected rows.
struct Front {
    /// The delta rule's inputs (keys and queries expanded to the value heads).
    inp: DeltaInputs,
    /// L2-normalised keys per key head `[t, Hk, dk]` (f32), before the expansion.
    key_heads: Tensor,
    /// The pre-conv q|k|v rows `[t, conv_dim]`.
    mixed: Tensor,
    /// Each segment's `[cached window ; new rows]`, stacked.
    ext: Tensor,
    /// Every token's conv taps `[t, K, conv_dim]`.
    gathered: Tensor,
    /// The output gate `[t, Hv, dv]`.
    z: Tensor,
}

/// Value head j reads key head j / r (HF repeat_interleave): `[t, Hk, d]` to `[t, Hv, d]`.
fn expand_heads(x: Tensor, hv: usize) -> Result<Tensor> {
    let (t, hk, d) = x.dims3()?;
    x.unsqueeze(2)?
        .broadcast_as((t, hk, hv / hk, d))?
        .reshape((t, hv, d))
}

/// `log(1 + e^x)`, linear above 20 as torch's default threshold.
fn softplus(x: &Tensor) -> Result<Tensor> {
    let soft = (x.exp()? + 1.0)?.log()?;
    x.ge(20.0)?.where_cond(x, &soft)
}
