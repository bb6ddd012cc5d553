//! The chunked delta rule of a prefill (`gdn_chunk.cu`) against `gdn_scan`'s token-by-token
//! recurrence, both through `gdn_split` (prologue, delta rule, gated norm), on the GPU (CI has
//! none): `dflash-serve bench --model <hybrid>` reports these in `kernel_checks`.

use std::time::Instant;

use candle_core::{DType, Device, Result, Tensor};
use serde_json::{json, Map, Value};

use super::check_attn::max_err;
use super::gdn::{GdnWeights, GDN_HEAD_DIM};
use super::{gdn_chunked, gdn_split, set_gdn_chunked, ScanStates};

/// One case's figures: `(name, max |chunked - scan|, max |scan|)` for the gated-norm output
/// and the last state, then `(name, scan_ms, chunked_ms)`.
type GdnChunkedCase = (Vec<(String, f32, f32)>, (String, f64, f64));

/// Largest max |chunked - scan|, relative to max |scan|, that passes: bf16 and TF32 operands
/// with f32 sums against the f32 recurrence give ~3e-3 of the scale
/// (`tools/emulate_gdn_chunk.py`); a wrong index or layout gives errors of the scale's order.
const GDN_CHUNKED_TOLERANCE: f32 = 2e-2;

/// [`gdn_chunked_errors`] as JSON entries (the family bench's `kernel_checks`, `gpu_check
/// --gdn-chunk`): `<case>:y_vs_scan` and `<case>:state_vs_scan` with `max_abs_diff`,
/// `max_abs_scan` and `pass`, and `<case>:ms` with both timings.
pub fn gdn_chunked_report(dev: &Device) -> Result<Map<String, Value>> {
    let mut res = Map::new();
    for (errs, (name, scan_ms, chunked_ms)) in gdn_chunked_errors(dev)? {
        for (name, err, scale) in errs {
            res.insert(
                name,
                json!({"max_abs_diff": err, "max_abs_scan": scale,
                       "pass": err <= GDN_CHUNKED_TOLERANCE * scale}),
            );
        }
        res.insert(
            format!("{name}:ms"),
            json!({"scan": scan_ms, "chunked": chunked_ms}),
        );
    }
    Ok(res)
}

/// Random GDN inputs of `hk` key and `hv` value heads over `t` tokens, from a random state,
/// through `gdn_split` with the chunked form off and on (the switch is restored after). Decays
/// per token between e^-0.01 and e^-1 (the long-memory end tests the state carried across
/// chunks and segments). Cases: the Qwen3.6-27B heads (16 / 48) at 1,000 tokens (a partial last
/// chunk) and 4,396 (two segments), the 35B-A3B heads (16 / 32) at 1,000.
fn gdn_chunked_errors(dev: &Device) -> Result<Vec<GdnChunkedCase>> {
    let was = gdn_chunked();
    let out = cases(dev);
    set_gdn_chunked(was);
    out
}

fn cases(dev: &Device) -> Result<Vec<GdnChunkedCase>> {
    let d = GDN_HEAD_DIM;
    let bf = |t: Tensor| t.to_dtype(DType::BF16);
    let mut out = Vec::new();
    for (hk, hv, t) in [
        (16usize, 48usize, 1000usize),
        (16, 48, 4396),
        (16, 32, 1000),
    ] {
        let (kernel, c) = (4usize, 2 * hk * d + hv * d);
        let p = c + hv * d + 2 * hv;
        let taps = bf((Tensor::randn(0f32, 1.0, (kernel, c), dev)? * 0.5)?)?;
        // -exp(A_log) in [-0.3, -0.01] and dt_bias 0: with softplus(a) of a ~ N(0, 1) the
        // per-token log-decay is mostly in [-1, -0.01].
        let neg_a = ((Tensor::rand(0f32, 1.0, hv, dev)? * -0.29)? - 0.01)?;
        let dt_bias = Tensor::zeros(hv, DType::F32, dev)?;
        let norm = bf(Tensor::rand(0.5f32, 1.5, d, dev)?)?;
        let w = GdnWeights {
            conv_taps: &taps,
            neg_a: &neg_a,
            dt_bias: &dt_bias,
            norm: &norm,
            hk,
            hv,
            eps: 1e-6,
        };
        let proj = bf(Tensor::randn(0f32, 1.0, (t, p), dev)?)?;
        let win = bf(Tensor::randn(0f32, 1.0, (kernel - 1, c), dev)?)?;
        let s0 = (Tensor::randn(0f32, 1.0, (hv, d, d), dev)? * 0.1)?;
        let run = |chunked: bool| -> Result<(Tensor, Tensor, f64)> {
            set_gdn_chunked(chunked);
            // One warm-up (module load, allocations), then one timed run.
            gdn_split(&win, &proj, &s0, &w, ScanStates::Last, false)?;
            dev.synchronize()?;
            let at = Instant::now();
            let o = gdn_split(&win, &proj, &s0, &w, ScanStates::Last, false)?;
            dev.synchronize()?;
            let ms = at.elapsed().as_secs_f64() * 1e3;
            let s = o
                .states
                .ok_or_else(|| candle_core::Error::Msg("gdn_split returned no state".into()))?;
            Ok((o.y, s, ms))
        };
        let (y_scan, s_scan, scan_ms) = run(false)?;
        let (y_chunk, s_chunk, chunk_ms) = run(true)?;
        let name = format!("gdn_chunked:hk{hk}_hv{hv}:t{t}");
        let (ey, sy) = max_err(&y_chunk, &y_scan)?;
        let (es, ss) = max_err(&s_chunk, &s_scan)?;
        out.push((
            vec![
                (format!("{name}:y_vs_scan"), ey, sy),
                (format!("{name}:state_vs_scan"), es, ss),
            ],
            (name, scan_ms, chunk_ms),
        ));
    }
    Ok(out)
}
