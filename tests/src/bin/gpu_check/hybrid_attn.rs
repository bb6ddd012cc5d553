//! One 27B-shaped gated full-attention layer (`gpu-check cuda --hybrid`): the fused kernels
//! (`cuda/gattn.cu` through `GatedAttention::attend_chain_fused`) against the plain ops
//! (`split_heads`, the cache write, `attend`, `gated`) on the same random q|gate|k|v rows and a
//! random committed cache of 1K rows, in f32 (tight tolerance) and bf16 (the stated one), for
//! a decode step, a 16-token chain and a 64-node verify tree (DDTree-like: a 16-deep spine,
//! three side children per spine node; the kernels through `attend_tree_fused`, masking by
//! ancestor bits). Reported per case: the o_proj input's largest
//! difference over the largest plain value, the same for the K rows written to the cache, and
//! whether the V rows written are equal; both paths' times per call (and the fused one's by
//! keys per split); and wrong cases the tolerance must reject: the fused kernels given the RoPE
//! tables of positions 0.. instead of 1024.. (the rotation as good as skipped), and for the
//! tree, the fused kernels run as a causal chain over the same rows.

use anyhow::Result;
use serde_json::Value;

/// Largest |fused - plain| over the largest |plain|, allowed per dtype: f32 differs only in
/// the summation order (and the online softmax); bf16 in roundings the plain path makes and
/// the kernels do not (the bf16 QK^T scores and probabilities, RoPE in bf16 arithmetic).
#[cfg(feature = "cuda")]
const F32_TOL: f32 = 1e-4;
#[cfg(feature = "cuda")]
const BF16_TOL: f32 = 2e-2;

pub fn attn_layer(dev: &candle_core::Device, cfg: &dflash_common::HybridConfig) -> Result<Value> {
    #[cfg(feature = "cuda")]
    return cuda_impl::attn_layer(dev, cfg);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (dev, cfg);
        anyhow::bail!("the fused attention kernels need the cuda feature")
    }
}

#[cfg(feature = "cuda")]
mod cuda_impl {
    use anyhow::{Context, Result};
    use candle_core::{DType, Device, Tensor};
    use dflash_common::HybridConfig;
    use dflash_models::layers::attention::attend;
    use dflash_models::qwen3_5::GatedAttention;
    use dflash_models::random::WeightRng;
    use dflash_models::{AttnPattern, OpsMode};
    use serde_json::{json, Value};

    use super::{BF16_TOL, F32_TOL};

    fn rel(a: &Tensor, b: &Tensor) -> Result<f32> {
        let a = a.to_dtype(DType::F32)?.flatten_all()?;
        let b = b.to_dtype(DType::F32)?.flatten_all()?;
        let diff = (&a - &b)?.abs()?.max(0)?.to_scalar::<f32>()?;
        let scale = b.abs()?.max(0)?.to_scalar::<f32>()?;
        Ok(diff / scale)
    }

    /// RoPE tables `[t, r / 2]` of positions `p0 ..` (HF's default rope, as `layers/rope.rs`).
    fn rope(
        cfg: &HybridConfig,
        p0: usize,
        t: usize,
        dtype: DType,
        dev: &Device,
    ) -> Result<(Tensor, Tensor)> {
        let half = cfg.rotary_dim / 2;
        let (mut c, mut s) = (Vec::with_capacity(t * half), Vec::with_capacity(t * half));
        for p in p0..p0 + t {
            for i in 0..half {
                let inv = cfg
                    .rope_theta
                    .powf(-(2.0 * i as f64) / cfg.rotary_dim as f64);
                let a = p as f64 * inv;
                c.push(a.cos() as f32);
                s.push(a.sin() as f32);
            }
        }
        let mk = |v: Vec<f32>| -> Result<Tensor> {
            Ok(Tensor::from_vec(v, (t, half), dev)?.to_dtype(dtype)?)
        };
        Ok((mk(c)?, mk(s)?))
    }

    struct Case<'a> {
        attn: &'a GatedAttention,
        cfg: &'a HybridConfig,
        qkv: Tensor,
        kc: Tensor,
        vc: Tensor,
        c: usize,
        t: usize,
        /// A verify tree's parents and ancestor bits; None: a causal chain.
        tree: Option<(Vec<Option<usize>>, Tensor)>,
    }

    impl Case<'_> {
        /// The plain ops: o_proj input and the cache after the write.
        fn plain(&self, cos: &Tensor, sin: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
            let (nq, nk) = self.attn.qkv_widths();
            let (q, k, v, gate) = self.attn.split_heads(
                &self.qkv.narrow(1, 0, nq)?,
                &self.qkv.narrow(1, nq, nk)?,
                &self.qkv.narrow(1, nq + nk, nk)?,
                cos,
                sin,
            )?;
            let (kc, vc) = (self.kc.copy()?, self.vc.copy()?);
            kc.slice_set(&k, 1, self.c)?;
            vc.slice_set(&v, 1, self.c)?;
            let live = self.c + self.t;
            let pattern = match &self.tree {
                Some((parents, _)) => AttnPattern::Tree {
                    parents: parents.clone(),
                },
                None => AttnPattern::Causal,
            };
            let mask = pattern.mask(self.c, self.t, self.kc.device())?;
            let a = attend(
                &q,
                &kc.narrow(1, 0, live)?,
                &vc.narrow(1, 0, live)?,
                mask.as_ref(),
                OpsMode::Fused,
            )?;
            Ok((self.attn.gated(&a, &gate)?, kc, vc))
        }

        fn fused(&self, cos: &Tensor, sin: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
            let (kc, vc) = (self.kc.copy()?, self.vc.copy()?);
            let out = self.fused_into(cos, sin, (&kc, &vc), None)?;
            Ok((out, kc, vc))
        }

        /// The fused kernels over the same rows as a causal chain (a tree's wrong case).
        fn fused_as_chain(&self, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
            let (kc, vc) = (self.kc.copy()?, self.vc.copy()?);
            self.attn
                .attend_chain_fused(&self.qkv, cos, sin, (&kc, &vc), self.c, None)?
                .context("the fused kernels did not take the 27B head size")
        }

        fn fused_into(
            &self,
            cos: &Tensor,
            sin: &Tensor,
            cache: (&Tensor, &Tensor),
            keys_per_split: Option<usize>,
        ) -> Result<Tensor> {
            let out = match &self.tree {
                Some((_, bits)) => {
                    self.attn
                        .attend_tree_fused(&self.qkv, (cos, sin), cache, self.c, bits)?
                }
                None => self.attn.attend_chain_fused(
                    &self.qkv,
                    cos,
                    sin,
                    cache,
                    self.c,
                    keys_per_split,
                )?,
            };
            out.context("the fused kernels did not take the 27B head size")
        }

        fn new_rows(&self, x: &Tensor) -> Result<Tensor> {
            Ok(x.narrow(1, self.c, self.t)?)
        }
    }

    pub fn attn_layer(dev: &Device, cfg: &HybridConfig) -> Result<Value> {
        let (nh, nkv, d) = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        );
        let width = (2 * nh + 2 * nkv) * d;
        let (c, cap) = (1024usize, 1024 + 64);
        let mut res = serde_json::Map::new();
        for (dtype, tol) in [(DType::F32, F32_TOL), (DType::BF16, BF16_TOL)] {
            let mut rng = WeightRng::on_device();
            let attn = GatedAttention::random(&mut rng, cfg, dtype, dev, OpsMode::Fused)?;
            let kc = rng.normal(&[nkv, cap, d], 0.0, 1.0, dtype, dev)?;
            let vc = rng.normal(&[nkv, cap, d], 0.0, 1.0, dtype, dev)?;
            let (parents, _) = crate::hybrid::tree(64, false);
            let bits = Tensor::new(dflash_models::cuda::tree_bits(&parents).as_slice(), dev)?;
            for (label, t, tree) in [
                ("t1", 1usize, None),
                ("t16", 16, None),
                ("tree64", 64, Some((parents.clone(), bits.clone()))),
            ] {
                let is_tree = tree.is_some();
                let case = Case {
                    attn: &attn,
                    cfg,
                    qkv: rng.normal(&[t, width], 0.0, 1.0, dtype, dev)?,
                    kc: kc.clone(),
                    vc: vc.clone(),
                    c,
                    t,
                    tree,
                };
                let (cos, sin) = rope(case.cfg, c, t, dtype, dev)?;
                let (po, pk, pv) = case.plain(&cos, &sin)?;
                let (fo, fk, fv) = case.fused(&cos, &sin)?;
                let out_rel = rel(&fo, &po)?;
                let k_rel = rel(&case.new_rows(&fk)?, &case.new_rows(&pk)?)?;
                let v_equal = rel(&fv, &pv)? == 0.0;
                // The committed rows must be untouched.
                let committed_equal = rel(&fk.narrow(1, 0, c)?, &kc.narrow(1, 0, c)?)? == 0.0;
                let (wcos, wsin) = rope(case.cfg, 0, t, dtype, dev)?;
                let wrong_rel = rel(&case.fused(&wcos, &wsin)?.0, &po)?;
                let wrong_chain_rel = match is_tree {
                    true => Some(rel(&case.fused_as_chain(&cos, &sin)?, &po)?),
                    false => None,
                };
                // Per call, 20 back to back (launch overheads included, as the eager
                // forward sees them); the fused kernels on one cache copy (they rewrite the
                // same new rows), the plain ops with their cache copies.
                let (kc1, vc1) = (kc.copy()?, vc.copy()?);
                let per_call = |f: &mut dyn FnMut() -> Result<()>| -> Result<f64> {
                    Ok(crate::time_ms(dev, 5, || {
                        for _ in 0..20 {
                            f()?;
                        }
                        Ok(())
                    })? * 1e3
                        / 20.0)
                };
                let fused_us = per_call(&mut || {
                    case.fused_into(&cos, &sin, (&kc1, &vc1), None)?;
                    Ok(())
                })?;
                let plain_us = per_call(&mut || {
                    case.plain(&cos, &sin)?;
                    Ok(())
                })?;
                let mut sweep = serde_json::Map::new();
                // (The tree form is timed by the plan's split only.)
                let sweep_splits: &[usize] = match is_tree {
                    true => &[],
                    false => &[16, 32, 64, 128, 256],
                };
                for &kps in sweep_splits {
                    let us = per_call(&mut || {
                        case.fused_into(&cos, &sin, (&kc1, &vc1), Some(kps))?;
                        Ok(())
                    })?;
                    sweep.insert(format!("keys_per_split_{kps}"), json!(us));
                }
                res.insert(
                    format!("{dtype:?}_{label}").to_lowercase(),
                    json!({
                        "out_rel_err": out_rel,
                        "new_k_rows_rel_err": k_rel,
                        "v_rows_equal": v_equal,
                        "committed_rows_untouched": committed_equal,
                        "tolerance": tol,
                        "pass": out_rel <= tol && k_rel <= tol && v_equal && committed_equal,
                        "wrong_rope_positions_from_0_rel_err": wrong_rel,
                        "wrong_tree_run_as_chain_rel_err": wrong_chain_rel,
                        "wrong_case_rejected": wrong_rel > tol && wrong_chain_rel.is_none_or(|w| w > tol),
                        "fused_us_per_call": fused_us,
                        "plain_us_per_call_incl_cache_copy": plain_us,
                        "fused_us_per_call_by_split": sweep,
                    }),
                );
            }
        }
        Ok(Value::Object(res))
    }
}
