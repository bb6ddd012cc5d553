//! The one-launch attention (`attn_decode.rs`) against the two-launch path and the plain
//! ops, and the two against each other in time, on the GPU (CI has none): `dflash-serve
//! bench` runs these through `check::kernel_errors` and reports them in `kernel_checks`.

use candle_core::{DType, Device, Result, Tensor};

use crate::layers::attention::{attend, AttnPattern};
use crate::layers::ops::{rms_norm, rope, OpsMode};

use super::{attn_decode, kernels};

/// `(max |a - b|, max |b|)` in f32.
pub(super) fn max_err(a: &Tensor, b: &Tensor) -> Result<(f32, f32)> {
    let a = a.to_dtype(DType::F32)?;
    let b = b.to_dtype(DType::F32)?;
    let d = (&a - &b)?
        .abs()?
        .flatten_all()?
        .max(0)?
        .to_scalar::<f32>()?;
    let s = b.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
    Ok((d, s))
}

/// The plain path's q or k heads `start .. start + heads` of `qkv` (`[t, (nh + 2 nkv) d]`):
/// per-head RMSNorm with `w`, then RoPE with the gathered `cos`/`sin` rows; `[t, heads, d]`.
pub(super) fn plain_norm_rope(
    qkv: &Tensor,
    (start, heads, d): (usize, usize, usize),
    w: &Tensor,
    (cos, sin): (&Tensor, &Tensor),
    eps: f64,
) -> Result<Tensor> {
    let t = qkv.dim(0)?;
    let y = qkv
        .narrow(1, start * d, heads * d)?
        .reshape((t, heads, d))?;
    rope(
        &rms_norm(&y, w, eps, OpsMode::Fused)?,
        cos,
        sin,
        OpsMode::Fused,
    )
}

/// The one-launch attention (`fused_attention`) against `qk_norm_rope_cache` + `attention`
/// and against the plain ops (rms_norm + rope + attend over the cache with the new rows
/// appended): the output, the whole K/V caches it leaves (new rows written, nothing else
/// touched) and a second launch (bit-identical: fixed merge order, counters re-armed).
pub(super) fn fused_attention_errors(
    dev: &Device,
    out: &mut Vec<(String, f32, f32)>,
) -> Result<()> {
    let bf = |t: Tensor| t.to_dtype(DType::BF16);
    let (nh, nkv, d, eps) = (8usize, 2usize, 128usize, 1e-6);
    let chain = |t: usize| -> Vec<Option<usize>> { (0..t).map(|i| i.checked_sub(1)).collect() };
    let bushy = |t: usize| -> Vec<Option<usize>> {
        (0..t)
            .map(|i| if i == 0 { None } else { Some((i * 7 + 3) % i) })
            .collect()
    };
    // (name, context, tokens, tree parents, split plan: None = split_plan, Some(cps) = that
    // many chunks per split, 0 = set on the device from the live length as forwards do,
    // 16-row tiles per block: None = by the row count).
    type Case = (
        &'static str,
        usize,
        usize,
        Option<Vec<Option<usize>>>,
        Option<usize>,
        Option<usize>,
    );
    let cases: [Case; 10] = [
        ("t1_ctx1k", 1023, 1, None, None, None),
        ("t1_ctx1k_device_split", 1023, 1, None, Some(0), None),
        ("t1_ctx8k", 8191, 1, None, None, None),
        ("t1_ctx8k_device_split", 8191, 1, None, Some(0), None),
        ("t4_ctx1k_device_split", 1020, 4, None, Some(0), None),
        ("t5_ctx7", 7, 5, None, None, None),
        ("t16_causal_ctx1k", 1000, 16, None, None, None),
        ("t16_causal_ctx1k_rt1", 1000, 16, None, None, Some(1)),
        ("t64_tree_ctx1k", 1000, 64, Some(bushy(64)), None, None),
        (
            "t64_chain_tree_ctx1k_3_chunks_per_split_rt1",
            1000,
            64,
            Some(chain(64)),
            Some(3),
            Some(1),
        ),
    ];
    for (name, c, t, parents, plan, rt) in cases {
        let cap = c + t + 100;
        let qkv = bf(Tensor::randn(0f32, 2.0, (t, (nh + 2 * nkv) * d), dev)?)?;
        let qn = bf(Tensor::randn(1f32, 0.2, d, dev)?)?;
        let kn = bf(Tensor::randn(1f32, 0.2, d, dev)?)?;
        let ang = Tensor::randn(0f32, 3.0, (cap, d / 2), dev)?;
        let (cos, sin) = (ang.cos()?, ang.sin()?);
        let pos_v: Vec<u32> = (c as u32..(c + t) as u32).collect();
        let pos = Tensor::new(pos_v.as_slice(), dev)?;
        let kc0 = bf(Tensor::randn(0f32, 1.0, (nkv, cap, d), dev)?)?;
        let vc0 = bf(Tensor::randn(0f32, 1.0, (nkv, cap, d), dev)?)?;
        let len = Tensor::new(&[c as u32], dev)?;
        let bits = match &parents {
            Some(p) => Some(Tensor::from_vec(
                super::tree_bits(p),
                (t, t.div_ceil(64)),
                dev,
            )?),
            None => None,
        };
        // The fused kernel's plan: None the one set on the device (what forwards use).
        let split = match plan {
            None => Some(kernels::split_plan(c + t, t, nh, nkv)),
            Some(0) => None,
            Some(cps) => Some(((c + t).div_ceil(kernels::CHUNK * cps), cps)),
        };
        // Two launches: qk_norm_rope_cache + attention.
        let (kc2, vc2) = (kc0.copy()?, vc0.copy()?);
        let rows = kernels::QkvRows {
            qkv: &qkv,
            q_norm: &qn,
            k_norm: &kn,
            cos: &cos,
            sin: &sin,
            positions: &pos,
            cache_len: &len,
            kc: &kc2,
            vc: &vc2,
            pages: None,
            heads: (nh, nkv, d),
            eps,
        };
        let q = kernels::qk_norm_rope_cache(&rows)?;
        let two = kernels::attention(&q, &kc2, &vc2, None, &len, bits.as_ref())?;
        // One launch, twice on fresh copies of the cache.
        let mut fused = Vec::new();
        for _ in 0..2 {
            let (kc1, vc1) = (kc0.copy()?, vc0.copy()?);
            let o = attn_decode::fused_attention_rt(
                rt,
                &kernels::QkvRows {
                    kc: &kc1,
                    vc: &vc1,
                    pages: None,
                    ..rows
                },
                bits.as_ref(),
                split,
            )?;
            fused.push((o, kc1, vc1));
        }
        let (o, kc1, vc1) = &fused[0];
        // Plain ops: norm + RoPE, the new rows appended to the committed ones, attend.
        let (cr, sr) = (cos.index_select(&pos, 0)?, sin.index_select(&pos, 0)?);
        let head = |start: usize, heads: usize, w: &Tensor| -> Result<Tensor> {
            plain_norm_rope(&qkv, (start, heads, d), w, (&cr, &sr), eps)
        };
        let qp = head(0, nh, &qn)?.transpose(0, 1)?.contiguous()?;
        let kp = head(nh, nkv, &kn)?.transpose(0, 1)?;
        let vp = qkv
            .narrow(1, (nh + nkv) * d, nkv * d)?
            .reshape((t, nkv, d))?
            .transpose(0, 1)?;
        let kall = Tensor::cat(&[&kc0.narrow(1, 0, c)?, &kp], 1)?.contiguous()?;
        let vall = Tensor::cat(&[&vc0.narrow(1, 0, c)?, &vp], 1)?.contiguous()?;
        let pattern = match &parents {
            Some(p) => AttnPattern::Tree { parents: p.clone() },
            None => AttnPattern::Causal,
        };
        let mask = pattern.mask(c, t, dev)?;
        let plain = attend(&qp, &kall, &vall, mask.as_ref(), OpsMode::Fused)?;
        let tag = match split {
            Some((n, cps)) => format!("fused_attention:{name}:plan{n}x{cps}"),
            None => format!("fused_attention:{name}:plan_on_device"),
        };
        for (what, a, b) in [
            ("vs_two_launch", o, &two),
            ("vs_plain", o, &plain),
            ("second_launch_vs_first", &fused[1].0, o),
            ("k_cache_vs_two_launch", kc1, &kc2),
            ("v_cache_vs_two_launch", vc1, &vc2),
            ("new_k_rows_vs_plain", &kc1.narrow(1, c, t)?, &kp),
            ("new_v_rows_vs_plain", &vc1.narrow(1, c, t)?, &vp),
        ] {
            let (e, s) = max_err(a, b)?;
            out.push((format!("{tag}:{what}"), e, s));
        }
    }
    Ok(())
}

/// The cache-less varlen causal attention (`attn_varlen.cu`) against the plain ops per
/// sequence, at the Qwen3-8B (d 128, 32 / 8 heads) and Qwen3.6 gated-attention (d 256, 24 / 4)
/// shapes: a packed batch of two sequences, and one sequence addressed by its offsets inside
/// the batch's rows (how the hybrid's prefill calls it).
pub fn varlen_attention_errors(dev: &Device, out: &mut Vec<(String, f32, f32)>) -> Result<()> {
    let bf = |t: Tensor| t.to_dtype(DType::BF16);
    for (nh, nkv, d) in [(32usize, 8usize, 128usize), (24, 4, 256)] {
        let lens = [300usize, 1000];
        let total: usize = lens.iter().sum();
        let q = bf(Tensor::randn(0f32, 1.0, (nh, total, d), dev)?)?;
        let k = bf(Tensor::randn(0f32, 1.0, (nkv, total, d), dev)?)?;
        let v = bf(Tensor::randn(0f32, 1.0, (nkv, total, d), dev)?)?;
        let mut plain = Vec::new();
        let mut off = 0;
        for &t in &lens {
            let mask = AttnPattern::Causal.mask(0, t, dev)?;
            let rows = |x: &Tensor| x.narrow(1, off, t);
            plain.push(attend(
                &rows(&q)?,
                &rows(&k)?,
                &rows(&v)?,
                mask.as_ref(),
                OpsMode::Fused,
            )?);
            off += t;
        }
        let plain_all = Tensor::cat(&plain, 0)?;
        let groups = nh / nkv;
        let offs = Tensor::new(&[0u32, lens[0] as u32, total as u32], dev)?;
        let tiles = Tensor::new(super::varlen_tiles(&lens, groups).as_slice(), dev)?;
        let fast = super::attention_varlen_causal(&q, &k, &v, &offs, &tiles)?;
        let (e, s) = max_err(&fast, &plain_all)?;
        out.push((
            format!("attention_varlen:h{nh}_kv{nkv}_d{d}:t300+1000:vs_plain"),
            e,
            s,
        ));
        let offs = Tensor::new(&[lens[0] as u32, total as u32], dev)?;
        let tiles = Tensor::new(super::varlen_tiles(&lens[1..], groups).as_slice(), dev)?;
        let one = super::attention_varlen_causal(&q, &k, &v, &offs, &tiles)?;
        let (e, s) = max_err(&one.narrow(0, lens[0], lens[1])?, &plain[1])?;
        out.push((
            format!("attention_varlen:h{nh}_kv{nkv}_d{d}:t1000_at300:vs_plain"),
            e,
            s,
        ));
    }
    Ok(())
}

/// Microseconds per layer of the attention step, Qwen3-8B heads (32 / 8, d 128), inside a
/// CUDA graph of 20 repetitions: `(case, two_launch_us, fused_us)` for decode at 1K and 8K
/// (the fused kernel with `split_plan`'s plan, the one set on the device, and one-chunk splits
/// over a 40K-row cache) and 4 / 16 / 64 new tokens over 1K and 8K (`_rtN`: the fused kernel
/// with N 16-row tiles per block; `_block`: a draft block, every token seeing the whole block;
/// `_capN`: a cache of N rows).
pub fn decode_attention_timings(dev: &Device) -> Result<Vec<(String, f64, f64)>> {
    let (nh, nkv, d, eps) = (32usize, 8usize, 128usize, 1e-6);
    let bf = |t: Tensor| t.to_dtype(DType::BF16);
    let mut out = Vec::new();
    // (context, tokens, mask: 0 causal / 1 chain tree / 2 whole block, the fused kernel's
    // split plan: 0 split_plan's, 1 set on the device as forwards do, 2 one-chunk splits over
    // the whole capacity (what step graphs gave it before), row tiles, cache rows: 0 for 64
    // past the new tokens, else that many, as the engine's caches of max_context rows); the
    // two-launch path plans its splits itself.
    for (c, t, tree, plan, rt, cap_rows) in [
        (1023usize, 1usize, 0u8, 0usize, None, 0usize),
        (1023, 1, 0, 1, None, 0),
        (1023, 1, 0, 1, None, 40960),
        (1023, 1, 0, 2, None, 40960),
        (8191, 1, 0, 0, None, 0),
        (8191, 1, 0, 1, None, 0),
        (1020, 4, 0, 1, None, 0),
        (1008, 16, 0, 1, None, 0),
        (1008, 16, 0, 1, None, 40960),
        (1008, 16, 0, 1, Some(1), 0),
        (1008, 16, 2, 1, None, 0),
        (8176, 16, 0, 1, None, 0),
        (960, 64, 1, 1, None, 0),
        (960, 64, 1, 1, Some(1), 0),
        (8128, 64, 1, 1, None, 0),
    ] {
        let cap = if cap_rows == 0 { c + t + 64 } else { cap_rows };
        let qkv = bf(Tensor::randn(0f32, 2.0, (t, (nh + 2 * nkv) * d), dev)?)?;
        let qn = bf(Tensor::randn(1f32, 0.2, d, dev)?)?;
        let ang = Tensor::randn(0f32, 3.0, (cap, d / 2), dev)?;
        let (cos, sin) = (ang.cos()?, ang.sin()?);
        let pos_v: Vec<u32> = (c as u32..(c + t) as u32).collect();
        let pos = Tensor::new(pos_v.as_slice(), dev)?;
        let kc = bf(Tensor::randn(0f32, 1.0, (nkv, cap, d), dev)?)?;
        let vc = bf(Tensor::randn(0f32, 1.0, (nkv, cap, d), dev)?)?;
        let len = Tensor::new(&[c as u32], dev)?;
        let bits = match tree {
            1 => {
                let chain: Vec<Option<usize>> = (0..t).map(|i| i.checked_sub(1)).collect();
                Some(Tensor::from_vec(super::tree_bits(&chain), (t, 1), dev)?)
            }
            2 => Some(Tensor::from_vec(
                vec![(u64::MAX >> (64 - t)) as i64; t],
                (t, 1),
                dev,
            )?),
            _ => None,
        };
        let split = match plan {
            0 => Some(kernels::split_plan(c + t, t, nh, nkv)),
            1 => None,
            _ => Some((cap.div_ceil(kernels::CHUNK), 1)),
        };
        let rows = kernels::QkvRows {
            qkv: &qkv,
            q_norm: &qn,
            k_norm: &qn,
            cos: &cos,
            sin: &sin,
            positions: &pos,
            cache_len: &len,
            kc: &kc,
            vc: &vc,
            pages: None,
            heads: (nh, nkv, d),
            eps,
        };
        let two = || -> crate::error::ModelResult<()> {
            for _ in 0..20 {
                let q = kernels::qk_norm_rope_cache(&rows)?;
                kernels::attention(&q, &kc, &vc, None, &len, bits.as_ref())?;
            }
            Ok(())
        };
        let one = || -> crate::error::ModelResult<()> {
            for _ in 0..20 {
                attn_decode::fused_attention_rt(rt, &rows, bits.as_ref(), split)?;
            }
            Ok(())
        };
        let mut us = [0f64; 2];
        for (i, body) in [&two as &dyn Fn() -> crate::error::ModelResult<()>, &one]
            .into_iter()
            .enumerate()
        {
            let graph = crate::cuda::decoder_stack::capture_graph(dev, body)
                .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
            let launch = || -> Result<()> {
                graph
                    .launch()
                    .map_err(|e| candle_core::Error::Msg(e.to_string()))
            };
            launch()?;
            dev.synchronize()?;
            let start = std::time::Instant::now();
            for _ in 0..10 {
                launch()?;
            }
            dev.synchronize()?;
            us[i] = start.elapsed().as_secs_f64() * 1e6 / 200.0;
        }
        let kind = ["eager_split", "device_split", "capacity_split"][plan.min(2)];
        let kind = if cap_rows == 0 {
            kind.to_string()
        } else {
            format!("{kind}_cap{cap_rows}")
        };
        let tiles = rt.map(|r| format!("_rt{r}")).unwrap_or_default();
        let block = if tree == 2 { "_block" } else { "" };
        out.push((format!("t{t}_ctx{c}_{kind}{tiles}{block}"), us[0], us[1]));
    }
    Ok(out)
}
