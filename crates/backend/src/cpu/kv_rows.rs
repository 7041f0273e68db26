//! Cached rows as the CPU attention kernels read them: float rows (`attn::Kv`, f32 or f16) or
//! quantized rows (`QKv`, see `kv_quant`), widened to f32 one row at a time for packing
//! (`attn`) or 16 values at a time in registers (`decode_attn`). No kernel makes a float copy
//! of a quantized cache.

use super::attn::{Kv, Widen};
use crate::kv_quant::KvQuant;

/// A `[H, S, row_bytes]` view of quantized rows (strides in bytes, rows contiguous) of head
/// size `d`: the bytes addressed as float rows are (`rows`, through a paged cache's block
/// table or one block), so contiguous and paged quantized caches read through the same code.
#[derive(Clone, Copy)]
pub struct QKv<'a> {
    pub rows: Kv<'a, u8>,
    pub quant: KvQuant,
    pub d: usize,
}

impl QKv<'_> {
    #[inline(always)]
    pub(crate) fn row(&self, head: usize, token: usize) -> &[u8] {
        self.rows.row(head, token, self.quant.row_bytes(self.d))
    }
}

/// Rows that widen to f32, one (head, token) row at a time.
pub trait WidenRows: Copy + Sync {
    /// Row (`head`, `token`) of head size `out.len()` into `out`.
    fn widen_row(&self, head: usize, token: usize, out: &mut [f32]);
}

impl<E: Widen> WidenRows for Kv<'_, E> {
    #[inline(always)]
    fn widen_row(&self, head: usize, token: usize, out: &mut [f32]) {
        let d = out.len();
        for (o, x) in out.iter_mut().zip(self.row(head, token, d)) {
            *o = x.widen();
        }
    }
}

impl WidenRows for QKv<'_> {
    #[inline(always)]
    fn widen_row(&self, head: usize, token: usize, out: &mut [f32]) {
        self.quant.dequantize_row(self.row(head, token), out)
    }
}
