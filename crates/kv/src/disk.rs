//! The prompt cache's disk tier: entries written as files (in the background) so that a prefix
//! outlives its RAM entry and the process. One file per entry:
//!
//! `FLKV1\0\0\0` · header length (u32 LE) · JSON header · payload
//!
//! The header names the model identity, the cache signature, the tokens, each layer's tensors
//! (dtype, shape, key start, offset) and the payload's length and sha256. A file whose header or
//! checksum does not match (foreign model, truncated, corrupt) is skipped with one warning and
//! removed; nothing read from disk is trusted before its checksum passes. The directory is kept
//! under its byte cap by removing the least recently used files.

use crate::{KvView, SeqCache};
use candle_core::{DType, Device, Tensor};
use ferrolm_core::TokenId;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::mpsc::{channel, Sender};
use std::thread::JoinHandle;

const MAGIC: &[u8; 8] = b"FLKV1\0\0\0";
const EXTENSION: &str = "flkv";

#[derive(Serialize, Deserialize)]
struct Header {
    identity: String,
    signature: String,
    tokens: Vec<TokenId>,
    layers: Vec<LayerHeader>,
    payload_bytes: u64,
    sha256: String,
}

#[derive(Serialize, Deserialize)]
struct LayerHeader {
    dtype: String,
    /// `[kv_heads, tokens held, head_dim]` of keys and of values (the same).
    shape: Vec<usize>,
    key_start: usize,
    offset: usize,
}

struct DiskEntry {
    path: PathBuf,
    tokens: Vec<TokenId>,
    bytes: u64,
    used: u64,
}

/// Files of one model's prompt prefixes in a directory.
pub struct DiskTier {
    dir: PathBuf,
    max_bytes: u64,
    identity: String,
    entries: Vec<DiskEntry>,
    clock: u64,
    writer: Option<(Sender<WriteJob>, JoinHandle<()>)>,
}

/// Work for the writer thread.
enum WriteJob {
    File(PathBuf, Vec<u8>),
    /// Answered once every earlier write is done.
    Sync(Sender<()>),
}

impl DiskTier {
    /// Opens (creating) `dir` for the model `identity` and indexes the entries already there:
    /// only their headers are read now.
    pub fn open(dir: &Path, max_bytes: u64, identity: &str) -> std::io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let (tx, rx) = channel::<WriteJob>();
        let handle = std::thread::Builder::new().name("ferrolm-kv-disk".into()).spawn(move || {
            for job in rx {
                match job {
                    WriteJob::File(path, bytes) => {
                        if let Err(e) = write_atomically(&path, &bytes) {
                            tracing::warn!("prompt cache: could not write {}: {e}", path.display());
                        }
                    }
                    WriteJob::Sync(done) => {
                        let _ = done.send(());
                    }
                }
            }
        })?;
        let mut tier = Self { dir: dir.to_path_buf(), max_bytes, identity: identity.to_string(), entries: Vec::new(), clock: 0, writer: Some((tx, handle)) };
        tier.index()?;
        Ok(tier)
    }

    /// Entries and bytes on disk.
    pub fn usage(&self) -> (usize, u64) {
        (self.entries.len(), self.entries.iter().map(|e| e.bytes).sum())
    }

    fn index(&mut self) -> std::io::Result<()> {
        let mut found: Vec<(PathBuf, Vec<TokenId>, u64, std::time::SystemTime)> = Vec::new();
        for item in std::fs::read_dir(&self.dir)? {
            let path = item?.path();
            if path.extension().and_then(|e| e.to_str()) != Some(EXTENSION) {
                continue;
            }
            match read_header(&path) {
                Ok((h, _)) if h.identity == self.identity => {
                    let meta = std::fs::metadata(&path)?;
                    found.push((path, h.tokens, meta.len(), meta.modified()?));
                }
                Ok(_) => {} // another model's entry: left alone
                Err(e) => discard(&path, &e),
            }
        }
        found.sort_by_key(|f| f.3);
        for (path, tokens, bytes, _) in found {
            self.clock += 1;
            self.entries.push(DiskEntry { path, tokens, bytes, used: self.clock });
        }
        Ok(())
    }

    /// The entry sharing the longest prefix with `prompt` (capped at `limit`): (its index, the
    /// prefix length).
    pub fn best(&self, prompt: &[TokenId], limit: usize) -> Option<(usize, usize)> {
        let mut best: Option<(usize, usize)> = None;
        for (i, e) in self.entries.iter().enumerate() {
            let n = e.tokens.iter().zip(prompt).take_while(|(a, b)| a == b).count().min(limit);
            if n > 0 && best.is_none_or(|(_, b)| n > b) {
                best = Some((i, n));
            }
        }
        best
    }

    /// Reads entry `i` into `empty` (fresh caches of the model): its tokens and cache, or None
    /// when the file is gone, foreign or corrupt (it is then dropped from the index).
    pub fn load(&mut self, i: usize, empty: SeqCache) -> Option<(Vec<TokenId>, SeqCache)> {
        let path = self.entries[i].path.clone();
        match read_entry(&path, &self.identity, empty) {
            Ok(loaded) => {
                self.clock += 1;
                self.entries[i].used = self.clock;
                Some(loaded)
            }
            Err(e) => {
                discard(&path, &e);
                self.entries.remove(i);
                None
            }
        }
    }

    /// Writes `cache` (holding exactly `tokens`) in the background; entries it supersedes (its
    /// prefixes) are removed, and the oldest past the byte cap.
    pub fn store(&mut self, tokens: &[TokenId], cache: &SeqCache) -> candle_core::Result<()> {
        if self.entries.iter().any(|e| e.tokens.starts_with(tokens)) {
            return Ok(()); // already on disk, or a longer entry serves it
        }
        let bytes = encode(&self.identity, tokens, cache)?;
        let path = self.dir.join(format!("{}.{EXTENSION}", file_stem(&self.identity, tokens)));
        self.entries.retain(|e| {
            let superseded = tokens.starts_with(&e.tokens);
            if superseded {
                let _ = std::fs::remove_file(&e.path);
            }
            !superseded
        });
        self.clock += 1;
        self.entries.push(DiskEntry { path: path.clone(), tokens: tokens.to_vec(), bytes: bytes.len() as u64, used: self.clock });
        if let Some((tx, _)) = &self.writer {
            let _ = tx.send(WriteJob::File(path, bytes));
        }
        self.evict();
        Ok(())
    }

    fn evict(&mut self) {
        let mut total: u64 = self.entries.iter().map(|e| e.bytes).sum();
        while total > self.max_bytes {
            let Some(oldest) = (0..self.entries.len()).min_by_key(|&i| self.entries[i].used) else { break };
            let e = self.entries.remove(oldest);
            let _ = std::fs::remove_file(&e.path);
            total -= e.bytes;
        }
    }

    /// Waits until every write queued so far is on disk.
    pub fn flush(&mut self) {
        if let Some((tx, _)) = &self.writer {
            let (done, wait) = channel();
            if tx.send(WriteJob::Sync(done)).is_ok() {
                let _ = wait.recv();
            }
        }
    }
}

impl Drop for DiskTier {
    fn drop(&mut self) {
        if let Some((tx, handle)) = self.writer.take() {
            drop(tx);
            let _ = handle.join();
        }
    }
}

fn discard(path: &Path, why: &dyn std::fmt::Display) {
    tracing::warn!("prompt cache: skipping {} ({why}); removed", path.display());
    let _ = std::fs::remove_file(path);
}

fn file_stem(identity: &str, tokens: &[TokenId]) -> String {
    let mut h = Sha256::new();
    h.update(identity.as_bytes());
    tokens.iter().for_each(|t| h.update(t.to_le_bytes()));
    hex(&h.finalize()[..16])
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::File::create(&tmp)?.write_all(bytes)?;
    std::fs::rename(&tmp, path)
}

/// The file of an entry: header and payload (each layer's keys then values, raw bytes).
fn encode(identity: &str, tokens: &[TokenId], cache: &SeqCache) -> candle_core::Result<Vec<u8>> {
    let mut payload = Vec::new();
    let mut layers = Vec::with_capacity(cache.num_layers());
    for i in 0..cache.num_layers() {
        let layer = cache.layer_ref(i);
        let Some(state) = layer.state()? else { candle_core::bail!("prompt cache: an empty layer") };
        for t in [&state.k, &state.v] {
            payload.extend(raw_bytes(t)?);
        }
        let dtype = format!("{:?}", state.k.dtype()).to_lowercase();
        layers.push(LayerHeader { dtype, shape: state.k.dims().to_vec(), key_start: state.key_start, offset: layer.offset() });
    }
    let header = Header {
        identity: identity.to_string(),
        signature: cache.signature(),
        tokens: tokens.to_vec(),
        layers,
        payload_bytes: payload.len() as u64,
        sha256: hex(&Sha256::digest(&payload)),
    };
    let json = serde_json::to_vec(&header).map_err(candle_core::Error::wrap)?;
    let mut out = Vec::with_capacity(16 + json.len() + payload.len());
    out.extend(MAGIC);
    out.extend((json.len() as u32).to_le_bytes());
    out.extend(json);
    out.extend(payload);
    Ok(out)
}

fn raw_bytes(t: &Tensor) -> candle_core::Result<Vec<u8>> {
    let t = t.to_device(&Device::Cpu)?.contiguous()?.flatten_all()?;
    Ok(match t.dtype() {
        DType::F16 => t.to_vec1::<half::f16>()?.iter().flat_map(|x| x.to_le_bytes()).collect(),
        DType::BF16 => t.to_vec1::<half::bf16>()?.iter().flat_map(|x| x.to_le_bytes()).collect(),
        DType::F32 => t.to_vec1::<f32>()?.iter().flat_map(|x| x.to_le_bytes()).collect(),
        DType::U8 => t.to_vec1::<u8>()?,
        other => candle_core::bail!("prompt cache: no disk format for {other:?}"),
    })
}

type ReadError = Box<dyn std::error::Error + Send + Sync>;

fn read_header(path: &Path) -> Result<(Header, std::fs::File), ReadError> {
    let mut f = std::fs::File::open(path)?;
    let mut magic = [0u8; 12];
    f.read_exact(&mut magic)?;
    if &magic[..8] != MAGIC {
        return Err("not a ferrolm prompt-cache file".into());
    }
    let len = u32::from_le_bytes(magic[8..12].try_into()?) as usize;
    if len > 64 << 20 {
        return Err("header too large".into());
    }
    let mut json = vec![0u8; len];
    f.read_exact(&mut json)?;
    Ok((serde_json::from_slice(&json)?, f))
}

fn read_entry(path: &Path, identity: &str, mut empty: SeqCache) -> Result<(Vec<TokenId>, SeqCache), ReadError> {
    let (h, f) = read_header(path)?;
    if h.identity != identity || h.signature != empty.signature() || h.layers.len() != empty.num_layers() {
        return Err("another model's or cache kind's entry".into());
    }
    let mut payload = Vec::with_capacity(h.payload_bytes as usize);
    f.take(h.payload_bytes + 1).read_to_end(&mut payload)?;
    if payload.len() as u64 != h.payload_bytes || hex(&Sha256::digest(&payload)) != h.sha256 {
        return Err("truncated or corrupt (checksum)".into());
    }
    let device = empty.device();
    let mut at = 0;
    for (i, l) in h.layers.iter().enumerate() {
        let dtype = match l.dtype.as_str() {
            "f16" => DType::F16,
            "bf16" => DType::BF16,
            "f32" => DType::F32,
            "u8" => DType::U8,
            other => return Err(format!("unknown dtype {other}").into()),
        };
        let n = l.shape.iter().product::<usize>() * dtype.size_in_bytes();
        let mut tensor = || -> candle_core::Result<Tensor> {
            let bytes = payload.get(at..at + n).ok_or_else(|| candle_core::Error::Msg("payload too short".into()))?;
            at += n;
            Tensor::from_raw_buffer(bytes, dtype, &l.shape, &Device::Cpu)?.to_device(&device)
        };
        let (k, v) = (tensor()?, tensor()?);
        // A quantized layer's rows come back as U8; the signature check above matched its format.
        empty.layer(i).load_state(&KvView { k, v, key_start: l.key_start, quant: None, table: None }, l.offset)?;
    }
    if empty.offset() != h.tokens.len() {
        return Err("the entry's tokens and cache disagree".into());
    }
    Ok((h.tokens, empty))
}
