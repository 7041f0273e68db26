pub mod gguf;
pub mod safetensors;

use crate::Result;
use candle_core::{Device, Tensor};
use ferrolm_backend::Weight;

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

    fn opt_tensor(&self, name: &str, device: &Device) -> Result<Option<Tensor>> {
        if self.has(name) {
            self.tensor(name, device).map(Some)
        } else {
            Ok(None)
        }
    }
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
