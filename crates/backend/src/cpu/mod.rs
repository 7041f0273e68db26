//! CPU kernels: quantized and dense matrix products.
//!
//! Activations are f32 and weights are dequantized block by block, except for quantized weights
//! on AVX-512 VNNI, where activation rows are quantized to 8 bits as llama.cpp does (`vnni` for
//! decode, `vnni_gemm` for prefill): faster, but it moves logits slightly (up to ~2 on small
//! models), so `set_exact_activations(true)` or `FERROLM_CPU_EXACT=1` keeps f32 activations.
//! Prefill attention runs on the GEMM micro-kernels (`attn`), decode attention on AVX-512 by
//! (kv head, key range) items (`decode_attn`). Kernels are
//! written as plain Rust over fixed-size lanes and compiled several times for different x86
//! feature levels (`multiversion!`), chosen once at run time; other CPUs get the portable build.

mod alloc;
pub mod attn;
#[cfg(target_arch = "x86_64")]
mod decode_batch;
#[cfg(target_arch = "x86_64")]
pub mod decode_attn;
#[cfg(target_arch = "x86_64")]
pub mod decode_q8;
pub mod formats;
pub mod kv_rows;
pub mod math;
pub mod matmul;
mod micro;
pub(crate) mod simd;
#[cfg(target_arch = "x86_64")]
mod q8_packed;
pub mod threads;
pub mod turbo_rows;
#[cfg(target_arch = "x86_64")]
mod vnni;
#[cfg(target_arch = "x86_64")]
mod vnni_gemm;
#[cfg(target_arch = "x86_64")]
mod vnni_packed;
#[cfg(target_arch = "x86_64")]
mod x86;

pub use formats::Format;
pub use matmul::CpuMatmul;

use std::sync::atomic::{AtomicU8, Ordering};

/// 0: not yet read from the environment; 1: fast (8-bit activations where a kernel exists);
/// 2: exact (f32 activations everywhere).
static EXACT: AtomicU8 = AtomicU8::new(0);

/// Process-wide: true keeps activations in f32 for every product (results as close to an exact
/// reference as f32 allows); false (the default) lets decode quantize activations to 8 bits.
pub fn set_exact_activations(exact: bool) {
    EXACT.store(if exact { 2 } else { 1 }, Ordering::Relaxed);
}

/// Whether activations stay f32 (`set_exact_activations`, else `FERROLM_CPU_EXACT=1`).
pub fn exact_activations() -> bool {
    match EXACT.load(Ordering::Relaxed) {
        0 => {
            let exact = std::env::var("FERROLM_CPU_EXACT").is_ok_and(|v| v == "1");
            // A concurrent `set_exact_activations` wins over the environment.
            let _ = EXACT.compare_exchange(0, if exact { 2 } else { 1 }, Ordering::Relaxed, Ordering::Relaxed);
            EXACT.load(Ordering::Relaxed) == 2
        }
        v => v == 2,
    }
}
