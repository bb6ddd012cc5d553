//! The dense bench's kernel checks: the fused CUDA kernels against the plain candle path on
//! the same weights and cache (decode, chain and tree forwards, the drafter, a prefill in
//! pieces), reported in the bench's JSON.

use anyhow::{Context, Result};
use dflash_models::{DFlashDrafter, Qwen3Model};
use serde_json::{json, Map, Value};

use super::measure::{self, fill_context, forward_n};

/// The fused CUDA kernels against the plain candle path on the same weights and cache:
/// max abs logit difference and argmax agreement for decode, chain and tree forwards.
pub(super) fn kernel_checks(base: &Qwen3Model, drafter: &DFlashDrafter) -> Result<Value> {
    let plain = base.clone().with_fast_kernels(false);
    let fast = base.clone().with_fast_kernels(true);
    let mut cache = base.new_cache(2048)?;
    fill_context(&plain, &mut cache, 1000)?;
    let mut out = Map::new();
    #[cfg(feature = "cuda")]
    for (name, err, scale) in dflash_models::cuda::check::kernel_errors(base.device())? {
        out.insert(name, json!({"max_abs_err": err, "max_abs_plain": scale}));
    }
    #[cfg(feature = "cuda")]
    for (name, two, fused) in dflash_models::cuda::check::decode_attention_timings(base.device())? {
        out.insert(
            format!("attention_us_{name}"),
            json!({"two_launch": two, "fused": fused}),
        );
    }
    #[cfg(feature = "cuda")]
    for (name, cublas, gemv, gb) in dflash_models::cuda::check::gemv_timings(base.device())? {
        out.insert(
            format!("gemm_{name}_ms"),
            json!({"cublas": cublas, "gemv": gemv, "weight_GB": gb,
                   "gemv_GBps": gb / gemv * 1e3, "cublas_GBps": gb / cublas * 1e3}),
        );
    }
    #[cfg(feature = "cuda")]
    for (name, ms) in dflash_models::cuda::check::topk_timings(base.device())? {
        out.insert(format!("topk_ms_{name}"), json!(ms));
    }
    #[cfg(feature = "cuda")]
    for (name, ms, tflops) in dflash_models::cuda::check::attention_timings(base.device())? {
        out.insert(format!("attn_{name}"), json!({"ms": ms, "TFLOPs": tflops}));
    }
    #[cfg(feature = "cuda")]
    {
        // The chain also on the skinny tensor-core GEMMs (the `fast_skinny` variant's path),
        // against the same plain forward.
        let skinny = fast
            .clone()
            .with_gemv_rows(dflash_models::cuda::GEMV_MAX_ROWS);
        for (name, n, tree) in [("graph_chain_16", 16, false), ("graph_tree_64", 64, true)] {
            let a = forward_n(&plain, &mut cache, n, tree)?;
            let (_, b) = measure::forward_graph_ms(&fast, &mut cache, n, tree, 1)?;
            out.insert(name.into(), compare(&a, &b)?);
            if !tree {
                let (_, c) = measure::forward_graph_ms(&skinny, &mut cache, n, tree, 1)?;
                out.insert(format!("{name}_skinny"), compare(&a, &c)?);
            }
        }
    }
    // The drafter: two rounds (300 then 7 new context rows) plain against fused.
    {
        let width = drafter.config().target_layer_ids.len() * drafter.config().layers.hidden_size;
        let dev = base.device();
        let f1 =
            candle_core::Tensor::randn(0f32, 1.0, (300, width), dev)?.to_dtype(base.dtype())?;
        let f2 = candle_core::Tensor::randn(0f32, 1.0, (7, width), dev)?.to_dtype(base.dtype())?;
        let mut block = vec![drafter.mask_token_id(); drafter.block_size()];
        block[0] = 11;
        let run = |d: &DFlashDrafter| -> Result<Vec<candle_core::Tensor>> {
            let mut c = d.new_cache(400)?;
            let mut outs = Vec::new();
            for f in [&f1, &f2] {
                outs.push(d.draft_logits(&mut [dflash_models::DraftInput {
                    cache: &mut c,
                    context: Some(f),
                    block: &block,
                }])?);
            }
            Ok(outs)
        };
        let a = run(&drafter.clone().with_fast_kernels(false))?;
        let b = run(&drafter.clone().with_fast_kernels(true))?;
        out.insert("drafter_round1".into(), compare(&a[0], &b[0])?);
        out.insert("drafter_round2".into(), compare(&a[1], &b[1])?);
        #[cfg(feature = "cuda")]
        {
            let skinny = drafter
                .clone()
                .with_fast_kernels(true)
                .with_gemv_rows(dflash_models::cuda::GEMV_MAX_ROWS);
            let c = run(&skinny)?;
            out.insert("drafter_round1_skinny".into(), compare(&a[0], &c[0])?);
            out.insert("drafter_round2_skinny".into(), compare(&a[1], &c[1])?);
        }
        // The draft graph against the fused forward on the same cache.
        #[cfg(feature = "cuda")]
        {
            let fd = drafter.clone().with_fast_kernels(true);
            let mut c = fd.new_cache(400)?;
            fd.forward(&mut [dflash_models::DraftInput {
                cache: &mut c,
                context: Some(&f1),
                block: &block,
            }])?;
            let direct = fd.forward(&mut [dflash_models::DraftInput {
                cache: &mut c,
                context: None,
                block: &block,
            }])?;
            let graph = fd.capture_block(&c)?.draft(&c, &block)?;
            let diff = (direct.to_dtype(candle_core::DType::F32)?
                - graph.to_dtype(candle_core::DType::F32)?)?
            .abs()?
            .flatten_all()?
            .max(0)?
            .to_scalar::<f32>()?;
            out.insert(
                "drafter_graph_hidden".into(),
                json!({"max_abs_diff_vs_fused": diff}),
            );
        }
    }
    // A 600-token prefill: plain (one forward) against fused in pieces of 256 (the logit rows
    // out of order and across pieces; the pieces of 256 run the one-pass prefill attention over
    // committed context, the last 88 rows the split-K kernel) and in one piece.
    {
        let toks = measure::tokens(600, 9, base.config().vocab_size);
        let pos: Vec<u32> = (0..600).collect();
        let rows = [599usize, 0, 300, 255, 256];
        let run = |m: &Qwen3Model| -> Result<candle_core::Tensor> {
            let mut c = m.new_cache(700)?;
            let out = m.forward(
                &mut [dflash_models::SeqForward {
                    cache: &mut c,
                    tokens: &toks,
                    positions: &pos,
                    pattern: &dflash_models::AttnPattern::Causal,
                    logit_rows: &rows,
                }],
                &[],
            )?;
            out.logits.context("no logits")
        };
        let a = run(&plain)?;
        let b = run(&fast.clone().with_prefill_chunk(256))?;
        out.insert("chunked_prefill_600".into(), compare(&a, &b)?);
        let b = run(&fast.clone().with_prefill_chunk(600))?;
        out.insert("prefill_600_one_piece".into(), compare(&a, &b)?);
    }
    for (name, n, tree) in [
        ("decode_1", 1, false),
        ("chain_16", 16, false),
        ("tree_64", 64, true),
        ("chain_256", 256, false),
        ("tree_256", 256, true),
    ] {
        let a = forward_n(&plain, &mut cache, n, tree)?;
        let b = forward_n(&fast, &mut cache, n, tree)?;
        out.insert(name.into(), compare(&a, &b)?);
    }
    Ok(Value::Object(out))
}

/// Max abs logit difference and argmax agreement of two `[rows, vocab]` logit tensors.
fn compare(a: &candle_core::Tensor, b: &candle_core::Tensor) -> Result<Value> {
    let diff = (a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
    let scale = a.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
    let am = a.argmax(1)?.to_vec1::<u32>()?;
    let bm = b.argmax(1)?.to_vec1::<u32>()?;
    let same = am.iter().zip(&bm).filter(|(x, y)| x == y).count();
    Ok(
        json!({"max_abs_logit_diff": diff, "max_abs_logit": scale, "argmax_equal_rows": same, "rows": am.len()}),
    )
}
