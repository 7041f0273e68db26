//! Durable generations (issue 35, docs/durable.md): each running generation appends the tokens
//! it emits to a per-request log (`log.rs`) through a writer thread (`writer.rs`), every
//! `every` tokens; after a crash the same request (its retry) continues from the log. The log
//! holds tokens only: resuming forwards the prompt as prompt rows and the saved tokens as one
//! multi-token decode row, which rebuilds the KV cache bit for bit (`Sequence::resume`,
//! tests/durable_resume.rs), and the sampler's stream is (seed, step), so the seed and the
//! step are its whole state.

pub mod log;
mod writer;

pub use log::{Header, Record, Saved};
pub use writer::WriterStats;

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, sync_channel, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};
use writer::{log_path, Msg, Writer};

/// `--checkpoint-dir`, `--checkpoint-every`, `--checkpoint-ttl`, `--checkpoint-fsync`: read
/// once at start.
#[derive(Clone, Debug)]
pub struct CheckpointSettings {
    pub dir: PathBuf,
    /// Tokens between records (at least 1).
    pub every: usize,
    /// How long a log that was not completed (a cancelled or crashed generation) is kept.
    pub ttl: Duration,
    /// Sync each written log to stable storage (group commit on the writer thread).
    pub fsync: bool,
    /// `identity::model_identity` of the served model: logs of another model are never resumed.
    pub model: String,
}

/// The logs of one server: who is writing which, and the writer thread.
pub struct CheckpointStore {
    settings: CheckpointSettings,
    writer: Mutex<Sender<Msg>>,
    /// Keys of generations running in this process (their log is theirs alone).
    active: Mutex<HashSet<String>>,
    last_sweep: Mutex<Instant>,
    /// Numbers the generations that write logs (a completion removes only its own).
    epochs: AtomicU64,
    stats: Arc<WriterStats>,
}

/// How often expired logs are looked for (also once at start).
const SWEEP_EVERY: Duration = Duration::from_secs(60);

impl CheckpointStore {
    /// Opens (creates) the directory, removes expired logs and starts the writer.
    pub fn open(settings: CheckpointSettings) -> std::io::Result<Arc<Self>> {
        std::fs::create_dir_all(&settings.dir)?;
        let (tx, rx) = channel();
        let stats = Arc::new(WriterStats::default());
        let writer = Writer::new(settings.dir.clone(), settings.fsync, stats.clone());
        std::thread::Builder::new().name("ferrolm-checkpoint".into()).spawn(move || writer.run(rx))?;
        let store = Arc::new(Self {
            settings,
            writer: Mutex::new(tx),
            active: Mutex::default(),
            last_sweep: Mutex::new(Instant::now()),
            epochs: AtomicU64::new(0),
            stats,
        });
        store.sweep(true);
        Ok(store)
    }

    pub fn settings(&self) -> &CheckpointSettings {
        &self.settings
    }

    pub fn stats(&self) -> &WriterStats {
        &self.stats
    }

    fn send(&self, msg: Msg) {
        let _ = self.writer.lock().unwrap_or_else(|p| p.into_inner()).send(msg);
    }

    /// The log under `key`, if there is one with an intact header.
    pub fn load(&self, key: &str) -> Option<Saved> {
        let path = log_path(&self.settings.dir, key);
        let bytes = std::fs::read(&path).ok()?;
        let saved = log::parse(&bytes);
        match &saved {
            None => tracing::warn!("checkpoint {}: no intact header; ignored", path.display()),
            Some(s) if s.torn => tracing::warn!("checkpoint {}: a torn last record was ignored", path.display()),
            Some(_) => {}
        }
        saved
    }

    /// The right to write `key`'s log, unless a generation of this process holds it.
    pub fn claim(self: &Arc<Self>, key: &str) -> Option<Claim> {
        self.maybe_sweep();
        let fresh = self.active.lock().unwrap_or_else(|p| p.into_inner()).insert(key.to_string());
        let epoch = self.epochs.fetch_add(1, Ordering::Relaxed);
        fresh.then(|| Claim { store: self.clone(), key: key.to_string(), epoch })
    }

    /// Removes a log whose generation completed (the answer was delivered whole).
    pub fn complete(&self, done: &Completion) {
        self.send(Msg::Remove { key: done.key.clone(), epoch: done.epoch });
    }

    /// Waits until everything sent so far is written and synced (at most `timeout`).
    pub fn flush(&self, timeout: Duration) -> bool {
        let (done, wait) = sync_channel(1);
        self.send(Msg::Flush(done));
        wait.recv_timeout(timeout).is_ok()
    }

    fn maybe_sweep(&self) {
        let due = {
            let mut last = self.last_sweep.lock().unwrap_or_else(|p| p.into_inner());
            let due = last.elapsed() >= SWEEP_EVERY;
            if due {
                *last = Instant::now();
            }
            due
        };
        if due {
            self.sweep(false);
        }
    }

    /// Removes logs untouched for longer than the TTL (and, at start, unfinished temp files).
    fn sweep(&self, at_start: bool) {
        let Ok(entries) = std::fs::read_dir(&self.settings.dir) else { return };
        let now = SystemTime::now();
        for entry in entries.flatten() {
            let path = entry.path();
            let name = entry.file_name().to_string_lossy().to_string();
            let age = entry.metadata().and_then(|m| m.modified()).ok().and_then(|t| now.duration_since(t).ok());
            let stale_log = name.ends_with(".ckpt") && age.is_some_and(|a| a > self.settings.ttl);
            let key = name.trim_end_matches(".ckpt");
            let active = self.active.lock().unwrap_or_else(|p| p.into_inner()).contains(key);
            if (stale_log && !active) || (at_start && name.ends_with(".ckpt.tmp")) {
                let _ = std::fs::remove_file(&path);
                tracing::info!("checkpoint {}: expired, removed", path.display());
            }
        }
    }
}

/// A key this process writes; released when dropped.
pub struct Claim {
    store: Arc<CheckpointStore>,
    key: String,
    epoch: u64,
}

/// What the server keeps to remove the log once the answer is complete.
#[derive(Clone, Debug)]
pub struct Completion {
    pub key: String,
    epoch: u64,
}

impl Claim {
    pub fn key(&self) -> &str {
        &self.key
    }

    pub fn completion(&self) -> Completion {
        Completion { key: self.key.clone(), epoch: self.epoch }
    }

    /// Starts the log (replacing the one it resumes, if any) with `resumed`, the tokens the
    /// generation had emitted before; records follow every `every` tokens.
    pub fn begin(self, header: &Header, resumed: &[u32]) -> Checkpointer {
        let rng_step = resumed.len() as u64;
        self.store.send(Msg::Create { key: self.key.clone(), epoch: self.epoch, bytes: log::new_log(header, resumed, rng_step) });
        let every = self.store.settings.every.max(1);
        Checkpointer { claim: self, every, pending: Vec::new(), written: resumed.len(), replaying: resumed.len() }
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        self.store.active.lock().unwrap_or_else(|p| p.into_inner()).remove(&self.key);
    }
}

/// One generation's side of its log, held by its sink on the engine thread: tokens collect in
/// memory and go to the writer as one record every `every` tokens (or when asked, at shutdown).
pub struct Checkpointer {
    claim: Claim,
    every: usize,
    pending: Vec<u32>,
    /// Tokens already in the log.
    written: usize,
    /// Tokens still to be delivered again by a resumed sequence (already in the log).
    replaying: usize,
}

impl Checkpointer {
    pub fn key(&self) -> &str {
        self.claim.key()
    }

    /// A token the generation emitted.
    pub fn token(&mut self, token: u32) {
        if self.replaying > 0 {
            self.replaying -= 1;
            return;
        }
        self.pending.push(token);
        if self.pending.len() >= self.every {
            self.checkpoint();
        }
    }

    /// Sends the tokens not yet in the log as one record. Every emitted token was one draw of
    /// the sampler (constrained generations, whose forced tokens are not, are never durable),
    /// so the stream's position is the number of tokens.
    pub fn checkpoint(&mut self) {
        if self.pending.is_empty() {
            return;
        }
        let tokens = std::mem::take(&mut self.pending);
        let record = Record { from: self.written, rng_step: (self.written + tokens.len()) as u64, tokens };
        self.written += record.tokens.len();
        self.claim.store.send(Msg::Append { key: self.claim.key.clone(), bytes: log::record_frame(&record) });
    }
}

impl Drop for Checkpointer {
    /// The generation left the engine: whatever it emitted since the last record is written,
    /// and the log stays until the server completes it or its TTL ends.
    fn drop(&mut self) {
        self.checkpoint();
        self.claim.store.send(Msg::Close { key: self.claim.key.clone() });
    }
}

/// How many records the writer wrote, its syncs and their total time (for the benchmark).
pub fn writer_counters(store: &CheckpointStore) -> (u64, u64, u64, u64) {
    let s = store.stats();
    let get = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    (get(&s.records), get(&s.syncs), get(&s.sync_micros), get(&s.failures))
}
