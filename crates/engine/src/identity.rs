//! A model's identity for files that must only be read back by the same model (the prompt
//! cache's disk tier): a hash of its files' names, sizes and first mebibyte — cheap to compute
//! at start, and different for any other checkpoint or quantization.

use sha2::{Digest, Sha256};
use std::io::Read;
use std::path::Path;

/// Bytes read from the start of each file.
const SAMPLE: u64 = 1 << 20;

/// The identity of the model at `path` (a GGUF file or a Hugging Face folder), as 32 hex digits.
pub fn model_identity(path: &Path) -> std::io::Result<String> {
    let mut h = Sha256::new();
    let files = match path.is_dir() {
        true => {
            let mut names: Vec<_> = std::fs::read_dir(path)?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "safetensors" || x == "json"))
                .collect();
            names.sort();
            names
        }
        false => vec![path.to_path_buf()],
    };
    for f in files {
        let len = std::fs::metadata(&f)?.len();
        h.update(f.file_name().map(|n| n.as_encoded_bytes()).unwrap_or_default());
        h.update(len.to_le_bytes());
        let mut head = Vec::new();
        std::fs::File::open(&f)?.take(SAMPLE).read_to_end(&mut head)?;
        h.update(&head);
    }
    Ok(h.finalize()[..16].iter().map(|b| format!("{b:02x}")).collect())
}
