//! Quantized rows (`--kv-bits 8|4`) in paged blocks (`--kv-layout paged`, docs/paged_kv.md):
//! logits bit-identical to the contiguous quantized cache (SmolLM2 8 and 4 bits, Qwen2.5 8 bits,
//! exact and default activations); requests sharing a running request's quantized prompt blocks
//! each equal their solo run; a second turn served from the block index and from the disk tier
//! equals the uncached run; the block index and the disk tier never hand f16 rows to a
//! quantized cache or quantized rows to an f16 one; the pools count quantized bytes. TurboQuant
//! rows in blocks: logits bit-identical to its contiguous cache, a second turn shares them.

mod common;

use common::paged::*;
use common::record::*;
use common::*;
use ferrolm_kv::{KvQuant, KvScheme, PagedPools};
use ferrolm_models::CausalLm;
use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Mutex;

/// Tests switch the process-wide exact-activation mode: one at a time.
static MODE: Mutex<()> = Mutex::new(());

const SMOL: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
const QWEN: &str = "qwen2.5-coder-0.5b-instruct-Q4_K_M.gguf";

fn quantized(file: &str, bits: u8) -> Option<Box<dyn CausalLm>> {
    let mut model = open_model(file)?;
    model.set_kv_scheme(KvScheme::Quant(KvQuant::new(bits, 32).unwrap())).unwrap();
    Some(model)
}

fn check_logits(file: &str, bits_of_kv: u8, block_sizes: &[usize]) {
    let Some(model) = quantized(file, bits_of_kv) else { return };
    check_logits_of(model.as_ref(), &format!("{file} q{bits_of_kv}"), block_sizes);
}

fn check_logits_of(model: &dyn CausalLm, name: &str, block_sizes: &[usize]) {
    let (a, b) = (longest_prompt(), other_prompt(1));
    for exact in [false, true] {
        ferrolm_backend::cpu::set_exact_activations(exact);
        let contiguous = logits_of(model, [model.make_cache(), model.make_cache()], [&a, &b]);
        for &block_tokens in block_sizes {
            let pools = PagedPools::for_model(&model.make_cache(), block_tokens);
            assert!(pools.all_paged(), "every quantized layer is paged");
            let caches = [pools.make(model.make_cache()), pools.make(model.make_cache())];
            assert!(caches[0].layer_ref(0).as_paged().is_some());
            let paged = logits_of(model, caches, [&a, &b]);
            assert!(paged == contiguous, "{name}: paged (blocks of {block_tokens}) logits differ, exact {exact}");
        }
    }
    ferrolm_backend::cpu::set_exact_activations(false);
}

#[test]
fn paged_quantized_logits_are_bit_identical_to_contiguous() {
    let _one = MODE.lock().unwrap_or_else(|p| p.into_inner());
    check_logits(SMOL, 8, &[16, 32]);
    check_logits(SMOL, 4, &[32]);
}

/// Qwen2.5 (2 kv heads, k biases: the rotation matters) with the SmolLM2 fixture's token ids
/// (valid ids of its larger vocabulary; only the layouts' agreement is checked).
#[test]
fn qwen_paged_quantized_logits_are_bit_identical_to_contiguous() {
    let _one = MODE.lock().unwrap_or_else(|p| p.into_inner());
    check_logits(QWEN, 8, &[32]);
}

/// TurboQuant (keys 8-bit affine, values 3-bit Lloyd–Max) in blocks: each fetch widens the
/// table's rows as the contiguous cache widens its own, so the logits are its bits; and a
/// second turn shares the first one's TurboQuant blocks and continues as uncached.
#[test]
fn turbo_paged_logits_are_bit_identical_to_contiguous_and_shared() {
    let _one = MODE.lock().unwrap_or_else(|p| p.into_inner());
    let Some(mut model) = open_model(SMOL) else { return };
    model.set_kv_scheme(KvScheme::from_kv_quant("turbo").unwrap()).unwrap();
    let model = model.as_ref();
    check_logits_of(model, "SmolLM2 turbo-k8v3", &[32]);
    let first = longest_prompt();
    let second: Vec<u32> = first.iter().chain(&other_prompt(0)[1..]).copied().collect();
    let mut batch = paged_batch(model, 1 << 30, 32);
    let turn1 = Rc::new(RefCell::new(Out::default()));
    batch.add(request(model, &first, 4, &turn1), model.make_cache());
    run(&mut batch);
    let turn2 = Rc::new(RefCell::new(Out::default()));
    batch.add(request(model, &second, 6, &turn2), model.make_cache());
    run(&mut batch);
    assert_eq!(turn2.borrow().stats.as_ref().unwrap().cached_tokens, first.len() - 1, "the first prompt's TurboQuant blocks are shared");
    assert!(turn2.borrow().trace == solo(model, &second, 6), "cached turn 2 differs from uncached");
}

/// Two requests arriving while a third decodes share its quantized prompt blocks by reference
/// and each gets its solo run's tokens and logprob bits (the solo runs on contiguous quantized
/// caches); so does the one whose blocks they share. The pools count quantized bytes.
#[test]
fn requests_share_a_running_quantized_prompt_and_equal_their_solo_runs() {
    let _one = MODE.lock().unwrap_or_else(|p| p.into_inner());
    for kv_bits in [8, 4] {
        let Some(model) = quantized(SMOL, kv_bits) else { return };
        let model = model.as_ref();
        let base = longest_prompt();
        let bt = 16;
        let mut batch = paged_batch(model, 1 << 30, bt);
        let first = Rc::new(RefCell::new(Out::default()));
        batch.add(request(model, &base, 16, &first), model.make_cache());
        while first.borrow().trace.len() < 3 {
            batch.step(&|| false);
        }
        let prompts: Vec<Vec<u32>> = (1..3).map(|i| base.iter().chain(&other_prompt(i)[1..]).copied().collect()).collect();
        let outs: Vec<_> = prompts.iter().map(|_| Rc::new(RefCell::new(Out::default()))).collect();
        for (p, o) in prompts.iter().zip(&outs) {
            batch.add(request(model, p, 10, o), model.make_cache());
        }
        batch.step(&|| false);
        let (blocks, bytes) = batch.paged_usage().unwrap();
        let per_token = model.make_cache().layer_ref(0).bytes_per_token();
        assert_eq!(bytes, blocks * bt * per_token, "blocks are counted in quantized bytes");
        assert!(per_token < 2 * 3 * 64 * 2 * 6 / 10, "q{kv_bits}: {per_token} bytes per token per layer");
        run(&mut batch);
        let shared = (base.len() - 1) / bt * bt;
        for (i, (p, o)) in prompts.iter().zip(&outs).enumerate() {
            assert_eq!(o.borrow().stats.as_ref().unwrap().cached_tokens, shared, "q{kv_bits}: request {i} shares the running prompt's blocks");
            assert!(o.borrow().trace == solo(model, p, 10), "q{kv_bits}: request {i} differs from its solo run");
        }
        assert!(first.borrow().trace == solo(model, &base, 16), "q{kv_bits}: the running request differs from its solo run");
    }
}

/// A second turn reuses the first turn's quantized rows (partial last block copied on write)
/// and continues as uncached; a new batch over the same `--kv-disk` is served from the file. A
/// batch of f16 KV over that directory finds nothing (the file holds q8 rows), and a q8 batch
/// finds nothing of what an f16 batch wrote: the index's hash chain and the files are keyed by
/// the cache kind.
#[test]
fn a_second_turn_reuses_quantized_rows_also_from_disk_and_kinds_never_mix() {
    let _one = MODE.lock().unwrap_or_else(|p| p.into_inner());
    let (Some(q8), Some(f16)) = (quantized(SMOL, 8), open_model(SMOL)) else { return };
    let (q8, f16) = (q8.as_ref(), f16.as_ref());
    let first = longest_prompt();
    let dir = std::env::temp_dir().join(format!("ferrolm-test-paged-q8-disk-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let open = || ferrolm_kv::DiskTier::open(&dir, 1 << 30, "model-a").unwrap();
    let second: Vec<u32> = first.iter().chain(&other_prompt(0)[1..]).copied().collect();
    let want = solo(q8, &second, 8);
    let turn = |model: &dyn CausalLm, prompt: &[u32]| {
        let mut batch = paged_batch(model, 1 << 30, 32);
        batch.set_disk_tier(open());
        let out = Rc::new(RefCell::new(Out::default()));
        batch.add(request(model, prompt, 8, &out), model.make_cache());
        run(&mut batch);
        batch.flush_prompt_cache();
        let o = out.borrow();
        (o.stats.as_ref().unwrap().cached_tokens, o.trace.clone())
    };
    {
        let mut batch = paged_batch(q8, 1 << 30, 32);
        batch.set_disk_tier(open());
        let turn1 = Rc::new(RefCell::new(Out::default()));
        batch.add(request(q8, &first, 6, &turn1), q8.make_cache());
        run(&mut batch);
        let turn2 = Rc::new(RefCell::new(Out::default()));
        batch.add(request(q8, &second, 8, &turn2), q8.make_cache());
        run(&mut batch);
        assert_eq!(turn2.borrow().stats.as_ref().unwrap().cached_tokens, first.len() - 1, "the first prompt's quantized rows are reused");
        assert!(turn2.borrow().trace == want, "cached turn 2 differs from uncached");
        batch.flush_prompt_cache();
    }
    let (cached, trace) = turn(q8, &second);
    assert_eq!(cached, second.len() - 1, "served from disk");
    assert!(trace == want, "the disk entry continues as uncached");
    let (cached, trace) = turn(f16, &second);
    assert_eq!(cached, 0, "an f16 cache never takes q8 rows");
    assert!(trace == solo(f16, &second, 8));
    let other: Vec<u32> = other_prompt(2).iter().chain(&first[1..]).copied().collect();
    assert_eq!(turn(f16, &other).0, 0);
    let (cached, trace) = turn(q8, &other);
    assert_eq!(cached, 0, "a q8 cache never takes the f16 rows written for the same prompt");
    assert!(trace == solo(q8, &other, 8));
    let _ = std::fs::remove_dir_all(&dir);
}
