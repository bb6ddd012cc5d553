//! One 27B-shaped Gated DeltaNet layer's fused mixers against the plain
//! [`GatedDeltaNet::mix`] (recurrent form, per-row states) at t = 1 and 16
//! (`gpu-check cuda --hybrid`, issue 20): `gdn_chain` (one kernel), `gdn_split` writing every
//! row's state, and `gdn_split` writing each row's `u` with the state rebuilt by
//! `gdn_state_along` (what a verify's commit runs). Checked: gated-norm outputs and states
//! relative to the largest plain value (bf16 tolerance), the rebuilt states equal to the
//! split scan's own bit for bit, and two deliberately wrong cases that the tolerance must
//! reject (a state rebuilt one row short; a zeroed conv window). Timed: per synchronised call,
//! and each launch's GPU time with the queue filled ahead (a 1 GB memset first, so the host's
//! launches do not show as gaps).

use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor};
use dflash_common::HybridConfig;
use dflash_models::cache::{GdnState, StagedState};
use dflash_models::cuda::{gdn_state_along, phases, ChainOut, ScanStates};
use dflash_models::qwen3_5::delta_rule::Forest;
use dflash_models::qwen3_5::GatedDeltaNet;
use dflash_models::random::WeightRng;
use serde_json::{json, Value};

/// Largest tolerated difference over the largest plain value for bf16 outputs and states
/// (the bf16 rounding the plain path does and the kernels do not; `gdn_chain` measured
/// 0.5-1.1%).
const TOL: f32 = 2e-2;

fn rel(a: &Tensor, b: &Tensor) -> Result<f32> {
    let a = a.to_dtype(DType::F32)?.flatten_all()?;
    let b = b.to_dtype(DType::F32)?.flatten_all()?;
    let diff = (&a - &b)?.abs()?.max(0)?.to_scalar::<f32>()?;
    let scale = b.abs()?.max(0)?.to_scalar::<f32>()?;
    Ok(diff / scale)
}

fn max_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    let a = a.to_dtype(DType::F32)?.flatten_all()?;
    let b = b.to_dtype(DType::F32)?.flatten_all()?;
    Ok((&a - &b)?.abs()?.max(0)?.to_scalar::<f32>()?)
}

/// GPU milliseconds per launch label of `reps` back-to-back calls of `f`, queued behind a
/// 1 GB memset so that the host is ahead of the GPU.
fn gpu_phases(dev: &Device, reps: usize, mut f: impl FnMut() -> Result<()>) -> Result<Value> {
    f()?;
    dev.synchronize()?;
    let fill = Tensor::zeros(1usize << 28, DType::F32, dev)?;
    phases::start();
    for _ in 0..reps {
        f()?;
    }
    phases::mark(dev, "end");
    let spans = phases::finish()?;
    drop(fill);
    let mut out = serde_json::Map::new();
    let mut total = 0.0;
    for (label, ms, _) in spans {
        let us = ms * 1e3 / reps as f64;
        total += us;
        out.insert(format!("{label}_us"), json!(us));
    }
    out.insert("total_us".into(), json!(total));
    Ok(Value::Object(out))
}

pub fn gdn_layer_paths(dev: &Device, cfg: &HybridConfig) -> Result<Value> {
    let mut rng = WeightRng::new(7);
    let g = GatedDeltaNet::random(&mut rng, cfg, DType::BF16, dev)?;
    let g32 = g.to_dtype(DType::F32)?;
    let (hv, dk, dv) = (
        cfg.linear_num_value_heads,
        cfg.linear_key_head_dim,
        cfg.linear_value_head_dim,
    );
    let p = g.conv_dim() + hv * dv + 2 * hv;
    let k = cfg.linear_conv_kernel_dim;
    let state = GdnState {
        conv: rng.normal(&[k - 1, g.conv_dim()], 0.0, 1.0, DType::BF16, dev)?,
        ssm: rng.normal(&[hv, dk, dv], 0.0, 0.1, DType::F32, dev)?,
    };
    let zero_window = GdnState {
        conv: state.conv.zeros_like()?,
        ssm: state.ssm.clone(),
    };
    let mut res = serde_json::Map::new();
    let mut all_pass = true;
    for t in [1usize, 16] {
        let proj = rng.normal(&[t, p], 0.0, 1.0, DType::BF16, dev)?;
        let chain: Vec<Option<usize>> = (0..t).map(|i| i.checked_sub(1)).collect();
        let forest = Forest::new(&[chain.as_slice()], k, dev)?;
        let (y, staged) = g.mix(&proj, &forest, &[&state], &[true], false)?;
        let Some(StagedState::Rows(rows)) = staged.into_iter().next() else {
            anyhow::bail!("the plain mix kept no per-row states");
        };
        let last = &rows.last().context("rows")?.ssm;

        // gdn_chain (the path before this session).
        let (yc, sc, _) = g.mix_fused(&proj, &state, ChainOut::EveryRow)?;
        // gdn_split, every row's state.
        let so = g.mix_split(&proj, &state, ScanStates::All, false)?;
        let ss = so.states.context("split states")?;
        // gdn_split, u only; the states rebuilt as the commit does.
        let si = g.mix_split(&proj, &state, ScanStates::None, true)?;
        let u = si.u.context("split writes")?;
        let rebuild = |n: usize| -> Result<Tensor> {
            Ok(gdn_state_along(
                &state.ssm,
                &si.k.narrow(0, 0, n)?.contiguous()?,
                &u.narrow(0, 0, n)?.contiguous()?,
                &si.g.narrow(0, 0, n)?.contiguous()?,
            )?)
        };
        let (r_last, r_first) = (rebuild(t)?, rebuild(1)?);
        let rebuilt_bits_last = max_diff(&r_last, &ss.get(t - 1)?)?;
        let rebuilt_bits_first = max_diff(&r_first, &ss.get(0)?)?;
        let y_bits = max_diff(&si.y, &so.y)?;

        let chain_y = rel(&yc, &y)?;
        let chain_last = rel(&sc.get(t - 1)?, last)?;
        let split_y = rel(&so.y, &y)?;
        let split_last = rel(&ss.get(t - 1)?, last)?;
        let split_first = rel(&ss.get(0)?, &rows[0].ssm)?;
        let rebuilt_last = rel(&r_last, last)?;
        // Wrong cases: must exceed the tolerance.
        let wrong_short = if t > 1 {
            Some(rel(&rebuild(t - 1)?, last)?)
        } else {
            None
        };
        let wrong_window = rel(
            &g.mix_split(&proj, &zero_window, ScanStates::None, true)?.y,
            &y,
        )?;
        let pass = [
            chain_y,
            chain_last,
            split_y,
            split_last,
            split_first,
            rebuilt_last,
        ]
        .iter()
        .all(|&e| e < TOL)
            && rebuilt_bits_last == 0.0
            && rebuilt_bits_first == 0.0
            && y_bits == 0.0
            && wrong_short.is_none_or(|e| e > TOL)
            && wrong_window > TOL;
        all_pass &= pass;

        let call = |f: &mut dyn FnMut() -> Result<()>| crate::time_ms(dev, 20, f);
        let chain_ms = call(&mut || {
            g.mix_fused(&proj, &state, ChainOut::EveryRow)?;
            Ok(())
        })?;
        let states_ms = call(&mut || {
            g.mix_split(&proj, &state, ScanStates::All, false)?;
            Ok(())
        })?;
        let inputs_ms = call(&mut || {
            g.mix_split(&proj, &state, ScanStates::None, true)?;
            Ok(())
        })?;
        let n = t.min(8);
        let (kk, uu, gg) = (
            si.k.narrow(0, 0, n)?.contiguous()?,
            u.narrow(0, 0, n)?.contiguous()?,
            si.g.narrow(0, 0, n)?.contiguous()?,
        );
        let commit_ms = call(&mut || {
            gdn_state_along(&state.ssm, &kk, &uu, &gg)?;
            Ok(())
        })?;
        let copy_ms = call(&mut || {
            ss.get(n - 1)?.copy()?;
            Ok(())
        })?;
        let plain_ms = crate::time_ms(dev, 5, || {
            g.mix(&proj, &forest, &[&state], &[true], false)?;
            Ok(())
        })?;
        let gpu = json!({
            "chain_all_states": gpu_phases(dev, 10, || { g.mix_fused(&proj, &state, ChainOut::EveryRow)?; Ok(()) })?,
            "split_all_states": gpu_phases(dev, 10, || { g.mix_split(&proj, &state, ScanStates::All, false)?; Ok(()) })?,
            "split_last_state": gpu_phases(dev, 10, || { g.mix_split(&proj, &state, ScanStates::Last, false)?; Ok(()) })?,
            "split_writes_only": gpu_phases(dev, 10, || { g.mix_split(&proj, &state, ScanStates::None, true)?; Ok(()) })?,
            "commit_rebuild_8_rows": gpu_phases(dev, 10, || { phases::mark(dev, "state_along"); gdn_state_along(&state.ssm, &kk, &uu, &gg)?; Ok(()) })?,
            "commit_copy_one_state": gpu_phases(dev, 10, || { phases::mark(dev, "copy"); ss.get(n - 1)?.copy()?; Ok(()) })?,
        });
        res.insert(
            format!("t{t}"),
            json!({
                "pass": pass,
                "tolerance": TOL,
                "chain": {"y_rel_err": chain_y, "last_state_rel_err": chain_last},
                "split": {"y_rel_err": split_y, "last_state_rel_err": split_last, "first_state_rel_err": split_first},
                "split_inputs": {
                    "rebuilt_last_state_rel_err": rebuilt_last,
                    "rebuilt_vs_split_state_max_abs_diff_last_first": [rebuilt_bits_last, rebuilt_bits_first],
                    "y_vs_split_states_max_abs_diff": y_bits,
                },
                "wrong_state_rebuilt_one_row_short_rel_err": wrong_short,
                "wrong_zeroed_conv_window_y_rel_err": wrong_window,
                "call_ms": {
                    "plain": plain_ms, "chain_all_states": chain_ms, "split_all_states": states_ms,
                    "split_writes_only": inputs_ms,
                    format!("commit_rebuild_{n}_rows"): commit_ms, "commit_copy_one_state": copy_ms,
                },
                "gpu_per_call_queued": gpu,
            }),
        );
    }
    // Prefill lengths (not multiples of the scan's 16-token tiles): the split kernels' last
    // state and outputs (`mix_prefill_split`, the fused path's prefill) against the plain
    // path's chunked form.
    for t in [100usize, 1000] {
        let proj = rng.normal(&[t, p], 0.0, 1.0, DType::BF16, dev)?;
        let chain: Vec<Option<usize>> = (0..t).map(|i| i.checked_sub(1)).collect();
        let forest = Forest::new(&[chain.as_slice()], k, dev)?;
        let (y, staged) = g.mix(&proj, &forest, &[&state], &[false], true)?;
        let Some(StagedState::Final(want)) = staged.into_iter().next() else {
            anyhow::bail!("the chunked mix staged no final state");
        };
        let (ys, got) = g
            .mix_prefill_split(&proj, &state)?
            .context("the split prefill does not apply")?;
        let StagedState::Final(got) = got else {
            anyhow::bail!("the split prefill staged no final state");
        };
        let (y_err, s_err) = (rel(&ys, &y)?, rel(&got.ssm, &want.ssm)?);
        let conv_bits = max_diff(&got.conv, &want.conv)?;
        // Both sides are bf16 approximations of one recurrence over t tokens; the f32 copy
        // of the layer on f32 inputs says which side carries the error. The split scan must
        // be as close to it as the chunked form is (or within the tolerance of it).
        let state32 = GdnState {
            conv: state.conv.to_dtype(DType::F32)?,
            ssm: state.ssm.clone(),
        };
        let (y32, staged32) = g32.mix(
            &proj.to_dtype(DType::F32)?,
            &forest,
            &[&state32],
            &[false],
            true,
        )?;
        let Some(StagedState::Final(want32)) = staged32.into_iter().next() else {
            anyhow::bail!("the f32 chunked mix staged no final state");
        };
        let (split_vs_f32, chunked_vs_f32) = (rel(&ys, &y32)?, rel(&y, &y32)?);
        let state_split_vs_f32 = rel(&got.ssm, &want32.ssm)?;
        let state_chunked_vs_f32 = rel(&want.ssm, &want32.ssm)?;
        let near_f32 = split_vs_f32 <= chunked_vs_f32.max(TOL)
            && state_split_vs_f32 <= state_chunked_vs_f32.max(TOL);
        let pass = near_f32 && conv_bits == 0.0;
        all_pass &= pass;
        let split_ms = crate::time_ms(dev, 10, || {
            g.mix_prefill_split(&proj, &state)?;
            Ok(())
        })?;
        let chunked_ms = crate::time_ms(dev, 3, || {
            g.mix(&proj, &forest, &[&state], &[false], true)?;
            Ok(())
        })?;
        res.insert(
            format!("prefill_t{t}"),
            json!({
                "pass": pass, "tolerance": TOL,
                "y_rel_err": y_err, "last_state_rel_err": s_err, "conv_window_max_abs_diff": conv_bits,
                "vs_f32_reference": {
                    "y_split": split_vs_f32, "y_chunked_bf16": chunked_vs_f32,
                    "last_state_split": state_split_vs_f32, "last_state_chunked_bf16": state_chunked_vs_f32,
                },
                "call_ms": {"split": split_ms, "chunked_plain": chunked_ms},
            }),
        );
    }
    // Verify trees on the tree kernels (`mix_tree_split`, opt-in) against the plain path's
    // tree form (`mix_staged`): outputs, the staged keys / writes / log-decays, and the state
    // rebuilt along the deepest path from each side's staging; a tree branching at every depth
    // (16 nodes) and a DDTree-like one (64 nodes: a main path of 16 with side branches).
    // On the depth-first walk, and past `cuda::GDN_TREE_CHUNKED_MIN_NODES` on the chunked form
    // (`cuda::set_gdn_tree_chunked`).
    let was_chunked = dflash_models::cuda::gdn_tree_chunked_on();
    for (name, parents, chunked) in [
        ("gdn_tree_16", branching_tree(16), false),
        ("gdn_tree_64", ddtree_like(64), false),
        ("gdn_tree_40_chunked", branching_tree(40), true),
        ("gdn_tree_64_chunked", ddtree_like(64), true),
    ] {
        dflash_models::cuda::set_gdn_tree_chunked(chunked);
        let t = parents.len();
        let proj = rng.normal(&[t, p], 0.0, 1.0, DType::BF16, dev)?;
        let forest = Forest::new(&[parents.as_slice()], k, dev)?;
        let (y, want) = g.mix_staged(&proj, &forest, &parents, &state)?;
        let (ys, got) = g
            .mix_tree_split(&proj, &forest, &parents, &state)?
            .context("the tree kernels do not apply")?;
        let (StagedState::Inputs(want), StagedState::Inputs(got)) = (want, got) else {
            anyhow::bail!("both sides must stage row inputs");
        };
        let path = deepest_path(&parents);
        let idx = Tensor::new(path.as_slice(), dev)?;
        let along = |r: &dflash_models::cache::RowInputs| -> Result<Tensor> {
            Ok(gdn_state_along(
                &state.ssm,
                &r.k.index_select(&idx, 0)?.contiguous()?,
                &r.writes.index_select(&idx, 0)?.contiguous()?,
                &r.g.index_select(&idx, 0)?.contiguous()?,
            )?)
        };
        let errs = [
            ("y_rel_err", rel(&ys, &y)?),
            ("k_rel_err", rel(&got.k, &want.k)?),
            ("writes_rel_err", rel(&got.writes, &want.writes)?),
            ("g_rel_err", rel(&got.g, &want.g)?),
            (
                "deepest_path_state_rel_err",
                rel(&along(&got)?, &along(&want)?)?,
            ),
        ];
        let pre_conv_bits = max_diff(&got.pre_conv, &want.pre_conv)?;
        // Wrong case: the tree read as a star (every node a child of the root; a chain of 64
        // would be deeper than the kernels take) must exceed the tolerance.
        let star: Vec<Option<usize>> = (0..t).map(|i| (i > 0).then_some(0)).collect();
        let star_forest = Forest::new(&[star.as_slice()], k, dev)?;
        let wrong = g
            .mix_tree_split(&proj, &star_forest, &star, &state)?
            .context("the tree kernels refused the star-shaped wrong case")?;
        let wrong_err = rel(&wrong.0, &y)?;
        let pass = errs.iter().all(|(_, e)| *e < TOL) && pre_conv_bits == 0.0 && wrong_err > TOL;
        all_pass &= pass;
        let kernel_ms = crate::time_ms(dev, 10, || {
            g.mix_tree_split(&proj, &forest, &parents, &state)?;
            Ok(())
        })?;
        let plain_ms = crate::time_ms(dev, 3, || {
            g.mix_staged(&proj, &forest, &parents, &state)?;
            Ok(())
        })?;
        let mut m: serde_json::Map<String, Value> = errs
            .iter()
            .map(|(n, e)| (n.to_string(), json!(e)))
            .collect();
        m.insert("pass".into(), json!(pass));
        m.insert("tolerance".into(), json!(TOL));
        m.insert("pre_conv_max_abs_diff".into(), json!(pre_conv_bits));
        m.insert("wrong_tree_as_star_y_rel_err".into(), json!(wrong_err));
        m.insert("deepest_path_len".into(), json!(path.len()));
        m.insert(
            "call_ms".into(),
            json!({"tree_kernels": kernel_ms, "plain": plain_ms}),
        );
        res.insert(name.into(), Value::Object(m));
    }
    dflash_models::cuda::set_gdn_tree_chunked(was_chunked);
    res.insert("pass".into(), json!(all_pass));
    Ok(Value::Object(res))
}

/// A tree of `n` nodes where every node up to the middle has two children (branching at every
/// depth).
fn branching_tree(n: usize) -> Vec<Option<usize>> {
    (0..n)
        .map(|i| if i == 0 { None } else { Some((i - 1) / 2) })
        .collect()
}

/// A DDTree-like tree of `n` nodes: a main path of 16, then each further node a child of a
/// main-path node (cycling through them), some of those extended by one more.
fn ddtree_like(n: usize) -> Vec<Option<usize>> {
    let main = 16.min(n);
    let mut parents: Vec<Option<usize>> = (0..main).map(|i| i.checked_sub(1)).collect();
    for i in main..n {
        parents.push(Some(if i % 3 == 0 { i - 1 } else { (i * 7) % main }));
    }
    parents
}

/// The root-to-leaf path of the deepest node (node indices, root first).
fn deepest_path(parents: &[Option<usize>]) -> Vec<u32> {
    let depth = |mut i: usize| {
        let mut d = 0;
        while let Some(p) = parents[i] {
            i = p;
            d += 1;
        }
        d
    };
    let mut leaf = (0..parents.len()).max_by_key(|&i| depth(i)).unwrap_or(0);
    let mut path = vec![leaf as u32];
    while let Some(p) = parents[leaf] {
        path.push(p as u32);
        leaf = p;
    }
    path.reverse();
    path
}
