pub mod gguf;
pub mod safetensors;

use crate::Result;
use candle_core::{Device, Tensor};
use ferrolm_backend::Weight;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

/// A load's progress callback: (bytes of tensors handed to the model so far, the source's
/// total). Called from the loading thread, once per tensor.
pub type ProgressFn = Box<dyn Fn(u64, u64) + Send + Sync>;

/// The progress of one source's load, reported as each tensor is handed to the model (which
/// then copies or repacks it: the report leads the work by one tensor).
#[derive(Default)]
pub struct Progress {
    report: OnceLock<ProgressFn>,
    done: AtomicU64,
}

impl Progress {
    /// Sets the callback (once; later calls are ignored).
    pub fn set(&self, f: ProgressFn) {
        let _ = self.report.set(f);
    }

    /// A tensor of `bytes` was handed out. A tensor read twice (a tied embedding and output
    /// head; every tensor once per tensor-parallel rank) counts each time, so `done` may pass
    /// `total`: the caller scales and caps its bar.
    pub(crate) fn advance(&self, bytes: u64, total: u64) {
        if let Some(f) = self.report.get() {
            let done = self.done.fetch_add(bytes, Ordering::Relaxed) + bytes;
            f(done, total);
        }
    }
}

/// Where a model's tensors come from. Models ask by GGUF tensor name (`blk.3.attn_q.weight`);
/// each source maps that to its own naming.
pub trait WeightSource {
    /// A weight matrix as stored (the layer places it on its device).
    fn weight(&self, name: &str) -> Result<Weight>;
    /// A small tensor (norms, biases) as f32.
    fn tensor(&self, name: &str, device: &Device) -> Result<Tensor>;
    fn has(&self, name: &str) -> bool;
    /// The file or folder the tensors come from (for error messages).
    fn origin(&self) -> String;

    /// Each expert's `[rows, cols]` matrix of the experts' tensor `name` (GGUF stacks them:
    /// `blk.N.ffn_gate_exps.weight` is `[experts, rows, cols]`).
    fn expert_weights(&self, name: &str, experts: usize) -> Result<Vec<Weight>> {
        split_experts(&self.weight(name)?, experts).map_err(|message| crate::LoadError::File {
            path: self.origin(),
            message: format!("{name}: {message}"),
        })
    }

    fn opt_tensor(&self, name: &str, device: &Device) -> Result<Option<Tensor>> {
        if self.has(name) {
            self.tensor(name, device).map(Some)
        } else {
            Ok(None)
        }
    }
}

/// `[experts, rows, cols]` → one `[rows, cols]` weight per expert (a copy of its bytes, which
/// are contiguous in the stacked tensor).
fn split_experts(w: &Weight, experts: usize) -> std::result::Result<Vec<Weight>, String> {
    let [e, rows, cols] = w.dims[..] else {
        return Err(format!("expected [experts, rows, cols], found {:?}", w.dims));
    };
    if e != experts {
        return Err(format!("{e} experts, the configuration says {experts}"));
    }
    let flat = Weight { dtype: w.dtype, dims: vec![e * rows, cols], data: w.data.clone() };
    (0..e).map(|i| flat.slice_rows(i * rows..(i + 1) * rows)).collect()
}

impl WeightSource for gguf::GgufFile {
    fn weight(&self, name: &str) -> Result<Weight> {
        gguf::GgufFile::weight(self, name)
    }
    fn tensor(&self, name: &str, device: &Device) -> Result<Tensor> {
        gguf::GgufFile::tensor(self, name, device)
    }
    fn has(&self, name: &str) -> bool {
        self.has_tensor(name)
    }
    fn origin(&self) -> String {
        self.path().display().to_string()
    }
}
