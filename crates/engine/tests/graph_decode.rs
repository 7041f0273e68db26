//! The static decode step (what CUDA graphs capture), run eagerly on the CPU: the same greedy
//! tokens as the regular decode path on the default model, the caches holding exactly what was
//! forwarded, early stops, and reuse of one decoder across generations.

mod common;
#[path = "common/parity.rs"]
mod parity;

use common::*;
use ferrolm_core::{CancelToken, GenerateParams};
use ferrolm_engine::{generate, DecodePath, Flow, GenerateInput, GraphDecoder};
use ferrolm_models::{CausalLm, SeqInput};
use parity::our_greedy;

/// Prefill, first token by argmax, then `n - 1` more through the decoder (stopping after `stop_at`).
fn static_greedy(model: &dyn CausalLm, dec: &mut GraphDecoder, prompt: &[u32], n: usize, stop_at: usize) -> (Vec<u32>, usize) {
    let mut cache = model.make_cache();
    let (body, tail) = prompt.split_at(prompt.len() - 1);
    if !body.is_empty() {
        model.forward_hidden(&mut [SeqInput::prompt(body, &mut cache)]).unwrap();
    }
    let h = model.forward_hidden(&mut [SeqInput::decode(tail, &mut cache)]).unwrap();
    let first = model.project_logits(&h).unwrap().squeeze(0).unwrap().argmax(0).unwrap().to_scalar::<u32>().unwrap();
    let mut out = vec![first];
    let path = dec
        .run(model, &mut cache, first, n - 1, &mut |t| {
            out.push(t);
            out.len() < stop_at
        })
        .unwrap();
    assert_eq!(path, Some(DecodePath::Eager), "CPU has no graphs");
    (out, cache.offset())
}

#[test]
fn static_decode_equals_regular_decode_on_the_default_model() {
    // The two paths attend differently (fused kernel vs composition): compare them in f32.
    exact_activations();
    let Some(model) = open_model("SmolLM2-135M-Instruct.Q4_1.gguf") else { return };
    let fixture = load_fixture("SmolLM2-135M-Instruct.Q4_1.json");
    let mut dec = GraphDecoder::new(model.as_ref(), Default::default()).unwrap().expect("llama has a static step");
    for name in ["chat_capital", "raw_code"] {
        let p = fixture.prompts.iter().find(|p| p.name == name).unwrap();
        let n = 24;
        let want = our_greedy(model.as_ref(), &p.prompt_ids, n, p.prompt_ids.len());
        let (got, offset) = static_greedy(model.as_ref(), &mut dec, &p.prompt_ids, n, usize::MAX);
        assert_eq!(got, want, "{name}");
        // The cache holds the prompt, the first token and all delivered tokens but the last.
        assert_eq!(offset, p.prompt_ids.len() + n - 1, "{name}");
        // Stopping early leaves the cache at what was forwarded.
        let (got, offset) = static_greedy(model.as_ref(), &mut dec, &p.prompt_ids, n, 5);
        assert_eq!(got, want[..5], "{name}: early stop");
        assert_eq!(offset, p.prompt_ids.len() + 4, "{name}: early stop");
    }
}

/// The engine's `generate` on a plain greedy request through the static step (forced on CPU):
/// the same tokens, EOS and length limits honoured, the cache holding what was forwarded.
#[test]
fn generate_uses_the_static_step_for_plain_greedy_requests() {
    exact_activations();
    let Some(model) = open_model("SmolLM2-135M-Instruct.Q4_1.gguf") else { return };
    let fixture = load_fixture("SmolLM2-135M-Instruct.Q4_1.json");
    let p = fixture.prompts.iter().find(|p| p.name == "chat_capital").unwrap();
    let want = our_greedy(model.as_ref(), &p.prompt_ids, 12, p.prompt_ids.len());
    let run = |max_tokens: usize, eos: &[u32]| {
        let mut cache = model.make_cache();
        let params = GenerateParams { max_tokens, ..Default::default() };
        // The static step on the CPU too (eagerly), to drive the GPU's code path.
        let graph = ferrolm_engine::GraphSettings { on_cpu: true, ..Default::default() };
        let input = GenerateInput { prompt: &p.prompt_ids, params: &params, eos_ids: eos, cancel: &CancelToken::new(), graph };
        let sp = ferrolm_core::SamplingParams::default();
        let cfg = ferrolm_sample::SamplerConfig { vocab_size: model.info().vocab_size, ..Default::default() };
        let mut sampler = ferrolm_sample::Sampler::new(&sp, &cfg).unwrap();
        let mut out = Vec::new();
        let stats = generate(model.as_ref(), &mut cache, input, &mut sampler, &mut |e| {
            out.push(e.token);
            Flow::Continue
        })
        .unwrap();
        (out, stats, cache.offset())
    };
    let (got, stats, offset) = run(12, &[]);
    assert_eq!(got, want);
    assert_eq!(stats.finish_reason, Some(ferrolm_core::FinishReason::Length));
    assert_eq!(offset, p.prompt_ids.len() + 11);
    assert_eq!(stats.cache_tokens.len(), offset);
    // EOS on the 4th token: it is delivered, not forwarded.
    let (got, stats, offset) = run(12, &[want[3]]);
    assert_eq!(got, want[..4]);
    assert_eq!(stats.finish_reason, Some(ferrolm_core::FinishReason::Stop));
    assert_eq!(offset, p.prompt_ids.len() + 3);
}
