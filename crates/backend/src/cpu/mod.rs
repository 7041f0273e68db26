//! CPU kernels: quantized and dense matrix products with f32 activations.
//!
//! ferrolm computes activations in f32 on weights dequantized block by block (llama.cpp instead
//! quantizes activations to 8 bits; on small models that moves logits by up to ~2). Kernels are
//! written as plain Rust over fixed-size lanes and compiled several times for different x86
//! feature levels (`multiversion!`), chosen once at run time; other CPUs get the portable build.

pub mod formats;
pub mod math;
pub mod matmul;
mod micro;
pub(crate) mod simd;
pub mod threads;
#[cfg(target_arch = "x86_64")]
mod x86;

pub use formats::Format;
pub use matmul::CpuMatmul;
