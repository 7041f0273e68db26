//! Tensor parallelism's weight split (Megatron style): a column-parallel product keeps a slice of
//! the output rows (Q/K/V by heads, gate/up by intermediate units), a row-parallel product keeps
//! the matching slice of the input columns (O, down) and yields a partial sum that the ranks
//! all-reduce. Slices are cut from the checkpoint's bytes, GGML blocks included: a column slice
//! must fall on block boundaries.

use crate::Weight;
use std::sync::Arc;

/// One rank of `world`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rank {
    pub rank: usize,
    pub world: usize,
}

impl Rank {
    /// This rank's share of `n` units (heads, intermediate units…), which must divide evenly.
    pub fn share(&self, n: usize, what: &str) -> Result<std::ops::Range<usize>, String> {
        if self.world == 0 || n % self.world != 0 {
            return Err(format!("{what} ({n}) do not split evenly over {} ranks", self.world));
        }
        let per = n / self.world;
        Ok(self.rank * per..(self.rank + 1) * per)
    }
}

impl Weight {
    /// Rows `rows` of a `[rows, cols]` weight (a column-parallel slice), as a new weight.
    pub fn slice_rows(&self, rows: std::ops::Range<usize>) -> Result<Weight, String> {
        let [total, cols] = self.dims[..] else { return Err("row slice of a non-matrix weight".into()) };
        if rows.end > total {
            return Err(format!("rows {rows:?} outside {total}"));
        }
        let row_bytes = self.row_bytes(cols)?;
        let bytes = self.data.bytes()[rows.start * row_bytes..rows.end * row_bytes].to_vec();
        Ok(Weight { dtype: self.dtype, dims: vec![rows.len(), cols], data: Arc::new(bytes) })
    }

    /// Columns `cols` of every row (a row-parallel slice), as a new weight; the cut must fall on
    /// the format's block boundaries.
    pub fn slice_cols(&self, cols: std::ops::Range<usize>) -> Result<Weight, String> {
        let [rows, total] = self.dims[..] else { return Err("column slice of a non-matrix weight".into()) };
        let block = self.dtype.block_size();
        if cols.end > total || cols.start % block != 0 || cols.len() % block != 0 {
            return Err(format!("columns {cols:?} of {total} do not fall on blocks of {block}"));
        }
        let row_bytes = self.row_bytes(total)?;
        let (start, len) = (cols.start / block * self.dtype.type_size(), cols.len() / block * self.dtype.type_size());
        let src = self.data.bytes();
        let mut bytes = Vec::with_capacity(rows * len);
        for r in 0..rows {
            bytes.extend_from_slice(&src[r * row_bytes + start..r * row_bytes + start + len]);
        }
        Ok(Weight { dtype: self.dtype, dims: vec![rows, cols.len()], data: Arc::new(bytes) })
    }

    fn row_bytes(&self, cols: usize) -> Result<usize, String> {
        let block = self.dtype.block_size();
        if cols % block != 0 {
            return Err(format!("{cols} columns are not whole blocks of {block}"));
        }
        Ok(cols / block * self.dtype.type_size())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::{GgmlDType, QTensor};
    use candle_core::{Device, Tensor};

    fn q4_weight(rows: usize, cols: usize) -> (Weight, Tensor) {
        let x = Tensor::randn(0f32, 1.0, (rows, cols), &Device::Cpu).unwrap();
        let q = QTensor::quantize(&x, GgmlDType::Q4_1).unwrap();
        let deq = q.dequantize(&Device::Cpu).unwrap();
        let w = Weight { dtype: GgmlDType::Q4_1, dims: vec![rows, cols], data: Arc::new(q.data().unwrap().to_vec()) };
        (w, deq)
    }

    /// Row and column slices of a quantized weight dequantize to the same slices of the whole.
    #[test]
    fn slices_equal_the_slices_of_the_dequantized_weight() {
        let (w, whole) = q4_weight(12, 96);
        let rows = w.slice_rows(4..8).unwrap().dequantize(&Device::Cpu).unwrap();
        let diff = (rows - whole.narrow(0, 4, 4).unwrap()).unwrap().abs().unwrap().max_all().unwrap();
        assert_eq!(diff.to_scalar::<f32>().unwrap(), 0.0);
        let cols = w.slice_cols(32..64).unwrap().dequantize(&Device::Cpu).unwrap();
        let diff = (cols - whole.narrow(1, 32, 32).unwrap()).unwrap().abs().unwrap().max_all().unwrap();
        assert_eq!(diff.to_scalar::<f32>().unwrap(), 0.0);
        assert!(w.slice_cols(16..48).is_err(), "not on block boundaries");
    }

    #[test]
    fn shares_split_evenly_or_fail_clearly() {
        let r = Rank { rank: 1, world: 3 };
        assert_eq!(r.share(9, "heads").unwrap(), 3..6);
        let e = Rank { rank: 0, world: 2 }.share(9, "attention heads").unwrap_err();
        assert!(e.contains("attention heads (9) do not split evenly over 2 ranks"), "{e}");
    }
}
