//! Each fused kernel against the plain candle ops it replaces, on random inputs, on the GPU
//! (CI has none): `dflash-serve bench` runs these and reports the errors; the model-level
//! check there compares whole forwards.

use candle_core::{DType, Device, Result, Tensor};

use crate::layers::attention::{attend, AttnPattern};
use crate::layers::ops::{rms_norm, OpsMode};

use super::check_attn::{max_err, plain_norm_rope};
use super::{attn_prefill, gemv, kernels};

pub use super::check_attn::{decode_attention_timings, varlen_attention_errors};
pub use super::check_gdn::gdn_chunked_report;

/// Milliseconds per call of `f`, 20 back-to-back host launches after one warm-up.
fn host_loop_ms(dev: &Device, f: &dyn Fn() -> Result<Tensor>) -> Result<f64> {
    f()?;
    dev.synchronize()?;
    let t = std::time::Instant::now();
    for _ in 0..20 {
        f()?;
    }
    dev.synchronize()?;
    Ok(t.elapsed().as_secs_f64() * 1e3 / 20.0)
}

/// (kernel, max |fast - plain|, max |plain|) per kernel.
pub fn kernel_errors(dev: &Device) -> Result<Vec<(String, f32, f32)>> {
    let mut out = Vec::new();
    let bf = |t: Tensor| t.to_dtype(DType::BF16);
    let (nh, nkv, d, cap, eps) = (8usize, 2usize, 128usize, 512usize, 1e-6);

    // q/k norm + RoPE + cache write.
    let (t, c0) = (5usize, 7usize);
    let qkv = bf(Tensor::randn(0f32, 2.0, (t, (nh + 2 * nkv) * d), dev)?)?;
    let qn = bf(Tensor::randn(1f32, 0.2, d, dev)?)?;
    let kn = bf(Tensor::randn(1f32, 0.2, d, dev)?)?;
    let ang = Tensor::randn(0f32, 3.0, (64, d / 2), dev)?;
    let (cos, sin) = (ang.cos()?, ang.sin()?);
    let pos = Tensor::new(&[3u32, 9, 9, 40, 63], dev)?;
    let kc = bf(Tensor::zeros((nkv, cap, d), DType::F32, dev)?)?;
    let vc = kc.copy()?;
    let len = Tensor::new(&[c0 as u32], dev)?;
    let full_rows = kernels::QkvRows {
        qkv: &qkv,
        q_norm: &qn,
        k_norm: &kn,
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
    let q = kernels::qk_norm_rope_cache(&full_rows)?;
    let (cr, sr) = (cos.index_select(&pos, 0)?, sin.index_select(&pos, 0)?);
    let head = |start: usize, heads: usize, w: &Tensor| -> Result<Tensor> {
        plain_norm_rope(&qkv, (start, heads, d), w, (&cr, &sr), eps)
    };
    let (e, s) = max_err(&q, &head(0, nh, &qn)?)?;
    out.push(("qk_norm_rope_cache:q".into(), e, s));
    let k_plain = head(nh, nkv, &kn)?.transpose(0, 1)?;
    let (e, s) = max_err(&kc.narrow(1, c0, t)?, &k_plain)?;
    out.push(("qk_norm_rope_cache:k_cache".into(), e, s));
    let v_plain = qkv
        .narrow(1, (nh + nkv) * d, nkv * d)?
        .reshape((t, nkv, d))?
        .transpose(0, 1)?;
    let (e, s) = max_err(&vc.narrow(1, c0, t)?, &v_plain)?;
    out.push(("qk_norm_rope_cache:v_cache".into(), e, s));
    // K/V-only rows (the drafter's context) against the cache rows written from full rows.
    let (kc2, vc2) = (kc.zeros_like()?, vc.zeros_like()?);
    let kv_rows = qkv.narrow(1, nh * d, 2 * nkv * d)?.contiguous()?;
    kernels::kv_norm_rope_cache(&kernels::QkvRows {
        qkv: &kv_rows,
        kc: &kc2,
        vc: &vc2,
        pages: None,
        ..full_rows
    })?;
    for (name, a, b) in [("k", &kc2, &kc), ("v", &vc2, &vc)] {
        let (e, s) = max_err(a, b)?;
        out.push((format!("kv_norm_rope_cache:{name}_cache_vs_qkv_rows"), e, s));
    }

    // Attention, causal and tree, against attend() with the dense mask.
    let c = 300usize;
    let kc = bf(Tensor::randn(0f32, 1.0, (nkv, cap, d), dev)?)?;
    let vc = bf(Tensor::randn(0f32, 1.0, (nkv, cap, d), dev)?)?;
    let len = Tensor::new(&[c as u32], dev)?;
    for t in [1usize, 16, 70] {
        let q = bf(Tensor::randn(0f32, 1.0, (t, nh, d), dev)?)?;
        let parents: Vec<Option<usize>> = (0..t)
            .map(|i| if i == 0 { None } else { Some((i * 7 + 3) % i) })
            .collect();
        for (name, pattern) in [
            ("attention:causal", AttnPattern::Causal),
            (
                "attention:tree",
                AttnPattern::Tree {
                    parents: parents.clone(),
                },
            ),
            // The draft block: every new token sees all of them (later ones too).
            ("attention:full", AttnPattern::Full),
        ] {
            let words = t.div_ceil(64);
            let bits = match &pattern {
                AttnPattern::Tree { parents } => Some(super::tree_bits(parents)),
                AttnPattern::Full => Some(
                    (0..t * words)
                        .map(|i| {
                            let left = t - 64 * (i % words);
                            (if left >= 64 {
                                u64::MAX
                            } else {
                                (1u64 << left) - 1
                            }) as i64
                        })
                        .collect(),
                ),
                _ => None,
            };
            let bits = match bits {
                Some(b) => Some(Tensor::from_vec(b, (t, words), dev)?),
                None => None,
            };
            let ns = (c + t).div_ceil(kernels::CHUNK);
            // One chunk per split (at most ns splits), three (at most ceil(ns / 3)).
            let fast = kernels::attention_split(&q, &kc, &vc, None, &len, bits.as_ref(), Some(ns))?;
            let multi = kernels::attention_split(
                &q,
                &kc,
                &vc,
                None,
                &len,
                bits.as_ref(),
                Some(ns.div_ceil(3)),
            )?;
            let simt = kernels::attention_simt(&q, &kc, &vc, None, &len, bits.as_ref(), ns)?;
            let mask = pattern.mask(c, t, dev)?;
            let plain = attend(
                &q.transpose(0, 1)?.contiguous()?,
                &kc.narrow(1, 0, c + t)?,
                &vc.narrow(1, 0, c + t)?,
                mask.as_ref(),
                OpsMode::Fused,
            )?;
            let (e, s) = max_err(&fast, &plain)?;
            out.push((format!("{name}:t{t}:tensor_cores"), e, s));
            let (e, s) = max_err(&multi, &plain)?;
            out.push((format!("{name}:t{t}:tensor_cores_3_chunks_per_split"), e, s));
            let (e, s) = max_err(&simt, &plain)?;
            out.push((format!("{name}:t{t}:cuda_cores"), e, s));
        }
    }

    // One-pass prefill attention against attend() and the split-K kernel, for a 300-token causal
    // piece with and without committed context (a partial last block of query rows in each).
    for (nh, nkv) in [(8usize, 2usize), (32, 8)] {
        let t = 300usize;
        let kc = bf(Tensor::randn(0f32, 1.0, (nkv, cap, d), dev)?)?;
        let vc = bf(Tensor::randn(0f32, 1.0, (nkv, cap, d), dev)?)?;
        let q = bf(Tensor::randn(0f32, 1.0, (t, nh, d), dev)?)?;
        for c in [0usize, 77] {
            let len = Tensor::new(&[c as u32], dev)?;
            let mask = AttnPattern::Causal.mask(c, t, dev)?;
            let plain = attend(
                &q.transpose(0, 1)?.contiguous()?,
                &kc.narrow(1, 0, c + t)?,
                &vc.narrow(1, 0, c + t)?,
                mask.as_ref(),
                OpsMode::Fused,
            )?;
            let old = kernels::attention_split(&q, &kc, &vc, None, &len, None, None)?;
            let tag = format!("attention_prefill:h{nh}_kv{nkv}:t{t}_c{c}");
            let fast = attn_prefill::attention_prefill(&q, &kc, &vc, None, &len)?;
            let (e, s) = max_err(&fast, &plain)?;
            out.push((format!("{tag}:vs_plain"), e, s));
            let (e, s) = max_err(&fast, &old)?;
            out.push((format!("{tag}:vs_split_kernel"), e, s));
            let (e, s) = max_err(&old, &plain)?;
            out.push((format!("{tag}:split_kernel:vs_plain"), e, s));
        }
    }

    super::check_attn::fused_attention_errors(dev, &mut out)?;
    super::check_attn::varlen_attention_errors(dev, &mut out)?;

    // Skinny GEMMs against cuBLAS and the candle ops they fuse.
    let (n, k) = (1008usize, 4096usize);
    let w = bf(Tensor::randn(0f32, 0.05, (n, k), dev)?)?;
    let w2 = bf(Tensor::randn(0f32, 0.05, (2 * n, k), dev)?)?;
    let nw = bf(Tensor::randn(1f32, 0.2, k, dev)?)?;
    let counter = Tensor::zeros(1, DType::U32, dev)?;
    let x16 = bf(Tensor::randn(0f32, 1.0, (16, k), dev)?)?;
    for variant in ["rows", "mma"] {
        let x = x16.narrow(0, 0, 1)?;
        let (e, s) = max_err(&gemv::gemv_variant(&x, &w, variant)?, &x.matmul(&w.t()?)?)?;
        out.push((format!("gemv:{variant}:m1"), e, s));
    }
    for m in [1usize, 2, 5, 16] {
        let x = x16.narrow(0, 0, m)?.contiguous()?;
        let (e, s) = max_err(&gemv::gemv(&x, &w, None)?, &x.matmul(&w.t()?)?)?;
        out.push((format!("gemv:m{m}"), e, s));
        let ss = gemv::row_sumsq(&x)?;
        let (e, s) = max_err(&ss, &x.to_dtype(DType::F32)?.sqr()?.sum(1)?)?;
        out.push((format!("row_sumsq:m{m}"), e, s));
        let norm = gemv::RowNorm {
            ss: Some(&ss),
            weight: &nw,
            eps,
        };
        let h = rms_norm(&x, &nw, eps, OpsMode::Fused)?;
        let (e, s) = max_err(&gemv::rms_apply(&x, norm)?, &h)?;
        out.push((format!("rms_apply:m{m}"), e, s));
        let (e, s) = max_err(&gemv::gemv(&x, &w, Some(norm))?, &h.matmul(&w.t()?)?)?;
        out.push((format!("gemv_norm:m{m}"), e, s));
        // Sums of squares made where needed (every block of the one-row kernel sums its own).
        let unsummed = gemv::RowNorm { ss: None, ..norm };
        let (e, s) = max_err(&gemv::gemv(&x, &w, Some(unsummed))?, &h.matmul(&w.t()?)?)?;
        out.push((format!("gemv_norm_unsummed:m{m}"), e, s));
        let (e, s) = max_err(&gemv::rms_apply(&x, unsummed)?, &h)?;
        out.push((format!("rms_apply_unsummed:m{m}"), e, s));
        let gu = h.matmul(&w2.t()?)?;
        let plain = (gu.narrow(1, 0, n)?.silu()? * gu.narrow(1, n, n)?)?;
        let (e, s) = max_err(&gemv::gemv_silu(&x, &w2, Some(norm))?, &plain)?;
        out.push((format!("gemv_silu_norm:m{m}"), e, s));
        let resid = bf(Tensor::randn(0f32, 3.0, (m, n), dev)?)?;
        // Twice on one counter: the kernel must leave it ready for the next launch.
        for pass in 0..2 {
            let (y, ss) = gemv::gemv_resid(&x, &w, &resid, Some(&counter), None)?;
            let ss = ss.ok_or_else(|| candle_core::Error::Msg("gemv_resid: no sums".into()))?;
            let plain = (&resid + x.matmul(&w.t()?)?)?;
            let (e, s) = max_err(&y, &plain)?;
            out.push((format!("gemv_resid:m{m}:pass{pass}"), e, s));
            let (e, s) = max_err(&ss, &y.to_dtype(DType::F32)?.sqr()?.sum(1)?)?;
            out.push((format!("gemv_resid_sumsq:m{m}:pass{pass}"), e, s));
            // The L2 prefetch of the next weights is a hint: the same bits (0.0) with it, and
            // the same again on a second launch (the K-split sums are in a fixed order).
            let warm = gemv::Prefetch {
                weight: &w2,
                bytes: 1 << 20,
            };
            let (yp, ssp) = gemv::gemv_resid(&x, &w, &resid, Some(&counter), Some(warm))?;
            let ssp = ssp.ok_or_else(|| candle_core::Error::Msg("gemv_resid: no sums".into()))?;
            let (e, s) = max_err(&yp, &y)?;
            out.push((format!("resid_y_prefetch_vs_none:m{m}:pass{pass}"), e, s));
            let (e, s) = max_err(&ssp, &ss)?;
            out.push((format!("resid_ss_prefetch_vs_none:m{m}:pass{pass}"), e, s));
            // One row without the sums (no last-block reduction): the same y bits.
            if m == 1 {
                let (yn, _) = gemv::gemv_resid(&x, &w, &resid, None, None)?;
                let (e, s) = max_err(&yn, &y)?;
                out.push((format!("resid_y_unsummed_vs_summed:m1:pass{pass}"), e, s));
            }
        }
    }

    // Device top-k against the host selection (ties by lower token), on rows with many ties.
    for k in [1usize, 16, 256] {
        let (rows, cols) = (15usize, 151936usize);
        let x = (Tensor::randn(0f32, 4.0, (rows, cols), dev)? * 4.0)?
            .round()?
            .affine(0.25, 0.0)?;
        let (idx, val) = super::topk_rows(&x, k)?;
        let idx = idx.to_vec2::<u32>()?;
        let val = val.to_vec2::<f32>()?;
        let host = x.to_vec2::<f32>()?;
        let mut wrong = 0usize;
        for r in 0..rows {
            let want = crate::speculative::tree::topk_from_logprobs(&host[r], cols, k);
            let mut got: Vec<(u32, f32)> =
                idx[r].iter().copied().zip(val[r].iter().copied()).collect();
            got.sort_unstable_by_key(|&(t, v)| crate::speculative::tree::rank_key(v, t));
            if got.as_slice() != want.row(0) {
                wrong += 1;
            }
        }
        out.push((
            format!("topk_rows:k{k}:rows_differing_from_host"),
            wrong as f32,
            rows as f32,
        ));
    }

    // SiLU product and residual add + RMSNorm.
    let gu = bf(Tensor::randn(0f32, 2.0, (3, 2 * 1000), dev)?)?;
    let plain = (gu.narrow(1, 0, 1000)?.silu()? * gu.narrow(1, 1000, 1000)?)?;
    let (e, s) = max_err(&kernels::silu_mul(&gu)?, &plain)?;
    out.push(("silu_mul".into(), e, s));
    // 4096 and 1000: the 16-byte vector kernel; 1004: the scalar one.
    for hidden in [4096usize, 1000, 1004] {
        let x = bf(Tensor::randn(0f32, 3.0, (3, hidden), dev)?)?;
        let dl = bf(Tensor::randn(0f32, 1.0, (3, hidden), dev)?)?;
        let w = bf(Tensor::randn(1f32, 0.2, hidden, dev)?)?;
        let (xo, ho) = kernels::add_rmsnorm(&x, &dl, &w, eps)?;
        let xs = (&x + &dl)?;
        let (e, s) = max_err(&xo, &xs)?;
        out.push((format!("add_rmsnorm:h{hidden}:sum"), e, s));
        let (e, s) = max_err(&ho, &rms_norm(&xs, &w, eps, OpsMode::Fused)?)?;
        out.push((format!("add_rmsnorm:h{hidden}:norm"), e, s));
    }
    Ok(out)
}

/// Milliseconds of causal attention on Qwen3-8B's heads (32 q / 8 KV, d 128) for `t` new tokens
/// over `c` committed ones: the split-K kernel as `attention` plans it and the one-pass prefill
/// kernel (`(name, ms, TFLOP/s)`, FLOPs `4 d nh` per visible (query, key) pair); `attention`
/// picks between them by `attn_prefill::MIN_BLOCKS`.
pub fn attention_timings(dev: &Device) -> Result<Vec<(String, f64, f64)>> {
    let time = |f: &dyn Fn() -> Result<Tensor>| host_loop_ms(dev, f);
    let (nh, nkv, d, cap) = (32usize, 8usize, 128usize, 8192usize);
    let kc = Tensor::randn(0f32, 1.0, (nkv, cap, d), dev)?.to_dtype(DType::BF16)?;
    let vc = Tensor::randn(0f32, 1.0, (nkv, cap, d), dev)?.to_dtype(DType::BF16)?;
    let mut out = Vec::new();
    for (t, c) in [
        (4096usize, 0usize),
        (2048, 0),
        (1024, 0),
        (512, 0),
        (256, 0),
        (128, 0),
        (1024, 3072),
        (256, 4096),
        (128, 4096),
    ] {
        let q = Tensor::randn(0f32, 1.0, (t, nh, d), dev)?.to_dtype(DType::BF16)?;
        let len = Tensor::new(&[c as u32], dev)?;
        let pairs = (t * c + t * (t + 1) / 2) as f64;
        let tflops = |ms: f64| 4.0 * (d * nh) as f64 * pairs / ms / 1e9;
        let ms = time(&|| kernels::attention_split(&q, &kc, &vc, None, &len, None, None))?;
        out.push((format!("t{t}_c{c}:split_kernel"), ms, tflops(ms)));
        let ms = time(&|| attn_prefill::attention_prefill(&q, &kc, &vc, None, &len))?;
        out.push((format!("t{t}_c{c}:prefill_kernel"), ms, tflops(ms)));
    }
    Ok(out)
}

/// Milliseconds of cuBLAS and of the skinny kernels on Qwen3-8B's projections (the SiLU
/// variant reads the stacked gate/up) for 1, 4 and 16 rows: `(name, cublas_ms, gemv_ms,
/// weight_GB)`; for one row also every store variant.
pub fn gemv_timings(dev: &Device) -> Result<Vec<(String, f64, f64, f64)>> {
    let time = |f: &dyn Fn() -> Result<Tensor>| host_loop_ms(dev, f);
    let counter = Tensor::zeros(1, DType::U32, dev)?;
    let mut out = Vec::new();
    for (name, n, k) in [
        ("qkv", 6144usize, 4096usize),
        ("o_proj", 4096, 4096),
        ("gate_up_silu", 24576, 4096),
        ("down", 4096, 12288),
        ("lm_head", 151936, 4096),
    ] {
        let w = Tensor::randn(0f32, 0.05, (n, k), dev)?.to_dtype(DType::BF16)?;
        let nw = Tensor::ones(k, DType::BF16, dev)?;
        let gb = (n * k * 2) as f64 / 1e9;
        for m in [1usize, 4, 16] {
            let x = Tensor::randn(0f32, 1.0, (m, k), dev)?.to_dtype(DType::BF16)?;
            let resid = Tensor::zeros((m, n), DType::BF16, dev)?;
            let ss = gemv::row_sumsq(&x)?;
            let norm = gemv::RowNorm {
                ss: Some(&ss),
                weight: &nw,
                eps: 1e-6,
            };
            let a = time(&|| x.matmul(&w.t()?))?;
            let b = match name {
                "gate_up_silu" => time(&|| gemv::gemv_silu(&x, &w, Some(norm)))?,
                "o_proj" | "down" => {
                    time(&|| Ok(gemv::gemv_resid(&x, &w, &resid, Some(&counter), None)?.0))?
                }
                _ => time(&|| gemv::gemv(&x, &w, Some(norm)))?,
            };
            out.push((format!("{name}_m{m}"), a, b, gb));
            if m == 1 || (m == 16 && name == "lm_head") {
                for v in ["rows", "mma"] {
                    if m > 1 && v.starts_with("rows") {
                        continue;
                    }
                    let c = time(&|| gemv::gemv_variant(&x, &w, v))?;
                    out.push((format!("{name}_m{m}_store_{v}"), a, c, gb));
                }
            }
        }
    }
    Ok(out)
}

/// Milliseconds per call of the DDTree draft selection's device steps on a round's 15 rows of
/// 151,936 f32 logits (as `spec::proposer`'s device top-k runs them): the argmax/log-prob
/// kernels, the piece top-k for k = 16, 64 and 256, and the packed copy to the host.
pub fn topk_timings(dev: &Device) -> Result<Vec<(String, f64)>> {
    let (rows, vocab) = (15usize, 151_936usize);
    let x = Tensor::randn(0f32, 4.0, (rows, vocab), dev)?;
    let mut out = vec![(
        "argmax_logprob".to_string(),
        host_loop_ms(dev, &|| super::argmax_logprob(&x))?,
    )];
    for (k, parts) in [(16usize, 32usize), (64, 32), (256, 8)] {
        let pieces = x.reshape((rows * parts, vocab / parts))?;
        let ms = host_loop_ms(dev, &|| Ok(super::topk_rows(&pieces, k)?.0))?;
        out.push((format!("topk_rows_k{k}_{parts}_pieces"), ms));
        let one = host_loop_ms(dev, &|| Ok(super::topk_rows(&x, k)?.0))?;
        out.push((format!("topk_rows_k{k}_whole_rows"), one));
        let (idx, val) = super::topk_rows(&pieces, k)?;
        dev.synchronize()?;
        let t = std::time::Instant::now();
        for _ in 0..20 {
            let packed = Tensor::cat(&[&idx.to_dtype(DType::F32)?, &val], 1)?
                .flatten_all()?
                .to_vec1::<f32>()?;
            std::hint::black_box(packed);
        }
        out.push((
            format!("topk_copy_k{k}"),
            t.elapsed().as_secs_f64() * 1e3 / 20.0,
        ));
    }
    Ok(out)
}
