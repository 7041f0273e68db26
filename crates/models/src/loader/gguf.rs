//! GGUF files: metadata and tensors read through candle's GGUF reader over a memory map.

use super::Progress;
use crate::{LoadError, Result};
use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::quantized::{ggml_file::qtensor_from_ggml, QTensor};
use candle_core::{DType, Device, Tensor};
use ferrolm_backend::{Weight, WeightBytes};
use memmap2::Mmap;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub struct GgufFile {
    path: PathBuf,
    content: Content,
    mmap: Arc<Mmap>,
    /// Bytes of all tensors (the denominator of `progress`).
    total_bytes: u64,
    pub(crate) progress: Progress,
}

/// A tensor's bytes inside the memory map: weights are used in place, never copied on CPU.
struct MappedTensor {
    map: Arc<Mmap>,
    start: usize,
    len: usize,
}

impl WeightBytes for MappedTensor {
    fn bytes(&self) -> &[u8] {
        &self.map[self.start..self.start + self.len]
    }

    fn release_pages(&self, range: std::ops::Range<usize>) {
        // Whole pages inside the range only (neighbours may still be in use).
        let page = 4096;
        let (start, end) = (self.start + range.start, self.start + range.end.min(self.len));
        let (lo, hi) = (start.div_ceil(page) * page, end / page * page);
        if lo < hi {
            // SAFETY: a read-only file mapping; dropped pages are read from the file again on
            // the next access, so no data is lost.
            let _ = unsafe { self.map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, lo, hi - lo) };
        }
    }
}

impl GgufFile {
    /// Opens and validates a GGUF file: header, metadata, and that every tensor lies inside it.
    pub fn open(path: &Path) -> Result<Self> {
        let err = |message: String| LoadError::File {
            path: path.display().to_string(),
            message,
        };
        let file = std::fs::File::open(path).map_err(|e| err(e.to_string()))?;
        // SAFETY: the file is opened read-only and treated as immutable for the model's lifetime.
        let mmap = unsafe { Mmap::map(&file) }.map_err(|e| err(e.to_string()))?;
        let content = Content::read(&mut std::io::Cursor::new(&mmap[..]))
            // First line only: candle appends a backtrace when RUST_BACKTRACE is set.
            .map_err(|e| err(format!("not a valid GGUF file: {}", e.to_string().lines().next().unwrap_or(""))))?;
        let mut this = Self {
            path: path.to_path_buf(),
            content,
            mmap: Arc::new(mmap),
            total_bytes: 0,
            progress: Progress::default(),
        };
        this.check_tensor_bounds().map_err(err)?;
        this.total_bytes = this.tensor_bytes("") as u64;
        Ok(this)
    }

    fn check_tensor_bounds(&self) -> std::result::Result<(), String> {
        for (name, info) in &self.content.tensor_infos {
            let (start, len) = self.tensor_range(info);
            if start + len > self.mmap.len() as u64 {
                return Err(format!(
                    "truncated: tensor {name} needs bytes {start}..{} but the file has {}",
                    start + len,
                    self.mmap.len()
                ));
            }
        }
        Ok(())
    }

    fn tensor_range(&self, info: &candle_core::quantized::gguf_file::TensorInfo) -> (u64, u64) {
        let elems = info.shape.elem_count();
        let bytes = elems / info.ggml_dtype.block_size() * info.ggml_dtype.type_size();
        (self.content.tensor_data_offset + info.offset, bytes as u64)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn metadata(&self) -> &HashMap<String, Value> {
        &self.content.metadata
    }

    pub fn architecture(&self) -> Result<String> {
        Ok(self.str("general.architecture")?.to_string())
    }

    fn missing(&self, what: &str) -> LoadError {
        LoadError::File {
            path: self.path.display().to_string(),
            message: format!("missing {what}"),
        }
    }

    pub fn str(&self, key: &str) -> Result<&str> {
        self.metadata()
            .get(key)
            .and_then(|v| v.to_string().ok())
            .map(|s| s.as_str())
            .ok_or_else(|| self.missing(&format!("metadata key {key}")))
    }

    pub fn u32(&self, key: &str) -> Result<u32> {
        self.opt_u32(key)
            .ok_or_else(|| self.missing(&format!("metadata key {key}")))
    }

    pub fn opt_u32(&self, key: &str) -> Option<u32> {
        self.metadata().get(key).and_then(|v| {
            v.to_u32()
                .ok()
                .or_else(|| v.to_u64().ok().map(|x| x as u32))
        })
    }

    pub fn opt_f32(&self, key: &str) -> Option<f32> {
        self.metadata().get(key).and_then(|v| v.to_f32().ok())
    }

    pub fn has_tensor(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    /// Total bytes of all tensors whose name starts with `prefix`.
    pub fn tensor_bytes(&self, prefix: &str) -> usize {
        self.content
            .tensor_infos
            .iter()
            .filter(|(n, _)| n.starts_with(prefix))
            .map(|(_, i)| self.tensor_range(i).1 as usize)
            .sum()
    }

    /// The raw blocks of a tensor, straight from the memory map.
    pub fn raw(
        &self,
        name: &str,
    ) -> Result<(&[u8], &candle_core::quantized::gguf_file::TensorInfo)> {
        let info = self
            .content
            .tensor_infos
            .get(name)
            .ok_or_else(|| self.missing(&format!("tensor {name}")))?;
        let (start, len) = self.tensor_range(info);
        self.progress.advance(len, self.total_bytes);
        Ok((&self.mmap[start as usize..(start + len) as usize], info))
    }

    pub fn qtensor(&self, name: &str, device: &Device) -> Result<QTensor> {
        let (bytes, info) = self.raw(name)?;
        Ok(qtensor_from_ggml(
            info.ggml_dtype,
            bytes,
            info.shape.dims().to_vec(),
            device,
        )?)
    }

    /// A weight in place in the memory map.
    pub fn weight(&self, name: &str) -> Result<Weight> {
        let (bytes, info) = self.raw(name)?;
        let start = bytes.as_ptr() as usize - self.mmap.as_ptr() as usize;
        let data = Arc::new(MappedTensor {
            map: self.mmap.clone(),
            start,
            len: bytes.len(),
        });
        Ok(Weight {
            dtype: info.ggml_dtype,
            dims: info.shape.dims().to_vec(),
            data,
        })
    }

    /// A tensor dequantized to f32 (norm weights, biases).
    pub fn tensor(&self, name: &str, device: &Device) -> Result<Tensor> {
        Ok(self
            .qtensor(name, device)?
            .dequantize(device)?
            .to_dtype(DType::F32)?)
    }

    pub fn opt_tensor(&self, name: &str, device: &Device) -> Result<Option<Tensor>> {
        if self.has_tensor(name) {
            self.tensor(name, device).map(Some)
        } else {
            Ok(None)
        }
    }
}
