//! With the `cuda` feature, compiles the fused kernels (src/cuda/kernels.cu) to PTX with nvcc
//! (the CUDA toolchain script puts it on PATH and sets CUDA_COMPUTE_CAP). Without the feature
//! nothing is built and the CPU path needs no CUDA at all.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    for f in [
        "kernels.cu",
        "gemv.cu",
        "topk.cu",
        "argmax.cu",
        "attn_decode.cu",
        "attn_prefill.cu",
        "linear_ce.cu",
        "adamw.cu",
        "attn_dflash.cu",
        "attn_varlen.cu",
        "attn_dflash_tc.cu",
        "gdn.cu",
        "gdn_split.cu",
        "gdn_chunk.cu",
        "train_ops.cu",
        "gattn.cu",
        "splitk.cu",
        "moe.cu",
        "moe_route.cu",
        "moe.cuh",
        "gemv_impl.cuh",
        "attn_step.cu",
        "common.cuh",
        "norm_rope.cuh",
    ] {
        println!("cargo:rerun-if-changed=src/cuda/{f}");
    }
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    println!("cargo:rerun-if-env-changed=NVCC");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let out_dir = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let nvcc = std::env::var("NVCC")
        .ok()
        .or_else(|| {
            std::env::var("CUDA_HOME")
                .ok()
                .map(|h| format!("{h}/bin/nvcc"))
        })
        .unwrap_or_else(|| "nvcc".into());
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "90".into());
    for (src, ptx) in [
        ("kernels.cu", "fast.ptx"),
        ("gemv.cu", "gemv.ptx"),
        ("topk.cu", "topk.ptx"),
        ("argmax.cu", "argmax.ptx"),
        ("attn_decode.cu", "attn_decode.ptx"),
        ("attn_prefill.cu", "attn_prefill.ptx"),
        ("linear_ce.cu", "linear_ce.ptx"),
        ("adamw.cu", "adamw.ptx"),
        ("attn_dflash.cu", "attn_dflash.ptx"),
        ("attn_varlen.cu", "attn_varlen.ptx"),
        ("attn_dflash_tc.cu", "attn_dflash_tc.ptx"),
        ("gdn.cu", "gdn.ptx"),
        ("gdn_split.cu", "gdn_split.ptx"),
        ("gdn_chunk.cu", "gdn_chunk.ptx"),
        ("train_ops.cu", "train_ops.ptx"),
        ("gattn.cu", "gattn.ptx"),
        ("splitk.cu", "splitk.ptx"),
        ("moe.cu", "moe.ptx"),
        ("moe_route.cu", "moe_route.ptx"),
        ("attn_step.cu", "attn_step.ptx"),
    ] {
        let status = Command::new(&nvcc)
            .args(["-ptx", "-O3", "-lineinfo"])
            .arg(format!("-arch=sm_{cap}"))
            .arg("-o")
            .arg(out_dir.join(ptx))
            .arg(format!("src/cuda/{src}"))
            .status();
        match status {
            Ok(s) if s.success() => {}
            Ok(s) => panic!("{nvcc} failed ({s}) compiling src/cuda/{src}"),
            Err(e) => panic!(
                "cannot run {nvcc} ({e}): the `cuda` feature needs nvcc; source ../shared/tools/cuda-toolchain.sh or set NVCC"
            ),
        }
    }
}
