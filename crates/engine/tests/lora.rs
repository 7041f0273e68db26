//! LoRA adapters per request (`ferrolm_models::lora`) against transformers+peft, on the tiny
//! llama3 and qwen3 fixtures with random-weight PEFT adapters made by peft itself
//! (scripts/fixtures/lora_fixture.py: `one` r 4 on every projection, `two` r 2 rsLoRA on q and
//! v of layer 1; logits with one, two and both active).
//! - teacher-forced logits with each stack within `F32_TOL` of peft's, folder and GGUF (whose
//!   llama Q/K rows are permuted: B's rows are permuted alike), the prompt whole or in chunks
//!   (same bits);
//! - base logits the same bits before and after adapters ran, and beside adapter rows;
//! - rows with different adapters in one forward each the same bits as alone;
//! - an adapter for another base, and options ferrolm does not compute, refused at mount.

mod common;

use common::{exact_activations, repo_root};
use ferrolm_models::lora::{mount, LoraStack};
use ferrolm_models::{CausalLm, ModelSource, SeqInput};
use serde::Deserialize;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Both sides compute in f32 on the same weights (base f16, adapters f32); the adapters move
/// the logits by 4-50 units (logits.json), so a missed or misplaced delta fails by far.
const F32_TOL: f32 = 1e-3;

#[derive(Deserialize)]
struct Record {
    ids: Vec<u32>,
    prompt_len: usize,
    logits_shape: [usize; 2],
    stacks: Vec<String>,
}

fn lora_dir(family: &str) -> PathBuf {
    repo_root().join("tests/fixtures/tiny/lora").join(family)
}

fn record(family: &str) -> Record {
    serde_json::from_str(&std::fs::read_to_string(lora_dir(family).join("logits.json")).unwrap()).unwrap()
}

fn oracle(family: &str, stack: &str, vocab: usize) -> Vec<Vec<f32>> {
    let bytes = std::fs::read(lora_dir(family).join(format!("logits-{stack}.f32"))).unwrap();
    let values: Vec<f32> = bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
    values.chunks(vocab).map(<[f32]>::to_vec).collect()
}

fn open(path: &Path) -> Box<dyn CausalLm> {
    let source = ModelSource::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    ferrolm_models::load(&source, &candle_core::Device::Cpu).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The stack `one+two` of adapters mounted on `model` from `family`'s fixture folders.
fn stack(model: &dyn CausalLm, family: &str, names: &str) -> Arc<LoraStack> {
    let adapters = names
        .split('+')
        .map(|n| Arc::new(mount(model, n, &lora_dir(family).join(n)).unwrap_or_else(|e| panic!("{family} {n}: {e}"))))
        .collect();
    Arc::new(LoraStack { adapters })
}

/// Teacher-forced logits along `ids` with `lora`: the prompt (all but its last token) in
/// `chunk`s of prompt rows, then one decode row per token from the last prompt token on.
fn logits_along(model: &dyn CausalLm, ids: &[u32], prompt_len: usize, steps: usize, chunk: usize, lora: Option<&Arc<LoraStack>>) -> Vec<Vec<f32>> {
    let mut cache = model.make_cache();
    for part in ids[..prompt_len - 1].chunks(chunk) {
        model.forward_hidden(&mut [SeqInput::prompt(part, &mut cache).with_lora(lora.cloned())]).unwrap();
    }
    (0..steps)
        .map(|i| {
            let feed = [ids[prompt_len - 1 + i]];
            let h = model.forward_hidden(&mut [SeqInput::decode(&feed, &mut cache).with_lora(lora.cloned())]).unwrap();
            model.project_logits(&h).unwrap().squeeze(0).unwrap().to_vec1().unwrap()
        })
        .collect()
}

fn max_delta(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    a.iter().flatten().zip(b.iter().flatten()).fold(0f32, |m, (x, y)| m.max((x - y).abs()))
}

fn argmax(v: &[f32]) -> usize {
    v.iter().enumerate().fold(0, |best, (i, &x)| if x > v[best] { i } else { best })
}

fn check_family(family: &str) {
    exact_activations();
    let r = record(family);
    let [steps, vocab] = r.logits_shape;
    let base_dir = repo_root().join("tests/fixtures/tiny").join(family);
    for (label, path) in [("folder", base_dir.clone()), ("gguf", base_dir.join("model-f16.gguf"))] {
        let model = open(&path);
        for name in &r.stacks {
            let lora = stack(model.as_ref(), family, name);
            let want = oracle(family, name, vocab);
            let whole = logits_along(model.as_ref(), &r.ids, r.prompt_len, steps, usize::MAX, Some(&lora));
            let chunked = logits_along(model.as_ref(), &r.ids, r.prompt_len, steps, 5, Some(&lora));
            let d = max_delta(&whole, &want);
            let top1 = whole.iter().zip(&want).all(|(a, b)| argmax(a) == argmax(b));
            eprintln!("{family} {label:<6} {name:<8}: max |Δ| vs transformers+peft {d:.2e}, top-1 equal {top1}");
            assert!(d <= F32_TOL, "{family} {label} {name}: {d}");
            assert!(top1, "{family} {label} {name}: top-1 differs");
            assert!(whole == chunked, "{family} {label} {name}: the prompt in chunks of 5 gives other bits");
        }
    }
}

#[test]
fn llama3_adapters_match_transformers_and_peft() {
    check_family("llama3");
}

#[test]
fn qwen3_adapters_match_transformers_and_peft() {
    check_family("qwen3");
}

/// The last decode row's hidden state of `ids` (prefilled, then `next` decoded) with `lora`, alone.
fn solo_decode(model: &dyn CausalLm, ids: &[u32], next: u32, lora: Option<&Arc<LoraStack>>) -> Vec<f32> {
    let mut cache = model.make_cache();
    model.forward_hidden(&mut [SeqInput::prompt(ids, &mut cache).with_lora(lora.cloned())]).unwrap();
    let h = model.forward_hidden(&mut [SeqInput::decode(&[next], &mut cache).with_lora(lora.cloned())]).unwrap();
    h.flatten_all().unwrap().to_vec1().unwrap()
}

#[test]
fn base_logits_are_the_same_bits_after_switching_adapters() {
    exact_activations();
    let r = record("llama3");
    let model = open(&repo_root().join("tests/fixtures/tiny/llama3"));
    let steps = r.logits_shape[0];
    let before = logits_along(model.as_ref(), &r.ids, r.prompt_len, steps, 7, None);
    for name in ["one", "two", "one+two"] {
        let lora = stack(model.as_ref(), "llama3", name);
        let with = logits_along(model.as_ref(), &r.ids, r.prompt_len, steps, 7, Some(&lora));
        assert!(max_delta(&with, &before) > 0.1, "{name} changes nothing");
        let after = logits_along(model.as_ref(), &r.ids, r.prompt_len, steps, 7, None);
        assert!(after == before, "base logits changed after running {name}");
    }
}

#[test]
fn rows_with_different_adapters_in_one_batch_equal_their_solo_run() {
    exact_activations();
    let r = record("qwen3");
    let model = open(&repo_root().join("tests/fixtures/tiny/qwen3"));
    let m = model.as_ref();
    let (one, two, both) = (stack(m, "qwen3", "one"), stack(m, "qwen3", "two"), stack(m, "qwen3", "one+two"));
    let (a, b, c, d) = (&r.ids[..20], &r.ids[3..30], &r.ids[10..40], &r.ids[5..25]);
    let want = [solo_decode(m, a, 7, Some(&one)), solo_decode(m, b, 9, Some(&two)), solo_decode(m, c, 11, None)];
    let prefilled = |ids: &[u32], lora: Option<&Arc<LoraStack>>| {
        let mut cache = m.make_cache();
        m.forward_hidden(&mut [SeqInput::prompt(ids, &mut cache).with_lora(lora.cloned())]).unwrap();
        cache
    };
    let (mut ca, mut cb, mut cc, mut cd) = (prefilled(a, Some(&one)), prefilled(b, Some(&two)), prefilled(c, None), m.make_cache());
    let h = m
        .forward_hidden(&mut [
            SeqInput::decode(&[7], &mut ca).with_lora(Some(one.clone())),
            SeqInput::decode(&[9], &mut cb).with_lora(Some(two.clone())),
            SeqInput::decode(&[11], &mut cc),
            SeqInput::prompt(d, &mut cd).with_lora(Some(both.clone())),
        ])
        .unwrap();
    let rows: Vec<Vec<f32>> = h.to_vec2().unwrap();
    assert_eq!(rows.len(), 3);
    for (i, (got, want)) in rows.iter().zip(&want).enumerate() {
        assert!(got == want, "row {i}: not the same bits as its solo run");
    }
    // The prompt rows with both adapters left the same cache as alone: decoding on from it
    // gives the solo bits.
    let h = m.forward_hidden(&mut [SeqInput::decode(&[3], &mut cd).with_lora(Some(both.clone()))]).unwrap();
    assert!(h.flatten_all().unwrap().to_vec1::<f32>().unwrap() == solo_decode(m, d, 3, Some(&both)));
}

#[test]
fn an_adapter_for_another_base_or_with_unsupported_options_is_refused() {
    let model = open(&repo_root().join("tests/fixtures/tiny/llama3"));
    let err = mount(model.as_ref(), "q", &lora_dir("qwen3").join("one")).err().expect("qwen3's adapter on llama3");
    assert!(err.contains("does not fit this llama model") && err.contains("q_proj"), "{err}");
    // The same adapter with DoRA switched on.
    let tmp = std::env::temp_dir().join(format!("ferrolm-lora-dora-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    let src = lora_dir("llama3").join("one");
    std::fs::copy(src.join("adapter_model.safetensors"), tmp.join("adapter_model.safetensors")).unwrap();
    let cfg = std::fs::read_to_string(src.join("adapter_config.json")).unwrap().replace("\"use_dora\": false", "\"use_dora\": true");
    std::fs::write(tmp.join("adapter_config.json"), cfg).unwrap();
    let err = mount(model.as_ref(), "d", &tmp).err().expect("a DoRA adapter");
    std::fs::remove_dir_all(&tmp).ok();
    assert!(err.contains("DoRA"), "{err}");
    let err = mount(model.as_ref(), "x", &lora_dir("llama3")).err().expect("a folder without an adapter");
    assert!(err.contains("adapter_config.json"), "{err}");
}

mod engine {
    //! Through the engine's batch: requests naming adapters (`GenerateParams::adapter`).
    use super::*;
    use ferrolm_core::{CancelToken, GenerateParams, GenerationStats, SamplingParams, TokenEvent};
    use ferrolm_engine::config::KvLayout;
    use ferrolm_engine::{Batch, BatchConfig, Flow, SeqRequest, Sink};
    use ferrolm_models::lora::Adapters;
    use ferrolm_sample::{Sampler, SamplerConfig};
    use std::cell::RefCell;
    use std::rc::Rc;

    /// Each token with its logprob's bits and the top alternatives' bits; then the outcome.
    type Trace = (Vec<(u32, u32, Vec<(u32, u32)>)>, Option<Result<usize, String>>);

    struct Recorder(Rc<RefCell<Trace>>);

    impl Sink for Recorder {
        fn token(&mut self, e: TokenEvent) -> Flow {
            let lp = e.logprobs.as_ref();
            let top = lp.map(|l| l.top.iter().map(|(t, p)| (*t, p.to_bits())).collect()).unwrap_or_default();
            self.0.borrow_mut().0.push((e.token, lp.map_or(0, |l| l.logprob.to_bits()), top));
            Flow::Continue
        }

        fn finish(&mut self, outcome: Result<GenerationStats, String>) {
            self.0.borrow_mut().1 = Some(outcome.map(|s| s.cached_tokens));
        }
    }

    fn request(model: &dyn CausalLm, prompt: &[u32], adapter: Option<&str>, out: &Rc<RefCell<Trace>>) -> SeqRequest<'static> {
        let sampling = SamplingParams { logprobs: Some(3), ..Default::default() };
        let sampler = Sampler::new(&sampling, &SamplerConfig { vocab_size: model.info().vocab_size, ..Default::default() }).unwrap();
        SeqRequest {
            prompt: prompt.to_vec(),
            params: GenerateParams { max_tokens: 8, sampling, adapter: adapter.map(str::to_string), ..Default::default() },
            eos_ids: vec![],
            cancel: CancelToken::new(),
            sampler: Box::new(sampler),
            sink: Box::new(Recorder(out.clone())),
            constraint: None,
        }
    }

    /// A batch over `model` with `adapters` mounted, its caches laid out as `layout` says.
    fn batch<'a>(model: &'a dyn CausalLm, adapters: &'a Adapters, cfg: BatchConfig, layout: KvLayout) -> Batch<'a> {
        let mut batch = Batch::new(model, cfg, Default::default());
        batch.set_adapters(adapters);
        batch.set_kv_layout(layout).unwrap();
        batch
    }

    const PAGED: KvLayout = KvLayout::Paged { block_tokens: 16 };

    /// Runs `jobs` (prompt, adapter) in one batch, job i joining before step i; their traces.
    fn run(model: &dyn CausalLm, adapters: &Adapters, jobs: &[(&[u32], Option<&str>)], cfg: BatchConfig) -> Vec<Trace> {
        run_in(model, adapters, jobs, cfg, KvLayout::Contiguous)
    }

    fn run_in(model: &dyn CausalLm, adapters: &Adapters, jobs: &[(&[u32], Option<&str>)], cfg: BatchConfig, layout: KvLayout) -> Vec<Trace> {
        let mut batch = batch(model, adapters, cfg, layout);
        let outs: Vec<_> = jobs.iter().map(|_| Rc::new(RefCell::new(Trace::default()))).collect();
        let mut step = 0;
        while step < jobs.len() || !batch.is_idle() {
            if let Some((prompt, adapter)) = jobs.get(step) {
                batch.add(request(model, prompt, *adapter, &outs[step]), model.make_cache());
            }
            batch.step(&|| false);
            step += 1;
        }
        outs.iter().map(|o| o.borrow().clone()).collect()
    }

    /// Runs `jobs` one after the other in one batch (each to its end before the next).
    fn run_in_turn(model: &dyn CausalLm, adapters: &Adapters, jobs: &[(&[u32], Option<&str>)], cfg: BatchConfig, layout: KvLayout) -> Vec<Trace> {
        let mut batch = batch(model, adapters, cfg, layout);
        let outs: Vec<_> = jobs.iter().map(|_| Rc::new(RefCell::new(Trace::default()))).collect();
        for ((prompt, adapter), out) in jobs.iter().zip(&outs) {
            batch.add(request(model, prompt, *adapter, out), model.make_cache());
            while !batch.is_idle() {
                batch.step(&|| false);
            }
        }
        outs.iter().map(|o| o.borrow().clone()).collect()
    }

    fn mounted(model: &dyn CausalLm) -> Adapters {
        let adapters = Adapters::default();
        for n in ["one", "two"] {
            adapters.insert(mount(model, n, &lora_dir("qwen3").join(n)).unwrap()).unwrap();
        }
        adapters
    }

    fn cfg(max_batch_tokens: usize, prompt_cache_bytes: usize) -> BatchConfig {
        BatchConfig { max_batch_tokens, max_seqs: 8, kv_budget_bytes: 1 << 30, prompt_cache_bytes }
    }

    #[test]
    fn requests_with_different_adapters_in_one_batch_equal_their_solo_run() {
        exact_activations();
        let r = record("qwen3");
        let model = open(&repo_root().join("tests/fixtures/tiny/qwen3"));
        let m = model.as_ref();
        let adapters = mounted(m);
        let jobs: Vec<(&[u32], Option<&str>)> =
            vec![(&r.ids[..24], Some("one")), (&r.ids[2..30], Some("two")), (&r.ids[5..21], None), (&r.ids[..24], Some("one+two")), (&r.ids[..24], Some("none"))];
        // Alone, the whole prompt in one chunk; together, joining step by step, prompts cut
        // into chunks of at most 7 rows beside the others' decode rows.
        let solo: Vec<Trace> = jobs.iter().map(|j| run(m, &adapters, &[*j], cfg(512, 0)).remove(0)).collect();
        for layout in [KvLayout::Contiguous, PAGED] {
            let together = run_in(m, &adapters, &jobs, cfg(7, 0), layout);
            for (i, (a, b)) in solo.iter().zip(&together).enumerate() {
                assert_eq!(a.1, Some(Ok(0)), "job {i}: {:?}", a.1);
                assert!(a == b, "job {i} ({:?}, {layout:?}): in a batch not the same as alone", jobs[i].1);
            }
        }
        assert!(solo[0].0 != solo[4].0 && solo[3].0 != solo[0].0, "adapters change nothing");
        assert!(solo[4] == run(m, &adapters, &[(&r.ids[..24], None)], cfg(512, 0))[0], "\"none\" is the base model");
    }

    #[test]
    fn the_prompt_cache_is_not_shared_across_adapters() {
        exact_activations();
        let r = record("qwen3");
        let model = open(&repo_root().join("tests/fixtures/tiny/qwen3"));
        let m = model.as_ref();
        let adapters = mounted(m);
        let (p, q) = (&r.ids[..24], &r.ids[..30]);
        let alone = |prompt: &[u32], adapter| run(m, &adapters, &[(prompt, adapter)], cfg(512, 0)).remove(0);
        // One after the other, prompt cache on: q extends p, so a base run of q after a base run
        // of p hits (cached tokens > 0); after a run with an adapter it must not.
        // With paged caches, prefixes are shared as blocks instead (the same rule applies).
        for layout in [KvLayout::Contiguous, PAGED] {
            let jobs: [(&[u32], Option<&str>); 5] = [(p, Some("one")), (q, None), (q, Some("one")), (p, None), (q, None)];
            let seq = run_in_turn(m, &adapters, &jobs, cfg(512, 1 << 26), layout);
            // The same tokens and logprobs as alone (the outcomes' cached-token counts differ).
            assert!(seq[0].0 == alone(p, Some("one")).0 && seq[2].0 == alone(q, Some("one")).0, "{layout:?}");
            assert!(seq[1].0 == alone(q, None).0 && seq[3].0 == alone(p, None).0, "{layout:?}");
            assert_eq!(seq[1].1, Some(Ok(0)), "{layout:?}: a base request reused an adapter's prefix");
            assert_eq!(seq[2].1, Some(Ok(0)), "{layout:?}: an adapter request reused a base prefix");
            assert!(matches!(seq[4].1, Some(Ok(n)) if n > 0), "{layout:?}: base requests still share prefixes: {:?}", seq[4].1);
            assert!(seq[4].0 == seq[1].0);
        }
    }

    #[test]
    fn an_unknown_adapter_fails_its_request_only() {
        let r = record("qwen3");
        let model = open(&repo_root().join("tests/fixtures/tiny/qwen3"));
        let adapters = mounted(model.as_ref());
        let out = run(model.as_ref(), &adapters, &[(&r.ids[..10], Some("three")), (&r.ids[..10], Some("one+three")), (&r.ids[..10], Some("one"))], cfg(512, 0));
        for o in &out[..2] {
            let err = o.1.clone().unwrap().unwrap_err();
            assert!(err.contains("unknown adapter \"three\"") && err.contains("mounted: one, two"), "{err}");
        }
        assert_eq!(out[2].1, Some(Ok(0)));
    }
}
