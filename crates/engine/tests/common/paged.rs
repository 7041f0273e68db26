//! Helpers of the paged-KV tests (f16 and quantized rows): a paged batch, the fixture's
//! prompts, and the logits of two sequences forwarded together.

use super::load_fixture;
use ferrolm_engine::config::KvLayout;
use ferrolm_engine::{Batch, BatchConfig};
use ferrolm_kv::SeqCache;
use ferrolm_models::{CausalLm, SeqInput};

pub const SMOL_FIXTURE: &str = "SmolLM2-135M-Instruct.Q4_1.json";

pub fn paged_batch<'a>(model: &'a dyn CausalLm, prompt_cache_bytes: usize, block_tokens: usize) -> Batch<'a> {
    let cfg = BatchConfig { max_batch_tokens: 64, max_seqs: 8, kv_budget_bytes: 1 << 30, prompt_cache_bytes };
    let mut batch = Batch::new(model, cfg, Default::default());
    batch.set_kv_layout(KvLayout::Paged { block_tokens }).unwrap();
    batch
}

pub fn longest_prompt() -> Vec<u32> {
    load_fixture(SMOL_FIXTURE).prompts.iter().max_by_key(|p| p.prompt_ids.len()).unwrap().prompt_ids.clone()
}

pub fn other_prompt(i: usize) -> Vec<u32> {
    load_fixture(SMOL_FIXTURE).prompts[i].prompt_ids.clone()
}

pub fn bits(t: &candle_core::Tensor) -> Vec<u32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect()
}

/// Two sequences forwarded together: prompts in chunks of 7 rows, then decode steps of one row
/// each and one step verifying three rows; the logits of every decode row.
pub fn logits_of(model: &dyn CausalLm, mut caches: [SeqCache; 2], prompts: [&[u32]; 2]) -> Vec<Vec<u32>> {
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
