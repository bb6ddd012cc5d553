//! What every kernel wrapper needs: the CUDA device and raw address of a candle tensor,
//! uninitialised device buffers, launch configurations and error mapping, dtype checks, and
//! host-to-device uploads of small inputs (stream-ordered, so CUDA graphs can replay them).

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::sys::{
    CUfunction_attribute_enum, CUstreamCaptureStatus,
};
use candle_core::cuda_backend::cudarc::driver::{
    CudaFunction, DevicePtr, LaunchArgs, LaunchConfig,
};
use candle_core::cuda_backend::{CudaDevice, CudaStorage};
use candle_core::op::BackpropOp;
use candle_core::{bail, DType, Device, Result, Shape, Storage, Tensor};
use half::bf16;

use super::switch::EnvSwitch;

pub(super) fn cuda(t: &Tensor) -> Result<CudaDevice> {
    match t.device() {
        Device::Cuda(d) => Ok(d.clone()),
        _ => bail!("fast kernels need CUDA tensors"),
    }
}

/// Whether `dev`'s stream is capturing a CUDA graph (then nothing may synchronise, time or grow
/// a buffer).
pub(super) fn capturing(dev: &CudaDevice) -> Result<bool> {
    let status = dev
        .cuda_stream()
        .capture_status()
        .map_err(|e| candle_core::Error::Msg(format!("capture status: {e:?}")))?;
    Ok(status != CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
}

/// Device address of a contiguous tensor's first element.
pub fn device_address(t: &Tensor) -> Result<u64> {
    ptr(t)
}

/// [`ptr`] of an optional tensor; 0 (a null pointer) for none.
pub(super) fn opt_ptr(t: Option<&Tensor>) -> Result<u64> {
    t.map_or(Ok(0), ptr)
}

/// Checks a batch's page tables (u32 `[seqs, pages]`) against `seqs` sequences and returns
/// the entries per sequence (0 without tables, which only a one-sequence launch may lack:
/// its rows are then in order in the buffers).
pub(super) fn page_stride(pages: Option<&Tensor>, seqs: usize, who: &str) -> Result<usize> {
    match pages {
        None if seqs == 1 => Ok(0),
        None => bail!("{who}: {seqs} sequences in one launch need their page tables"),
        Some(p) => {
            let (n, stride) = p.dims2()?;
            if n != seqs || p.dtype() != candle_core::DType::U32 || stride == 0 {
                bail!(
                    "{who}: page tables must be u32 [{seqs}, pages], got {:?} {:?}",
                    p.dtype(),
                    p.shape()
                )
            }
            Ok(stride)
        }
    }
}

pub(super) fn ptr(t: &Tensor) -> Result<u64> {
    let (st, layout) = t.storage_and_layout();
    let Storage::Cuda(cs) = &*st else {
        bail!("fast kernels need CUDA tensors")
    };
    let Some((start, _)) = layout.contiguous_offsets() else {
        bail!("fast kernels need contiguous tensors, got {:?}", layout)
    };
    let stream = cs.device.cuda_stream();
    let base = match t.dtype() {
        DType::BF16 => cs.as_cuda_slice::<bf16>()?.device_ptr(&stream).0,
        DType::F32 => cs.as_cuda_slice::<f32>()?.device_ptr(&stream).0,
        DType::U32 => cs.as_cuda_slice::<u32>()?.device_ptr(&stream).0,
        DType::I64 => cs.as_cuda_slice::<i64>()?.device_ptr(&stream).0,
        other => bail!("fast kernels: unsupported dtype {other:?}"),
    };
    Ok(base + (start * t.dtype().size_in_bytes()) as u64)
}

/// Device address of the first element of a contiguous layout of `cs` (as [`ptr`], for custom
/// ops that see storages rather than tensors).
pub(super) fn storage_ptr(cs: &CudaStorage, layout: &candle_core::Layout) -> Result<u64> {
    let Some((start, _)) = layout.contiguous_offsets() else {
        bail!("fast kernels need contiguous tensors, got {:?}", layout)
    };
    let stream = cs.device.cuda_stream();
    let dtype = cs.dtype();
    let base = match dtype {
        DType::BF16 => cs.as_cuda_slice::<bf16>()?.device_ptr(&stream).0,
        DType::F32 => cs.as_cuda_slice::<f32>()?.device_ptr(&stream).0,
        DType::U32 => cs.as_cuda_slice::<u32>()?.device_ptr(&stream).0,
        other => bail!("fast kernels: unsupported dtype {other:?}"),
    };
    Ok(base + (start * dtype.size_in_bytes()) as u64)
}

pub(super) fn alloc_bf16(dev: &CudaDevice, shape: impl Into<Shape>) -> Result<Tensor> {
    let shape = shape.into();
    // Every element is written by the kernel before it is read.
    let s = unsafe { dev.alloc::<bf16>(shape.elem_count())? };
    Ok(Tensor::from_storage(
        Storage::Cuda(CudaStorage::wrap_cuda_slice(s, dev.clone())),
        shape,
        BackpropOp::none(),
        false,
    ))
}

pub(super) fn alloc_f32(dev: &CudaDevice, n: usize) -> Result<Tensor> {
    let s = unsafe { dev.alloc::<f32>(n)? };
    Ok(Tensor::from_storage(
        Storage::Cuda(CudaStorage::wrap_cuda_slice(s, dev.clone())),
        n,
        BackpropOp::none(),
        false,
    ))
}

pub(super) fn cfg(grid: (u32, u32, u32), block: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: grid,
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Kernel `name` of `module` (from `ptx`), allowed `smem` bytes of dynamic shared memory (over
/// the 48 KB default a function must be; a per-function setting, cheap to repeat).
pub(super) fn function_with_smem(
    dev: &CudaDevice,
    (module, ptx): (&str, &str),
    name: &str,
    smem: usize,
) -> Result<CudaFunction> {
    let f = dev
        .get_or_load_custom_func(name, module, ptx)?
        .into_cuda_function();
    f.set_attribute(
        CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        smem as i32,
    )
    .map_err(|e| candle_core::Error::Msg(format!("{name}: shared memory {smem} B: {e}")))?;
    Ok(f)
}

/// Launches `f` on `dev`'s stream with `args` (a pointer to each argument's value, in the
/// kernel's order, the values alive for the call); with `pdl`, as a programmatic dependent
/// launch (the kernel may start before the one before it on the stream has finished: it must
/// `griddepcontrol.wait`, `pdl_wait` in common.cuh, before reading what that one wrote).
fn go_ex(
    dev: &CudaDevice,
    f: &CudaFunction,
    cfg: LaunchConfig,
    args: &mut [*mut std::ffi::c_void],
    pdl: bool,
    name: &str,
) -> Result<()> {
    use candle_core::cuda_backend::cudarc::driver::sys;
    let stream = dev.cuda_stream();
    let err = |e: String| candle_core::Error::Msg(format!("{name}: {e}"));
    stream
        .context()
        .bind_to_thread()
        .map_err(|e| err(e.to_string()))?;
    // SAFETY: a zeroed attribute is a valid "ignore" value; id and the union member are set
    // together, and the driver reads only `numAttrs` of them.
    let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.programmaticStreamSerializationAllowed = 1;
    let config = sys::CUlaunchConfig {
        gridDimX: cfg.grid_dim.0,
        gridDimY: cfg.grid_dim.1,
        gridDimZ: cfg.grid_dim.2,
        blockDimX: cfg.block_dim.0,
        blockDimY: cfg.block_dim.1,
        blockDimZ: cfg.block_dim.2,
        sharedMemBytes: cfg.shared_mem_bytes,
        hStream: stream.cu_stream(),
        attrs: &mut attr,
        numAttrs: pdl as u32,
    };
    // SAFETY: the caller passes one pointer per kernel parameter, to a value of its type, alive
    // until this returns (the driver copies the values at launch).
    unsafe {
        sys::cuLaunchKernelEx(
            &config,
            f.cu_function(),
            args.as_mut_ptr(),
            std::ptr::null_mut(),
        )
    }
    .result()
    .map_err(|e| err(e.to_string()))
}

static PDL: EnvSwitch = EnvSwitch::new("DFLASH_PDL", true);

/// Whether a decode step's kernels launch as programmatic dependents of the kernel before them
/// (PDL, sm_90, `launch::KernelArgs::launch`): the one-row skinny GEMMs (`gemv.cu`'s
/// `gemv_rows2_*`, every projection), the decode attention (`attn_decode_*`, `attn_step_*`),
/// the gated attention (`gattn_*`), the GDN chain and its gated norm, the MoE routing and
/// decode kernels. Each may start while the previous kernel finishes and waits for that
/// kernel's writes (`pdl_wait`) before reading them, so a step's ~5-15 launches a layer overlap
/// their start-up with their predecessors' tails. Every kernel triggers its dependents
/// (`pdl_launch_dependents`) only after its own wait, so what a kernel reads before its wait
/// (the step attention's page table, length and committed keys) was written two or
/// more kernels back and is complete; the heavy kernels trigger once their weight or key
/// streams are done, so dependents take no slot a wave of theirs still needs. On by default:
/// against it off, one machine, one binary (H100, session 28, call U,
/// deploy/bench/results/h100-2026-12-07-s28): the 27B's decode through the engine 20.50 /
/// 20.53 ms against 21.23 (-3.4%), the 35B-A3B's 4.51 against 4.60, the Coder's eager decode
/// 3.95 against 4.33 and its graph 3.807 against 3.808, Qwen3-8B's graph 6.009 / 5.971
/// against 5.970 / 5.964; greedy tokens identical. (With the trigger at every kernel's start
/// it was slower on the MoE shapes, session 27, and with the GEMMs pulling their weight rows
/// into L2 before the wait 13% slower on the 27B, session 26.) `DFLASH_PDL=0` or this switch
/// turns it off. Process-wide.
pub fn set_pdl(on: bool) {
    PDL.set(on);
}

/// Whether decode kernels launch with PDL ([`set_pdl`]).
pub fn pdl() -> bool {
    PDL.get()
}

/// A kernel's arguments for [`KernelArgs::launch`]: a pointer to each value, in the kernel's
/// order; the values outlive the builder (the driver copies them at launch).
pub(super) struct KernelArgs<'a> {
    ptrs: Vec<*mut std::ffi::c_void>,
    values: std::marker::PhantomData<&'a ()>,
}

impl<'a> KernelArgs<'a> {
    pub(super) fn new() -> Self {
        Self {
            ptrs: Vec::with_capacity(24),
            values: std::marker::PhantomData,
        }
    }

    /// The next argument: a plain value (a device address, a scalar, a `repr(C)` struct) of
    /// the kernel parameter's type.
    pub(super) fn arg<T: Copy>(&mut self, value: &'a T) -> &mut Self {
        self.ptrs.push(value as *const T as *mut std::ffi::c_void);
        self
    }

    /// Launches `f` with these arguments, as a programmatic dependent of the kernel before it
    /// where [`pdl`] is on: `f` must `pdl_wait()` (common.cuh) before reading what that kernel
    /// wrote, and call `pdl_launch_dependents()` only after that wait (or not at all: exiting
    /// triggers too); before the wait it may read only what kernels two or more back wrote.
    pub(super) fn launch(
        &mut self,
        dev: &CudaDevice,
        f: &CudaFunction,
        cfg: LaunchConfig,
        name: &str,
    ) -> Result<()> {
        self.launch_as(dev, f, cfg, pdl(), name)
    }

    /// [`Self::launch`] with the caller's choice of PDL (a kernel family only some of whose
    /// kernels wait).
    pub(super) fn launch_as(
        &mut self,
        dev: &CudaDevice,
        f: &CudaFunction,
        cfg: LaunchConfig,
        pdl: bool,
        name: &str,
    ) -> Result<()> {
        go_ex(dev, f, cfg, &mut self.ptrs, pdl, name)
    }
}

pub(super) fn go(b: &mut LaunchArgs<'_>, cfg: LaunchConfig, name: &str) -> Result<()> {
    unsafe { b.launch(cfg) }.map_err(|e| candle_core::Error::Msg(format!("{name}: {e}")))?;
    Ok(())
}

pub(super) fn check_bf16(name: &str, t: &Tensor) -> Result<()> {
    if t.dtype() != DType::BF16 || !t.is_contiguous() {
        bail!("{name} must be contiguous bf16, got {:?}", t.dtype())
    }
    Ok(())
}

/// Writes `values` into the contiguous u32 CUDA tensor `dst` (stream-ordered, from pageable
/// memory: the driver stages the bytes before returning, so `values` may go away at once).
pub fn upload_u32(dst: &Tensor, values: &[u32]) -> Result<()> {
    upload(dst, DType::U32, values)
}

/// As [`upload_u32`] for i64 tensors (the tree bit rows).
pub fn upload_i64(dst: &Tensor, values: &[i64]) -> Result<()> {
    upload(dst, DType::I64, values)
}

fn upload<T>(dst: &Tensor, dtype: DType, values: &[T]) -> Result<()> {
    if dst.dtype() != dtype || dst.elem_count() != values.len() {
        bail!(
            "upload: {} values into {:?} {:?}",
            values.len(),
            dst.dtype(),
            dst.shape()
        )
    }
    let dev = cuda(dst)?;
    let p = ptr(dst)?;
    let stream = dev.cuda_stream();
    unsafe {
        candle_core::cuda_backend::cudarc::driver::result::memcpy_htod_async(
            p,
            values,
            stream.cu_stream(),
        )
    }
    .map_err(|e| candle_core::Error::Msg(format!("upload: {e}")))
}
