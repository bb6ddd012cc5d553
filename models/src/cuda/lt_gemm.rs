//! cuBLASLt products `x @ wᵀ` for decode-sized row counts (at most [`TUNED_MAX_ROWS`]), with
//! the algorithm picked per shape by timing. The first product of a shape asks cuBLASLt's
//! heuristic for up to [`HEURISTICS`] algorithms, adds split-K variants of each (2..16
//! splits, reduced in the workspace in a fixed order), times every candidate and cuBLAS's
//! default (candle's matmul) with CUDA events, each run after a write that evicts L2 (the
//! weights stream from HBM, as in a step), and keeps the fastest for the process.
//!
//! Built on the reading that cuBLAS streams the weights of a 32-row step at 1.35-2.6 TB/s;
//! measured (deploy/bench/results/h200-2026-12-03-gemm2), that reading was mostly host launch
//! cost of back-to-back uncaptured calls: the heuristic's first choice is bit-identical to
//! cuBLAS's, the best candidate is within 0-3% of it in GPU time, and a CUDA-graph decode step
//! is no faster, so the decoder stack leaves it off by default ([`super::TUNED_DEFAULT_ROWS`]);
//! kept for comparisons and for the residual epilogue (beta = 1), which does save the add.
//!
//! Graph capture: the workspace is allocated once per device, and a shape first seen while
//! the stream captures takes the heuristic's first algorithm untimed (not cached), because
//! timing needs a synchronisation; the decoder stack's captures run their body eagerly first
//! (`decoder_stack::capture_graph`), so a captured step replays the tuned choice.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock};

use candle_core::cuda_backend::cudarc::cublaslt::{result as lt, sys};
use candle_core::cuda_backend::cudarc::driver::{sys as dsys, CudaSlice, CudaStream, DevicePtr};
use candle_core::cuda_backend::{CudaDevice, DeviceId};
use candle_core::{bail, Result, Tensor};

use super::launch::{alloc_bf16, capturing, check_bf16, cuda, ptr};
use super::TUNED_MAX_ROWS;

/// Workspace per device for split-K partials (the largest split of a 64 x 24576 f32 output
/// at 16 splits is 100 MB; candidates that need more than this are dropped).
const WORKSPACE: usize = 32 << 20;
/// Bytes written before each timed run so that no weight is left in L2 (50 MB on the H200).
const FLUSH: usize = 128 << 20;
/// Heuristic algorithms asked for per shape.
const HEURISTICS: usize = 16;
/// Split counts tried on top of each heuristic algorithm's own.
const SPLITS: [u32; 4] = [2, 4, 8, 16];
/// Timed runs per candidate (the median counts).
const RUNS: usize = 5;

/// How a product runs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum LtMode {
    /// cuBLASLt's heuristic first algorithm, untimed.
    Heuristic,
    /// The fastest measured candidate (cuBLAS's default among them), timed at first use.
    Tuned,
}

#[derive(Clone, Copy)]
enum Choice {
    /// candle's matmul (cuBLAS `gemmStridedBatchedEx` with its default algorithm).
    Cublas,
    Lt {
        algo: sys::cublasLtMatmulAlgo_t,
        workspace: usize,
    },
}

/// One measured candidate of a shape, for reports: `(label, microseconds)`.
pub type Timing = (String, f64);

/// Descriptors of one shape `(m, n, k)`, column-major: `yᵀ [n, m] = w [k, n]ᵀ · xᵀ [k, m]`.
struct Shape {
    desc: sys::cublasLtMatmulDesc_t,
    a: sys::cublasLtMatrixLayout_t,
    b: sys::cublasLtMatrixLayout_t,
    d: sys::cublasLtMatrixLayout_t,
    heuristic: Option<(sys::cublasLtMatmulAlgo_t, usize)>,
    tuned: Option<Choice>,
    timings: Vec<Timing>,
}

struct DeviceLt {
    handle: sys::cublasLtHandle_t,
    workspace: CudaSlice<u8>,
    shapes: HashMap<(usize, usize, usize, bool), Shape>,
}

// The handle and descriptors are plain cuBLASLt pointers, used only under the mutex.
unsafe impl Send for DeviceLt {}

fn state() -> &'static Mutex<HashMap<DeviceId, DeviceLt>> {
    static STATE: OnceLock<Mutex<HashMap<DeviceId, DeviceLt>>> = OnceLock::new();
    STATE.get_or_init(|| Mutex::new(HashMap::new()))
}

fn lt_err(what: &str, e: impl std::fmt::Debug) -> candle_core::Error {
    candle_core::Error::Msg(format!("cublasLt {what}: {e:?}"))
}

fn new_shape(m: usize, n: usize, k: usize, resid: bool) -> Result<Shape> {
    let bf = sys::cudaDataType::CUDA_R_16BF;
    let desc = lt::create_matmul_desc(
        sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        sys::cudaDataType::CUDA_R_32F,
    )
    .map_err(|e| lt_err("desc", e))?;
    let trans: i32 = 1; // CUBLAS_OP_T: w is [n, k] row-major, i.e. [k, n] column-major.
    unsafe {
        lt::set_matmul_desc_attribute(
            desc,
            sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
            (&trans as *const i32).cast(),
            4,
        )
        .map_err(|e| lt_err("transa", e))?;
    }
    let a =
        lt::create_matrix_layout(bf, k as u64, n as u64, k as i64).map_err(|e| lt_err("a", e))?;
    let b =
        lt::create_matrix_layout(bf, k as u64, m as u64, k as i64).map_err(|e| lt_err("b", e))?;
    let d =
        lt::create_matrix_layout(bf, n as u64, m as u64, n as i64).map_err(|e| lt_err("d", e))?;
    let _ = resid; // the residual reads C with D's layout.
    Ok(Shape {
        desc,
        a,
        b,
        d,
        heuristic: None,
        tuned: None,
        timings: Vec::new(),
    })
}

/// The heuristic's algorithms for a shape, each with the workspace it needs.
fn heuristics(
    h: sys::cublasLtHandle_t,
    s: &Shape,
) -> Result<Vec<(sys::cublasLtMatmulAlgo_t, usize)>> {
    let pref = lt::create_matmul_pref().map_err(|e| lt_err("pref", e))?;
    let ws = WORKSPACE as u64;
    let mut results =
        vec![unsafe { std::mem::zeroed::<sys::cublasLtMatmulHeuristicResult_t>() }; HEURISTICS];
    let mut count = 0i32;
    let status = unsafe {
        lt::set_matmul_pref_attribute(
            pref,
            sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
            (&ws as *const u64).cast(),
            8,
        )
        .map_err(|e| lt_err("pref workspace", e))?;
        sys::cublasLtMatmulAlgoGetHeuristic(
            h,
            s.desc,
            s.a,
            s.b,
            s.d,
            s.d,
            pref,
            HEURISTICS as i32,
            results.as_mut_ptr(),
            &mut count,
        )
    };
    unsafe { lt::destroy_matmul_pref(pref) }.map_err(|e| lt_err("pref destroy", e))?;
    status.result().map_err(|e| lt_err("heuristic", e))?;
    Ok(results
        .into_iter()
        .take(count.max(0) as usize)
        .filter(|r| r.state == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS)
        .map(|r| (r.algo, r.workspaceSize))
        .collect())
}

/// `algo` with `splits` K splits reduced in the workspace in the compute type (a fixed
/// order), if cuBLASLt accepts it for the shape within [`WORKSPACE`].
fn with_splits(
    h: sys::cublasLtHandle_t,
    s: &Shape,
    algo: &sys::cublasLtMatmulAlgo_t,
    splits: u32,
) -> Option<(sys::cublasLtMatmulAlgo_t, usize)> {
    let mut a = *algo;
    let scheme = sys::cublasLtReductionScheme_t::CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE as u32;
    let mut check = unsafe { std::mem::zeroed::<sys::cublasLtMatmulHeuristicResult_t>() };
    let ok = unsafe {
        sys::cublasLtMatmulAlgoConfigSetAttribute(
            &mut a,
            sys::cublasLtMatmulAlgoConfigAttributes_t::CUBLASLT_ALGO_CONFIG_SPLITK_NUM,
            (&splits as *const u32).cast(),
            4,
        ) == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS
            && sys::cublasLtMatmulAlgoConfigSetAttribute(
                &mut a,
                sys::cublasLtMatmulAlgoConfigAttributes_t::CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME,
                (&scheme as *const u32).cast(),
                4,
            ) == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS
            && sys::cublasLtMatmulAlgoCheck(h, s.desc, s.a, s.b, s.d, s.d, &a, &mut check)
                == sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS
    };
    (ok && check.workspaceSize <= WORKSPACE).then_some((a, check.workspaceSize))
}

fn splits_of(algo: &sys::cublasLtMatmulAlgo_t) -> u32 {
    let mut v = 0u32;
    let mut written = 0usize;
    unsafe {
        sys::cublasLtMatmulAlgoConfigGetAttribute(
            algo,
            sys::cublasLtMatmulAlgoConfigAttributes_t::CUBLASLT_ALGO_CONFIG_SPLITK_NUM,
            (&mut v as *mut u32).cast(),
            4,
            &mut written,
        );
    }
    v.max(1)
}

/// Runs one cuBLASLt product into a fresh `[m, n]` tensor (`y = x wᵀ + resid`).
#[allow(clippy::too_many_arguments)]
fn run_lt(
    dev: &CudaDevice,
    st: &DeviceLt,
    s: &Shape,
    algo: &sys::cublasLtMatmulAlgo_t,
    workspace: usize,
    x: &Tensor,
    w: &Tensor,
    resid: Option<&Tensor>,
) -> Result<Tensor> {
    let (m, _) = x.dims2()?;
    let (n, _) = w.dims2()?;
    let y = alloc_bf16(dev, (m, n))?;
    let stream = dev.cuda_stream();
    let (ws_ptr, _guard) = st.workspace.device_ptr(&stream);
    let alpha = 1f32;
    let beta = if resid.is_some() { 1f32 } else { 0f32 };
    let c = match resid {
        Some(r) => ptr(r)?,
        None => ptr(&y)?,
    };
    unsafe {
        lt::matmul(
            st.handle,
            s.desc,
            (&alpha as *const f32).cast(),
            (&beta as *const f32).cast(),
            ptr(w)? as *const c_void,
            s.a,
            ptr(x)? as *const c_void,
            s.b,
            c as *const c_void,
            s.d,
            ptr(&y)? as *mut c_void,
            s.d,
            algo,
            ws_ptr as *mut c_void,
            workspace,
            stream.cu_stream() as *mut _,
        )
    }
    .map_err(|e| lt_err("matmul", e))?;
    Ok(y)
}

fn run_cublas(x: &Tensor, w: &Tensor, resid: Option<&Tensor>) -> Result<Tensor> {
    let y = x.matmul(&w.t()?)?;
    match resid {
        Some(r) => r + y,
        None => Ok(y),
    }
}

/// Median microseconds of `f` over [`RUNS`] runs, each after an L2-evicting write.
fn time_us(
    stream: &Arc<CudaStream>,
    flush: &mut CudaSlice<u8>,
    f: &dyn Fn() -> Result<Tensor>,
) -> Result<f64> {
    let drv = |e| candle_core::Error::Msg(format!("tuning: {e:?}"));
    f()?;
    let mut us = Vec::with_capacity(RUNS);
    for _ in 0..RUNS {
        stream.memset_zeros(flush).map_err(drv)?;
        let start = stream
            .record_event(Some(dsys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(drv)?;
        f()?;
        let end = stream
            .record_event(Some(dsys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(drv)?;
        end.synchronize().map_err(drv)?;
        us.push(start.elapsed_ms(&end).map_err(drv)? as f64 * 1e3);
    }
    us.sort_by(|a, b| a.total_cmp(b));
    Ok(us[RUNS / 2])
}

/// `x @ wᵀ (+ resid)` for `x: [m, k]` (m <= [`TUNED_MAX_ROWS`]), `w: [n, k]`, `resid:
/// [m, n]`, all contiguous bf16, through cuBLASLt as `mode` says.
pub fn linear_lt(x: &Tensor, w: &Tensor, resid: Option<&Tensor>, mode: LtMode) -> Result<Tensor> {
    check_bf16("linear_lt x", x)?;
    check_bf16("linear_lt w", w)?;
    let (m, k) = x.dims2()?;
    let (n, wk) = w.dims2()?;
    if m == 0 || m > TUNED_MAX_ROWS || wk != k {
        bail!(
            "linear_lt: x {:?}, w {:?}: needs 1..={TUNED_MAX_ROWS} rows and matching k",
            x.shape(),
            w.shape()
        )
    }
    if let Some(r) = resid {
        check_bf16("linear_lt resid", r)?;
        if r.dims2()? != (m, n) {
            bail!("linear_lt: resid {:?} for a [{m}, {n}] product", r.shape())
        }
    }
    let dev = cuda(x)?;
    let mut guard = state()
        .lock()
        .map_err(|_| candle_core::Error::Msg("linear_lt: state poisoned".into()))?;
    let st = match guard.entry(dev.id()) {
        std::collections::hash_map::Entry::Occupied(o) => o.into_mut(),
        std::collections::hash_map::Entry::Vacant(v) => {
            let handle = lt::create_handle().map_err(|e| lt_err("handle", e))?;
            let workspace = dev
                .cuda_stream()
                .alloc_zeros::<u8>(WORKSPACE)
                .map_err(|e| candle_core::Error::Msg(format!("linear_lt workspace: {e:?}")))?;
            v.insert(DeviceLt {
                handle,
                workspace,
                shapes: HashMap::new(),
            })
        }
    };
    let key = (m, n, k, resid.is_some());
    if !st.shapes.contains_key(&key) {
        let mut s = new_shape(m, n, k, resid.is_some())?;
        s.heuristic = heuristics(st.handle, &s)?.first().copied();
        st.shapes.insert(key, s);
    }
    let untuned = st.shapes.get(&key).is_some_and(|s| s.tuned.is_none());
    if mode == LtMode::Tuned && !capturing(&dev)? && untuned {
        let (choice, timings) = tune(&dev, st, key, x, w, resid)?;
        if let Some(s) = st.shapes.get_mut(&key) {
            s.tuned = Some(choice);
            s.timings = timings;
        }
    }
    let Some(s) = st.shapes.get(&key) else {
        bail!("linear_lt: shape {key:?} lost")
    };
    let choice = match (mode, s.tuned) {
        (LtMode::Tuned, Some(c)) => c,
        _ => match s.heuristic {
            Some((algo, workspace)) => Choice::Lt { algo, workspace },
            None => Choice::Cublas,
        },
    };
    match choice {
        Choice::Cublas => run_cublas(x, w, resid),
        Choice::Lt { algo, workspace } => run_lt(&dev, st, s, &algo, workspace, x, w, resid),
    }
}

/// [`linear_lt`] on cuBLASLt's heuristic choice for inputs of any layout (dense copies where
/// they are strided): the hybrid verifies' products (the fused chain and tree forwards, the
/// plain tree path's MLP).
pub fn linear_lt_dense(x: &Tensor, w: &Tensor, resid: Option<&Tensor>) -> Result<Tensor> {
    let resid = resid.map(Tensor::contiguous).transpose()?;
    linear_lt(&x.contiguous()?, w, resid.as_ref(), LtMode::Heuristic)
}

fn tune(
    dev: &CudaDevice,
    st: &DeviceLt,
    key: (usize, usize, usize, bool),
    x: &Tensor,
    w: &Tensor,
    resid: Option<&Tensor>,
) -> Result<(Choice, Vec<Timing>)> {
    let Some(s) = st.shapes.get(&key) else {
        bail!("linear_lt: shape {key:?} lost")
    };
    let stream = dev.cuda_stream();
    let mut flush = stream
        .alloc_zeros::<u8>(FLUSH)
        .map_err(|e| candle_core::Error::Msg(format!("tuning flush buffer: {e:?}")))?;
    let mut cands: Vec<(String, Choice)> = vec![("cublas".into(), Choice::Cublas)];
    for (i, (algo, ws)) in heuristics(st.handle, s)?.into_iter().enumerate() {
        let own = splits_of(&algo);
        cands.push((
            format!("h{i}_s{own}"),
            Choice::Lt {
                algo,
                workspace: ws,
            },
        ));
        for sp in SPLITS.into_iter().filter(|&sp| sp != own) {
            if let Some((a, ws)) = with_splits(st.handle, s, &algo, sp) {
                cands.push((
                    format!("h{i}_s{sp}"),
                    Choice::Lt {
                        algo: a,
                        workspace: ws,
                    },
                ));
            }
        }
    }
    let mut best: Option<(f64, Choice)> = None;
    let mut timings = Vec::with_capacity(cands.len());
    for (label, c) in cands {
        let f = || match c {
            Choice::Cublas => run_cublas(x, w, resid),
            Choice::Lt { algo, workspace } => run_lt(dev, st, s, &algo, workspace, x, w, resid),
        };
        // A candidate cuBLASLt accepts in the check but fails to launch is skipped.
        let Ok(us) = time_us(&stream, &mut flush, &f) else {
            continue;
        };
        if best.is_none_or(|(b, _)| us < b) {
            best = Some((us, c));
        }
        timings.push((label, us));
    }
    let (_, choice) =
        best.ok_or_else(|| candle_core::Error::Msg("linear_lt: no candidate ran".into()))?;
    Ok((choice, timings))
}

/// The timings measured when `(m, n, k)` (with or without the residual) was tuned, fastest
/// first; empty when it has not been.
pub fn tuned_timings(
    dev: &candle_core::Device,
    m: usize,
    n: usize,
    k: usize,
    resid: bool,
) -> Vec<Timing> {
    let candle_core::Device::Cuda(cd) = dev else {
        return Vec::new();
    };
    let Ok(guard) = state().lock() else {
        return Vec::new();
    };
    let mut t = guard
        .get(&cd.id())
        .and_then(|st| st.shapes.get(&(m, n, k, resid)))
        .map(|s| s.timings.clone())
        .unwrap_or_default();
    t.sort_by(|a, b| a.1.total_cmp(&b.1));
    t
}
