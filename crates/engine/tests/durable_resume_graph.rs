//! A plain greedy sequence alone decodes through the captured step (`graph_decode`; forced on
//! the CPU here, as on a GPU). A resumed one (`Sequence::resume`) must first forward its saved
//! tokens as one decode row, not hand only the last one to the captured step. Exact
//! activations (this test binary only: the setting is process-wide) make the captured step's
//! arithmetic the plain decode's, so the tokens must be equal.

mod common;

use common::*;
use ferrolm_core::{CancelToken, GenerateParams, GenerationStats, SamplingParams, TokenEvent};
use ferrolm_engine::{Batch, BatchConfig, Flow, GraphSettings, SeqRequest, Sink};
use ferrolm_sample::{Sampler, SamplerConfig};
use std::cell::RefCell;
use std::rc::Rc;

struct Rec(Rc<RefCell<(Vec<u32>, Option<GenerationStats>)>>);

impl Sink for Rec {
    fn token(&mut self, e: TokenEvent) -> Flow {
        self.0.borrow_mut().0.push(e.token);
        Flow::Continue
    }

    fn finish(&mut self, outcome: Result<GenerationStats, String>) {
        self.0.borrow_mut().1 = Some(outcome.unwrap());
    }
}

/// The tokens of a greedy run of `prompt` resumed from `emitted`, and the cache tokens it ended with.
fn greedy(model: &dyn ferrolm_models::CausalLm, prompt: &[u32], emitted: &[u32], graph: GraphSettings) -> (Vec<u32>, usize) {
    let cfg = BatchConfig { max_batch_tokens: 512, max_seqs: 1, kv_budget_bytes: 1 << 30, prompt_cache_bytes: 0 };
    let sp = SamplingParams::default();
    let sampler = Sampler::new(&sp, &SamplerConfig { vocab_size: model.info().vocab_size, ..Default::default() }).unwrap();
    let rec = Rc::new(RefCell::new((Vec::new(), None)));
    let mut batch = Batch::new(model, cfg, graph);
    let req = SeqRequest {
        prompt: prompt.to_vec(),
        params: GenerateParams { max_tokens: 24, sampling: sp, ..Default::default() },
        eos_ids: vec![],
        cancel: CancelToken::new(),
        sampler: Box::new(sampler),
        sink: Box::new(Rec(rec.clone())),
        constraint: None,
    };
    batch.add_resumed(req, model.make_cache(), emitted);
    while !batch.is_idle() {
        batch.step(&|| false);
    }
    let (tokens, stats) = rec.borrow_mut().clone();
    (tokens, stats.unwrap().cache_tokens.len())
}

#[test]
fn resume_before_the_captured_greedy_step() {
    exact_activations();
    let Some(model) = open_model("SmolLM2-135M-Instruct.Q4_1.gguf") else { return };
    let model = model.as_ref();
    let f = load_fixture("SmolLM2-135M-Instruct.Q4_1.json");
    let prompt = &f.prompts[0].prompt_ids;
    let graph = GraphSettings { on_cpu: true, ..Default::default() };
    let (want, _) = greedy(model, prompt, &[], Default::default());
    let (fresh, _) = greedy(model, prompt, &[], graph);
    assert_eq!(fresh, want, "the captured step decodes as the plain one");
    for cut in [1, 5] {
        let (got, cached) = greedy(model, prompt, &want[..cut], graph);
        assert_eq!(got, want, "resumed after {cut} tokens");
        assert_eq!(cached, prompt.len() + want.len() - 1, "the cache holds prompt ++ every token but the last");
    }
}
