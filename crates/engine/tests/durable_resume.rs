//! Resuming a checkpointed generation (issue 35): a sequence given the tokens an earlier run
//! emitted forwards its prompt as prompt rows and those tokens as one multi-token decode row,
//! and must then go on exactly as the uninterrupted run — the same tokens, the same logprob
//! bits, the same seeded draws, and a KV cache equal bit for bit. This is what lets the
//! checkpoint log hold tokens only (no KV). Cut points from the first token to the last,
//! greedy with logprobs and seeded sampling with a repetition penalty, alone and in a batch.

mod common;

use common::record::*;
use common::*;
use ferrolm_core::SamplingParams;
use ferrolm_engine::{Batch, BatchConfig, GraphSettings};
use ferrolm_kv::SeqCache;
use ferrolm_models::CausalLm;
use std::cell::RefCell;
use std::rc::Rc;

const MAX_TOKENS: usize = 40;

struct Run {
    out: Out,
    /// Each layer's keys and values, as bits, once the generation ended.
    kv: Vec<Vec<u32>>,
}

/// Runs `cases` in one batch; case i resumes from `emitted[i]` (empty: a fresh start).
fn run(model: &dyn CausalLm, cases: &[(Vec<u32>, SamplingParams)], emitted: &[Vec<u32>]) -> Vec<Run> {
    run_with(model, cases, emitted, Default::default())
}

fn run_with(model: &dyn CausalLm, cases: &[(Vec<u32>, SamplingParams)], emitted: &[Vec<u32>], graph: GraphSettings) -> Vec<Run> {
    let cfg = BatchConfig { max_batch_tokens: 512, max_seqs: 16, kv_budget_bytes: 1 << 30, prompt_cache_bytes: 0 };
    let mut batch = Batch::new(model, cfg, graph);
    let recs: Vec<_> = cases.iter().map(|_| Rc::new(RefCell::new(Out::default()))).collect();
    let mut ids = Vec::new();
    for (((prompt, sp), r), e) in cases.iter().zip(&recs).zip(emitted) {
        let req = request_with(model, prompt, sp, MAX_TOKENS, r);
        ids.push(batch.add_resumed(req, model.make_cache(), e));
    }
    let mut caches: Vec<Option<SeqCache>> = cases.iter().map(|_| None).collect();
    while !batch.is_idle() {
        for (id, cache) in batch.step(&|| false).retired {
            let i = ids.iter().position(|&x| x == id).unwrap();
            caches[i] = Some(cache);
        }
    }
    recs.into_iter()
        .zip(caches)
        .map(|(r, c)| Run { out: Rc::try_unwrap(r).ok().unwrap().into_inner(), kv: kv_bits(&c.unwrap()) })
        .collect()
}

fn kv_bits(cache: &SeqCache) -> Vec<Vec<u32>> {
    let mut out = Vec::new();
    for i in 0..cache.num_layers() {
        let Some(view) = cache.layer_ref(i).state().unwrap() else { continue };
        for t in [&view.k, &view.v] {
            let t = t.to_dtype(candle_core::DType::F32).unwrap().flatten_all().unwrap();
            out.push(t.to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect());
        }
    }
    out
}

fn cases(fixture: &str) -> Vec<(Vec<u32>, SamplingParams)> {
    let f = load_fixture(fixture);
    f.prompts
        .iter()
        .take(3)
        .enumerate()
        .map(|(i, p)| {
            let sp = match i % 2 {
                0 => SamplingParams { logprobs: Some(2), ..Default::default() },
                _ => SamplingParams { temperature: 0.9, seed: Some(7 + i as u64), repetition_penalty: Some(1.1), logprobs: Some(1), ..Default::default() },
            };
            (p.prompt_ids.clone(), sp)
        })
        .collect()
}

fn check(file: &str, fixture: &str) {
    let Some(model) = open_model(file) else { return };
    let model = model.as_ref();
    let cs = cases(fixture);
    let fresh = vec![Vec::new(); cs.len()];
    let reference = run(model, &cs, &fresh);
    for cut in [1, 9, MAX_TOKENS - 1, MAX_TOKENS] {
        // Alone, and all resumed together in one batch (their multi-token decode rows side by side).
        let emitted: Vec<Vec<u32>> = reference.iter().map(|r| r.out.trace[..cut].iter().map(|t| t.0).collect()).collect();
        let together = run(model, &cs, &emitted);
        let alone: Vec<Run> = (0..cs.len()).map(|i| run(model, &cs[i..=i], &emitted[i..=i]).pop().unwrap()).collect();
        for (i, want) in reference.iter().enumerate() {
            for (how, got) in [("batched", &together[i]), ("alone", &alone[i])] {
                let tokens = |t: &Trace| t.iter().map(|x| x.0).collect::<Vec<_>>();
                assert_eq!(tokens(&got.out.trace), tokens(&want.out.trace), "{file}: case {i} cut {cut} {how}: tokens");
                // Replayed tokens carry no logprobs; every new one must carry the same bits.
                assert_eq!(got.out.trace[cut..], want.out.trace[cut..], "{file}: case {i} cut {cut} {how}: logprob bits");
                // A log that holds the whole generation (killed before it was deleted) only
                // replays: nothing is forwarded, so there is no cache to compare.
                if cut < MAX_TOKENS {
                    assert!(got.kv == want.kv, "{file}: case {i} cut {cut} {how}: the KV cache differs");
                }
                let (g, w) = (got.out.stats.as_ref().unwrap(), want.out.stats.as_ref().unwrap());
                assert_eq!((g.generated_tokens, g.finish_reason), (w.generated_tokens, w.finish_reason));
            }
        }
    }
}

#[test]
fn resume_continues_bit_for_bit_smollm2() {
    check("SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct.Q4_1.json");
}

#[test]
fn resume_continues_bit_for_bit_qwen2() {
    check("qwen2.5-coder-0.5b-instruct-Q4_K_M.gguf", "qwen2.5-coder-0.5b-instruct-Q4_K_M.json");
}

