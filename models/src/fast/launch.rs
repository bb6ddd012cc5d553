//! Kernel launches with attributes cudarc's `LaunchArgs` cannot set, through
//! `cuLaunchKernelEx`: thread-block clusters (distributed shared memory between the blocks of
//! a cluster) and programmatic dependent launch (the kernel may start while the one before it
//! on the stream finishes; it must then execute `griddepcontrol.wait` before it touches
//! anything that kernel writes). Arguments are pushed like cudarc's builder: the launch keeps
//! pointers to the caller's values, which outlive it.

use std::ffi::c_void;
use std::marker::PhantomData;

use candle_core::cuda_backend::cudarc::driver::{sys, CudaFunction, DeviceRepr, LaunchConfig};
use candle_core::cuda_backend::CudaDevice;
use candle_core::Result;

/// Launch attributes beyond grid, block and shared memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct LaunchOpts {
    /// Blocks per cluster along x, y, z (the grid must be a multiple of it).
    pub cluster: Option<(u32, u32, u32)>,
    /// Programmatic stream serialisation: the kernel may launch before its predecessor on
    /// the stream completes. Only for kernels that call `griddepcontrol.wait` first.
    pub early_start: bool,
}

/// One launch of `func`: its arguments, in kernel parameter order.
pub(crate) struct Launch<'a> {
    func: &'a CudaFunction,
    args: Vec<*mut c_void>,
    _values: PhantomData<&'a ()>,
}

impl<'a> Launch<'a> {
    pub fn new(func: &'a CudaFunction) -> Self {
        Self {
            func,
            args: Vec::with_capacity(24),
            _values: PhantomData,
        }
    }

    /// The next kernel parameter; `value` is read when the launch is issued.
    pub fn arg<T: DeviceRepr>(&mut self, value: &'a T) -> &mut Self {
        self.args.push(value as *const T as *mut c_void);
        self
    }

    /// Issues the launch on `dev`'s stream; `name` labels errors.
    pub fn run(
        mut self,
        dev: &CudaDevice,
        cfg: LaunchConfig,
        opts: LaunchOpts,
        name: &str,
    ) -> Result<()> {
        let err = |e: String| candle_core::Error::Msg(format!("{name}: {e}"));
        let stream = dev.cuda_stream();
        stream
            .context()
            .bind_to_thread()
            .map_err(|e| err(e.to_string()))?;
        let mut attrs: Vec<sys::CUlaunchAttribute> = Vec::with_capacity(2);
        if let Some((x, y, z)) = opts.cluster {
            let (gx, gy, gz) = cfg.grid_dim;
            if x == 0 || y == 0 || z == 0 || gx % x != 0 || gy % y != 0 || gz % z != 0 {
                return Err(err(format!(
                    "cluster {x}x{y}x{z} does not divide the grid {gx}x{gy}x{gz}"
                )));
            }
            // SAFETY: a plain C struct and union; zero is a valid bit pattern for both.
            let mut a: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
            a.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
            a.value.clusterDim = sys::CUlaunchAttributeValue_union__bindgen_ty_1 { x, y, z };
            attrs.push(a);
        }
        if opts.early_start {
            // SAFETY: as above.
            let mut a: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
            a.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            a.value.programmaticStreamSerializationAllowed = 1;
            attrs.push(a);
        }
        let config = sys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: stream.cu_stream(),
            attrs: attrs.as_mut_ptr(),
            numAttrs: attrs.len() as u32,
        };
        // SAFETY: `args` points at live values of the kernel's parameter types, in order (the
        // caller's contract, as with cudarc's builder); `config` and `attrs` outlive the call.
        unsafe {
            sys::cuLaunchKernelEx(
                &config,
                self.func.cu_function(),
                self.args.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
        .map_err(|e| err(e.to_string()))
    }
}
