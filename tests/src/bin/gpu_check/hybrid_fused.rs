//! The hybrid's fused CUDA forward (`qwen3_5/cuda.rs`) against its plain path on the same
//! weights and cache (`gpu-check cuda --hybrid`): a decode step, a 16-token chain verify and
//! eight decode steps in a row (the staged conv windows and states carried between fused
//! steps), each from the same committed prefix. Reported: the largest logit difference, that
//! difference relative to the largest plain logit, and how many rows agree on the argmax.

use anyhow::{Context, Result};
use candle_core::Tensor;
use dflash_models::{AttnPattern, Qwen35Model, SeqForward, SequenceCache};
use serde_json::{json, Value};

pub(crate) fn logits(
    m: &Qwen35Model,
    cache: &mut SequenceCache,
    tokens: &[u32],
    start: usize,
) -> Result<Tensor> {
    let positions: Vec<u32> = (start as u32..(start + tokens.len()) as u32).collect();
    let rows: Vec<usize> = (0..tokens.len()).collect();
    m.forward(
        &mut [SeqForward {
            cache,
            tokens,
            positions: &positions,
            pattern: &AttnPattern::Causal,
            logit_rows: &rows,
        }],
        &[],
    )?
    .logits
    .context("logits")
}

/// Decode steps one token at a time; the logits of every step stacked.
fn steps(
    m: &Qwen35Model,
    cache: &mut SequenceCache,
    tokens: &[u32],
    start: usize,
) -> Result<Tensor> {
    let mut out = Vec::with_capacity(tokens.len());
    for (i, tok) in tokens.iter().enumerate() {
        out.push(logits(m, cache, std::slice::from_ref(tok), start + i)?);
    }
    Ok(Tensor::cat(&out, 0)?)
}

pub(crate) fn compare(fused: &Tensor, plain: &Tensor) -> Result<Value> {
    let f = fused.to_vec2::<f32>()?;
    let p = plain.to_vec2::<f32>()?;
    let argmax = |r: &[f32]| {
        r.iter()
            .enumerate()
            .fold(
                (0, f32::NEG_INFINITY),
                |b, (i, &v)| if v > b.1 { (i, v) } else { b },
            )
            .0
    };
    let (mut diff, mut scale, mut agree) = (0f32, 0f32, 0usize);
    for (fr, pr) in f.iter().zip(&p) {
        for (a, b) in fr.iter().zip(pr) {
            diff = diff.max((a - b).abs());
            scale = scale.max(b.abs());
        }
        agree += usize::from(argmax(fr) == argmax(pr));
    }
    Ok(json!({
        "max_abs_diff": diff,
        "max_abs_plain": scale,
        "rel_err": diff / scale,
        "argmax_agree": format!("{agree}/{}", p.len()),
    }))
}

/// Runs each case on `fused` and `plain` (one model with the fused path off) from the
/// cache's committed `start`, truncating back after each.
pub fn fused_vs_plain(
    fused: &Qwen35Model,
    plain: &Qwen35Model,
    cache: &mut SequenceCache,
    vocab: u32,
) -> Result<Value> {
    anyhow::ensure!(fused.fast_kernels(), "the fused hybrid path is not on");
    let start = cache.len();
    let toks = |n: u32, mul: u32| (0..n).map(|i| (i * mul + 11) % vocab).collect::<Vec<_>>();
    let mut res = serde_json::Map::new();
    for (name, tokens, one_by_one) in [
        ("decode_1", toks(1, 7919), false),
        ("verify_chain_16", toks(16, 7919), false),
        ("decode_8_steps", toks(8, 104729), true),
    ] {
        let mut run = |m: &Qwen35Model| -> Result<Tensor> {
            let out = if one_by_one {
                steps(m, cache, &tokens, start)?
            } else {
                logits(m, cache, &tokens, start)?
            };
            cache.truncate(start)?;
            Ok(out)
        };
        let f = run(fused)?;
        let p = run(plain)?;
        res.insert(name.into(), compare(&f, &p)?);
    }
    Ok(Value::Object(res))
}

/// Largest absolute difference of two tensors of one shape (0 where they are the same bits).
#[cfg(feature = "cuda")]
fn max_abs(a: &Tensor, b: &Tensor) -> Result<f32> {
    let d = (a.to_dtype(candle_core::DType::F32)? - b.to_dtype(candle_core::DType::F32)?)?;
    Ok(d.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?)
}

#[cfg(feature = "cuda")]
fn rel(a: &Tensor, b: &Tensor) -> Result<f32> {
    let a = a.to_dtype(candle_core::DType::F32)?.flatten_all()?;
    let b = b.to_dtype(candle_core::DType::F32)?.flatten_all()?;
    let diff = (&a - &b)?.abs()?.max(0)?.to_scalar::<f32>()?;
    let scale = b.abs()?.max(0)?.to_scalar::<f32>()?;
    Ok(diff / scale)
}

/// One 27B-shaped Gated DeltaNet layer's mixer, fused kernels against the plain
/// [`GatedDeltaNet::mix`] (recurrent form, per-row states), from a random state and conv
/// window: gated-norm outputs, the last row's state and conv window, relative to the
/// largest plain value, and both mixers' times.
pub fn gdn_layer(dev: &candle_core::Device, cfg: &dflash_common::HybridConfig) -> Result<Value> {
    #[cfg(feature = "cuda")]
    return gdn_layer_cuda(dev, cfg);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (dev, cfg);
        anyhow::bail!("the fused GDN mixer needs the cuda feature")
    }
}

#[cfg(feature = "cuda")]
fn gdn_layer_cuda(dev: &candle_core::Device, cfg: &dflash_common::HybridConfig) -> Result<Value> {
    use candle_core::DType;
    use dflash_models::cache::{GdnState, StagedState};
    use dflash_models::cuda::ChainOut;
    use dflash_models::qwen3_5::delta_rule::Forest;
    use dflash_models::qwen3_5::GatedDeltaNet;
    use dflash_models::random::WeightRng;
    let mut rng = WeightRng::new(7);
    let g = GatedDeltaNet::random(&mut rng, cfg, DType::BF16, dev)?;
    let p = g.conv_dim()
        + cfg.linear_num_value_heads * cfg.linear_value_head_dim
        + 2 * cfg.linear_num_value_heads;
    let k = cfg.linear_conv_kernel_dim;
    let state = GdnState {
        conv: rng.normal(&[k - 1, g.conv_dim()], 0.0, 1.0, DType::BF16, dev)?,
        ssm: rng.normal(
            &[
                cfg.linear_num_value_heads,
                cfg.linear_key_head_dim,
                cfg.linear_value_head_dim,
            ],
            0.0,
            0.1,
            DType::F32,
            dev,
        )?,
    };
    let mut res = serde_json::Map::new();
    for t in [1usize, 16] {
        let proj = rng.normal(&[t, p], 0.0, 1.0, DType::BF16, dev)?;
        let chain: Vec<Option<usize>> = (0..t).map(|i| i.checked_sub(1)).collect();
        let forest = Forest::new(&[chain.as_slice()], k, dev)?;
        let (y, staged) = g.mix(&proj, &forest, &[&state], &[true], false)?;
        let Some(StagedState::Rows(rows)) = staged.into_iter().next() else {
            anyhow::bail!("the plain mix kept no per-row states");
        };
        let last = rows.last().context("rows")?;
        let (yf, states, ext) = g.mix_fused(&proj, &state, ChainOut::EveryRow)?;
        let fused_ms = crate::time_ms(dev, 20, || {
            g.mix_fused(&proj, &state, ChainOut::EveryRow)?;
            Ok(())
        })?;
        let plain_ms = crate::time_ms(dev, 5, || {
            g.mix(&proj, &forest, &[&state], &[true], false)?;
            Ok(())
        })?;
        // The last row only, fresh and in place (a decode graph's form, on copies of the
        // state): the same bits as the every-row launch's last row.
        let (yl, sl, wl) = g.mix_fused(&proj, &state, ChainOut::LastRow)?;
        let own = GdnState {
            conv: state.conv.force_contiguous()?,
            ssm: state.ssm.force_contiguous()?,
        };
        let (yi, _, _) = g.mix_fused(&proj, &own, ChainOut::InPlace)?;
        let last_fused = states.get(t - 1)?;
        let window_fused = ext.narrow(0, t, k - 1)?;
        let forms_bits = [
            max_abs(&yl, &yf)?,
            max_abs(&sl.get(0)?, &last_fused)?,
            max_abs(&wl, &window_fused)?,
            max_abs(&yi, &yf)?,
            max_abs(&own.ssm.reshape(last_fused.shape())?, &last_fused)?,
            max_abs(&own.conv, &window_fused)?,
        ];
        res.insert(
            format!("t{t}"),
            json!({
                "last_row_and_in_place_max_diff": forms_bits.iter().cloned().fold(0f32, f32::max),
                "fused_mixer_ms": fused_ms,
                "plain_mixer_ms": plain_ms,
                "y_rel_err": rel(&yf, &y)?,
                "last_state_rel_err": rel(&states.get(t - 1)?, &last.ssm)?,
                "first_state_rel_err": rel(&states.get(0)?, &rows[0].ssm)?,
                "last_conv_window_rel_err": rel(&ext.narrow(0, t, k - 1)?, &last.conv)?,
            }),
        );
    }
    Ok(Value::Object(res))
}
