//! The draft model's proposer: a small model of the target's vocabulary guesses greedily, its
//! cache following each sequence. Its guesses are made by the engine step for every
//! speculating sequence together (`draft_together`): each draft token is one forward of the
//! draft over one row per sequence still guessing (plus the tokens each must catch up on),
//! through the same multi-sequence forward as the target's step (`spans::forward_spans`).

use super::gate::{DraftGate, DraftMode, StepNote};
use super::{NgramProposer, Proposal, Proposer, SpecConfig};
use crate::spans::forward_spans;
use candle_core::{Result, Tensor};
use ferrolm_core::TokenId;
use ferrolm_kv::SeqCache;
use ferrolm_models::{CausalLm, SeqInput};
use std::time::Instant;

/// One sequence's cache in the draft model, and what the last batched draft told its gate.
pub struct DraftCache {
    cache: SeqCache,
    /// The tokens whose keys and values `cache` holds.
    cached: Vec<TokenId>,
    /// The last draft: (guesses made, seconds of the guessing forwards, seconds catching up).
    note: Option<(usize, f64, f64)>,
}

impl DraftCache {
    pub fn new(model: &dyn CausalLm) -> Self {
        Self { cache: model.make_cache(), cached: Vec::new(), note: None }
    }

    /// Keeps the longest prefix of `tokens` it holds (a fresh cache where the rest cannot be
    /// trimmed); returns the tokens still to forward.
    fn realign<'t>(&mut self, model: &dyn CausalLm, tokens: &'t [TokenId]) -> &'t [TokenId] {
        let common = self.cached.iter().zip(tokens).take_while(|(a, b)| a == b).count();
        let extra = self.cached.len() - common;
        if self.cache.trim(extra) != extra {
            (self.cache, self.cached) = (model.make_cache(), Vec::new());
            return tokens;
        }
        self.cached.truncate(common);
        &tokens[common..]
    }
}

/// A sequence's request in a batched draft step: its draft cache, its history (the last token
/// pending), how many guesses at most, the probability below which guessing stops, and where
/// the guesses go.
pub struct DraftJob<'s> {
    pub cache: &'s mut DraftCache,
    pub history: &'s [TokenId],
    pub max: usize,
    pub min_p: Option<f32>,
    pub drafts: &'s mut Vec<TokenId>,
}

/// One job's state during the batched draft.
struct Guessing {
    /// The rows of its next forward: the catch-up it decodes (first forward only) and the
    /// token to guess after.
    rows: Vec<TokenId>,
    /// Prompt rows still to forward before it guesses (a long catch-up).
    prompt: Vec<TokenId>,
    done: bool,
}

/// The draft model's guesses for every job, batched: each forward takes one span per job
/// still guessing (several sequences' rows in one `forward_hidden`). Every job's guesses are
/// those it would make alone (decode rows get the same bits in a batch as alone).
pub fn draft_together(model: &dyn CausalLm, jobs: &mut [DraftJob<'_>]) -> Result<()> {
    let started = Instant::now();
    let mut states: Vec<Guessing> = jobs.iter_mut().map(|job| start(model, job)).collect();
    catch_up(model, jobs, &mut states)?;
    let catching_up = started.elapsed().as_secs_f64();
    while states.iter().any(|s| !s.done) {
        guess_once(model, jobs, &mut states)?;
    }
    let guessing = started.elapsed().as_secs_f64() - catching_up;
    jobs.iter_mut().for_each(|j| j.cache.note = Some((j.drafts.len(), guessing, catching_up)));
    Ok(())
}

/// Realigns the job's cache with its history and splits what it must catch up on: the
/// prompt, and long stretches the model did not draft (while prompt lookup guessed or the
/// model rested), as prompt rows (the prefill products, several times cheaper a row); the
/// token or two a verification adds as decode rows, as the target computed them, so that a
/// draft of the same weights guesses exactly what the target would.
fn start(model: &dyn CausalLm, job: &mut DraftJob<'_>) -> Guessing {
    job.drafts.clear();
    let Some((&pending, known)) = job.history.split_last().filter(|_| job.max > 0) else {
        return Guessing { rows: Vec::new(), prompt: Vec::new(), done: true };
    };
    let fresh = job.cache.cached.is_empty();
    let missing = job.cache.realign(model, known);
    let as_prompt = fresh || job.cache.cached.is_empty() || missing.len() > DECODE_CATCH_UP;
    let (prompt, mut rows) = match as_prompt {
        true => (missing.to_vec(), Vec::new()),
        false => (Vec::new(), missing.to_vec()),
    };
    rows.push(pending);
    Guessing { rows, prompt, done: false }
}

/// Forwards every job's prompt-row catch-up, `DRAFT_CHUNK` rows of each per forward.
fn catch_up(model: &dyn CausalLm, jobs: &mut [DraftJob<'_>], states: &mut [Guessing]) -> Result<()> {
    while states.iter().any(|s| !s.prompt.is_empty()) {
        let chunks: Vec<Vec<TokenId>> = states
            .iter_mut()
            .map(|s| {
                let n = s.prompt.len().min(DRAFT_CHUNK);
                s.prompt.drain(..n).collect()
            })
            .collect();
        let spans = jobs
            .iter_mut()
            .zip(&chunks)
            .filter(|(_, c)| !c.is_empty())
            .map(|(j, c)| SeqInput::prompt(c, &mut j.cache.cache))
            .collect();
        forward_spans(model, spans)?;
        jobs.iter_mut().zip(&chunks).for_each(|(j, c)| j.cache.cached.extend_from_slice(c));
    }
    Ok(())
}

/// One forward of every job still guessing, and each one's next guess (or its end).
fn guess_once(model: &dyn CausalLm, jobs: &mut [DraftJob<'_>], states: &mut [Guessing]) -> Result<()> {
    let spans = jobs
        .iter_mut()
        .zip(states.iter())
        .filter(|(_, s)| !s.done)
        .map(|(j, s)| SeqInput::decode(&s.rows, &mut j.cache.cache))
        .collect();
    let (hidden, first) = forward_spans(model, spans)?;
    // Only each span's last row is guessed from (the catch-up rows only fill the cache).
    let guessing: Vec<usize> = (0..states.len()).filter(|&i| !states[i].done).collect();
    let last: Vec<u32> = guessing
        .iter()
        .zip(&first)
        .map(|(&i, f)| (f.expect("a decode span") + states[i].rows.len() - 1) as u32)
        .collect();
    let picked = hidden.index_select(&Tensor::new(last.as_slice(), hidden.device())?, 0)?;
    let logits = model.project_logits(&picked)?.to_vec2::<f32>()?;
    for (&i, logits) in guessing.iter().zip(&logits) {
        let (job, state) = (&mut jobs[i], &mut states[i]);
        job.cache.cached.extend_from_slice(&state.rows);
        let (best, p) = argmax_and_probability(logits);
        if job.min_p.is_some_and(|m| p < m) {
            state.done = true;
            continue;
        }
        job.drafts.push(best);
        state.rows = vec![best];
        state.done = job.drafts.len() >= job.max;
    }
    Ok(())
}

/// The largest logit's token and its softmax probability (the first of equal maxima, as
/// `argmax` takes it).
fn argmax_and_probability(logits: &[f32]) -> (TokenId, f32) {
    let (best, max) =
        logits.iter().enumerate().fold((0, f32::NEG_INFINITY), |(b, m), (i, &v)| if v > m { (i, v) } else { (b, m) });
    let sum: f32 = logits.iter().map(|&v| (v - max).exp()).sum();
    (best as TokenId, 1.0 / sum)
}

/// The draft model's guesses stop at one it gives less than this probability (with prompt
/// lookup and the gate; the model alone guesses every step).
const DRAFT_MIN_P: f32 = 0.5;

/// Catch-ups longer than this go in as prompt rows (see `start`).
const DECODE_CATCH_UP: usize = 4;

/// Prompt rows the draft model forwards at a time while it catches up with a sequence.
const DRAFT_CHUNK: usize = 512;

/// A small model of the same vocabulary guesses greedily: its own cache follows the sequence
/// (realigned to the tokens kept after each verification, the new ones forwarded), then it
/// guesses up to `max` tokens, one draft forward each. Prompt lookup goes first where it
/// matches (free guesses, and on text that repeats its input better ones), and a `DraftGate`
/// measures whether the model's guesses pay for their cost on this sequence, resting the model
/// while they do not.
pub struct DraftModelProposer<'a> {
    model: &'a dyn CausalLm,
    cache: DraftCache,
    /// Prompt lookup (gated itself) tried first, and the gate that rests the model (None: the
    /// model alone).
    lookup: Option<(NgramProposer, DraftGate)>,
    /// What the previous step drafted (the model's part filled in by the draft step).
    last: StepNote,
}

impl<'a> DraftModelProposer<'a> {
    /// Prompt lookup (n-grams of 4 down to 2 tokens: a longer match than plain lookup's
    /// default asks, since the model's guess is the alternative) where it matches, the model
    /// where the gate finds that it pays: what `--draft-model` runs. Lookup has its own gate
    /// (open chat repeats short n-grams whose continuations are mostly rejected).
    pub fn new(model: &'a dyn CausalLm) -> Self {
        let lookup = NgramProposer::new(&SpecConfig::default());
        Self { lookup: Some((lookup, DraftGate::plain_first())), ..Self::model_only(model) }
    }

    /// The model's guesses alone, every step.
    pub fn model_only(model: &'a dyn CausalLm) -> Self {
        Self { model, cache: DraftCache::new(model), lookup: None, last: StepNote::default() }
    }

    /// The previous step's note, with what the draft step recorded when the model guessed.
    fn previous_step(&mut self) -> StepNote {
        match (self.last.tested, self.cache.note.take()) {
            (true, Some((drafts, secs, excluded))) => {
                StepNote { tested: true, drafts, draft_secs: secs, excluded_secs: excluded }
            }
            _ => self.last,
        }
    }
}

impl Proposer for DraftModelProposer<'_> {
    fn propose(&mut self, history: &[TokenId], max: usize) -> Vec<TokenId> {
        match self.plan(history, max) {
            Proposal::Drafts(drafts) => drafts,
            Proposal::Model { max, min_p } => {
                let mut drafts = Vec::new();
                let job = DraftJob { cache: &mut self.cache, history, max, min_p, drafts: &mut drafts };
                if let Err(e) = draft_together(self.model, &mut [job]) {
                    tracing::warn!("draft model: {e}; no drafts this step");
                    drafts.clear();
                }
                drafts
            }
        }
    }

    fn plan(&mut self, history: &[TokenId], max: usize) -> Proposal {
        let note = self.previous_step();
        let model = Proposal::Model { max, min_p: self.lookup.is_some().then_some(DRAFT_MIN_P) };
        let Some((lookup, gate)) = self.lookup.as_mut() else { return model };
        let mode = gate.next(history.len(), note);
        // Lookup's gate weighs the steps lookup drafted; the model's are neither its nor plain.
        let found = lookup.propose_noted(history, max, StepNote { tested: !note.tested && note.drafts > 0, ..note });
        if !found.is_empty() || mode == DraftMode::Lean || max == 0 || history.is_empty() {
            self.last = StepNote { tested: false, drafts: found.len(), ..Default::default() };
            return Proposal::Drafts(found);
        }
        self.last = StepNote { tested: true, ..Default::default() };
        model
    }

    fn draft_cache(&mut self) -> Option<&mut DraftCache> {
        Some(&mut self.cache)
    }
}
