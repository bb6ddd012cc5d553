//! `gpu-check <dev> <out.json> --hybrid`: the hybrid target on the device.
//! 1. Parity of the tiny Qwen3.5 fixture (prefill, decode) in f32 and bf16.
//! 2. A Qwen3.6-27B-shaped bf16 model with random weights at 1K context: decode, 16-token chain
//!    verify, 64-node trees (shallow binary and deep DDTree-like), each against the memory
//!    roofline, and the recurrent-state bytes every tree node stages until the commit.

use std::time::Instant;

use anyhow::{Context, Result};
use candle_core::{DType, Device};
use dflash_common::HybridConfig;
use dflash_models::random::WeightRng;
use dflash_models::{AttnPattern, OpsMode, Qwen35Model, SeqForward, SequenceCache};
use dflash_tests::{fixture, ids, load_expected, max_abs_diff};
use serde_json::{json, Value};

use crate::time_ms;

pub(crate) fn run(
    m: &Qwen35Model,
    cache: &mut SequenceCache,
    tokens: &[u32],
    positions: &[u32],
    pattern: &AttnPattern,
    rows: &[usize],
) -> Result<Option<candle_core::Tensor>> {
    Ok(m.forward(
        &mut [SeqForward {
            cache,
            tokens,
            positions,
            pattern,
            logit_rows: rows,
        }],
        &[],
    )?
    .logits)
}

pub fn parity(dev: &Device, dtype: DType) -> Result<Value> {
    let name = "qwen3_5-tiny-random";
    let m = Qwen35Model::load(&fixture(name), dtype, dev, 128, OpsMode::Fused)?;
    let exp = load_expected(name);
    let tokens = ids(&exp["tokens"]);
    let pos: Vec<u32> = (0..80).collect();
    let rows: Vec<usize> = (0..80).collect();
    let mut cache = m.new_cache(128)?;
    let logits =
        run(&m, &mut cache, &tokens, &pos, &AttnPattern::Causal, &rows)?.context("logits")?;
    let prefill_err = max_abs_diff(&logits, &exp["prefill_logits"]);
    let mut cache = m.new_cache_with_rollback(128, 1)?;
    run(
        &m,
        &mut cache,
        &tokens[..5],
        &pos[..5],
        &AttnPattern::Causal,
        &[],
    )?;
    let mut dec = Vec::new();
    for i in 5..17 {
        dec.push(
            run(
                &m,
                &mut cache,
                &tokens[i..=i],
                &pos[i..=i],
                &AttnPattern::Causal,
                &[0],
            )?
            .context("logits")?,
        );
        cache.settle()?;
    }
    let decode_err = max_abs_diff(&candle_core::Tensor::cat(&dec, 0)?, &exp["decode_logits"]);
    // The fixture's sizes (hidden 64, GDN heads of 16) are outside the fused kernels' shapes,
    // so this checks the plain path on the device; `fused_path` says which one ran.
    Ok(
        json!({"dtype": format!("{dtype:?}"), "fused_path": m.fast_kernels(), "prefill_logits_max_abs_err": prefill_err, "decode_logits_max_abs_err": decode_err}),
    )
}

pub fn qwen36_27b() -> Result<HybridConfig> {
    let layer_types: Vec<&str> = (0..64)
        .map(|i| {
            if (i + 1) % 4 == 0 {
                "full_attention"
            } else {
                "linear_attention"
            }
        })
        .collect();
    let v = json!({
        "model_type": "qwen3_5_text", "vocab_size": 248320, "hidden_size": 5120,
        "intermediate_size": 17408, "num_hidden_layers": 64, "num_attention_heads": 24,
        "num_key_value_heads": 4, "head_dim": 256, "linear_num_key_heads": 16,
        "linear_num_value_heads": 48, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4, "layer_types": layer_types, "max_position_embeddings": 262144,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25}
    });
    Ok(HybridConfig::from_value(
        std::path::Path::new("qwen3.6-27b-shape"),
        &v,
    )?)
}

/// The timed forwards: a decode step, a chain verify, and the two 64-node tree shapes
/// (`Some(binary)`, see [`tree`]).
pub(crate) const SHAPES: [(&str, usize, Option<bool>); 4] = [
    ("decode_1", 1, None),
    ("verify_chain_16", 16, None),
    ("verify_tree_64_binary_depth6", 64, Some(true)),
    ("verify_tree_64_ddtree_like_depth16", 64, Some(false)),
];

/// Tokens, attention pattern and positions of a [`SHAPES`] forward of `n` tokens from `start`.
pub(crate) fn shape_inputs(
    start: usize,
    n: usize,
    kind: Option<bool>,
    vocab: u32,
) -> (Vec<u32>, AttnPattern, Vec<u32>) {
    let tokens: Vec<u32> = (0..n as u32).map(|i| (i * 7919) % vocab).collect();
    let (pattern, positions) = match kind {
        None => (
            AttnPattern::Causal,
            (start as u32..(start + n) as u32).collect::<Vec<_>>(),
        ),
        Some(binary) => {
            let (parents, depth) = tree(n, binary);
            (
                AttnPattern::Tree { parents },
                depth.iter().map(|d| start as u32 + d).collect(),
            )
        }
    };
    (tokens, pattern, positions)
}

/// Parents of a 64-node tree: `binary` (depth 6) or DDTree-like (a 16-deep spine with three
/// extra children per spine node, depth 16).
pub(crate) fn tree(n: usize, binary: bool) -> (Vec<Option<usize>>, Vec<u32>) {
    let mut parents = Vec::with_capacity(n);
    let mut depth = Vec::with_capacity(n);
    for i in 0..n {
        let p = if i == 0 {
            None
        } else if binary {
            Some((i - 1) / 2)
        } else if i < 16 {
            Some(i - 1) // the spine
        } else {
            Some((i - 16) / 3) // three side children under spine nodes 0..15
        };
        depth.push(p.map_or(0, |p: usize| depth[p] + 1));
        parents.push(p);
    }
    (parents, depth)
}

/// A scaled-down config with the 27B's proportions, so that `gpu-check cpu --hybrid` runs the
/// benchmark code path too.
pub fn small_for_cpu() -> Result<HybridConfig> {
    let mut c = qwen36_27b()?;
    (
        c.vocab_size,
        c.hidden_size,
        c.intermediate_size,
        c.num_hidden_layers,
    ) = (1024, 128, 256, 8);
    (
        c.num_attention_heads,
        c.num_key_value_heads,
        c.head_dim,
        c.rotary_dim,
    ) = (4, 2, 32, 8);
    (c.linear_num_key_heads, c.linear_num_value_heads) = (2, 6);
    (c.linear_key_head_dim, c.linear_value_head_dim) = (16, 16);
    c.layer_types.truncate(8);
    Ok(c)
}

/// Bytes of all weights read by one forward (every layer, the LM head, one embedding row).
fn weight_bytes(c: &HybridConfig, elem: f64) -> f64 {
    let h = c.hidden_size as f64;
    let mlp = 3.0 * h * c.intermediate_size as f64;
    let hv_dv = (c.linear_num_value_heads * c.linear_value_head_dim) as f64;
    let gdn = h * (c.conv_dim() as f64 + hv_dv + 2.0 * c.linear_num_value_heads as f64) + h * hv_dv;
    let (nh, nkv, d) = (
        c.num_attention_heads as f64,
        c.num_key_value_heads as f64,
        c.head_dim as f64,
    );
    let attn = h * 2.0 * nh * d + 2.0 * h * nkv * d + h * nh * d;
    let lin = c.num_linear_layers() as f64;
    let full = c.num_hidden_layers as f64 - lin;
    elem * (c.num_hidden_layers as f64 * mlp + lin * gdn + full * attn + c.vocab_size as f64 * h)
}

pub fn bench(dev: &Device, copy_bw: f64, cfg: HybridConfig) -> Result<Value> {
    let t0 = Instant::now();
    let m = Qwen35Model::random(
        cfg.clone(),
        &mut WeightRng::on_device(),
        DType::BF16,
        dev,
        4096,
        OpsMode::Fused,
    )?;
    dev.synchronize()?;
    let init_s = t0.elapsed().as_secs_f64();
    let weight_bytes = weight_bytes(&cfg, 2.0);
    let state_per_layer = cfg.recurrent_state_bytes_per_layer(2) as f64;
    let state_bytes = cfg.num_linear_layers() as f64 * state_per_layer;
    // What a verified row stages on the plain path (trees), instead of a full state.
    let staged_per_row = cfg.staged_bytes_per_verified_row(2) as f64;
    let full_layers = (cfg.num_hidden_layers - cfg.num_linear_layers()) as f64;
    let kv_1k = full_layers * 2.0 * (cfg.num_key_value_heads * cfg.head_dim) as f64 * 2.0 * 1024.0;
    let vocab = cfg.vocab_size as u32;
    let mut cache = m.new_cache_with_rollback(4096, 64)?;
    let prompt: Vec<u32> = (0..1024u32).map(|i| (i * 31) % vocab).collect();
    let pos: Vec<u32> = (0..1024).collect();
    let t = Instant::now();
    run(&m, &mut cache, &prompt, &pos, &AttnPattern::Causal, &[1023])?;
    dev.synchronize()?;
    let prefill_1k_ms = t.elapsed().as_secs_f64() * 1e3;
    let mut res = serde_json::Map::new();
    let plain = m.clone().with_fast_kernels(false);
    // The fused checks record their errors instead of ending the run, so that one device call
    // still brings back the plain figures if a fused kernel fails.
    if m.fast_kernels() {
        let layer = crate::hybrid_fused::gdn_layer(dev, &cfg)
            .unwrap_or_else(|e| json!({"error": format!("{e:#}")}));
        println!("hybrid fused GDN layer vs plain {layer}");
        res.insert("fused_gdn_layer_vs_plain".into(), layer);
        #[cfg(feature = "cuda")]
        {
            let paths = crate::hybrid_gdn::gdn_layer_paths(dev, &cfg)
                .unwrap_or_else(|e| json!({"error": format!("{e:#}")}));
            println!("hybrid GDN layer paths {paths}");
            res.insert("gdn_layer_paths".into(), paths);
        }
        let parity = crate::hybrid_fused::fused_vs_plain(&m, &plain, &mut cache, vocab)
            .unwrap_or_else(|e| json!({"error": format!("{e:#}")}));
        println!("hybrid fused vs plain {parity}");
        res.insert("fused_vs_plain".into(), parity);
        #[cfg(feature = "cuda")]
        {
            // The decode roofline as below: weights, 1K of K/V, the state read and written.
            let roof = (weight_bytes + kv_1k + 2.0 * state_bytes) / copy_bw * 1e3;
            let graph = crate::hybrid_graph::graph_vs_eager(dev, &m, &mut cache, vocab, roof)
                .unwrap_or_else(|e| json!({"error": format!("{e:#}")}));
            println!("hybrid decode graph vs eager {graph}");
            res.insert("decode_graph_vs_eager".into(), graph);
        }
        let attn = crate::hybrid_attn::attn_layer(dev, &cfg)
            .unwrap_or_else(|e| json!({"error": format!("{e:#}")}));
        println!("hybrid fused attention layer vs plain {attn}");
        res.insert("fused_attention_layer_vs_plain".into(), attn);
        // 16 layers: 4 of them full attention, and f32 beside bf16 fits the device.
        let noise = crate::hybrid_noise::noise_floor(dev, &cfg, 16, 1024)
            .unwrap_or_else(|e| json!({"error": format!("{e:#}")}));
        println!("hybrid bf16 noise floor {noise}");
        res.insert("bf16_noise_floor_16_layers".into(), noise);
    }
    res.insert("fused_path".into(), json!(m.fast_kernels()));
    let start = cache.len();
    for (name, n, kind) in SHAPES {
        let (tokens, pattern, positions) = shape_inputs(start, n, kind, vocab);
        let rows: Vec<usize> = (0..n).collect();
        let mut timed = |model: &Qwen35Model| {
            time_ms(dev, 5, || {
                run(model, &mut cache, &tokens, &positions, &pattern, &rows)?;
                cache.truncate(start)?;
                Ok(())
            })
        };
        // The plain path on the same weights for the shapes the fused one takes.
        let plain_ms = if m.fast_kernels() && kind.is_none() {
            Some(timed(&plain)?)
        } else {
            None
        };
        let ms = match timed(&m) {
            Ok(ms) => ms,
            Err(e) => {
                cache.truncate(start)?;
                res.insert(format!("{name}_error"), json!(format!("{e:#}")));
                match plain_ms {
                    Some(p) => p,
                    None => return Err(e),
                }
            }
        };
        // Roofline: weights once, K/V of the context, the committed state read once, and per
        // node its staging written: a full state on the fused chain paths that stage states,
        // the compact inputs on the plain (tree) path and the fused `SplitInputs` path.
        let full_states = !matches!(
            m.gdn_paths().for_tokens(n),
            dflash_models::qwen3_5::GdnPath::SplitInputs
        );
        let per_node = if kind.is_none() && m.fast_kernels() && full_states {
            state_bytes
        } else {
            staged_per_row
        };
        let bytes = weight_bytes + kv_1k + state_bytes + n as f64 * per_node;
        let roof = bytes / copy_bw * 1e3;
        res.insert(
            name.into(),
            json!({"ms": ms, "plain_ms": plain_ms, "roofline_ms": roof, "fraction_of_roofline": roof / ms, "bytes_GB": bytes / 1e9}),
        );
    }
    #[cfg(feature = "cuda")]
    if m.fast_kernels() {
        let roof = (weight_bytes + kv_1k + 2.0 * state_bytes) / copy_bw * 1e3;
        let p = crate::hybrid_paths::paths(dev, &m, &plain, &mut cache, vocab, roof)
            .unwrap_or_else(|e| json!({"error": format!("{e:#}")}));
        println!("hybrid GDN paths, whole model {p}");
        res.insert("gdn_paths_whole_model".into(), p);
        let decode_ms = res
            .get("decode_1")
            .and_then(|d| d["ms"].as_f64())
            .unwrap_or(f64::NAN);
        let lt = crate::hybrid_lt::verify_lt(dev, &m, &mut cache, vocab, decode_ms)
            .unwrap_or_else(|e| json!({"error": format!("{e:#}")}));
        println!("hybrid verify products on cuBLASLt {lt}");
        res.insert("verify_lt".into(), lt);
    }
    res.insert("weights_init_s".into(), json!(init_s));
    res.insert("weight_bytes_GB".into(), json!(weight_bytes / 1e9));
    res.insert("prefill_1k_ms".into(), json!(prefill_1k_ms));
    res.insert(
        "config".into(),
        json!(format!(
            "{} layers ({} GDN), hidden {}, vocab {}",
            cfg.num_hidden_layers,
            cfg.num_linear_layers(),
            cfg.hidden_size,
            cfg.vocab_size
        )),
    );
    res.insert(
        "recurrent_state_bytes_per_tree_node_MiB".into(),
        json!(staged_per_row / (1u64 << 20) as f64),
    );
    res.insert(
        "recurrent_staging_64_node_tree_per_sequence_MB".into(),
        json!(64.0 * staged_per_row / 1e6),
    );
    res.insert(
        "full_recurrent_state_MiB_per_fused_chain_row".into(),
        json!(state_bytes / (1u64 << 20) as f64),
    );
    res.insert(
        "recurrent_state_bytes_per_gdn_layer_per_node_MiB".into(),
        json!(state_per_layer / (1u64 << 20) as f64),
    );
    res.insert("copy_bandwidth_GBps".into(), json!(copy_bw / 1e9));
    res.insert(
        "copy_bandwidth_probe".into(),
        json!("driver memcpy of 4 GiB, read + write (dflash_models::probe, as dflash-serve bench)"),
    );
    Ok(Value::Object(res))
}
