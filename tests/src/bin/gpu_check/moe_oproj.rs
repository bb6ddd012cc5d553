//! `gpu_check --moe`'s `moe_oproj_router_route`: the one-launch o-projection + router +
//! routing of a decode row (`cuda::oproj_router_route`, `DFLASH_MOE_OPROJ_ROUTER`) against the
//! two launches it replaces (`cuda::gemv_resid` then `cuda::router_route`), which it must equal
//! **bit for bit**: y, its sum of squares, every routed expert in order with its f32 weight's
//! bits and the used experts. Qwen3-Coder-30B-A3B's shapes (attention width 4096, hidden 2048,
//! 128 experts top 8, renormalised), 32 random rows; wrong case: the renormalisation flipped
//! must differ on every row. Times both forms (one row, 50 launches each).

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use dflash_models::cuda;
use dflash_models::random::WeightRng;
use serde_json::{json, Value};

use crate::time_ms;

pub fn oproj_router_route_check(dev: &Device) -> Result<Value> {
    let (h, width, e, k) = (2048usize, 4096usize, 128usize, 8usize);
    let mut rng = WeightRng::on_device().rounded_to(DType::BF16);
    let nw = rng.normal(&[h], 1.0, 0.2, DType::BF16, dev)?;
    let o_proj = rng.normal(&[h, width], 0.0, 0.02, DType::BF16, dev)?;
    let router = rng.normal(&[e, h], 0.0, 0.05, DType::BF16, dev)?;
    let counter = Tensor::zeros(1, DType::U32, dev)?;
    let norm = cuda::RowNorm {
        ss: None,
        weight: &nw,
        eps: 1e-6,
    };
    let bits = |r: &cuda::MoeRouting| -> Result<Vec<Vec<(usize, u32)>>> {
        Ok(r.to_host()?
            .into_iter()
            .map(|row| row.into_iter().map(|(i, w)| (i, w.to_bits())).collect())
            .collect())
    };
    let f32_bits = |t: &Tensor| -> Result<Vec<u32>> {
        Ok(t.to_dtype(DType::F32)?
            .flatten_all()?
            .to_vec1::<f32>()?
            .into_iter()
            .map(f32::to_bits)
            .collect())
    };
    let (mut y_differ, mut ss_differ, mut routing_differ, mut wrong_differs) = (0, 0, 0, 0);
    let rows = 32;
    for _ in 0..rows {
        let attn = rng.normal(&[1, width], 0.0, 1.0, DType::BF16, dev)?;
        let resid = rng.normal(&[1, h], 0.0, 1.0, DType::BF16, dev)?;
        let (y0, ss0) = cuda::gemv_resid(&attn, &o_proj, &resid, Some(&counter), None)?;
        let ss0 = ss0.ok_or_else(|| anyhow::anyhow!("gemv_resid made no sums of squares"))?;
        let r0 = cuda::router_route(&y0, Some(norm), &router, e, k, true, false)?;
        let (y1, ss1, r1) =
            cuda::oproj_router_route(&attn, &o_proj, &resid, &counter, norm, &router, e, k, true)?;
        y_differ += (f32_bits(&y0)? != f32_bits(&y1)?) as usize;
        ss_differ += (f32_bits(&ss0)? != f32_bits(&ss1)?) as usize;
        let want = bits(&r0)?;
        routing_differ += (want != bits(&r1)? || r0.experts_used()? != r1.experts_used()?) as usize;
        let (_, _, wrong) =
            cuda::oproj_router_route(&attn, &o_proj, &resid, &counter, norm, &router, e, k, false)?;
        wrong_differs += (want != bits(&wrong)?) as usize;
    }
    let pass = y_differ == 0 && ss_differ == 0 && routing_differ == 0 && wrong_differs == rows;
    let attn = rng.normal(&[1, width], 0.0, 1.0, DType::BF16, dev)?;
    let resid = rng.normal(&[1, h], 0.0, 1.0, DType::BF16, dev)?;
    let two = time_ms(dev, 50, || {
        let (y, _) = cuda::gemv_resid(&attn, &o_proj, &resid, Some(&counter), None)?;
        cuda::router_route(&y, Some(norm), &router, e, k, true, false)?;
        Ok(())
    })?;
    let one = time_ms(dev, 50, || {
        cuda::oproj_router_route(&attn, &o_proj, &resid, &counter, norm, &router, e, k, true)?;
        Ok(())
    })?;
    Ok(json!({
        "rows": rows,
        "y_rows_differing": y_differ,
        "ss_rows_differing": ss_differ,
        "routing_rows_differing": routing_differ,
        "wrong_renorm_rows_differing": wrong_differs,
        "ms_oproj_then_router_route": two,
        "ms_oproj_router_route": one,
        "pass": pass,
    }))
}
