//! The checkpoint store without a model: a log holds what its checkpointer was given (records
//! every `every` tokens, the rest when it is dropped), a resumed log is rewritten whole, a
//! completed one is removed (but never a newer generation's log of the same key), a key runs
//! once at a time, a directory that cannot be written fails no caller. And (ignored, timing)
//! what a token costs the engine thread.

use ferrolm_engine::durable::{CheckpointSettings, CheckpointStore, Header};
use std::path::PathBuf;
use std::time::{Duration, Instant};

fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ferrolm-durable-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn settings(dir: &PathBuf, every: usize) -> CheckpointSettings {
    CheckpointSettings { dir: dir.clone(), every, ttl: Duration::from_secs(3600), fsync: true, model: "m".into() }
}

fn header(seed: u64) -> Header {
    Header { identity: "id".into(), model: "m".into(), seed, prompt_tokens: 3, created: 0 }
}

const WAIT: Duration = Duration::from_secs(10);

#[test]
fn logs_hold_what_was_emitted_and_go_when_complete() {
    let d = dir("lifecycle");
    let store = CheckpointStore::open(settings(&d, 4)).unwrap();
    let claim = store.claim("k1").unwrap();
    assert!(store.claim("k1").is_none(), "a key runs once at a time");
    let done = claim.completion();
    let mut cp = claim.begin(&header(9), &[]);
    (0..6).for_each(|t| cp.token(t));
    assert!(store.flush(WAIT));
    let saved = store.load("k1").unwrap();
    assert_eq!((saved.header.seed, saved.tokens.clone(), saved.rng_step), (9, vec![0, 1, 2, 3], 4), "one record of 4");
    drop(cp); // the generation left: the rest is written, the log stays
    assert!(store.flush(WAIT));
    assert_eq!(store.load("k1").unwrap().tokens, vec![0, 1, 2, 3, 4, 5]);
    // Its retry resumes: the log is rewritten with the saved tokens, replayed ones are not
    // written twice, new ones follow.
    let claim = store.claim("k1").expect("released when the checkpointer went");
    let done2 = claim.completion();
    let mut cp = claim.begin(&header(9), &[0, 1, 2, 3, 4, 5]);
    (0..6).for_each(|t| cp.token(t));
    (6..10).for_each(|t| cp.token(t));
    assert!(store.flush(WAIT));
    assert_eq!(store.load("k1").unwrap().tokens, (0..10).collect::<Vec<_>>());
    // The first generation's completion arrives late: the newer log stays.
    store.complete(&done);
    assert!(store.flush(WAIT));
    assert!(store.load("k1").is_some(), "a stale completion removed a newer generation's log");
    store.complete(&done2);
    drop(cp);
    assert!(store.flush(WAIT));
    assert!(store.load("k1").is_none());
    assert_eq!(std::fs::read_dir(&d).unwrap().count(), 0, "nothing left behind");
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn a_directory_that_cannot_be_written_fails_no_generation() {
    let d = dir("gone");
    let store = CheckpointStore::open(settings(&d, 2)).unwrap();
    // The directory turns into a file: every create fails.
    std::fs::remove_dir_all(&d).unwrap();
    std::fs::write(&d, b"not a directory").unwrap();
    let mut cp = store.claim("k").unwrap().begin(&header(1), &[]);
    (0..10).for_each(|t| cp.token(t));
    drop(cp);
    assert!(store.flush(WAIT));
    let (_, _, _, failures) = ferrolm_engine::durable::writer_counters(&store);
    assert_eq!(failures, 1, "one warning for the log that could not be created");
    assert!(store.load("k").is_none());
    std::fs::remove_file(&d).unwrap();
}

/// What checkpointing costs the engine thread per emitted token (the writer's disk work is on
/// its own thread): 64 sequences × 1024 tokens, a record every 16, fsync on.
#[test]
#[ignore = "timing: cargo test --release -p ferrolm-engine --test durable_store -- --ignored --nocapture"]
fn engine_thread_cost_per_token() {
    let d = dir("cost");
    let store = CheckpointStore::open(settings(&d, 16)).unwrap();
    let (mut cps, mut dones) = (Vec::new(), Vec::new());
    for i in 0..64 {
        let claim = store.claim(&format!("k{i}")).unwrap();
        dones.push(claim.completion());
        cps.push(claim.begin(&header(i), &[]));
    }
    let t = Instant::now();
    for tok in 0..1024u32 {
        cps.iter_mut().for_each(|c| c.token(tok));
    }
    let per_token_ns = t.elapsed().as_nanos() as f64 / (64.0 * 1024.0);
    let t = Instant::now();
    assert!(store.flush(Duration::from_secs(60)));
    let drain_ms = t.elapsed().as_secs_f64() * 1e3;
    let (records, syncs, sync_us, failures) = ferrolm_engine::durable::writer_counters(&store);
    eprintln!(
        "engine thread: {per_token_ns:.0} ns per token; writer: {records} records, {syncs} syncs, {:.3} ms per sync, drained {drain_ms:.1} ms after; {failures} failures",
        sync_us as f64 / 1e3 / syncs.max(1) as f64
    );
    drop(cps);
    dones.iter().for_each(|done| store.complete(done));
    assert!(store.flush(Duration::from_secs(60)));
    let _ = std::fs::remove_dir_all(&d);
}
