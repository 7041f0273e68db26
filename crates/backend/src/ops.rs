//! Small fused elementwise ops: one pass and one allocation instead of several candle ops.

use crate::cpu::math;
use candle_core::{CpuStorage, CustomOp2, DType, Device, Layout, Shape, Tensor};

/// silu(gate) · up, elementwise (the SwiGLU of llama-family MLPs).
pub fn silu_mul(gate: &Tensor, up: &Tensor) -> candle_core::Result<Tensor> {
    let cpu_f32 = matches!(gate.device(), Device::Cpu) && gate.dtype() == DType::F32 && up.dtype() == DType::F32;
    if cpu_f32 && gate.shape() == up.shape() {
        return gate.contiguous()?.apply_op2_no_bwd(&up.contiguous()?, &GatedMul { name: "silu-mul", act: math::silu });
    }
    #[cfg(feature = "cuda")]
    if let Some(y) = crate::cuda::ops::silu_mul(&gate.contiguous()?, &up.contiguous()?)? {
        return Ok(y);
    }
    candle_nn::ops::silu(gate)? * up
}

/// gelu(gate) · up with GELU's tanh approximation (Gemma's MLP), elementwise.
pub fn gelu_tanh_mul(gate: &Tensor, up: &Tensor) -> candle_core::Result<Tensor> {
    let cpu_f32 = matches!(gate.device(), Device::Cpu) && gate.dtype() == DType::F32 && up.dtype() == DType::F32;
    if cpu_f32 && gate.shape() == up.shape() {
        return gate.contiguous()?.apply_op2_no_bwd(&up.contiguous()?, &GatedMul { name: "gelu-tanh-mul", act: math::gelu_tanh });
    }
    gate.gelu()? * up
}

/// `dst[0]` ← the index of the largest of `logits` (first on ties), in place: a greedy token
/// that stays on the device (a captured step feeds it to the next one). `dst` is a one-element
/// u32 tensor on the logits' device.
pub fn argmax_into(logits: &Tensor, dst: &Tensor) -> candle_core::Result<()> {
    let logits = logits.flatten_all()?.to_dtype(DType::F32)?.contiguous()?;
    #[cfg(feature = "cuda")]
    if crate::cuda::ops::argmax_into(&logits, dst)? {
        return Ok(());
    }
    let best = logits.argmax(0)?.reshape(1)?;
    dst.slice_set(&best, 0, 0)
}

/// `p[0] += 1` in place for a one-element u32 tensor (the position of a captured decode step).
pub fn increment(p: &Tensor) -> candle_core::Result<()> {
    #[cfg(feature = "cuda")]
    if crate::cuda::ops::increment(p)? {
        return Ok(());
    }
    let next = p.affine(1.0, 1.0)?;
    p.slice_set(&next, 0, 0)
}

/// act(gate) · up on f32 CPU tensors, one threaded pass (SwiGLU, GeGLU). `act` is a function
/// item, so each activation gets its own inlined, vectorizable loop.
struct GatedMul<A> {
    name: &'static str,
    act: A,
}

impl<A: Fn(f32) -> f32 + Send + Sync + Copy> CustomOp2 for GatedMul<A> {
    fn name(&self) -> &'static str {
        self.name
    }

    fn cpu_fwd(&self, a: &CpuStorage, al: &Layout, b: &CpuStorage, bl: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let (CpuStorage::F32(a), CpuStorage::F32(b)) = (a, b) else { candle_core::bail!("{}: expected f32", self.name) };
        let n = al.shape().elem_count();
        let a = &a[al.start_offset()..al.start_offset() + n];
        let b = &b[bl.start_offset()..bl.start_offset() + n];
        let act = self.act;
        Ok((CpuStorage::F32(map2(a, b, |g, u| act(g) * u)), al.shape().clone()))
    }
}

/// `f(a[i], b[i])` for every i, split over the CPU threads when large.
fn map2(a: &[f32], b: &[f32], f: impl Fn(f32, f32) -> f32 + Sync) -> Vec<f32> {
    use crate::cpu::threads::{parallel_ranges, SharedOut};
    let mut out = vec![0f32; a.len()];
    let shared = SharedOut::new(&mut out);
    parallel_ranges(a.len(), 64, a.len() >= 1 << 14, |r| {
        // SAFETY: each thread writes only its own range of `out`.
        let o = unsafe { std::slice::from_raw_parts_mut(shared.ptr().add(r.start), r.len()) };
        for (o, (x, y)) in o.iter_mut().zip(a[r.clone()].iter().zip(&b[r])) {
            *o = f(*x, *y);
        }
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argmax_and_increment_write_in_place() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let logits = Tensor::new(&[0.5f32, 3.0, -1.0, 3.0], &dev)?;
        let dst = Tensor::zeros(1, DType::U32, &dev)?;
        argmax_into(&logits, &dst)?;
        assert_eq!(dst.to_vec1::<u32>()?, [1]);
        increment(&dst)?;
        increment(&dst)?;
        assert_eq!(dst.to_vec1::<u32>()?, [3]);
        Ok(())
    }

    #[test]
    fn gelu_tanh_mul_equals_candle() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let g = (Tensor::randn(0f32, 1.0, (3, 4000), &dev)? * 4.0)?;
        let u = Tensor::randn(0f32, 1.0, (3, 4000), &dev)?;
        let want = (g.gelu()? * &u)?;
        let diff = (gelu_tanh_mul(&g, &u)? - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-5, "{diff}");
        Ok(())
    }

    #[test]
    fn silu_mul_equals_candle() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let g = (Tensor::randn(0f32, 1.0, (3, 40), &dev)? * 4.0)?;
        let u = Tensor::randn(0f32, 1.0, (3, 40), &dev)?;
        let want = (candle_nn::ops::silu(&g)? * &u)?;
        let diff = (silu_mul(&g, &u)? - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-5, "{diff}");
        Ok(())
    }
}
