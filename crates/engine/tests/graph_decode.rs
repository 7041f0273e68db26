//! The static decode step (what CUDA graphs capture), run eagerly on the CPU: the same greedy
//! tokens as the regular decode path on the default model, the caches holding exactly what was
//! forwarded, early stops, and reuse of one decoder across generations.

mod common;

use common::*;
use ferrolm_core::{CancelToken, GenerateParams};
use ferrolm_engine::{generate, DecodePath, Flow, GenerateInput, GraphDecoder};
use ferrolm_models::{CausalLm, SeqInput};

fn regular_greedy(model: &dyn CausalLm, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut cache = model.make_cache();
    let params = GenerateParams { max_tokens: n, ..Default::default() };
    let input = GenerateInput { prompt, params: &params, eos_ids: &[], cancel: &CancelToken::new() };
    let mut out = Vec::new();
    generate(model, &mut cache, input, &mut Greedy, None, &mut |e| {
        out.push(e.token);
        Flow::Continue
    })
    .unwrap();
    out
}

/// Prefill, first token by argmax, then `n - 1` more through the decoder (stopping after `stop_at`).
fn static_greedy(model: &dyn CausalLm, dec: &mut GraphDecoder, prompt: &[u32], n: usize, stop_at: usize) -> (Vec<u32>, usize) {
    let mut cache = model.make_cache();
    let h = model.forward_hidden(&mut [SeqInput { tokens: prompt, cache: &mut cache }]).unwrap();
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
    let Some(model) = open_model("SmolLM2-135M-Instruct.Q4_1.gguf") else { return };
    let fixture = load_fixture("SmolLM2-135M-Instruct.Q4_1.json");
    let mut dec = GraphDecoder::new(model.as_ref()).unwrap().expect("llama has a static step");
    for name in ["chat_capital", "raw_code"] {
        let p = fixture.prompts.iter().find(|p| p.name == name).unwrap();
        let n = 24;
        let want = regular_greedy(model.as_ref(), &p.prompt_ids, n);
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
