//! The prompt cache (RAM tier): a later request reuses the longest prefix an earlier one
//! computed, and continues bit for bit as it would uncached (only prompt rows' keys and values
//! are kept, and the prefill kernels do not depend on the chunking); batched requests sharing a
//! prefix each take their own copy.

mod common;

use common::record::*;
use common::*;
use ferrolm_engine::{Batch, BatchConfig};
use std::cell::RefCell;
use std::rc::Rc;

fn check_second_turn(file: &str, fixture: &str) {
    let Some(model) = open_model(file) else { return };
    let model = model.as_ref();
    let f = load_fixture(fixture);
    let first: Vec<u32> = f.prompts.iter().max_by_key(|p| p.prompt_ids.len()).unwrap().prompt_ids.clone();
    let cfg = BatchConfig { max_batch_tokens: 256, max_seqs: 8, kv_budget_bytes: 1 << 30, prompt_cache_bytes: 1 << 30 };
    let mut batch = Batch::new(model, cfg, Default::default());
    let turn1 = Rc::new(RefCell::new(Out::default()));
    batch.add(request(model, &first, 12, &turn1), model.make_cache());
    run(&mut batch);
    // Turn 2: the first prompt, its answer and a new user message (some other prompt's tokens).
    let answer: Vec<u32> = turn1.borrow().trace.iter().map(|t| t.0).collect();
    let second: Vec<u32> = first.iter().chain(&answer).chain(&f.prompts[0].prompt_ids[1..]).copied().collect();
    let turn2 = Rc::new(RefCell::new(Out::default()));
    batch.add(request(model, &second, 10, &turn2), model.make_cache());
    run(&mut batch);
    let stats = turn2.borrow().stats.clone().unwrap();
    assert_eq!(stats.cached_tokens, first.len() - 1, "{file}: the first prompt's rows are reused");
    assert!(turn2.borrow().trace == solo(model, &second, 10), "{file}: cached turn 2 differs from uncached");
    assert_eq!(batch.prompt_cache_stats().unwrap().hits, 1);
}

#[test]
fn a_second_turn_reuses_the_first_prompt_and_equals_the_uncached_run() {
    check_second_turn("SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct.Q4_1.json");
}

/// Gemma 3: its sliding-window layers hold only the window once the prompt is longer: a prefix
/// is reused where every layer still holds what it needs.
#[test]
fn gemma3_second_turn_equals_the_uncached_run() {
    check_second_turn("gemma-3-270m-Q4_K_M.gguf", "gemma-3-270m-Q4_K_M.json");
}

/// Two requests sharing a prefix and continuing differently, batched, each with its own copy:
/// neither sees the other's keys and values.
#[test]
fn batched_requests_sharing_a_cached_prefix_do_not_touch_each_other() {
    let Some(model) = open_model("SmolLM2-135M-Instruct.Q4_1.gguf") else { return };
    let model = model.as_ref();
    let f = load_fixture("SmolLM2-135M-Instruct.Q4_1.json");
    let base: Vec<u32> = f.prompts.iter().max_by_key(|p| p.prompt_ids.len()).unwrap().prompt_ids.clone();
    let cfg = BatchConfig { max_batch_tokens: 128, max_seqs: 8, kv_budget_bytes: 1 << 30, prompt_cache_bytes: 1 << 30 };
    let mut batch = Batch::new(model, cfg, Default::default());
    let warm = Rc::new(RefCell::new(Out::default()));
    batch.add(request(model, &base, 2, &warm), model.make_cache());
    run(&mut batch);
    let prompts: Vec<Vec<u32>> =
        (1..4).map(|i| base.iter().chain(&f.prompts[i].prompt_ids[1..]).copied().collect()).collect();
    let outs: Vec<_> = prompts.iter().map(|_| Rc::new(RefCell::new(Out::default()))).collect();
    for (p, o) in prompts.iter().zip(&outs) {
        batch.add(request(model, p, 12, o), model.make_cache());
    }
    run(&mut batch);
    for (i, (p, o)) in prompts.iter().zip(&outs).enumerate() {
        assert_eq!(o.borrow().stats.as_ref().unwrap().cached_tokens, base.len() - 1, "request {i}");
        assert!(o.borrow().trace == solo(model, p, 12), "request {i} differs from its uncached run");
    }
}

fn temp_dir(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("ferrolm-test-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// The disk tier: a later process (a new batch over the same directory) finds the first
/// turn's prefix on disk and continues exactly as uncached; corrupt, truncated and foreign
/// files are skipped (and removed) without harm.
#[test]
fn prefixes_survive_a_restart_and_bad_files_are_skipped() {
    let Some(model) = open_model("SmolLM2-135M-Instruct.Q4_1.gguf") else { return };
    let model = model.as_ref();
    let f = load_fixture("SmolLM2-135M-Instruct.Q4_1.json");
    let first: Vec<u32> = f.prompts.iter().max_by_key(|p| p.prompt_ids.len()).unwrap().prompt_ids.clone();
    let dir = temp_dir("kv-disk");
    let cfg = BatchConfig { max_batch_tokens: 256, max_seqs: 8, kv_budget_bytes: 1 << 30, prompt_cache_bytes: 1 << 30 };
    let open = |identity: &str| ferrolm_kv::DiskTier::open(&dir, 1 << 30, identity).unwrap();
    {
        let mut batch = Batch::new(model, cfg, Default::default());
        batch.set_disk_tier(open("model-a"));
        let out = Rc::new(RefCell::new(Out::default()));
        batch.add(request(model, &first, 4, &out), model.make_cache());
        run(&mut batch);
        batch.flush_prompt_cache();
    }
    let files: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).collect();
    assert_eq!(files.len(), 1, "one entry written");
    // Beside it: garbage, a truncated copy, and the same entry under another model's identity.
    std::fs::write(dir.join("garbage.flkv"), b"not a cache file at all").unwrap();
    let bytes = std::fs::read(&files[0]).unwrap();
    std::fs::write(dir.join("truncated.flkv"), &bytes[..bytes.len() / 2]).unwrap();
    let second: Vec<u32> = first.iter().chain(&f.prompts[0].prompt_ids[1..]).copied().collect();
    let mut batch = Batch::new(model, cfg, Default::default());
    batch.set_disk_tier(open("model-a"));
    let out = Rc::new(RefCell::new(Out::default()));
    batch.add(request(model, &second, 10, &out), model.make_cache());
    run(&mut batch);
    assert_eq!(out.borrow().stats.as_ref().unwrap().cached_tokens, first.len() - 1, "served from disk");
    assert!(out.borrow().trace == solo(model, &second, 10), "the disk entry continues as uncached");
    let s = batch.prompt_cache_stats().unwrap();
    assert_eq!(s.disk_hits, 1);
    assert!(!dir.join("garbage.flkv").exists() && !dir.join("truncated.flkv").exists(), "bad files removed");
    // Another model's process does not read it.
    let mut other = Batch::new(model, cfg, Default::default());
    other.set_disk_tier(open("model-b"));
    let out = Rc::new(RefCell::new(Out::default()));
    other.add(request(model, &second, 2, &out), model.make_cache());
    run(&mut other);
    assert_eq!(out.borrow().stats.as_ref().unwrap().cached_tokens, 0, "a foreign entry is not used");
    let _ = std::fs::remove_dir_all(&dir);
}
