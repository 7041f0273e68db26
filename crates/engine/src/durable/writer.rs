//! The log writer: one thread owns every open checkpoint file, so the engine thread never
//! waits for a disk. It takes every message queued since it last woke, writes them in order,
//! then syncs each file it touched once (group commit): a record is on stable storage one
//! wake-up after it was sent. A file whose write fails is dropped with a warning and its
//! generation goes on without checkpoints (a full disk must not fail a request).

use std::collections::{HashMap, HashSet};
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender};
use std::sync::Arc;

pub enum Msg {
    /// A new log (or one replacing the log it resumes): written whole, then renamed in place.
    Create { key: String, epoch: u64, bytes: Vec<u8> },
    /// Frames appended to an open log (ignored once the log was closed or removed).
    Append { key: String, bytes: Vec<u8> },
    /// The generation stopped without completing: the file stays (until its TTL).
    Close { key: String },
    /// The generation of `epoch` completed: the file goes (unless a later generation of the
    /// same key has replaced it since).
    Remove { key: String, epoch: u64 },
    /// Answered once everything sent before is written and synced.
    Flush(SyncSender<()>),
}

/// What the writer did, for `/metrics` and the benchmark.
#[derive(Default)]
pub struct WriterStats {
    pub records: AtomicU64,
    pub bytes: AtomicU64,
    pub syncs: AtomicU64,
    pub sync_micros: AtomicU64,
    pub failures: AtomicU64,
}

pub fn log_path(dir: &Path, key: &str) -> PathBuf {
    dir.join(format!("{key}.ckpt"))
}

pub struct Writer {
    dir: PathBuf,
    fsync: bool,
    files: HashMap<String, File>,
    /// The epoch of the generation that created each key's current log.
    owners: HashMap<String, u64>,
    dirty: HashSet<String>,
    stats: Arc<WriterStats>,
}

impl Writer {
    pub fn new(dir: PathBuf, fsync: bool, stats: Arc<WriterStats>) -> Self {
        Self { dir, fsync, files: HashMap::new(), owners: HashMap::new(), dirty: HashSet::new(), stats }
    }

    /// Serves messages until every sender is gone.
    pub fn run(mut self, rx: Receiver<Msg>) {
        while let Ok(first) = rx.recv() {
            let mut waiters = Vec::new();
            for msg in std::iter::once(first).chain(std::iter::from_fn(|| rx.try_recv().ok())) {
                match msg {
                    Msg::Flush(done) => waiters.push(done),
                    other => self.handle(other),
                }
            }
            self.sync_dirty();
            for w in waiters {
                let _ = w.send(());
            }
        }
    }

    fn handle(&mut self, msg: Msg) {
        match msg {
            Msg::Create { key, epoch, bytes } => {
                self.owners.insert(key.clone(), epoch);
                if let Err(e) = self.create(&key, &bytes) {
                    self.fail(&key, "could not be created", e);
                }
            }
            Msg::Append { key, bytes } => {
                let Some(f) = self.files.get_mut(&key) else { return };
                match f.write_all(&bytes) {
                    Ok(()) => {
                        self.stats.records.fetch_add(1, Ordering::Relaxed);
                        self.stats.bytes.fetch_add(bytes.len() as u64, Ordering::Relaxed);
                        self.dirty.insert(key);
                    }
                    Err(e) => self.fail(&key, "could not be appended to", e),
                }
            }
            Msg::Close { key } => self.sync_and_close(&key),
            Msg::Remove { key, epoch } => {
                if self.owners.get(&key).is_some_and(|&e| e != epoch) {
                    return;
                }
                self.owners.remove(&key);
                self.files.remove(&key);
                self.dirty.remove(&key);
                let path = log_path(&self.dir, &key);
                if let Err(e) = std::fs::remove_file(&path) {
                    if e.kind() != std::io::ErrorKind::NotFound {
                        tracing::warn!("checkpoint {}: could not be removed ({e})", path.display());
                    }
                }
            }
            Msg::Flush(_) => unreachable!("answered in run"),
        }
    }

    /// Writes the whole log beside its place, syncs it, and renames it over the old one: a
    /// crash leaves either the old log or the new one, never a mix.
    fn create(&mut self, key: &str, bytes: &[u8]) -> std::io::Result<()> {
        let path = log_path(&self.dir, key);
        let tmp = path.with_extension("ckpt.tmp");
        let mut f = OpenOptions::new().write(true).create(true).truncate(true).open(&tmp)?;
        let written = f.write_all(bytes).and_then(|()| if self.fsync { f.sync_data() } else { Ok(()) });
        if let Err(e) = written.and_then(|()| std::fs::rename(&tmp, &path)) {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
        if self.fsync {
            // The rename is durable once the directory is.
            File::open(&self.dir)?.sync_all()?;
        }
        self.stats.bytes.fetch_add(bytes.len() as u64, Ordering::Relaxed);
        self.files.insert(key.to_string(), f);
        Ok(())
    }

    fn sync_dirty(&mut self) {
        if !self.fsync {
            self.dirty.clear();
            return;
        }
        for key in std::mem::take(&mut self.dirty) {
            let Some(f) = self.files.get(&key) else { continue };
            let t = std::time::Instant::now();
            let synced = f.sync_data();
            self.stats.syncs.fetch_add(1, Ordering::Relaxed);
            self.stats.sync_micros.fetch_add(t.elapsed().as_micros() as u64, Ordering::Relaxed);
            if let Err(e) = synced {
                self.fail(&key, "could not be synced", e);
            }
        }
    }

    fn sync_and_close(&mut self, key: &str) {
        if let Some(f) = self.files.remove(key) {
            if self.dirty.remove(key) && self.fsync {
                let _ = f.sync_data();
            }
        }
    }

    /// Stops writing `key`'s log; what it holds stays valid (a torn frame is ignored on read).
    fn fail(&mut self, key: &str, what: &str, e: std::io::Error) {
        self.files.remove(key);
        self.dirty.remove(key);
        self.stats.failures.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(
            "checkpoint {}: {what} ({e}); the generation continues without checkpoints",
            log_path(&self.dir, key).display()
        );
    }
}
