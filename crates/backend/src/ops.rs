//! Small fused elementwise ops: one pass and one allocation instead of several candle ops.

use crate::cpu::math;
use candle_core::{CpuStorage, CustomOp2, DType, Device, Layout, Shape, Tensor};

/// silu(gate) · up, elementwise (the SwiGLU of llama-family MLPs).
pub fn silu_mul(gate: &Tensor, up: &Tensor) -> candle_core::Result<Tensor> {
    let cpu_f32 = matches!(gate.device(), Device::Cpu) && gate.dtype() == DType::F32 && up.dtype() == DType::F32;
    if cpu_f32 && gate.shape() == up.shape() {
        return map2(gate, up, Map2 { name: "silu-mul", f: |g, u| math::silu(g) * u });
    }
    #[cfg(feature = "cuda")]
    if let Some(y) = crate::cuda::ops::silu_mul(gate, up)? {
        return Ok(y);
    }
    candle_nn::ops::silu(gate)? * up
}

/// gelu(gate) · up with GELU's tanh approximation (Gemma's MLP), elementwise.
pub fn gelu_tanh_mul(gate: &Tensor, up: &Tensor) -> candle_core::Result<Tensor> {
    let cpu_f32 = matches!(gate.device(), Device::Cpu) && gate.dtype() == DType::F32 && up.dtype() == DType::F32;
    if cpu_f32 && gate.shape() == up.shape() {
        return map2(gate, up, Map2 { name: "gelu-tanh-mul", f: |g, u| math::gelu_tanh(g) * u });
    }
    gate.gelu()? * up
}

/// a + b of equally shaped tensors (the residual sum). On the CPU in f32 over ferrolm's threads:
/// candle's add of 64K elements or more (a prefill chunk's residual) runs on its own spinning
/// thread pool, which then competes with ours for the cores.
pub fn add(a: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    let cpu_f32 = matches!(a.device(), Device::Cpu) && a.dtype() == DType::F32 && b.dtype() == DType::F32;
    if cpu_f32 && a.shape() == b.shape() {
        return map2(a, b, Map2 { name: "add", f: |x, y| x + y });
    }
    a + b
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

/// The argmax of each row of logits `[rows, vocab]` (first index on ties) as a `[rows]` u32
/// tensor on their device, in one pass over all rows; None where no such kernel runs (CPU:
/// each row's sampler takes its own argmax there).
pub fn argmax_rows(logits: &Tensor) -> candle_core::Result<Option<Tensor>> {
    #[cfg(feature = "cuda")]
    {
        let flat = logits.to_dtype(DType::F32)?.contiguous()?;
        return crate::cuda::ops::argmax_rows(&flat);
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = logits;
        Ok(None)
    }
}

/// [`argmax_into`] then [`increment`] of `pos`: the end of a greedy static decode step (on CUDA
/// one kernel fewer: the final argmax pass advances the position too).
pub fn argmax_and_advance(logits: &Tensor, dst: &Tensor, pos: &Tensor) -> candle_core::Result<()> {
    #[cfg(feature = "cuda")]
    {
        let flat = logits.flatten_all()?.to_dtype(DType::F32)?.contiguous()?;
        if crate::cuda::ops::argmax_advance(&flat, dst, Some(pos))? {
            return Ok(());
        }
    }
    argmax_into(logits, dst)?;
    increment(pos)
}

/// Rows `ids` (u32 `[n]` on the table's device) of a dense `table [rows, hidden]`, each times
/// `scale` when given: token embeddings (on CUDA one kernel into the step arena, so a captured
/// step holds no allocation node).
pub fn embed_rows(table: &Tensor, ids: &Tensor, scale: Option<f64>) -> candle_core::Result<Tensor> {
    #[cfg(feature = "cuda")]
    if let Some(x) = crate::cuda::ops::embed_rows(table, ids, scale)? {
        return Ok(x);
    }
    let x = table.index_select(ids, 0)?;
    match scale {
        Some(s) => x * s,
        None => Ok(x),
    }
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

/// `op` on a and b as they are where both are rows with contiguous values (e.g. the two
/// halves of a stacked gate|up product, read in place), else on contiguous copies.
fn map2<F: Fn(f32, f32) -> f32 + Send + Sync + Copy>(a: &Tensor, b: &Tensor, op: Map2<F>) -> candle_core::Result<Tensor> {
    if rows(a.layout()).is_some() && rows(b.layout()).is_some() {
        return a.apply_op2_no_bwd(b, &op);
    }
    a.contiguous()?.apply_op2_no_bwd(&b.contiguous()?, &op)
}

/// A layout as rows of contiguous values: (first offset, rows, row length, row stride), where
/// the leading dimensions are regular (rows evenly spaced).
fn rows(l: &Layout) -> Option<(usize, usize, usize, usize)> {
    let (dims, strides) = (l.shape().dims(), l.stride());
    let n = dims.len();
    let cols = *dims.last()?;
    if strides[n - 1] != 1 && cols > 1 {
        return None;
    }
    let row_stride = if n >= 2 { strides[n - 2] } else { cols };
    let regular = (0..n.saturating_sub(2)).all(|i| dims[i] <= 1 || strides[i] == strides[i + 1] * dims[i + 1]);
    regular.then(|| (l.start_offset(), l.shape().elem_count() / cols.max(1), cols, row_stride))
}

/// f(a, b) elementwise on f32 CPU tensors, one threaded pass (SwiGLU's act(gate) · up, GeGLU's,
/// the residual sum). `f` is a closure without captures, so each op gets its own inlined,
/// vectorizable loop.
struct Map2<F> {
    name: &'static str,
    f: F,
}

impl<F: Fn(f32, f32) -> f32 + Send + Sync + Copy> CustomOp2 for Map2<F> {
    fn name(&self) -> &'static str {
        self.name
    }

    fn cpu_fwd(&self, a: &CpuStorage, al: &Layout, b: &CpuStorage, bl: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let (CpuStorage::F32(a), CpuStorage::F32(b)) = (a, b) else { candle_core::bail!("{}: expected f32", self.name) };
        let (Some(ra), Some(rb)) = (rows(al), rows(bl)) else { candle_core::bail!("{}: inputs are not rows", self.name) };
        Ok((CpuStorage::F32(map2_rows(a, ra, b, rb, self.f)), al.shape().clone()))
    }
}

/// `f(a[i], b[i])` for every element of two equally shaped row layouts (`rows`), into a
/// contiguous result, split over the CPU threads when large.
fn map2_rows(a: &[f32], (a0, n, cols, sa): (usize, usize, usize, usize), b: &[f32], (b0, _, _, sb): (usize, usize, usize, usize), f: impl Fn(f32, f32) -> f32 + Sync) -> Vec<f32> {
    use crate::cpu::threads::{filled_vec, parallel_ranges, SharedOut};
    // Flat ranges (rows × cols), so that a few long rows still split over the threads.
    let fill = |shared: SharedOut| parallel_ranges(n * cols, 64, n * cols >= 1 << 14, |r| {
        let mut i = r.start;
        while i < r.end {
            let (row, col) = (i / cols, i % cols);
            let len = (cols - col).min(r.end - i);
            let (x, y) = (&a[a0 + row * sa + col..][..len], &b[b0 + row * sb + col..][..len]);
            // SAFETY: each thread writes only its own range of `out`.
            let o = unsafe { std::slice::from_raw_parts_mut(shared.ptr().add(i), len) };
            for (o, (x, y)) in o.iter_mut().zip(x.iter().zip(y)) {
                *o = f(*x, *y);
            }
            i += len;
        }
    });
    // SAFETY: the ranges cover 0..n·cols.
    unsafe { filled_vec(n * cols, fill) }
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
        let pos = Tensor::new(&[7u32], &dev)?;
        argmax_and_advance(&Tensor::new(&[0.0f32, -2.0, 4.5], &dev)?, &dst, &pos)?;
        assert_eq!((dst.to_vec1::<u32>()?, pos.to_vec1::<u32>()?), (vec![2], vec![8]));
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

    /// The halves of a stacked `[t, 2n]` product, read in place, give what contiguous copies give.
    #[test]
    fn gated_mul_reads_strided_halves() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let stacked = Tensor::randn(0f32, 2.0, (5, 2, 3000), &dev)?.reshape((5, 6000))?;
        let (g, u) = (stacked.narrow(1, 0, 3000)?, stacked.narrow(1, 3000, 3000)?);
        assert!(!g.is_contiguous() && rows(u.layout()).is_some());
        for (got, want) in [
            (gelu_tanh_mul(&g, &u)?, (g.gelu()? * &u)?),
            (silu_mul(&g, &u)?, (candle_nn::ops::silu(&g)? * &u)?),
        ] {
            let diff = (got - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(diff < 1e-5, "{diff}");
        }
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
