//! The paged KV layout (`--kv-layout paged`, docs/paged_kv.md): logits bit-identical to the
//! contiguous layout (exact and default activations; SmolLM2, and Gemma 3 whose sliding-window
//! layers stay on their rings); requests sharing a running request's prompt blocks by reference
//! each get the tokens and logprob bits of their solo run; eviction never touches a running
//! sequence's blocks; the prompt cache (`cached_tokens`) and its disk tier keep working.

mod common;

use common::record::*;
use common::*;
use ferrolm_engine::config::KvLayout;
use ferrolm_engine::{Batch, BatchConfig};
use ferrolm_kv::{PagedPools, SeqCache};
use ferrolm_models::{CausalLm, SeqInput};
use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Mutex;

/// Tests switch the process-wide exact-activation mode: one at a time.
static MODE: Mutex<()> = Mutex::new(());

const SMOL: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
const SMOL_FIXTURE: &str = "SmolLM2-135M-Instruct.Q4_1.json";

fn paged_batch<'a>(model: &'a dyn CausalLm, prompt_cache_bytes: usize, block_tokens: usize) -> Batch<'a> {
    let cfg = BatchConfig { max_batch_tokens: 64, max_seqs: 8, kv_budget_bytes: 1 << 30, prompt_cache_bytes };
    let mut batch = Batch::new(model, cfg, Default::default());
    batch.set_kv_layout(KvLayout::Paged { block_tokens }).unwrap();
    batch
}

fn longest_prompt() -> Vec<u32> {
    load_fixture(SMOL_FIXTURE).prompts.iter().max_by_key(|p| p.prompt_ids.len()).unwrap().prompt_ids.clone()
}

fn other_prompt(i: usize) -> Vec<u32> {
    load_fixture(SMOL_FIXTURE).prompts[i].prompt_ids.clone()
}

fn bits(t: &candle_core::Tensor) -> Vec<u32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect()
}

/// Two sequences forwarded together: prompts in chunks of 7 rows, then decode steps of one row
/// each and one step verifying three rows; the logits of every decode row.
fn logits_of(model: &dyn CausalLm, mut caches: [SeqCache; 2], prompts: [&[u32]; 2]) -> Vec<Vec<u32>> {
    let n = prompts.map(|p| p.len() - 1);
    let mut done = [0, 0];
    while done != n {
        let [a, b] = &mut caches;
        let parts: Vec<(usize, &mut SeqCache)> = [(0, a), (1, b)].into_iter().filter(|(i, _)| done[*i] < n[*i]).collect();
        let mut inputs: Vec<SeqInput> = parts
            .into_iter()
            .map(|(i, c)| {
                let part = &prompts[i][done[i]..(done[i] + 7).min(n[i])];
                done[i] += part.len();
                SeqInput::prompt(part, c)
            })
            .collect();
        model.forward_hidden(&mut inputs).unwrap();
    }
    let mut out = Vec::new();
    let feeds: [Vec<Vec<u32>>; 2] = [0, 1].map(|i| {
        let p = prompts[i];
        vec![vec![p[n[i]]], vec![p[0]], vec![p[1], p[2], p[3]], vec![p[4]]]
    });
    for step in 0..4 {
        let [a, b] = &mut caches;
        let mut inputs = [SeqInput::decode(&feeds[0][step], a), SeqInput::decode(&feeds[1][step], b)];
        let h = model.forward_hidden(&mut inputs).unwrap();
        out.push(bits(&model.project_logits(&h).unwrap()));
    }
    out
}

fn check_logits(file: &str, block_sizes: &[usize]) {
    let Some(model) = open_model(file) else { return };
    let model = model.as_ref();
    let (a, b) = (longest_prompt(), other_prompt(1));
    for exact in [false, true] {
        ferrolm_backend::cpu::set_exact_activations(exact);
        let contiguous = logits_of(model, [model.make_cache(), model.make_cache()], [&a, &b]);
        for &block_tokens in block_sizes {
            let pools = PagedPools::for_model(&model.make_cache(), block_tokens);
            let paged = logits_of(model, [pools.make(model.make_cache()), pools.make(model.make_cache())], [&a, &b]);
            assert!(paged == contiguous, "{file}: paged (blocks of {block_tokens}) logits differ, exact {exact}");
        }
    }
    ferrolm_backend::cpu::set_exact_activations(false);
}

#[test]
fn paged_logits_are_bit_identical_to_contiguous() {
    let _one = MODE.lock().unwrap_or_else(|p| p.into_inner());
    check_logits(SMOL, &[16, 64]);
}

/// Gemma 3: its global layers paged, its sliding-window layers on their rings as before.
#[test]
fn gemma3_paged_logits_are_bit_identical_to_contiguous() {
    let _one = MODE.lock().unwrap_or_else(|p| p.into_inner());
    check_logits("gemma-3-270m-Q4_K_M.gguf", &[16]);
}

/// Two requests arriving while a third decodes share its prompt's blocks by reference (no
/// copy: fewer blocks in use than their tokens need), continue differently, and each gets its
/// solo run's tokens and logprob bits; so does the one whose blocks they share (a shared block
/// is never written: a write into one copies it first).
#[test]
fn batched_requests_share_a_running_prompt_and_equal_their_solo_runs() {
    let _one = MODE.lock().unwrap_or_else(|p| p.into_inner());
    let Some(model) = open_model(SMOL) else { return };
    let model = model.as_ref();
    let base = longest_prompt();
    let bt = 16;
    let mut batch = paged_batch(model, 1 << 30, bt);
    let first = Rc::new(RefCell::new(Out::default()));
    batch.add(request(model, &base, 24, &first), model.make_cache());
    while first.borrow().trace.len() < 3 {
        batch.step(&|| false);
    }
    let prompts: Vec<Vec<u32>> = (1..3).map(|i| base.iter().chain(&other_prompt(i)[1..]).copied().collect()).collect();
    let outs: Vec<_> = prompts.iter().map(|_| Rc::new(RefCell::new(Out::default()))).collect();
    for (p, o) in prompts.iter().zip(&outs) {
        batch.add(request(model, p, 12, o), model.make_cache());
    }
    batch.step(&|| false);
    let (blocks, _) = batch.paged_usage().unwrap();
    let layers = model.info().num_layers;
    let unshared: usize = [base.len() + 3].iter().chain(&prompts.iter().map(|p| p.len()).collect::<Vec<_>>()).map(|t| t.div_ceil(bt)).sum();
    assert!(blocks < unshared * layers, "blocks in use {blocks}: the prompt is shared (unshared {})", unshared * layers);
    run(&mut batch);
    let shared = (base.len() - 1) / bt * bt;
    for (i, (p, o)) in prompts.iter().zip(&outs).enumerate() {
        assert_eq!(o.borrow().stats.as_ref().unwrap().cached_tokens, shared, "request {i} shares the running prompt's whole blocks");
        assert!(o.borrow().trace == solo(model, p, 12), "request {i} differs from its solo run");
    }
    assert!(first.borrow().trace == solo(model, &base, 24), "the running request differs from its solo run");
}

/// A second turn finds the first turn's prompt rows (partial last block included, copied on
/// write) and continues as uncached; `cached_tokens` reports them. The disk tier keeps working
/// beside the block index: a new batch over the same directory is served from the file.
#[test]
fn a_second_turn_reuses_the_first_prompt_also_from_disk() {
    let _one = MODE.lock().unwrap_or_else(|p| p.into_inner());
    let Some(model) = open_model(SMOL) else { return };
    let model = model.as_ref();
    let first = longest_prompt();
    let dir = std::env::temp_dir().join(format!("ferrolm-test-paged-disk-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let open = || ferrolm_kv::DiskTier::open(&dir, 1 << 30, "model-a").unwrap();
    let second: Vec<u32> = first.iter().chain(&other_prompt(0)[1..]).copied().collect();
    let want = solo(model, &second, 10);
    {
        let mut batch = paged_batch(model, 1 << 30, 32);
        batch.set_disk_tier(open());
        let turn1 = Rc::new(RefCell::new(Out::default()));
        batch.add(request(model, &first, 6, &turn1), model.make_cache());
        run(&mut batch);
        let turn2 = Rc::new(RefCell::new(Out::default()));
        batch.add(request(model, &second, 10, &turn2), model.make_cache());
        run(&mut batch);
        assert_eq!(turn2.borrow().stats.as_ref().unwrap().cached_tokens, first.len() - 1, "the first prompt's rows are reused");
        assert!(turn2.borrow().trace == want, "cached turn 2 differs from uncached");
        let s = batch.prompt_cache_stats().unwrap();
        assert!(s.hits >= 1 && s.entries > 0, "{s:?}");
        batch.flush_prompt_cache();
    }
    let mut batch = paged_batch(model, 1 << 30, 32);
    batch.set_disk_tier(open());
    let out = Rc::new(RefCell::new(Out::default()));
    batch.add(request(model, &second, 10, &out), model.make_cache());
    run(&mut batch);
    // Turn 2's own prompt rows were written at its end too: all but its last token come from disk.
    assert_eq!(out.borrow().stats.as_ref().unwrap().cached_tokens, second.len() - 1, "served from disk");
    assert!(out.borrow().trace == want, "the disk entry continues as uncached");
    assert_eq!(batch.prompt_cache_stats().unwrap().disk_hits, 1);
    let _ = std::fs::remove_dir_all(&dir);
}

/// With a prompt cache far smaller than the prompts, finished requests' blocks are evicted as
/// they come, but never the blocks of a request still running: it ends as its solo run.
#[test]
fn eviction_never_touches_a_running_sequence() {
    let _one = MODE.lock().unwrap_or_else(|p| p.into_inner());
    let Some(model) = open_model(SMOL) else { return };
    let model = model.as_ref();
    let base = longest_prompt();
    let mut batch = paged_batch(model, 1, 16);
    let long = Rc::new(RefCell::new(Out::default()));
    batch.add(request(model, &base, 100, &long), model.make_cache());
    while long.borrow().trace.is_empty() {
        batch.step(&|| false);
    }
    for i in 0..4 {
        let o = Rc::new(RefCell::new(Out::default()));
        let p: Vec<u32> = other_prompt(i).iter().chain(&other_prompt(i + 1)).copied().collect();
        batch.add(request(model, &p, 2, &o), model.make_cache());
        while o.borrow().stats.is_none() {
            batch.step(&|| false);
        }
        // The next request's lookup evicts what nobody holds; the running prompt's blocks stay.
        let again = Rc::new(RefCell::new(Out::default()));
        let shares: Vec<u32> = base.iter().chain(&[7, 8]).copied().collect();
        batch.add(request(model, &shares, 1, &again), model.make_cache());
        while again.borrow().stats.is_none() {
            batch.step(&|| false);
        }
        assert!(long.borrow().stats.is_none(), "round {i}: the long request still runs");
        assert_eq!(again.borrow().stats.as_ref().unwrap().cached_tokens, (base.len() - 1) / 16 * 16, "round {i}: the running prompt's blocks are still cached");
    }
    run(&mut batch);
    assert!(long.borrow().trace == solo(model, &base, 100), "the running request differs from its solo run");
    // Nothing runs now: the next lookup evicts down to the cap.
    let o = Rc::new(RefCell::new(Out::default()));
    batch.add(request(model, &[1, 2, 3], 1, &o), model.make_cache());
    run(&mut batch);
    assert!(batch.prompt_cache_stats().unwrap().bytes <= 1 << 20, "{:?}", batch.prompt_cache_stats());
}

/// Prompt-lookup speculation (multi-row verify steps, rejected drafts trimmed from the blocks)
/// and `n` choices (forked by sharing the leader's blocks, the partial one copied on write) on
/// paged caches: every output equals its solo contiguous run.
#[test]
fn speculation_and_choices_on_paged_caches_equal_solo_runs() {
    let _one = MODE.lock().unwrap_or_else(|p| p.into_inner());
    let Some(model) = open_model(SMOL) else { return };
    let model = model.as_ref();
    // A prompt that repeats itself, so that lookup drafts are found and partly accepted.
    let base = other_prompt(2);
    let prompt: Vec<u32> = base.iter().chain(&base).chain(&base[..base.len() / 2]).copied().collect();
    let mut batch = paged_batch(model, 1 << 30, 16);
    batch.set_speculation(Some(ferrolm_engine::SpecConfig { max_drafts: 4, ngram_min: 1, ngram_max: 3 }));
    let spec = Rc::new(RefCell::new(Out::default()));
    batch.add(request(model, &prompt, 24, &spec), model.make_cache());
    run(&mut batch);
    assert!(spec.borrow().trace == solo(model, &prompt, 24), "speculation on paged caches differs from the solo run");
    let stats = spec.borrow().stats.clone().unwrap();
    assert!(stats.drafted_tokens > stats.accepted_tokens && stats.accepted_tokens > 0, "drafts both kept and rejected: {stats:?}");
    let mut batch = paged_batch(model, 0, 16);
    let choices: Vec<_> = (0..2).map(|_| Rc::new(RefCell::new(Out::default()))).collect();
    batch.add_group(choices.iter().map(|o| request(model, &base, 12, o)).collect(), model.make_cache());
    run(&mut batch);
    let want = solo(model, &base, 12);
    for (i, o) in choices.iter().enumerate() {
        assert!(o.borrow().trace == want, "choice {i} differs from the solo run");
    }
}
