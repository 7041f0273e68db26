use candle_core::{Device, Result, Tensor};
use ferrolm_backend::cpu::{formats::dequant_rows, Format};
use ferrolm_backend::ops::embed_rows;
use ferrolm_backend::{Linear, Weight};
use std::sync::Arc;

/// Token embeddings looked up from the (possibly quantized) table; only the rows needed are
/// dequantized.
pub struct Embedding {
    table: Weight,
    /// GPUs, dense tables: the rows in the activation dtype, looked up by ferrolm's kernel
    /// (the tied output head's own tensor when there is one: no second copy).
    device_rows: Option<Tensor>,
    /// Quantized tables on GPUs, and formats without a CPU kernel: candle's quantized lookup.
    device_table: Option<Arc<candle_core::quantized::QTensor>>,
    /// Gemma multiplies embeddings by sqrt(hidden).
    scale: Option<f64>,
}

impl Embedding {
    pub fn new(table: Weight, scale: Option<f64>, device: &Device) -> Result<Self> {
        Self::tied(table, scale, device, None)
    }

    /// As [`Embedding::new`], sharing the rows of `head` (the output head made from this same
    /// table, when the model ties them) on GPUs where it holds them dense.
    pub fn tied(table: Weight, scale: Option<f64>, device: &Device, head: Option<&Linear>) -> Result<Self> {
        let (mut device_rows, mut device_table) = (None, None);
        if !(device.is_cpu() && Format::from_ggml(table.dtype).is_some()) {
            let shared = head.and_then(Linear::dense_weight).filter(|w| w.dims() == table.dims.as_slice());
            match shared {
                Some(w) => device_rows = Some(w.clone()),
                None if table.is_dense() && !device.is_cpu() => device_rows = Some(table.to_dense(device)?),
                None => device_table = Some(Arc::new(table.qtensor(device)?)),
            }
        }
        Ok(Self { table, device_rows, device_table, scale })
    }

    /// ids already on `device` (a u32 tensor `[tokens]`) → `[tokens, hidden]`; on GPUs the
    /// lookup stays on the device (no host copy: capturable).
    pub fn forward_tensor(&self, ids: &Tensor, device: &Device) -> Result<Tensor> {
        if let Some(rows) = &self.device_rows {
            return embed_rows(rows, ids, self.scale);
        }
        match &self.device_table {
            Some(q) => self.finish(q.embedding(ids)?, device),
            None => self.forward(&ids.to_vec1::<u32>()?, device),
        }
    }

    /// ids → `[tokens, hidden]` in the device's activation dtype (f32 on CPU, bf16 on GPUs).
    pub fn forward(&self, ids: &[u32], device: &Device) -> Result<Tensor> {
        let [rows, hidden] = self.table.dims[..] else {
            candle_core::bail!("embedding table must be 2-D")
        };
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= rows) {
            candle_core::bail!("token id {id} is outside the vocabulary ({rows})")
        }
        if let Some(table) = &self.device_rows {
            return embed_rows(table, &Tensor::from_slice(ids, ids.len(), device)?, self.scale);
        }
        let x = match &self.device_table {
            Some(q) => q.embedding(&Tensor::from_slice(ids, ids.len(), device)?)?,
            None => {
                let format = Format::from_ggml(self.table.dtype).expect("checked in new");
                let mut out = vec![0f32; ids.len() * hidden];
                for (i, &id) in ids.iter().enumerate() {
                    let r = id as usize;
                    dequant_rows(
                        format,
                        self.table.data.bytes(),
                        hidden,
                        r..r + 1,
                        &mut out[i * hidden..(i + 1) * hidden],
                    );
                }
                Tensor::from_vec(out, (ids.len(), hidden), device)?
            }
        };
        self.finish(x, device)
    }

    fn finish(&self, x: Tensor, device: &Device) -> Result<Tensor> {
        // candle's quantized lookup (GPUs) gives f32 whatever the table's format.
        let x = x.to_dtype(ferrolm_backend::activation_dtype(device))?;
        match self.scale {
            Some(s) => x * s,
            None => Ok(x),
        }
    }
}
