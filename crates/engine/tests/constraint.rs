//! Constrained decoding through the engine step: the sampler only picks allowed tokens, tokens
//! the constraint determines are delivered without sampling (jump-forward) and forwarded with
//! the next step, the cache stays aligned, and the output is token-identical with jump-forward
//! on and off (and with speculation); a finished constraint ends the generation with "stop".

mod common;

use common::*;
use ferrolm_core::{CancelToken, FinishReason, GenerateParams, GenerationStats, SamplingParams, TokenEvent};
use ferrolm_engine::{Batch, BatchConfig, Flow, SeqRequest, Sink, SpecConfig, TokenConstraint};
use ferrolm_models::CausalLm;
use ferrolm_sample::{Sampler, SamplerConfig};
use std::cell::RefCell;
use std::rc::Rc;

/// A small grammar over token ids: a choice among `branches` (each starts with a distinct
/// token, which the model picks), then the rest of the chosen branch, then the end.
struct Branches {
    vocab: usize,
    branches: Vec<Vec<u32>>,
    /// The chosen branch and how far into it the output is.
    at: Option<(usize, usize)>,
    /// Deliver determined tokens without sampling (jump-forward) or mask down to one token.
    jump: bool,
}

impl Branches {
    fn remaining(&self) -> &[u32] {
        match self.at {
            Some((b, i)) => &self.branches[b][i..],
            None => &[],
        }
    }
}

impl TokenConstraint for Branches {
    fn mask(&mut self) -> Result<Vec<u32>, String> {
        let mut bits = vec![0u32; self.vocab.div_ceil(32)];
        let allowed: Vec<u32> = match self.at {
            None => self.branches.iter().map(|b| b[0]).collect(),
            Some(_) => self.remaining().first().copied().into_iter().collect(),
        };
        if allowed.is_empty() {
            return Err("the grammar is finished".into());
        }
        allowed.iter().for_each(|&t| bits[t as usize / 32] |= 1 << (t % 32));
        Ok(bits)
    }

    fn consume(&mut self, token: u32) -> Result<(), String> {
        self.at = match self.at {
            None => self.branches.iter().position(|b| b[0] == token).map(|b| (b, 1)),
            Some((b, i)) if self.branches[b].get(i) == Some(&token) => Some((b, i + 1)),
            _ => None,
        };
        self.at.map(|_| ()).ok_or_else(|| format!("token {token} is not allowed"))
    }

    fn forced(&mut self) -> Vec<u32> {
        if !self.jump {
            return Vec::new();
        }
        let rest = self.remaining().to_vec();
        if let Some((b, _)) = self.at {
            self.at = Some((b, self.branches[b].len()));
        }
        rest
    }

    fn is_finished(&self) -> bool {
        self.at.is_some() && self.remaining().is_empty()
    }
}

#[derive(Default)]
struct Out {
    tokens: Vec<u32>,
    stats: Option<GenerationStats>,
}

struct Rec(Rc<RefCell<Out>>);

impl Sink for Rec {
    fn token(&mut self, e: TokenEvent) -> Flow {
        self.0.borrow_mut().tokens.push(e.token);
        Flow::Continue
    }

    fn finish(&mut self, outcome: Result<GenerationStats, String>) {
        self.0.borrow_mut().stats = Some(outcome.unwrap());
    }
}

fn run(model: &dyn CausalLm, prompt: &[u32], branches: &[Vec<u32>], jump: bool, spec: Option<SpecConfig>) -> (Out, usize) {
    let cfg = BatchConfig { max_batch_tokens: 256, max_seqs: 4, kv_budget_bytes: 1 << 30, prompt_cache_bytes: 0 };
    let mut batch = Batch::new(model, cfg, Default::default());
    batch.set_speculation(spec);
    let vocab = model.info().vocab_size;
    let sp = SamplingParams::default();
    let out = Rc::new(RefCell::new(Out::default()));
    let req = SeqRequest {
        prompt: prompt.to_vec(),
        params: GenerateParams { max_tokens: 50, sampling: sp.clone(), ..Default::default() },
        eos_ids: vec![],
        cancel: CancelToken::new(),
        sampler: Box::new(Sampler::new(&sp, &SamplerConfig { vocab_size: vocab, ..Default::default() }).unwrap()),
        sink: Box::new(Rec(out.clone())),
        constraint: Some(Box::new(Branches { vocab, branches: branches.to_vec(), at: None, jump })),
    };
    batch.add(req, model.make_cache());
    let mut steps = 0;
    let mut cache_tokens = 0;
    while !batch.is_idle() {
        for (_, c) in batch.step(&|| false).retired {
            cache_tokens = c.offset();
        }
        steps += 1;
    }
    let o = Rc::try_unwrap(out).ok().unwrap().into_inner();
    let stats = o.stats.as_ref().unwrap();
    assert_eq!(stats.cache_tokens.len(), cache_tokens, "cache tokens = prompt ++ forwarded");
    assert_eq!(&stats.cache_tokens[..prompt.len()], prompt);
    (o, steps)
}

#[test]
fn constrained_output_follows_the_grammar_with_and_without_jump_forward() {
    let Some(model) = open_model("SmolLM2-135M-Instruct.Q4_1.gguf") else { return };
    let model = model.as_ref();
    let f = load_fixture("SmolLM2-135M-Instruct.Q4_1.json");
    let prompt = &f.prompts[0].prompt_ids;
    // Two branches of real text tokens from another prompt, with long determined tails.
    let text = f.prompts.iter().max_by_key(|p| p.prompt_ids.len()).unwrap().prompt_ids.clone();
    let branches = vec![text[2..14].to_vec(), text[20..30].to_vec()];
    assert_ne!(branches[0][0], branches[1][0], "branches start with distinct tokens");
    let (plain, plain_steps) = run(model, prompt, &branches, false, None);
    let (jumped, jump_steps) = run(model, prompt, &branches, true, None);
    assert!(branches.contains(&plain.tokens), "the output is one branch: {:?}", plain.tokens);
    assert_eq!(plain.tokens, jumped.tokens, "token-identical with jump-forward on and off");
    assert!(jump_steps < plain_steps, "jump-forward saves steps: {jump_steps} vs {plain_steps}");
    for o in [&plain, &jumped] {
        assert_eq!(o.stats.as_ref().unwrap().finish_reason, Some(FinishReason::Stop), "a finished grammar stops");
    }
    // With speculation as well (drafts verified under the masks).
    let spec = Some(SpecConfig { max_drafts: 4, ngram_min: 1, ngram_max: 3 });
    let (spec_out, _) = run(model, prompt, &branches, true, spec);
    assert_eq!(spec_out.tokens, plain.tokens);
}

/// A JSON schema through llguidance (`ferrolm-grammar`), greedy and sampled, alone and batched
/// with speculation on: every output is valid JSON with the schema's required keys.
#[test]
fn a_json_schema_constrains_real_outputs() {
    let Some(model) = open_model("SmolLM2-135M-Instruct.Q4_1.gguf") else { return };
    let model = model.as_ref();
    let path = ferrolm_models::paths::models_dir().join("SmolLM2-135M-Instruct.Q4_1.gguf");
    let tokenizer = std::sync::Arc::new(ferrolm_text::Tokenizer::from_gguf_file(&path).unwrap());
    let eos = tokenizer.eos_ids().to_vec();
    let grammars = ferrolm_grammar::Grammars::new(tokenizer.clone(), &eos, model.info().vocab_size).unwrap();
    let schema = serde_json::json!({
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "population": {"type": "integer", "minimum": 0, "maximum": 99999999}},
        "required": ["city", "population"],
        "additionalProperties": false
    });
    let spec = ferrolm_grammar::ConstraintSpec::JsonSchema(schema);
    let prompt = tokenizer.encode("Give me a city as JSON:", true).unwrap();
    let cfg = BatchConfig { max_batch_tokens: 256, max_seqs: 4, kv_budget_bytes: 1 << 30, prompt_cache_bytes: 0 };
    let mut batch = Batch::new(model, cfg, Default::default());
    batch.set_speculation(Some(SpecConfig { max_drafts: 4, ngram_min: 1, ngram_max: 3 }));
    let vocab = model.info().vocab_size;
    let outs: Vec<_> = (0..3).map(|_| Rc::new(RefCell::new(Out::default()))).collect();
    for (i, out) in outs.iter().enumerate() {
        let sp = SamplingParams { temperature: if i == 0 { 0.0 } else { 1.0 }, seed: Some(i as u64), ..Default::default() };
        let req = SeqRequest {
            prompt: prompt.clone(),
            params: GenerateParams { max_tokens: 80, sampling: sp.clone(), ..Default::default() },
            eos_ids: eos.clone(),
            cancel: CancelToken::new(),
            sampler: Box::new(Sampler::new(&sp, &SamplerConfig { vocab_size: vocab, ..Default::default() }).unwrap()),
            sink: Box::new(Rec(out.clone())),
            constraint: Some(Box::new(grammars.compile(&spec).unwrap())),
        };
        batch.add(req, model.make_cache());
    }
    while !batch.is_idle() {
        batch.step(&|| false);
    }
    for out in outs {
        let o = out.borrow();
        let ids: Vec<u32> = o.tokens.iter().copied().filter(|t| !eos.contains(t)).collect();
        let text = tokenizer.decode(&ids, true);
        let v: serde_json::Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("not JSON ({e}): {text:?}"));
        assert!(v["city"].is_string() && v["population"].is_i64(), "{text}");
        assert_eq!(o.stats.as_ref().unwrap().finish_reason, Some(FinishReason::Stop), "{text}");
    }
}

/// 16 constrained sequences in one batch (a JSON schema through llguidance; greedy and seeded
/// sampling, with logprobs) give each the tokens and logprob bits it gets alone, whichever way
/// the step computes their masks: one by one, over the CPU pool, or during the forward.
#[test]
fn sixteen_constrained_sequences_batched_equal_each_alone() {
    use common::record::{request_with, Out as Recorded, Trace};
    use ferrolm_engine::MaskSchedule;
    let Some(model) = open_model("SmolLM2-135M-Instruct.Q4_1.gguf") else { return };
    let model = model.as_ref();
    let path = ferrolm_models::paths::models_dir().join("SmolLM2-135M-Instruct.Q4_1.gguf");
    let tokenizer = std::sync::Arc::new(ferrolm_text::Tokenizer::from_gguf_file(&path).unwrap());
    let eos = tokenizer.eos_ids().to_vec();
    let grammars = ferrolm_grammar::Grammars::new(tokenizer.clone(), &eos, model.info().vocab_size).unwrap();
    let schema = serde_json::json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "kind": {"enum": ["city", "river", "mountain"]},
            "size": {"type": "integer", "minimum": 0},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}
        },
        "required": ["name", "kind", "size", "tags"],
        "additionalProperties": false
    });
    let spec = ferrolm_grammar::ConstraintSpec::JsonSchema(schema);
    let places = ["a city", "a river", "a mountain", "a famous place"];
    let prompts: Vec<Vec<u32>> = places.iter().map(|p| tokenizer.encode(&format!("Describe {p} as JSON:"), true).unwrap()).collect();
    // (prompt, temperature, seed) per sequence: a quarter greedy, the rest sampled.
    let cases: Vec<(usize, f32, u64)> = (0..16).map(|i| (i % 4, if i < 4 { 0.0 } else { 0.9 }, i as u64)).collect();
    let request = |&(p, temperature, seed): &(usize, f32, u64), out: &Rc<RefCell<Recorded>>| {
        let sp = SamplingParams { temperature, seed: Some(seed), logprobs: Some(2), ..Default::default() };
        let mut req = request_with(model, &prompts[p], &sp, 64, out);
        req.eos_ids = eos.clone();
        req.constraint = Some(Box::new(grammars.compile(&spec).unwrap()));
        req
    };
    let cfg = BatchConfig { max_batch_tokens: 512, max_seqs: 16, kv_budget_bytes: 1 << 30, prompt_cache_bytes: 0 };
    let run_batch = |cases: &[(usize, f32, u64)], schedule: MaskSchedule| -> Vec<Trace> {
        let mut batch = Batch::new(model, cfg, Default::default());
        batch.set_mask_schedule(schedule);
        let outs: Vec<_> = cases.iter().map(|_| Rc::new(RefCell::new(Recorded::default()))).collect();
        for (case, out) in cases.iter().zip(&outs) {
            batch.add(request(case, out), model.make_cache());
        }
        let mut most_masks = 0;
        while !batch.is_idle() {
            most_masks = most_masks.max(batch.step(&|| false).masks.rows);
        }
        assert!(cases.len() == 1 || most_masks == cases.len(), "a step masked all {} rows: {most_masks}", cases.len());
        outs.iter().map(|o| o.borrow().trace.clone()).collect()
    };
    let alone: Vec<Trace> = cases.iter().map(|c| run_batch(std::slice::from_ref(c), MaskSchedule::Serial).remove(0)).collect();
    // Every output is valid JSON of the schema, or was cut by the length limit.
    let mut complete = 0;
    for trace in &alone {
        let ids: Vec<u32> = trace.iter().map(|t| t.0).filter(|t| !eos.contains(t)).collect();
        let text = tokenizer.decode(&ids, true);
        match serde_json::from_str::<serde_json::Value>(&text) {
            Ok(v) => {
                assert!(v["name"].is_string() && v["tags"].is_array(), "{text}");
                complete += 1;
            }
            Err(e) => assert_eq!(trace.len(), 64, "not JSON ({e}) before the length limit: {text:?}"),
        }
    }
    assert!(complete >= 8, "most sequences complete their JSON: {complete} of 16");
    let distinct: std::collections::HashSet<_> = alone.iter().collect();
    assert!(distinct.len() > 8, "the sequences differ: {} distinct outputs", distinct.len());
    for schedule in [MaskSchedule::Serial, MaskSchedule::Parallel, MaskSchedule::Overlap] {
        let batched = run_batch(&cases, schedule);
        for (i, (b, a)) in batched.iter().zip(&alone).enumerate() {
            assert_eq!(b, a, "sequence {i} batched ({schedule:?}) vs alone");
        }
    }
}
