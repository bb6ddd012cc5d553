//! The whole 27B-shaped hybrid model's decode step and 16-token chain verify on each fused GDN
//! path (`GdnPath`: `gdn_chain` with per-row states, `gdn_split` with per-row states,
//! `gdn_split` staging the rows' inputs), from the same 1K prefix (`gpu-check cuda --hybrid`,
//! issue 20):
//! - time of the forward alone (then truncated back, as the bench's `decode_1` /
//!   `verify_chain_16`), and of the forward plus the commit the engine runs after it
//!   (`compact` keeping the first rows: the state rebuild or copy), on a clone of the cache
//!   so the prefix stays;
//! - a GPU-timeline profile of one forward (+ commit) by phase (`cuda::phases`): what the GPU
//!   spent from each labelled point to the next, summed over the layers;
//! - logits against the plain path (decode, verify, 8 decode steps, and a verify committed on
//!   8 rows then a decode step, which reads the rebuilt state).

use anyhow::Result;
use candle_core::Device;
use dflash_models::cuda::phases;
use dflash_models::qwen3_5::{GdnPath, GdnPaths};
use dflash_models::{AttnPattern, Qwen35Model, SequenceCache};
use serde_json::{json, Value};

use crate::hybrid_fused::{compare, logits};
use crate::hybrid_lt::{commit_then_decode, profile};

/// Rows a timed verify commits (the accepted prefix).
const ACCEPT: usize = 8;

fn name(p: GdnPath) -> &'static str {
    match p {
        GdnPath::Chain => "chain",
        GdnPath::SplitStates => "split_states",
        GdnPath::SplitInputs => "split_inputs",
    }
}

/// `roof_decode_ms`: the decode roofline as the bench computes it.
pub fn paths(
    dev: &Device,
    m: &Qwen35Model,
    plain: &Qwen35Model,
    cache: &mut SequenceCache,
    vocab: u32,
    roof_decode_ms: f64,
) -> Result<Value> {
    let start = cache.len();
    let toks = |n: u32, mul: u32| (0..n).map(|i| (i * mul + 11) % vocab).collect::<Vec<_>>();
    let mut res = serde_json::Map::new();
    let all = [GdnPath::Chain, GdnPath::SplitStates, GdnPath::SplitInputs];
    let mut decode_ms = serde_json::Map::new();
    for path in all {
        let model = m.clone().with_gdn_paths(GdnPaths {
            decode: path,
            verify: path,
        });
        let mut out = serde_json::Map::new();
        for (label, n) in [("decode_1", 1usize), ("verify_chain_16", 16)] {
            let tokens = toks(n as u32, 7919);
            let keep: Vec<usize> = (start..start + n.min(ACCEPT)).collect();
            let alone = crate::time_ms(dev, 9, || {
                logits(&model, cache, &tokens, start)?;
                cache.truncate(start)?;
                Ok(())
            })?;
            let with_commit = crate::time_ms(dev, 9, || {
                let mut c = cache.clone();
                logits(&model, &mut c, &tokens, start)?;
                c.compact(start, &keep)?;
                Ok(())
            })?;
            // One forward + commit profiled (after the warm runs above).
            let mut c = cache.clone();
            let prof = profile(dev, "embed", &mut || {
                logits(&model, &mut c, &tokens, start)?;
                phases::mark(dev, "commit");
                c.compact(start, &keep)?;
                Ok(())
            })?;
            drop(c);
            if n == 1 {
                decode_ms.insert(name(path).into(), json!(alone));
            }
            out.insert(
                label.into(),
                json!({
                    "ms": alone,
                    "with_commit_ms": with_commit,
                    "committed_rows": keep.len(),
                    "profile_forward_and_commit": prof,
                }),
            );
        }
        // Ratio of this path's verify to this path's decode, and decode against the roofline.
        let d = out["decode_1"]["ms"].as_f64().unwrap_or(f64::NAN);
        let v = out["verify_chain_16"]["ms"].as_f64().unwrap_or(f64::NAN);
        let dc = out["decode_1"]["with_commit_ms"]
            .as_f64()
            .unwrap_or(f64::NAN);
        let vc = out["verify_chain_16"]["with_commit_ms"]
            .as_f64()
            .unwrap_or(f64::NAN);
        out.insert(
            "decode_fraction_of_roofline".into(),
            json!(roof_decode_ms / d),
        );
        out.insert("verify_16_over_decode".into(), json!(v / d));
        out.insert("verify_16_over_decode_with_commits".into(), json!(vc / dc));

        // Logits against the plain path (bf16 noise at 64 layers: see the noise floor).
        let mut parity = serde_json::Map::new();
        let v16 = toks(16, 7919);
        for (label, tokens, one_by_one) in [
            ("decode_1", toks(1, 7919), false),
            ("verify_chain_16", v16.clone(), false),
            ("decode_8_steps", toks(8, 104729), true),
        ] {
            let mut run = |mm: &Qwen35Model| -> Result<candle_core::Tensor> {
                let out = if one_by_one {
                    let mut rows = Vec::new();
                    for (i, tok) in tokens.iter().enumerate() {
                        rows.push(logits(mm, cache, std::slice::from_ref(tok), start + i)?);
                    }
                    candle_core::Tensor::cat(&rows, 0)?
                } else {
                    logits(mm, cache, &tokens, start)?
                };
                cache.truncate(start)?;
                Ok(out)
            };
            let f = run(&model)?;
            let p = run(plain)?;
            parity.insert(label.into(), compare(&f, &p)?);
        }
        // A verify of 16 committed on its first ACCEPT rows, then a decode step.
        let causal = AttnPattern::Causal;
        let positions: Vec<u32> = (start as u32..start as u32 + 16).collect();
        let keep: Vec<usize> = (start..start + ACCEPT).collect();
        let verify = (v16.as_slice(), &causal, positions.as_slice());
        let f = commit_then_decode(&model, cache, verify, &keep, 4242 % vocab)?;
        let p = commit_then_decode(plain, cache, verify, &keep, 4242 % vocab)?;
        parity.insert("verify_16_commit_8_then_decode".into(), compare(&f, &p)?);
        out.insert("vs_plain".into(), Value::Object(parity));
        res.insert(name(path).into(), Value::Object(out));
    }
    res.insert("decode_ms_by_path".into(), Value::Object(decode_ms));
    res.insert(
        "default_paths".into(),
        json!(format!("{:?}", m.gdn_paths())),
    );
    Ok(Value::Object(res))
}
