//! With the `cuda` feature: compiles `src/cuda/kernels.cu` to PTX with nvcc (the same toolchain
//! candle's kernels use: `$CUDA_HOME/bin/nvcc` or `nvcc` on PATH, `CUDA_COMPUTE_CAP`, default 90)
//! and bakes the GPU machine's CUDA library folder into this crate's test binaries as an rpath.
//! Without the feature it does nothing.
use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    println!("cargo:rerun-if-changed=src/cuda/kernels.cu");
    println!("cargo:rerun-if-changed=src/cuda/decode_layer.cuh");
    println!("cargo:rerun-if-changed=src/cuda/gemv_tma.cuh");
    println!("cargo:rerun-if-changed=src/cuda/flash_prefill.cuh");
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    let out = PathBuf::from(std::env::var("OUT_DIR").unwrap()).join("ferrolm_kernels.ptx");
    let nvcc = std::env::var("CUDA_HOME")
        .map(|h| PathBuf::from(h).join("bin/nvcc"))
        .ok()
        .filter(|p| p.exists())
        .unwrap_or_else(|| PathBuf::from("nvcc"));
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "90".into());
    let status = Command::new(&nvcc)
        .args(["--ptx", "-O3", "-std=c++17", &format!("-arch=sm_{cap}"), "src/cuda/kernels.cu", "-o"])
        .arg(&out)
        .status()
        .unwrap_or_else(|e| panic!("cannot run {}: {e} (see scripts/gpu/build.sh)", nvcc.display()));
    assert!(status.success(), "nvcc failed on src/cuda/kernels.cu");
    println!("cargo:rustc-link-arg=-Wl,-rpath,/usr/local/cuda/lib64");
}
