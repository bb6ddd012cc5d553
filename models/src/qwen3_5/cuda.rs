//! The fused-kernel forward of [`Qwen35Model`] (CUDA, bf16) for one sequence's short causal
//! chain: a decode step or a chain verify of up to [`cuda::GDN_MAX_CHAIN`] tokens; and, where
//! [`cuda::hybrid_fused_tree`] is on, its verify tree of up to
//! [`cuda::HYBRID_FUSED_TREE_MAX_NODES`] nodes (the GDN tree kernels,
//! the gated-attention kernels masking the new rows by ancestor bits, every product on
//! cuBLASLt).
//! Same contract and outputs as the plain path in `qwen3_5/forward.rs` (to bf16 rounding),
//! which stays the reference and takes everything else (batches, prefills, f32, CPU).
//!
//! Per layer: every projection through the skinny GEMMs with the input norm, the residual add
//! (and the next norm's sums of squares) and the SiLU-gate product fused around them
//! (`cuda/gemv.rs`); a Gated DeltaNet layer's mixer is the [`GdnPath`] the model's
//! [`crate::qwen3_5::GdnPaths`] name for the chain's length: `Chain` (decode's default:
//! `cuda/gdn.cu`'s `gdn_chain`, conv over the cached window and the new rows where they lie +
//! SiLU + L2 norms + decay/beta + the delta rule with the state in registers, then the gated
//! RMSNorm, which also writes the conv window to keep: two launches) or the split kernels
//! (`cuda/gdn_split.cu`: a prologue once per channel and token, a warp-shuffle scan over twice
//! the warps, the same gated RMSNorm). A gated full-attention layer
//! (head_dim 256, partial RoPE, sigmoid output gate: not the dense attention kernels' shape) is
//! three launches on the fused q|gate|k|v product (`cuda/gattn.cu`: q/k norm + RoPE + cache
//! write, split-K attention, merge x gate); other head sizes and paged caches run the plain
//! path's ops there.
//!
//! A forward that may be rolled back stages, per GDN layer, either the state after every row
//! (`Chain`, `SplitStates`: views into the kernel's one state buffer) or, on `SplitInputs`
//! (the verify default), the rows' inputs as the plain path does (pre-conv rows, keys, the
//! values the scan wrote, log-decays), from which the commit rebuilds the accepted row's state
//! in one launch per layer (`cache/recurrent.rs`). A longer forward stages only the last state.
//! `cuda::phases` marks label the launches for the benches' GPU-timeline profile.

use candle_core::{DType, Tensor};

use crate::batch::{ForwardOutput, SeqForward};
use crate::cache::{GdnState, RowInputs, StagedState};
use crate::cuda::phases::mark;
use crate::cuda::{self, ChainOut, RowNorm, ScanStates};
use crate::error::{ModelError, ModelResult};
use crate::layers::attention::{attend, AttnPattern};
use crate::qwen3_5::delta_rule::{dfs_order, Forest};
use crate::qwen3_5::{GatedAttention, GatedDeltaNet, GdnPath, Mixer, Qwen35Model};
use crate::taps::TapCollector;

impl Qwen35Model {
    /// Whether the fused forward applies to `batch` (see the module doc): one sequence's causal
    /// chain of up to [`cuda::GDN_MAX_CHAIN`] tokens, or, with [`cuda::hybrid_fused_tree`] on,
    /// its verify tree of up to [`cuda::HYBRID_FUSED_TREE_MAX_NODES`] nodes the GDN tree kernels
    /// take.
    pub(crate) fn takes_fused(&self, batch: &[SeqForward<'_>]) -> bool {
        let [s] = batch else { return false };
        let t = s.tokens.len();
        self.fast
            && t > 0
            && match s.pattern {
                AttnPattern::Causal => t <= cuda::GDN_MAX_CHAIN,
                AttnPattern::Tree { parents } => {
                    cuda::hybrid_fused_tree()
                        && t <= cuda::HYBRID_FUSED_TREE_MAX_NODES
                        && parents.len() == t
                        && dfs_order(parents, cuda::GDN_TREE_MAX_DEPTH).is_some()
                }
                _ => false,
            }
    }

    /// The fused forward of one causal chain or verify tree (checked by the caller:
    /// [`Self::takes_fused`]).
    pub(crate) fn forward_fused(
        &self,
        seq: &mut SeqForward<'_>,
        taps: &[usize],
    ) -> ModelResult<ForwardOutput> {
        let dev = self.device.clone();
        let t = seq.tokens.len();
        let tracker = seq.cache.row_tracker().ok_or_else(|| {
            ModelError::BadInput("a hybrid model needs a cache from Qwen35Model::new_cache".into())
        })?;
        tracker.check_extendable(seq.cache.len())?;
        let keep = t <= tracker.rollback;
        let tree = match seq.pattern {
            AttnPattern::Tree { parents } => Some(parents.as_slice()),
            _ => None,
        };
        // A tree's GDN layers share one plan of it (the plain path's `Forest`).
        let forest = match tree {
            Some(_) if !keep => {
                return Err(ModelError::BadInput(format!(
                    "a tree of {t} nodes exceeds the cache's rollback window of {} rows; create the cache with new_cache_with_rollback",
                    tracker.rollback
                )))
            }
            Some(p) => Some(Forest::new(&[p], self.cfg.linear_conv_kernel_dim, &dev)?),
            None => None,
        };
        // Its ancestor bits for the gated-attention kernels (one word a node: at most 64).
        let tree_bits = match &forest {
            Some(f) => f.ancestor_bits()?,
            None => None,
        };
        let len = seq.cache.len();
        let eps = self.cfg.rms_norm_eps;
        let positions = Tensor::new(seq.positions, &dev)?;
        let (cos, sin) = self.rope.gather(&positions)?;
        let (cos, sin) = (cos.to_dtype(self.dtype)?, sin.to_dtype(self.dtype)?);
        let mut x = self.embed(seq.tokens)?;
        let mut tapped = TapCollector::new(taps, self.layers.len());
        let mut staged: Vec<(usize, StagedState)> = Vec::new();
        // As in the dense fused stack: the one-row q/k/v (here: in-projection) kernel sums its
        // input row itself, so down makes no sums; with more rows the tensor-core residual
        // kernel always makes them (it needs the counter) and they feed the next input norm.
        let one_row = t == 1;
        let counter = Tensor::zeros(1, DType::U32, &dev)?;
        let products = Products {
            // Past a chain's 16 rows (trees) the skinny kernels lose at every shape measured.
            all_lt: t > cuda::GDN_MAX_CHAIN,
            rows: t,
            counter: &counter,
        };
        let mut ss: Option<Tensor> = None;
        for (li, layer) in self.layers.iter().enumerate() {
            let norm = RowNorm {
                ss: ss.as_ref(),
                weight: &layer.input_norm,
                eps,
            };
            let (mixed, o_proj) = match &layer.mixer {
                Mixer::Linear(g) => {
                    mark(&dev, "gdn.in_proj");
                    let proj = products.normed(&x, &g.in_proj, norm)?;
                    let state = seq.cache.layer(li).recurrent()?.last()?;
                    let (y, st) = match (&forest, tree) {
                        // As the plain path: the tree kernels where they take it.
                        (Some(f), Some(p)) => {
                            match self.gdn_kernels(g, &proj, f, p, state, true)? {
                                Some(out) => out,
                                None => g.mix_staged(&proj, f, p, state)?,
                            }
                        }
                        _ => gdn_mix(g, &proj, state, keep, self.gdn_paths.for_tokens(t))?,
                    };
                    staged.push((li, st));
                    (y, &g.out_proj)
                }
                Mixer::Full(attn) => {
                    let qkv_w = attn.fused_qkv().ok_or_else(|| {
                        ModelError::BadInput("fused forward on unfused weights".into())
                    })?;
                    mark(&dev, "attn.qkv");
                    let qkv = products.normed(&x, qkv_w, norm)?;
                    mark(&dev, "attn.mix");
                    let fused = fused_attention(seq, li, attn, &qkv, (&cos, &sin), t, tree_bits)?;
                    if let Some(mixed) = fused {
                        (mixed, attn.o_proj())
                    } else {
                        let mask = seq.pattern.mask(len, t, &dev)?;
                        let (nq, nk) = attn.qkv_widths();
                        let (q, k, v, gate) = attn.split_heads(
                            &qkv.narrow(1, 0, nq)?,
                            &qkv.narrow(1, nq, nk)?,
                            &qkv.narrow(1, nq + nk, nk)?,
                            &cos,
                            &sin,
                        )?;
                        seq.cache.write_kv(li, len, &k, &v)?;
                        let (kc, vc) = seq.cache.view_kv(li, len + t)?;
                        let a = attend(&q, &kc, &vc, mask.as_ref(), self.mode)?;
                        (attn.gated(&a, &gate)?.contiguous()?, attn.o_proj())
                    }
                }
            };
            let out_label = match &layer.mixer {
                Mixer::Linear(_) => "gdn.out_proj",
                Mixer::Full(_) => "attn.o_proj",
            };
            mark(&dev, out_label);
            let (x1, ss1) = products.resid(&mixed, o_proj, &x, true)?;
            mark(&dev, "mlp");
            let norm = RowNorm {
                ss: ss1.as_ref(),
                weight: &layer.post_norm,
                eps,
            };
            let (x2, ss2) = if layer.is_sparse() {
                // The next layer's input norm sums its rows itself (no sums from here).
                (layer.moe_block_normed(&x1, norm)?, None)
            } else {
                let (gate_up, down) = layer.fused_mlp()?;
                let act = products.silu(&x1, gate_up, norm)?;
                products.resid(&act, down, &x1, !one_row)?
            };
            x = x2;
            ss = ss2;
            tapped.layer_output(li, &x);
        }
        mark(&dev, "head");
        let h = cuda::rms_apply(
            &x,
            RowNorm {
                ss: ss.as_ref(),
                weight: &self.norm,
                eps,
            },
        )?;
        mark(&dev, "end");
        let chain: Vec<Option<usize>>;
        let parents = match tree {
            Some(p) => p,
            None => {
                chain = (0..t).map(|i| i.checked_sub(1)).collect();
                chain.as_slice()
            }
        };
        seq.cache
            .commit_recurrent(t, keep.then_some(parents), staged)?;
        let taps = tapped.finish(tapped.wants_final_norm().then_some(&h))?;
        let logits = if seq.logit_rows.is_empty() {
            None
        } else {
            let rows = if seq.logit_rows.len() == t
                && seq.logit_rows.iter().enumerate().all(|(i, &r)| r == i)
            {
                h
            } else {
                let r: Vec<u32> = seq.logit_rows.iter().map(|&r| r as u32).collect();
                h.index_select(&Tensor::new(r.as_slice(), &dev)?, 0)?
            };
            Some(products.plain(&rows, &self.lm_head)?.to_dtype(DType::F32)?)
        };
        Ok(ForwardOutput {
            logits,
            taps,
            token_offsets: vec![0, t],
            logit_offsets: vec![0, seq.logit_rows.len()],
        })
    }
}

/// The products of one fused chain forward: the skinny GEMMs with their fused norm, SiLU and
/// residual epilogues, or cuBLASLt products (residual folded in as beta = 1) with the norms and
/// the SiLU gate as their own launches: every product past a chain's rows (a tree), else the
/// unnormed ones [`cuda::hybrid_lt_product`] picks. Either way the residual products may return
/// the row sums of squares the next norm reads; where they do not, that norm sums its rows
/// itself.
struct Products<'a> {
    all_lt: bool,
    rows: usize,
    /// The skinny residual kernels' block counter.
    counter: &'a Tensor,
}

fn lt_product(x: &Tensor, w: &Tensor, resid: Option<&Tensor>) -> ModelResult<Tensor> {
    Ok(cuda::linear_lt_dense(x, w, resid)?)
}

impl Products<'_> {
    /// Whether the unnormed product with `w` runs on cuBLASLt.
    fn lt(&self, w: &Tensor) -> bool {
        self.all_lt || cuda::hybrid_lt_product(self.rows, w.elem_count())
    }

    /// `x @ wᵀ`.
    fn plain(&self, x: &Tensor, w: &Tensor) -> ModelResult<Tensor> {
        match self.lt(w) {
            true => lt_product(x, w, None),
            false => Ok(cuda::gemv(x, w, None)?),
        }
    }

    /// `norm(x) @ wᵀ` (cuBLASLt only for trees: the skinny kernels fold the norm in).
    fn normed(&self, x: &Tensor, w: &Tensor, norm: RowNorm<'_>) -> ModelResult<Tensor> {
        match self.all_lt {
            true => lt_product(&cuda::rms_apply(x, norm)?, w, None),
            false => Ok(cuda::gemv(x, w, Some(norm))?),
        }
    }

    /// `silu(g) * u` of `norm(x) @ wᵀ = [g | u]`.
    fn silu(&self, x: &Tensor, w: &Tensor, norm: RowNorm<'_>) -> ModelResult<Tensor> {
        match self.lt(w) {
            true => Ok(cuda::silu_mul(&lt_product(
                &cuda::rms_apply(x, norm)?,
                w,
                None,
            )?)?),
            false => Ok(cuda::gemv_silu(x, w, Some(norm))?),
        }
    }

    /// `resid + x @ wᵀ` and, where `sums` asks and the skinny kernel runs, its rows' sums of
    /// squares.
    fn resid(
        &self,
        x: &Tensor,
        w: &Tensor,
        resid: &Tensor,
        sums: bool,
    ) -> ModelResult<(Tensor, Option<Tensor>)> {
        match self.lt(w) {
            true => Ok((lt_product(x, w, Some(resid))?, None)),
            false => Ok(cuda::gemv_resid(
                x,
                w,
                resid,
                sums.then_some(self.counter),
                None,
            )?),
        }
    }
}

/// The gated-attention layer `li` of the chain or tree (`tree_bits`: its ancestor bits)
/// through `cuda/gattn.cu` (q/k norm + partial RoPE + the K/V write, split-K attention, the
/// gate), or None where the kernels do not take it (head size, a paged cache): the caller
/// runs the plain ops. The new rows are written
/// where [`crate::cache::SequenceCache::write_kv`] puts them and made live only by the commit, as there.
fn fused_attention(
    seq: &SeqForward<'_>,
    li: usize,
    attn: &GatedAttention,
    qkv: &Tensor,
    rope: (&Tensor, &Tensor),
    t: usize,
    tree_bits: Option<&Tensor>,
) -> ModelResult<Option<Tensor>> {
    let len = seq.cache.len();
    if !seq.cache.page_table().is_contiguous() {
        return Ok(None);
    }
    if len + t > seq.cache.backed_rows() {
        return Err(ModelError::CacheFull {
            len,
            requested: t,
            capacity: seq.cache.backed_rows(),
        });
    }
    let kv = seq.cache.layer(li).attention()?.buffers();
    Ok(match tree_bits {
        Some(bits) => attn.attend_tree_fused(qkv, rope, kv, len, bits)?,
        None => attn.attend_chain_fused(qkv, rope.0, rope.1, kv, len, None)?,
    })
}

impl Qwen35Model {
    /// A gated full-attention layer's attention for one sequence of a plain forward that starts
    /// from an empty cache and is causal (a prefill's first piece, a trainer's target forward):
    /// the new rows are every key, so the tensor-core varlen kernel (`cuda/attn_varlen.cu`,
    /// head dim 256) runs it in one launch in place of the plain path's materialised f32 scores
    /// (~8 GB of traffic a layer at 4K tokens, 24 heads). `q` `[nh, rows, d]`, `k`, `v` `[nkv,
    /// rows, d]` of the whole batch, the sequence on rows `off .. off + t`; returns `[t, nh *
    /// d]`. `None` where it does not apply (the caller attends over the cache as before).
    pub(crate) fn fresh_causal_attention(
        &self,
        (q, k, v): (&Tensor, &Tensor, &Tensor),
        (off, t): (usize, usize),
        committed: usize,
        pattern: &AttnPattern,
    ) -> ModelResult<Option<Tensor>> {
        if !self.fast
            || !cuda::hybrid_varlen_prefill()
            || committed != 0
            || t == 0
            || *pattern != AttnPattern::Causal
            || q.dtype() != DType::BF16
            || !cuda::varlen_head_dim_supported(q.dim(2)?)
        {
            return Ok(None);
        }
        let groups = q.dim(0)? / k.dim(0)?.max(1);
        let tiles = cuda::varlen_tiles(&[t], groups);
        let offsets = Tensor::new(&[off as u32, (off + t) as u32], &self.device)?;
        let tiles = Tensor::new(tiles.as_slice(), &self.device)?;
        let out = cuda::attention_varlen_causal(q, k, v, &offsets, &tiles)?;
        Ok(Some(out.narrow(0, off, t)?))
    }

    /// A GDN layer's mixer for one sequence of the plain path's forward on the CUDA kernels,
    /// where they apply: a prefill (`keep` false) on the split scan, a verify tree (`keep`) on
    /// the tree kernels when [`cuda::gdn_tree_kernel`] is on. `None`: the plain path's forms.
    pub(crate) fn gdn_kernels(
        &self,
        gdn: &GatedDeltaNet,
        proj: &Tensor,
        forest: &crate::qwen3_5::delta_rule::Forest,
        parents: &[Option<usize>],
        state: &GdnState,
        keep: bool,
    ) -> ModelResult<Option<(Tensor, StagedState)>> {
        if !self.fast {
            return Ok(None);
        }
        Ok(if !keep {
            gdn.mix_prefill_split(proj, state)?
        } else if cuda::gdn_tree_kernel() {
            gdn.mix_tree_split(proj, forest, parents, state)?
        } else {
            None
        })
    }
}

/// One GDN layer's mixer on the fused path `path` from `state`: the gated-norm output (the
/// `out_proj` input) and what the layer stages. `keep`: the forward may be rolled back, so
/// every row's state must be recoverable (a full state per row, or the rows' inputs);
/// otherwise only the state after the last row.
fn gdn_mix(
    g: &GatedDeltaNet,
    proj: &Tensor,
    state: &GdnState,
    keep: bool,
    path: GdnPath,
) -> ModelResult<(Tensor, StagedState)> {
    let t = proj.dim(0)?;
    let w1 = g.kernel - 1;
    // A row's conv window after it: the K-1 rows of [window; new rows] ending at it.
    let rows_staging = |ext: &Tensor, states: &Tensor| -> candle_core::Result<StagedState> {
        Ok(StagedState::Rows(
            (0..t)
                .map(|i| {
                    Ok(GdnState {
                        conv: ext.narrow(0, i + 1, w1)?,
                        ssm: states.get(i)?,
                    })
                })
                .collect::<candle_core::Result<Vec<_>>>()?,
        ))
    };
    let join = |state: &GdnState| Tensor::cat(&[&state.conv, &proj.narrow(1, 0, g.conv_dim())?], 0);
    Ok(match (path, keep) {
        (GdnPath::Chain, true) if t > 1 => {
            let (y, states, ext) = g.mix_fused(proj, state, ChainOut::EveryRow)?;
            mark(proj.device(), "gdn.stage");
            (y, rows_staging(&ext, &states)?)
        }
        (GdnPath::Chain, keep) => {
            // Only the last row's state and window, in buffers of their own: a decode step
            // staged for rollback is kept as it is at the commit (no copies).
            let (y, states, conv) = g.mix_fused(proj, state, ChainOut::LastRow)?;
            let last = GdnState {
                conv,
                ssm: states.get(0)?,
            };
            let staged = if keep {
                StagedState::OwnRows(vec![last])
            } else {
                StagedState::Final(last)
            };
            (y, staged)
        }
        (GdnPath::SplitStates, true) => {
            mark(proj.device(), "gdn.join");
            let ext = join(state)?;
            let out = g.mix_split(proj, state, ScanStates::All, false)?;
            let states = out
                .states
                .ok_or_else(|| ModelError::BadInput("gdn_split returned no states".into()))?;
            mark(proj.device(), "gdn.stage");
            (out.y, rows_staging(&ext, &states)?)
        }
        (GdnPath::SplitInputs, true) => {
            let out = g.mix_split(proj, state, ScanStates::None, true)?;
            mark(proj.device(), "gdn.stage");
            let writes = out.u.ok_or_else(|| {
                ModelError::BadInput("gdn_split returned no written values".into())
            })?;
            let st = StagedState::Inputs(RowInputs {
                pre_conv: proj.narrow(1, 0, g.conv_dim())?,
                k: out.k,
                writes,
                g: out.g,
            });
            (out.y, st)
        }
        (GdnPath::SplitStates | GdnPath::SplitInputs, false) => {
            let out = g.mix_split(proj, state, ScanStates::Last, false)?;
            let ssm = out
                .states
                .ok_or_else(|| ModelError::BadInput("gdn_split returned no state".into()))?;
            mark(proj.device(), "gdn.stage");
            let conv = join(state)?.narrow(0, t, w1)?.force_contiguous()?;
            (
                out.y,
                StagedState::Final(GdnState {
                    conv,
                    ssm: ssm.get(0)?,
                }),
            )
        }
    })
}
