//! GEMM micro-kernels: out[t][j] = Σ_k x[k][t] · w[k][j] for a tile of MR tokens and NR weight
//! rows, reading activations packed `[k][MR]` and a dequantized panel `[k][NR]`. The x86
//! versions keep the whole tile in registers (2·MR accumulators) with explicit intrinsics:
//! compilers do not reliably register-block the portable loop.

/// Tile shape and kernel for one feature level.
pub trait MicroKernel {
    const MR: usize;
    const NR: usize;
    /// # Safety
    /// The CPU supports the kernel's features; `xt` holds `k·MR` and `w` `k·NR` values, `out`
    /// `MR·NR`.
    unsafe fn run(k: usize, xt: &[f32], w: &[f32], out: &mut [f32]);
}

pub struct Avx512;
pub struct Avx2;
pub struct Portable;

#[cfg(target_arch = "x86_64")]
impl MicroKernel for Avx512 {
    const MR: usize = 8;
    const NR: usize = 32;
    #[inline(always)]
    unsafe fn run(k: usize, xt: &[f32], w: &[f32], out: &mut [f32]) {
        avx512_8x32(k, xt, w, out)
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn avx512_8x32(k: usize, xt: &[f32], w: &[f32], out: &mut [f32]) {
    use std::arch::x86_64::*;
    assert!(xt.len() >= k * 8 && w.len() >= k * 32 && out.len() >= 8 * 32);
    let (xp, wp) = (xt.as_ptr(), w.as_ptr());
    let mut c = [[_mm512_setzero_ps(); 2]; 8];
    for kk in 0..k {
        let w0 = _mm512_loadu_ps(wp.add(kk * 32));
        let w1 = _mm512_loadu_ps(wp.add(kk * 32 + 16));
        for (t, ct) in c.iter_mut().enumerate() {
            let xb = _mm512_set1_ps(*xp.add(kk * 8 + t));
            ct[0] = _mm512_fmadd_ps(xb, w0, ct[0]);
            ct[1] = _mm512_fmadd_ps(xb, w1, ct[1]);
        }
    }
    for (t, ct) in c.iter().enumerate() {
        _mm512_storeu_ps(out.as_mut_ptr().add(t * 32), ct[0]);
        _mm512_storeu_ps(out.as_mut_ptr().add(t * 32 + 16), ct[1]);
    }
}

#[cfg(target_arch = "x86_64")]
impl MicroKernel for Avx2 {
    const MR: usize = 6;
    const NR: usize = 16;
    #[inline(always)]
    unsafe fn run(k: usize, xt: &[f32], w: &[f32], out: &mut [f32]) {
        avx2_6x16(k, xt, w, out)
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn avx2_6x16(k: usize, xt: &[f32], w: &[f32], out: &mut [f32]) {
    use std::arch::x86_64::*;
    assert!(xt.len() >= k * 6 && w.len() >= k * 16 && out.len() >= 6 * 16);
    let (xp, wp) = (xt.as_ptr(), w.as_ptr());
    let mut c = [[_mm256_setzero_ps(); 2]; 6];
    for kk in 0..k {
        let w0 = _mm256_loadu_ps(wp.add(kk * 16));
        let w1 = _mm256_loadu_ps(wp.add(kk * 16 + 8));
        for (t, ct) in c.iter_mut().enumerate() {
            let xb = _mm256_broadcast_ss(&*xp.add(kk * 6 + t));
            ct[0] = _mm256_fmadd_ps(xb, w0, ct[0]);
            ct[1] = _mm256_fmadd_ps(xb, w1, ct[1]);
        }
    }
    for (t, ct) in c.iter().enumerate() {
        _mm256_storeu_ps(out.as_mut_ptr().add(t * 16), ct[0]);
        _mm256_storeu_ps(out.as_mut_ptr().add(t * 16 + 8), ct[1]);
    }
}

impl MicroKernel for Portable {
    const MR: usize = 4;
    const NR: usize = 8;
    #[inline(always)]
    unsafe fn run(k: usize, xt: &[f32], w: &[f32], out: &mut [f32]) {
        let mut c = [[0f32; 8]; 4];
        for (wk, xk) in w[..k * 8].chunks_exact(8).zip(xt[..k * 4].chunks_exact(4)) {
            for t in 0..4 {
                for j in 0..8 {
                    c[t][j] += xk[t] * wk[j];
                }
            }
        }
        for t in 0..4 {
            out[t * 8..t * 8 + 8].copy_from_slice(&c[t]);
        }
    }
}
