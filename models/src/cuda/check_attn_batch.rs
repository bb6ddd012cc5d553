//! The batched decode attention (one launch for B sequences through their page tables, as the
//! decoder stack's batched decode step runs it): its kernel variants and target block counts
//! checked against one launch per sequence, and timed alone (`gpu_check cuda out.json --scale
//! --attn-only`), Qwen3-8B heads.

use candle_core::{DType, Device, Result, Tensor};

use super::attn_decode::{self, BatchKernel, DEFAULT_BATCH_LAUNCH};
use super::kernels;

const NH: usize = 32;
const NKV: usize = 8;
const D: usize = 128;
const PAGE: usize = 64;

/// The batched launches compared (`BATCH_SPLIT_BLOCKS` was 1024 when the first nine were
/// measured; the step kernels' target 0 fills the device once, see `attn_plan::step_splits`).
pub const VARIANTS: [(BatchKernel, usize); 14] = [
    (BatchKernel::Base, 1024),
    (BatchKernel::Base, 512),
    (BatchKernel::Base, 2048),
    (BatchKernel::Base, 256),
    (BatchKernel::Blocks3, 1024),
    (BatchKernel::Blocks3, 2048),
    (BatchKernel::Blocks4OneStage, 1024),
    (BatchKernel::Blocks4OneStage, 2048),
    (BatchKernel::Blocks4OneStage, 4096),
    (BatchKernel::Step3, 0),
    (BatchKernel::Step2, 0),
    (BatchKernel::Step3, 512),
    (BatchKernel::Step3, 1024),
    (BatchKernel::Step2, 1024),
];

/// The variants to compare: [`VARIANTS`], or those named in `GPU_CHECK_ATTN_VARIANTS`
/// (comma-separated [`variant_name`]s; a rerun without one that faults keeps the others).
pub fn variants() -> Vec<(BatchKernel, usize)> {
    match std::env::var("GPU_CHECK_ATTN_VARIANTS") {
        Ok(list) => VARIANTS
            .into_iter()
            .filter(|&v| list.split(',').any(|n| n.trim() == variant_name(v)))
            .collect(),
        Err(_) => VARIANTS.to_vec(),
    }
}

/// A variant's name in the reports.
pub fn variant_name((k, blocks): (BatchKernel, usize)) -> String {
    let k = match k {
        BatchKernel::Base => "base",
        BatchKernel::Blocks3 => "b3",
        BatchKernel::Blocks4OneStage => "b4s1",
        BatchKernel::Step3 => "step3",
        BatchKernel::Step2 => "step2",
    };
    match blocks {
        0 => format!("{k}_auto"),
        _ => format!("{k}_{blocks}"),
    }
}

/// One layer's K/V pool and the inputs of a batched decode step: `b` sequences at the given
/// lengths, each through a page table of shuffled pages of the pool (pages interleaved across
/// sequences, as a shared pool holds them).
struct Batch {
    qkv: Tensor,
    norm: Tensor,
    cos: Tensor,
    sin: Tensor,
    positions: Tensor,
    lens: Tensor,
    kc: Tensor,
    vc: Tensor,
    pages: Tensor,
    lens_host: Vec<usize>,
    pages_host: Vec<u32>,
    per_seq_pages: usize,
}

fn batch(dev: &Device, lens: &[usize], salt: u64) -> Result<Batch> {
    let bf = |t: Tensor| t.to_dtype(DType::BF16);
    let b = lens.len();
    let max_len = lens.iter().copied().max().unwrap_or(0);
    let per_seq_pages = (max_len + 1).div_ceil(PAGE) + 1;
    let total_pages = b * per_seq_pages;
    // A fixed permutation of the pool's pages (multiplier coprime with the page count).
    let mut mult = (salt as usize * 2 + 7919) % total_pages.max(1);
    while gcd(mult.max(1), total_pages) != 1 {
        mult += 1;
    }
    let pages_host: Vec<u32> = (0..total_pages)
        .map(|i| ((i * mult.max(1) + 3) % total_pages) as u32)
        .collect();
    let rows = total_pages * PAGE;
    let ang = Tensor::randn(0f32, 3.0, (max_len + 2, D / 2), dev)?;
    let pos: Vec<u32> = lens.iter().map(|&l| l as u32).collect();
    Ok(Batch {
        qkv: bf(Tensor::randn(0f32, 2.0, (b, (NH + 2 * NKV) * D), dev)?)?,
        norm: bf(Tensor::randn(1f32, 0.2, D, dev)?)?,
        cos: ang.cos()?,
        sin: ang.sin()?,
        positions: Tensor::new(pos.as_slice(), dev)?,
        lens: Tensor::new(pos.as_slice(), dev)?,
        kc: bf(Tensor::randn(0f32, 1.0, (NKV, rows, D), dev)?)?,
        vc: bf(Tensor::randn(0f32, 1.0, (NKV, rows, D), dev)?)?,
        pages: Tensor::from_vec(pages_host.clone(), (b, per_seq_pages), dev)?,
        lens_host: lens.to_vec(),
        pages_host,
        per_seq_pages,
    })
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

impl Batch {
    fn rows<'a>(
        &'a self,
        qkv: &'a Tensor,
        positions: &'a Tensor,
        lens: &'a Tensor,
        pages: &'a Tensor,
    ) -> kernels::QkvRows<'a> {
        kernels::QkvRows {
            qkv,
            q_norm: &self.norm,
            k_norm: &self.norm,
            cos: &self.cos,
            sin: &self.sin,
            positions,
            cache_len: lens,
            kc: &self.kc,
            vc: &self.vc,
            pages: Some(pages),
            heads: (NH, NKV, D),
            eps: 1e-6,
        }
    }

    /// The batched launch with `variant`, `[b, nh * d]`.
    fn batched(&self, variant: (BatchKernel, usize)) -> Result<Tensor> {
        attn_decode::set_batch_launch(variant.0, variant.1)?;
        let o = attn_decode::fused_attention(
            &self.rows(&self.qkv, &self.positions, &self.lens, &self.pages),
            None,
            None,
        );
        attn_decode::set_batch_launch(DEFAULT_BATCH_LAUNCH.0, DEFAULT_BATCH_LAUNCH.1)?;
        o
    }

    /// One launch per sequence (the one-sequence path, which no variant touches).
    fn per_sequence(&self) -> Result<Tensor> {
        let dev = self.qkv.device();
        let mut outs = Vec::new();
        for (s, &l) in self.lens_host.iter().enumerate() {
            let qkv = self.qkv.narrow(0, s, 1)?.copy()?;
            let len = Tensor::new(&[l as u32], dev)?;
            let p = &self.pages_host[s * self.per_seq_pages..(s + 1) * self.per_seq_pages];
            let pages = Tensor::from_vec(p.to_vec(), (1, p.len()), dev)?;
            outs.push(attn_decode::fused_attention(
                &self.rows(&qkv, &len, &len, &pages),
                None,
                None,
            )?);
        }
        Tensor::cat(&outs, 0)
    }
}

/// `(max |a - b|, max |b|)`.
fn err(a: &Tensor, b: &Tensor) -> Result<(f32, f32)> {
    let (a, b) = (a.to_dtype(DType::F32)?, b.to_dtype(DType::F32)?);
    let e = (&a - &b)?
        .abs()?
        .flatten_all()?
        .max(0)?
        .to_scalar::<f32>()?;
    Ok((e, b.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?))
}

/// Every variant's batched output against one launch per sequence, `(name, max abs err, max
/// abs ref)`, for 16 and 37 sequences of different lengths (short, 640-ish and 4K-ish: one
/// to 33 chunks per split; pages shuffled across sequences); `:repeat` a second launch of
/// each variant (0: fixed merge order); `:cache` the K/V pools after the variant's launch
/// from the pools as they were before any launch, against the pools the reference left (0:
/// the new rows written alike, nothing else touched). Cases that must fail (the checks can):
/// `:wrong_sequence` a variant's output against the reference of the next sequence (far
/// off), and `:wrong_cache` the pools before any launch against the reference's (not 0).
pub fn batch_attention_errors(dev: &Device) -> Result<Vec<(String, f32, f32)>> {
    let mut out = Vec::new();
    for (tag, lens) in [
        (
            "b16_ctx640",
            (0..16).map(|s| 600 + 7 * s).collect::<Vec<_>>(),
        ),
        (
            "b37_mixed",
            (0..37)
                .map(|s| [5usize, 63, 64, 640, 1000, 4095][s % 6] + s)
                .collect(),
        ),
    ] {
        let bt = batch(dev, &lens, lens.len() as u64)?;
        let (k0, v0) = (bt.kc.copy()?, bt.vc.copy()?);
        let reference = bt.per_sequence()?;
        let (k1, v1) = (bt.kc.copy()?, bt.vc.copy()?);
        let b = lens.len();
        let shifted = Tensor::cat(
            &[reference.narrow(0, 1, b - 1)?, reference.narrow(0, 0, 1)?],
            0,
        )?;
        let vs = variants();
        for &v in &vs {
            let name = variant_name(v);
            bt.kc.slice_set(&k0, 0, 0)?;
            bt.vc.slice_set(&v0, 0, 0)?;
            let o = bt.batched(v)?;
            let (ek, sk) = err(&bt.kc, &k1)?;
            let (ev, sv) = err(&bt.vc, &v1)?;
            out.push((
                format!("batch_attn:{tag}:{name}:cache"),
                ek.max(ev),
                sk.max(sv),
            ));
            let (e, s) = err(&o, &reference)?;
            out.push((format!("batch_attn:{tag}:{name}"), e, s));
            let (e, s) = err(&bt.batched(v)?, &o)?;
            out.push((format!("batch_attn:{tag}:{name}:repeat"), e, s));
            if v == VARIANTS[0] || matches!(v.0, BatchKernel::Step3 | BatchKernel::Step2) {
                let (e, s) = err(&o, &shifted)?;
                out.push((format!("batch_attn:{tag}:{name}:wrong_sequence"), e, s));
            }
        }
        let (ek, sk) = err(&k0, &k1)?;
        let (ev, sv) = err(&v0, &v1)?;
        out.push((
            format!("batch_attn:{tag}:wrong_cache"),
            ek.max(ev),
            sk.max(sv),
        ));
    }
    Ok(out)
}

/// Microseconds per batched decode attention launch alone (inside a CUDA graph of 20
/// launches cycling over enough layer pools to exceed 256 MB, so L2 holds none of them) and
/// the K/V read rate: `(case, variant, us, GB/s)` for 16 / 32 / 64 sequences at 640, 4096
/// and 8192 positions.
pub fn batch_attention_timings(dev: &Device) -> Result<Vec<(String, String, f64, f64)>> {
    let mut out = Vec::new();
    for ctx in [640usize, 4096, 8192] {
        for b in [16usize, 32, 64] {
            let kv_bytes = (b * NKV * (ctx + 1) * D * 2 * 2) as f64;
            let copies = ((256e6 / kv_bytes).ceil() as usize).clamp(1, 20);
            let layers = (0..copies)
                .map(|i| batch(dev, &vec![ctx; b], i as u64))
                .collect::<Result<Vec<_>>>()?;
            for v in variants() {
                attn_decode::set_batch_launch(v.0, v.1)?;
                let body = || -> crate::error::ModelResult<()> {
                    for i in 0..20 {
                        let l = &layers[i % copies];
                        attn_decode::fused_attention(
                            &l.rows(&l.qkv, &l.positions, &l.lens, &l.pages),
                            None,
                            None,
                        )?;
                    }
                    Ok(())
                };
                let graph = crate::cuda::decoder_stack::capture_graph(dev, body);
                attn_decode::set_batch_launch(DEFAULT_BATCH_LAUNCH.0, DEFAULT_BATCH_LAUNCH.1)?;
                let graph = graph.map_err(|e| candle_core::Error::Msg(e.to_string()))?;
                let launch = || -> Result<()> {
                    graph
                        .launch()
                        .map_err(|e| candle_core::Error::Msg(e.to_string()))
                };
                launch()?;
                dev.synchronize()?;
                let start = std::time::Instant::now();
                for _ in 0..5 {
                    launch()?;
                }
                dev.synchronize()?;
                let us = start.elapsed().as_secs_f64() * 1e6 / 100.0;
                out.push((
                    format!("b{b}_ctx{ctx}"),
                    variant_name(v),
                    us,
                    kv_bytes / us / 1e3,
                ));
            }
        }
    }
    Ok(out)
}
