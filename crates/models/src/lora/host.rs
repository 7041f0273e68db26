//! LoRA deltas on the CPU, one row at a time: `t = A·x` (r dot products over the input), then
//! `y[o] += scale·(B·t)[o]`. A decode row's delta is a few thousand multiply-adds, far below what
//! candle's small matrix products cost to dispatch; and each row's arithmetic is the same
//! whatever rows surround it, so a sequence gets the same bits in a batch as alone, and its
//! prompt the same bits however it is cut into chunks.

use super::{LoraStack, Pair, Target};
use crate::layers::BatchRows;
use candle_core::{Result, Tensor};

/// [`super::apply`] on the CPU (f32 activations): `y`'s rows copied, each sequence with
/// adapters getting its deltas added to its own rows.
pub(super) fn apply(rows: &BatchRows, layer: usize, target: Target, x: &Tensor, y: Tensor) -> Result<Tensor> {
    let (n, out) = y.dims2()?;
    let inp = x.dim(1)?;
    let mut ys: Vec<f32> = y.flatten_all()?.to_vec1()?;
    for (span, lora) in rows.spans.iter().zip(&rows.lora) {
        let Some(stack) = lora else { continue };
        let xs: Vec<f32> = x.narrow(0, span.row, span.len)?.flatten_all()?.to_vec1()?;
        for i in 0..span.len {
            let y_row = &mut ys[(span.row + i) * out..][..out];
            add_stack(stack, layer, target, &xs[i * inp..][..inp], y_row)?;
        }
    }
    Tensor::from_vec(ys, (n, out), y.device())
}

/// Every adapter of `stack` that touches `target` of `layer`, in order, added to one row.
fn add_stack(stack: &LoraStack, layer: usize, target: Target, x: &[f32], y: &mut [f32]) -> Result<()> {
    for adapter in &stack.adapters {
        match adapter.pair(layer, target) {
            None => {}
            Some(Pair::Host { a, b, rank }) => add_row(a, b, *rank, adapter.scale as f32, x, y),
            Some(Pair::Device { .. }) => candle_core::bail!("lora: a device pair on a CPU forward"),
        }
    }
    Ok(())
}

/// `y += scale·B(A·x)` for one row: A `[rank, x.len()]`, B `[y.len(), rank]`, row-major.
fn add_row(a: &[f32], b: &[f32], rank: usize, scale: f32, x: &[f32], y: &mut [f32]) {
    let t: Vec<f32> = a.chunks_exact(x.len()).take(rank).map(|row| dot(row, x)).collect();
    for (yo, b_row) in y.iter_mut().zip(b.chunks_exact(rank)) {
        *yo += scale * dot(b_row, &t);
    }
}

/// A dot product in eight independent lanes (vectorized), summed pairwise at the end.
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(p, q)| p * q).sum();
    for (pa, pb) in ca.zip(cb) {
        for l in 0..8 {
            acc[l] += pa[l] * pb[l];
        }
    }
    let quads = [acc[0] + acc[4], acc[1] + acc[5], acc[2] + acc[6], acc[3] + acc[7]];
    (quads[0] + quads[2]) + (quads[1] + quads[3]) + tail
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_row_delta_is_scale_times_b_a_x() {
        // A [2, 3], B [2, 2]: t = A·x = [1·1 + 2·2 + 3·3, 0] = [14, 0]; B·t = [14, 28].
        let (a, b) = ([1., 2., 3., 0., 0., 0.], [1., 5., 2., 7.]);
        let mut y = [1., 1.];
        add_row(&a, &b, 2, 0.5, &[1., 2., 3.], &mut y);
        assert_eq!(y, [8., 15.]);
        let long: Vec<f32> = (0..21).map(|i| i as f32).collect();
        assert_eq!(dot(&long, &long), (0..21).map(|i| (i * i) as f32).sum::<f32>());
    }
}
