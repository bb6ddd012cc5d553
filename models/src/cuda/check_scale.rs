//! Kernel checks and timings for steps at scale (`gpu-check cuda out.json --scale`): prefill
//! pieces over a long context (the one-pass kernel against the split-K ones, 4- and 8-warp
//! blocks, several split counts) and the skinny tensor-core GEMMs at 17..64 rows against
//! cuBLAS, on Qwen3-8B's shapes.

use std::cell::Cell;

use candle_core::{DType, Device, Result, Tensor};

use super::{attn_prefill, gemv, kernels, lt_gemm, splitk, LtMode, SplitkEpi};

/// Qwen3-8B attention heads: 32 q, 8 KV, head_dim 128; 36 layers.
const NH: usize = 32;
const NKV: usize = 8;
const D: usize = 128;
pub const LAYERS: usize = 36;

/// Whether the split-K kernels are checked and timed (`GPU_CHECK_NO_SPLITK` unset): a rerun
/// without them keeps the other figures if they ever fault.
pub fn splitk_checked() -> bool {
    std::env::var_os("GPU_CHECK_NO_SPLITK").is_none()
}

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

/// `(max |a - b|, max |b|)` over every element.
fn err(a: &Tensor, b: &Tensor) -> Result<(f32, f32)> {
    let a = a.to_dtype(DType::F32)?;
    let b = b.to_dtype(DType::F32)?;
    let e = (&a - &b)?
        .abs()?
        .flatten_all()?
        .max(0)?
        .to_scalar::<f32>()?;
    let s = b.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
    Ok((e, s))
}

fn rand_bf16(dev: &Device, shape: impl Into<candle_core::Shape>, std: f32) -> Result<Tensor> {
    Tensor::randn(0f32, std, shape, dev)?.to_dtype(DType::BF16)
}

/// Pieces of `t` tokens over `c` committed rows, Qwen3-8B heads: the split-K kernels (4 and 8
/// warps per block, several split counts, default and forced) against the one-pass kernel,
/// `(name, max |split - one_pass|, max |one_pass|)`; `:repeat` a second launch of the same
/// split (0 when deterministic). Through a page table of shuffled 64-row pages, as the pool
/// holds them.
pub fn piece_attention_errors(dev: &Device) -> Result<Vec<(String, f32, f32)>> {
    let mut out = Vec::new();
    for (t, c) in [
        (64usize, 16384usize),
        (128, 32000),
        (256, 9000),
        (512, 4100),
        (37, 20000),
    ] {
        let cap = (c + t).div_ceil(64) * 64;
        let pages = cap / 64;
        // Pages in a scrambled order (a fixed odd stride over the page count).
        let table: Vec<u32> = (0..pages as u32)
            .map(|i| (i * 37 + 11) % pages as u32)
            .collect();
        let pt = if (0..pages).all(|i| table.iter().filter(|&&p| p as usize == i).count() == 1) {
            Some(Tensor::from_vec(table, (1, pages), dev)?)
        } else {
            None
        };
        let kc = rand_bf16(dev, (NKV, cap, D), 1.0)?;
        let vc = rand_bf16(dev, (NKV, cap, D), 1.0)?;
        let q = rand_bf16(dev, (t, NH, D), 1.0)?;
        let len = Tensor::new(&[c as u32], dev)?;
        let one = attn_prefill::attention_prefill(&q, &kc, &vc, pt.as_ref(), &len)?;
        let tag = format!("t{t}_c{c}");
        for warps in [4usize, 8] {
            for splits in [None, Some(1), Some(7), Some(32)] {
                let s = kernels::attention_split_with(
                    &q,
                    &kc,
                    &vc,
                    pt.as_ref(),
                    &len,
                    None,
                    splits,
                    warps,
                )?;
                let (e, m) = err(&s, &one)?;
                let sp = splits.map_or("default".to_string(), |n| n.to_string());
                out.push((format!("piece_attn:{tag}:w{warps}_s{sp}"), e, m));
                if splits.is_none() {
                    let again = kernels::attention_split_with(
                        &q,
                        &kc,
                        &vc,
                        pt.as_ref(),
                        &len,
                        None,
                        splits,
                        warps,
                    )?;
                    let (e, m) = err(&again, &s)?;
                    out.push((format!("piece_attn:{tag}:w{warps}_s{sp}:repeat"), e, m));
                }
            }
        }
        let chosen = kernels::attention_for_context(&q, &kc, &vc, pt.as_ref(), &len, None, c)?;
        let (e, m) = err(&chosen, &one)?;
        out.push((format!("piece_attn:{tag}:dispatch"), e, m));
    }
    Ok(out)
}

/// Milliseconds per layer of one causal piece of `t` tokens over `c` committed rows,
/// Qwen3-8B heads, contiguous cache: the one-pass kernel, the split-K kernels (4 and 8 warps,
/// default and forced split counts) and what `attention_for_context` picks; `(name, ms per
/// layer, ms per 36-layer step, TFLOP/s)`, FLOPs `4 d nh` per visible (query, key) pair.
pub fn piece_attention_timings(dev: &Device) -> Result<Vec<(String, f64, f64, f64)>> {
    let cap = 32768 + 1024;
    let kc = rand_bf16(dev, (NKV, cap, D), 1.0)?;
    let vc = rand_bf16(dev, (NKV, cap, D), 1.0)?;
    let mut out = Vec::new();
    for c in [1024usize, 8192, 16384, 32768] {
        for t in [64usize, 128, 256, 512] {
            let q = rand_bf16(dev, (t, NH, D), 1.0)?;
            let len = Tensor::new(&[c as u32], dev)?;
            let pairs = (t * c + t * (t + 1) / 2) as f64;
            let row = |name: String, ms: f64| {
                let tflops = 4.0 * (D * NH) as f64 * pairs / ms / 1e9;
                (name, ms, ms * LAYERS as f64, tflops)
            };
            let tag = format!("t{t}_c{c}");
            let ms = host_loop_ms(dev, &|| {
                attn_prefill::attention_prefill(&q, &kc, &vc, None, &len)
            })?;
            out.push(row(format!("{tag}:one_pass"), ms));
            for warps in [4usize, 8] {
                for splits in [None, Some(8), Some(16), Some(32), Some(64)] {
                    let ms = host_loop_ms(dev, &|| {
                        kernels::attention_split_with(&q, &kc, &vc, None, &len, None, splits, warps)
                    })?;
                    let sp = splits.map_or("default".to_string(), |n| n.to_string());
                    out.push(row(format!("{tag}:split_w{warps}_s{sp}"), ms));
                }
            }
            let ms = host_loop_ms(dev, &|| {
                kernels::attention_for_context(&q, &kc, &vc, None, &len, None, c)
            })?;
            out.push(row(format!("{tag}:dispatch"), ms));
            let ms = host_loop_ms(dev, &|| kernels::attention(&q, &kc, &vc, None, &len, None))?;
            out.push(row(format!("{tag}:dispatch_before"), ms));
        }
    }
    Ok(out)
}

/// The skinny tensor-core GEMMs at 1..64 rows against cuBLAS (and the separate SiLU product /
/// residual add the wide path runs): `(name, max |gemv - reference|, max |reference|)`, and
/// `:row_independent` the first rows of an m-row product against the same rows alone
/// (0 when a row's result does not depend on the rows beside it).
pub fn gemv_wide_errors(dev: &Device) -> Result<Vec<(String, f32, f32)>> {
    let mut out = Vec::new();
    let counter = Tensor::zeros(1, DType::U32, dev)?;
    // n 1024 (4 K splits), 12288 (2), 24576 (1); k 4096 and 12288.
    for (n, k) in [
        (1024usize, 4096usize),
        (12288, 4096),
        (4096, 12288),
        (24576, 4096),
    ] {
        let w = rand_bf16(dev, (n, k), 0.05)?;
        let wsilu = rand_bf16(dev, (2 * n.min(12288), k), 0.05)?;
        let ni = n.min(12288);
        for m in [1usize, 16, 17, 24, 32, 33, 48, 63, 64] {
            let x = rand_bf16(dev, (m, k), 1.0)?;
            let resid = rand_bf16(dev, (m, n), 1.0)?;
            let tag = format!("n{n}_k{k}_m{m}");
            let want = x.matmul(&w.t()?)?;
            let got = gemv::gemv(&x, &w, None)?;
            let (e, s) = err(&got, &want)?;
            out.push((format!("gemv_store:{tag}"), e, s));
            let (yr, ss) = gemv::gemv_resid(&x, &w, &resid, Some(&counter), None)?;
            let want_r = (&resid + &want)?;
            let (e, s) = err(&yr, &want_r)?;
            out.push((format!("gemv_resid:{tag}"), e, s));
            if let Some(ss) = ss {
                let want_ss = yr.to_dtype(DType::F32)?.sqr()?.sum(1)?;
                let (e, s) = err(&ss, &want_ss)?;
                out.push((format!("gemv_resid_sumsq:{tag}"), e, s));
            }
            let gu = x.matmul(&wsilu.t()?)?;
            let want_s = kernels::silu_mul(&gu)?;
            let got_s = gemv::gemv_silu(&x, &wsilu, None)?;
            let (e, s) = err(&got_s, &want_s)?;
            out.push((format!("gemv_silu:n{ni}_k{k}_m{m}"), e, s));
            for (label, mode) in [
                ("lt_heuristic", LtMode::Heuristic),
                ("lt_tuned", LtMode::Tuned),
            ] {
                let got = lt_gemm::linear_lt(&x, &w, None, mode)?;
                let (e, s) = err(&got, &want)?;
                out.push((format!("{label}:{tag}"), e, s));
                let got_r = lt_gemm::linear_lt(&x, &w, Some(&resid), mode)?;
                let (e, s) = err(&got_r, &want_r)?;
                out.push((format!("{label}_resid:{tag}"), e, s));
            }
            if m == 32 {
                // The check must be able to fail: the tuned product of w against the
                // reference of other weights.
                let other = rand_bf16(dev, (n, k), 0.05)?;
                let got = lt_gemm::linear_lt(&x, &w, None, LtMode::Tuned)?;
                let (e, s) = err(&got, &x.matmul(&other.t()?)?)?;
                out.push((format!("lt_tuned:{tag}:wrong_weights"), e, s));
            }
            if splitk_checked() {
                let sk = splitk::splitk_gemm(&x, &w, SplitkEpi::Store, None)?;
                let (e, s) = err(&sk, &want)?;
                out.push((format!("splitk_store:{tag}"), e, s));
                let again = splitk::splitk_gemm(&x, &w, SplitkEpi::Store, None)?;
                let (e, s) = err(&again, &sk)?;
                out.push((format!("splitk_store:{tag}:repeat"), e, s));
                let sk_r = splitk::splitk_gemm(&x, &w, SplitkEpi::Resid, Some(&resid))?;
                let (e, s) = err(&sk_r, &want_r)?;
                out.push((format!("splitk_resid:{tag}"), e, s));
                let sk_s = splitk::splitk_gemm(&x, &wsilu, SplitkEpi::Silu, None)?;
                let (e, s) = err(&sk_s, &want_s)?;
                out.push((format!("splitk_silu:n{ni}_k{k}_m{m}"), e, s));
                if m > 16 {
                    let head = x.narrow(0, 0, 16)?.contiguous()?;
                    let alone = splitk::splitk_gemm(&head, &w, SplitkEpi::Store, None)?;
                    let (e, s) = err(&sk.narrow(0, 0, 16)?, &alone)?;
                    out.push((format!("splitk_store:{tag}:row_independent"), e, s));
                }
                if m == 32 {
                    let other = rand_bf16(dev, (n, k), 0.05)?;
                    let (e, s) = err(&sk, &x.matmul(&other.t()?)?)?;
                    out.push((format!("splitk_store:{tag}:wrong_weights"), e, s));
                }
            }
            if m > 16 {
                // The first 16 rows alone (the one-tile kernel) against the same rows here.
                let head = x.narrow(0, 0, 16)?.contiguous()?;
                let alone = gemv::gemv(&head, &w, None)?;
                let (e, s) = err(&got.narrow(0, 0, 16)?, &alone)?;
                out.push((format!("gemv_store:{tag}:row_independent"), e, s));
                let alone_s = gemv::gemv_silu(&head, &wsilu, None)?;
                let (e, s) = err(&got_s.narrow(0, 0, 16)?, &alone_s)?;
                out.push((format!("gemv_silu:{tag}:row_independent"), e, s));
            }
        }
    }
    Ok(out)
}

/// Microseconds per call on Qwen3-8B's projections at 16..64 rows: cuBLAS (plus the SiLU
/// product or residual add the wide path runs after it) against the skinny kernels with
/// their epilogue, cycling over enough weight copies (>= 256 MB) that L2 holds none:
/// `(name, [cublas, lt_heuristic, lt_tuned, skinny, splitk, splitk_528] us, weight_GB)`; the
/// cuBLASLt forms fuse the residual add (beta = 1) and run the SiLU product after gate/up,
/// the split-K kernels fuse both (`splitk_528`: aiming for 528 blocks instead of 264).
pub fn gemv_wide_timings(dev: &Device) -> Result<Vec<(String, [f64; 6], f64)>> {
    let counter = Tensor::zeros(1, DType::U32, dev)?;
    let mut out = Vec::new();
    for (name, n, k) in [
        ("qkv", 6144usize, 4096usize),
        ("o_proj", 4096, 4096),
        ("gate_up_silu", 24576, 4096),
        ("down", 4096, 12288),
        ("lm_head", 151936, 4096),
    ] {
        let bytes = n * k * 2;
        let copies = (256usize << 20).div_ceil(bytes).max(2);
        let ws = (0..copies)
            .map(|_| rand_bf16(dev, (n, k), 0.05))
            .collect::<Result<Vec<_>>>()?;
        let gb = bytes as f64 / 1e9;
        let next = Cell::new(0usize);
        let pick = || {
            let i = next.get();
            next.set((i + 1) % copies);
            &ws[i]
        };
        for m in [16usize, 24, 32, 48, 64] {
            let x = rand_bf16(dev, (m, k), 1.0)?;
            let resid = rand_bf16(dev, (m, n), 1.0)?;
            let cublas = host_loop_ms(dev, &|| {
                let y = x.matmul(&pick().t()?)?;
                match name {
                    "gate_up_silu" => kernels::silu_mul(&y),
                    "o_proj" | "down" => &resid + &y,
                    _ => Ok(y),
                }
            })?;
            let skinny = host_loop_ms(dev, &|| match name {
                "gate_up_silu" => gemv::gemv_silu(&x, pick(), None),
                "o_proj" | "down" => {
                    Ok(gemv::gemv_resid(&x, pick(), &resid, Some(&counter), None)?.0)
                }
                _ => gemv::gemv(&x, pick(), None),
            })?;
            let lt = |mode| {
                host_loop_ms(dev, &|| match name {
                    "gate_up_silu" => {
                        kernels::silu_mul(&lt_gemm::linear_lt(&x, pick(), None, mode)?)
                    }
                    "o_proj" | "down" => lt_gemm::linear_lt(&x, pick(), Some(&resid), mode),
                    _ => lt_gemm::linear_lt(&x, pick(), None, mode),
                })
            };
            let heur = lt(LtMode::Heuristic)?;
            let tuned = lt(LtMode::Tuned)?;
            let sk = |blocks| {
                host_loop_ms(dev, &|| match name {
                    "gate_up_silu" => {
                        splitk::splitk_gemm_blocks(&x, pick(), SplitkEpi::Silu, None, blocks)
                    }
                    "o_proj" | "down" => splitk::splitk_gemm_blocks(
                        &x,
                        pick(),
                        SplitkEpi::Resid,
                        Some(&resid),
                        blocks,
                    ),
                    _ => splitk::splitk_gemm_blocks(&x, pick(), SplitkEpi::Store, None, blocks),
                })
            };
            let (sk264, sk528) = if splitk_checked() {
                (sk(264)?, sk(528)?)
            } else {
                (f64::NAN, f64::NAN)
            };
            out.push((
                format!("{name}_m{m}"),
                [
                    cublas * 1e3,
                    heur * 1e3,
                    tuned * 1e3,
                    skinny * 1e3,
                    sk264 * 1e3,
                    sk528 * 1e3,
                ],
                gb,
            ));
        }
    }
    Ok(out)
}
