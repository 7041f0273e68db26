//! The paged KV layout (`--kv-layout paged`, docs/paged_kv.md): logits bit-identical to the
//! contiguous layout (exact and default activations; SmolLM2, and Gemma 3 whose sliding-window
//! layers run on blocks released as the window leaves them, equal to its rings over a prompt of
//! more than 4 windows and greedy decode, in memory bounded by the window); requests sharing a running request's prompt blocks by reference
//! each get the tokens and logprob bits of their solo run; eviction never touches a running
//! sequence's blocks; the prompt cache (`cached_tokens`) and its disk tier keep working.

mod common;

use common::paged::*;
use common::record::*;
use common::*;
use ferrolm_engine::{Batch, BatchConfig};
use ferrolm_kv::{PagedPools, SeqCache};
use ferrolm_models::{CausalLm, SeqInput};
use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Mutex;

/// Tests switch the process-wide exact-activation mode: one at a time.
static MODE: Mutex<()> = Mutex::new(());

const SMOL: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

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

/// Gemma 3: its global layers and its sliding-window layers paged (a short prompt: the windows
/// still hold every token).
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

const GEMMA: &str = "gemma-3-270m-Q4_K_M.gguf";

/// `n` tokens: the fixture's prompts one after another, as often as needed.
fn tokens_of_length(n: usize) -> Vec<u32> {
    let all: Vec<u32> = load_fixture(SMOL_FIXTURE).prompts.iter().flat_map(|p| p.prompt_ids.clone()).collect();
    all.iter().cycle().take(n).copied().collect()
}

fn argmax(row: &[f32]) -> u32 {
    row.iter().enumerate().fold((0, f32::NEG_INFINITY), |best, (i, &x)| if x > best.1 { (i, x) } else { best }).0 as u32
}

/// The most blocks each sliding-window layer of `cache` holds, if it is paged.
fn sliding_blocks(cache: &SeqCache) -> Option<usize> {
    (0..cache.num_layers()).filter_map(|i| cache.layer_ref(i).as_paged().filter(|p| p.window().is_some()).map(|p| p.blocks().len())).max()
}

/// Two sequences forwarded together over long prompts (chunks of 61 and 47 rows), then greedy
/// decode: single rows, one step verifying three rows of which two are trimmed as rejected
/// drafts, single rows again. The logits of every decode row, and the most blocks a sliding
/// layer held after a prompt chunk and after a decode step.
fn greedy_logits(model: &dyn CausalLm, mut caches: [SeqCache; 2], prompts: [&[u32]; 2]) -> (Vec<Vec<u32>>, [usize; 2]) {
    let n = prompts.map(|p| p.len() - 1);
    let (mut done, mut held) = ([0, 0], [0, 0]);
    while done != n {
        let [a, b] = &mut caches;
        let parts: Vec<(usize, &mut SeqCache)> = [(0, a), (1, b)].into_iter().filter(|(i, _)| done[*i] < n[*i]).collect();
        let mut inputs: Vec<SeqInput> = parts
            .into_iter()
            .map(|(i, c)| {
                let part = &prompts[i][done[i]..(done[i] + [61, 47][i]).min(n[i])];
                done[i] += part.len();
                SeqInput::prompt(part, c)
            })
            .collect();
        model.forward_hidden(&mut inputs).unwrap();
        held[0] = held[0].max(caches.iter().filter_map(sliding_blocks).max().unwrap_or(0));
    }
    let (mut out, mut next) = (Vec::new(), [0, 1].map(|i| vec![prompts[i][n[i]]]));
    for step in 0..10 {
        let [a, b] = &mut caches;
        let mut inputs = [SeqInput::decode(&next[0], a), SeqInput::decode(&next[1], b)];
        let logits = model.project_logits(&model.forward_hidden(&mut inputs).unwrap()).unwrap();
        out.push(bits(&logits));
        let rows: Vec<Vec<f32>> = logits.to_vec2().unwrap();
        let per = next[0].len();
        if per == 3 {
            caches.iter_mut().for_each(|c| assert_eq!(c.trim(2), 2, "two rejected drafts trimmed"));
        }
        // Row 0 of each sequence is the one kept; step 4 verifies it with two drafts.
        next = [0, 1].map(|i| {
            let t = argmax(&rows[i * per]);
            if step == 4 { vec![t, prompts[i][5], prompts[i][9]] } else { vec![t] }
        });
        held[1] = held[1].max(caches.iter().filter_map(sliding_blocks).max().unwrap_or(0));
    }
    (out, held)
}

/// Gemma 3's sliding-window layers on blocks equal its rings bit for bit (exact and default
/// activations) over a prompt of more than 4 windows and greedy decode with a trimmed verify
/// step, while each sliding layer holds at most the window's blocks (one block of margin, and a
/// prompt chunk's while it is forwarded) however long the sequence.
#[test]
fn gemma3_sliding_layers_on_blocks_equal_the_ring_over_a_long_prompt() {
    let _one = MODE.lock().unwrap_or_else(|p| p.into_inner());
    let Some(model) = open_model(GEMMA) else { return };
    let model = model.as_ref();
    let window = 512;
    let (a, b) = (tokens_of_length(4 * window + 100), tokens_of_length(2 * window + 77)[40..].to_vec());
    let bt = 16;
    for exact in [false, true] {
        ferrolm_backend::cpu::set_exact_activations(exact);
        let (ring, _) = greedy_logits(model, [model.make_cache(), model.make_cache()], [&a, &b]);
        let pools = PagedPools::for_model(&model.make_cache(), bt);
        let caches = [pools.make(model.make_cache()), pools.make(model.make_cache())];
        assert_eq!(sliding_blocks(&caches[0]), Some(0), "{GEMMA}: its sliding layers are paged");
        let (paged, [prompt_held, decode_held]) = greedy_logits(model, caches, [&a, &b]);
        assert!(paged == ring, "sliding layers on blocks differ from the ring, exact {exact}");
        let window_blocks = (window - 1 + bt).div_ceil(bt) + 1;
        eprintln!("blocks held by a sliding layer: {prompt_held} during the prompt, {decode_held} decoding; a full layer {}", a.len().div_ceil(bt));
        assert!(decode_held <= window_blocks, "decode: {decode_held} blocks held (window {window_blocks})");
        assert!(prompt_held <= window_blocks + 61usize.div_ceil(bt), "prompt: {prompt_held} blocks held");
        assert!(a.len() / bt > 3 * decode_held, "a full layer holds {} blocks", a.len() / bt);
    }
    ferrolm_backend::cpu::set_exact_activations(false);
}

/// Gemma 3, prompts over 2 windows long: two requests arriving while a third decodes share its
/// prompt blocks (the sliding layers' window of them included), with prompt-lookup speculation
/// trimming rejected drafts on the sliding layers; a later turn finds every finished prompt row
/// (kept when the requests ended: 40 tokens past their prompts, their sliding layers could not
/// trim back to them; the index held the window's blocks since the prompts were in). Every
/// output equals its solo run on rings.
#[test]
fn gemma3_batched_requests_share_a_long_prompt_and_equal_their_solo_runs() {
    let _one = MODE.lock().unwrap_or_else(|p| p.into_inner());
    let Some(model) = open_model(GEMMA) else { return };
    let model = model.as_ref();
    let base = tokens_of_length(2 * 512 + 90);
    let bt = 16;
    let dir = std::env::temp_dir().join(format!("ferrolm-test-paged-gemma-kept-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let open = || ferrolm_kv::DiskTier::open(&dir, 1 << 30, "model-g").unwrap();
    let mut batch = paged_batch(model, 1 << 30, bt);
    batch.set_disk_tier(open());
    batch.set_speculation(Some(ferrolm_engine::SpecConfig { max_drafts: 4, ngram_min: 1, ngram_max: 3 }));
    let first = Rc::new(RefCell::new(Out::default()));
    batch.add(request(model, &base, 40, &first), model.make_cache());
    while first.borrow().trace.len() < 3 {
        batch.step(&|| false);
    }
    let prompts: Vec<Vec<u32>> = (1..3).map(|i| base.iter().chain(&other_prompt(i)[1..]).copied().collect()).collect();
    let outs: Vec<_> = prompts.iter().map(|_| Rc::new(RefCell::new(Out::default()))).collect();
    for (p, o) in prompts.iter().zip(&outs) {
        batch.add(request(model, p, 40, o), model.make_cache());
    }
    run(&mut batch);
    let shared = (base.len() - 1) / bt * bt;
    for (i, (p, o)) in prompts.iter().zip(&outs).enumerate() {
        assert_eq!(o.borrow().stats.as_ref().unwrap().cached_tokens, shared, "request {i} shares the running prompt's whole blocks");
        assert!(o.borrow().trace == solo(model, p, 40), "request {i} differs from its solo run");
    }
    assert!(first.borrow().trace == solo(model, &base, 40), "the running request differs from its solo run");
    let drafted: usize = outs.iter().chain([&first]).map(|o| o.borrow().stats.as_ref().unwrap().drafted_tokens).sum();
    assert!(drafted > 0, "speculation ran on the sliding layers");
    let turn = Rc::new(RefCell::new(Out::default()));
    // Request 0's prompt rows (only it had them: the others' prompts went on differently),
    // then tokens it did not have there.
    let last = prompts[0].len() - 1;
    let second: Vec<u32> = prompts[0][..last].iter().chain(&[prompts[0][last] ^ 1, 7]).copied().collect();
    batch.add(request(model, &second, 8, &turn), model.make_cache());
    run(&mut batch);
    assert_eq!(turn.borrow().stats.as_ref().unwrap().cached_tokens, last, "the finished prompt's rows are reused, partial block included");
    assert!(turn.borrow().trace == solo(model, &second, 8), "the later turn differs from its solo run");
    // The disk tier got the prompts whose caches could not trim back to them, from the index's
    // blocks (a prompt superseded by a longer one is not kept): request 1's serves a new batch.
    batch.flush_prompt_cache();
    assert!(batch.prompt_cache_stats().unwrap().disk_entries >= 2, "{:?}", batch.prompt_cache_stats());
    drop(batch);
    let last = prompts[1].len() - 1;
    let third: Vec<u32> = prompts[1][..last].iter().chain(&[prompts[1][last] ^ 1, 7]).copied().collect();
    let mut batch = paged_batch(model, 1 << 30, bt);
    batch.set_disk_tier(open());
    let out = Rc::new(RefCell::new(Out::default()));
    batch.add(request(model, &third, 8, &out), model.make_cache());
    run(&mut batch);
    assert_eq!((out.borrow().stats.as_ref().unwrap().cached_tokens, batch.prompt_cache_stats().unwrap().disk_hits), (last, 1), "served from disk");
    assert!(out.borrow().trace == solo(model, &third, 8), "the disk entry continues as uncached");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Disk files stay interchangeable with sliding layers on blocks: a Gemma 3 prompt over 2
/// windows long kept by the contiguous layout (its rings' newest tokens, starting inside a
/// block) is loaded into blocks by a paged batch over the same `--kv-disk`, and the turn it
/// serves equals its uncached solo run.
#[test]
fn gemma3_ring_disk_file_loads_into_sliding_blocks() {
    let _one = MODE.lock().unwrap_or_else(|p| p.into_inner());
    let Some(model) = open_model(GEMMA) else { return };
    let model = model.as_ref();
    let first = tokens_of_length(2 * 512 + 90);
    let dir = std::env::temp_dir().join(format!("ferrolm-test-paged-gemma-disk-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let open = || ferrolm_kv::DiskTier::open(&dir, 1 << 30, "model-g").unwrap();
    {
        let cfg = BatchConfig { max_batch_tokens: 64, max_seqs: 8, kv_budget_bytes: 1 << 30, prompt_cache_bytes: 1 << 30 };
        let mut batch = Batch::new(model, cfg, Default::default());
        batch.set_disk_tier(open());
        let out = Rc::new(RefCell::new(Out::default()));
        batch.add(request(model, &first, 4, &out), model.make_cache());
        run(&mut batch);
        batch.flush_prompt_cache();
    }
    let second: Vec<u32> = first.iter().chain(&other_prompt(0)[1..]).copied().collect();
    let mut batch = paged_batch(model, 1 << 30, 16);
    batch.set_disk_tier(open());
    let out = Rc::new(RefCell::new(Out::default()));
    batch.add(request(model, &second, 10, &out), model.make_cache());
    run(&mut batch);
    assert_eq!(out.borrow().stats.as_ref().unwrap().cached_tokens, first.len() - 1, "served from the contiguous layout's file");
    assert_eq!(batch.prompt_cache_stats().unwrap().disk_hits, 1);
    assert!(out.borrow().trace == solo(model, &second, 10), "the file's prefix on blocks continues as uncached");
    let _ = std::fs::remove_dir_all(&dir);
}
