//! Every kernel module loaded (and so JIT-compiled from PTX by the driver) at start-up instead
//! of at its first launch. A module's first load compiles all of it, which took 0.7-4.6 s on a
//! fresh H100 machine in the middle of serving (s18-server: a plain server's first two-prompt
//! prefill 683 ms, the first 16-stream decode step 821 ms, a chain server's first mixed step
//! beside 33 speculating sequences 4.6 s, each a one-off of a shape seen for the first time);
//! the trainer's first steps paid the same (h200-2026-12-03-train-fused-ops: 1.22 s per step
//! in its first window). Loading them all before the first request moves that to start-up.

use std::time::{Duration, Instant};

use candle_core::cuda_backend::kernels;
use candle_core::{Device, Result};

/// This crate's kernel modules: (module name, PTX), as each wrapper loads it.
const OURS: [(&str, &str); 20] = [
    (super::adamw::MODULE, super::adamw::PTX),
    (super::argmax::MODULE, super::argmax::PTX),
    (super::attn_decode::MODULE, super::attn_decode::PTX),
    (super::attn_dflash::MODULE, super::attn_dflash::PTX),
    (super::attn_dflash_tc::MODULE, super::attn_dflash_tc::PTX),
    (super::attn_prefill::MODULE, super::attn_prefill::PTX),
    (super::attn_step::MODULE, super::attn_step::PTX),
    (super::attn_varlen::MODULE, super::attn_varlen::PTX),
    (super::gattn::MODULE, super::gattn::PTX),
    (super::gdn::MODULE, super::gdn::PTX),
    (super::gdn_chunk::MODULE, super::gdn_chunk::PTX),
    (super::gdn_split::MODULE, super::gdn_split::PTX),
    (super::gemv::MODULE, super::gemv::PTX),
    (super::kernels::MODULE, super::kernels::PTX),
    (super::linear_ce::MODULE, super::linear_ce::PTX),
    (super::moe::MODULE, super::moe::PTX),
    (super::moe_route::MODULE, super::moe_route::PTX),
    (super::splitk::MODULE, super::splitk::PTX),
    (super::topk::MODULE, super::topk::PTX),
    (super::train_ops::MODULE, super::train_ops::PTX),
];

/// Function name no module defines: the load caches the module, then the lookup fails.
const NO_FUNCTION: &str = "dflash_preload_no_such_function";

/// candle's own modules that the models launch (not its quantized or convolution ones).
fn candle_modules() -> [&'static kernels::Module; 9] {
    [
        &kernels::AFFINE,
        &kernels::BINARY,
        &kernels::CAST,
        &kernels::FILL,
        &kernels::INDEXING,
        &kernels::REDUCE,
        &kernels::SORT,
        &kernels::TERNARY,
        &kernels::UNARY,
    ]
}

/// Whether `e` is the lookup of [`NO_FUNCTION`] failing, i.e. the module itself loaded.
fn only_missing_function(e: &candle_core::Error) -> bool {
    e.to_string().contains("CUDA_ERROR_NOT_FOUND")
}

/// Loads every module on `device` (nothing elsewhere): returns how many and how long it took.
pub fn preload_kernel_modules(device: &Device) -> Result<(usize, Duration)> {
    let Device::Cuda(dev) = device else {
        return Ok((0, Duration::ZERO));
    };
    let t0 = Instant::now();
    let mut n = 0;
    let mut check = |r: Result<_>, what: &str| -> Result<()> {
        match r {
            Ok(_) => Ok(()),
            Err(e) if only_missing_function(&e) => Ok(()),
            Err(e) => Err(candle_core::Error::Msg(format!(
                "loading kernel module {what}: {e}"
            ))),
        }
        .map(|()| n += 1)
    };
    for (name, ptx) in OURS {
        check(dev.get_or_load_custom_func(NO_FUNCTION, name, ptx), name)?;
    }
    for m in candle_modules() {
        check(dev.get_or_load_func(NO_FUNCTION, m), "of candle")?;
    }
    Ok((n, t0.elapsed()))
}
