//! The engine step (DESIGN §3a): every active sequence in one forward. Each step retires what
//! ended, admits and preempts by the scheduler's policy, forwards the decode rows and prompt
//! chunks the scheduler picked in one `forward_hidden`, projects logits for the decode rows
//! only, and samples each row with its own sequence's sampler.

use crate::config::{BatchConfig, GraphSettings};
use crate::graph_decode::{use_static_decode, GraphDecoder};
use crate::masks::{self, MaskJob, MaskSchedule, MaskTimes};
use crate::scheduler::{self, Plan, SeqView};
use crate::seq::{SeqRequest, Sequence};
use crate::spec::{DraftModelProposer, NgramProposer, SpecConfig};
use paged_kv::PagedKv;
use candle_core::Tensor;
use ferrolm_kv::{PromptCache, PromptCacheStats, SeqCache};
use ferrolm_models::lora::{Adapters, LoraStack, NONE};
use ferrolm_models::{CausalLm, SeqInput};
use std::collections::VecDeque;
use std::sync::Arc;
use std::panic::AssertUnwindSafe;

#[path = "paged_kv.rs"]
mod paged_kv;

/// The running and waiting sequences of one model, and the step that advances them.
pub struct Batch<'a> {
    model: &'a dyn CausalLm,
    cfg: BatchConfig,
    graph: GraphSettings,
    /// The KV budget in cache tokens.
    kv_budget: usize,
    running: Vec<Sequence<'a>>,
    waiting: VecDeque<Sequence<'a>>,
    /// The captured greedy step, kept across requests (valid while a cache's buffers stay).
    decoder: Option<GraphDecoder>,
    /// Prompt prefixes of finished sequences, reused by new ones (`--prompt-cache-bytes`).
    prompt_cache: Option<PromptCache>,
    /// `--kv-layout paged`: block pools, and the block index that shares prompt prefixes.
    paged: Option<PagedKv>,
    /// Speculative decoding, when on: by prompt lookup, or by `draft` when set.
    spec: Option<SpecConfig>,
    draft: Option<&'a dyn CausalLm>,
    /// The mounted LoRA adapters that requests name (`GenerateParams::adapter`).
    adapters: Option<&'a Adapters>,
    /// When constrained rows' masks are computed (`masks.rs`).
    masks: MaskSchedule,
    next_id: u64,
}

/// What one step did (for metrics).
#[derive(Default)]
pub struct StepReport {
    /// Sequences in the forward and the rows they forwarded.
    pub seqs: usize,
    pub tokens: usize,
    pub preempted: usize,
    /// Sequences that ended this step, with their caches.
    pub retired: Vec<(u64, SeqCache)>,
    /// Draft rows verified in this step.
    pub drafted: usize,
    /// The grammar masks computed ahead of sampling, and their time.
    pub masks: MaskTimes,
}

impl<'a> Batch<'a> {
    pub fn new(model: &'a dyn CausalLm, cfg: BatchConfig, graph: GraphSettings) -> Self {
        let kv_budget = scheduler::kv_budget_tokens(&cfg, model.make_cache().bytes_per_token());
        let prompt_cache = (cfg.prompt_cache_bytes > 0).then(|| PromptCache::new(cfg.prompt_cache_bytes));
        Self {
            model,
            cfg,
            graph,
            kv_budget,
            running: Vec::new(),
            waiting: VecDeque::new(),
            decoder: None,
            prompt_cache,
            paged: None,
            spec: None,
            draft: None,
            adapters: None,
            masks: MaskSchedule::for_device(model.device()),
            next_id: 0,
        }
    }

    /// When constrained rows' masks are computed (default: `MaskSchedule::for_device`).
    pub fn set_mask_schedule(&mut self, schedule: MaskSchedule) {
        self.masks = schedule;
    }

    /// Speculates by prompt lookup for the requests added from now on (unless one opts out).
    pub fn set_speculation(&mut self, spec: Option<SpecConfig>) {
        self.spec = spec.filter(|s| s.max_drafts > 0);
    }

    /// Speculates with `draft`, a small model of the target's vocabulary (checked by the
    /// caller), instead of prompt lookup.
    pub fn set_draft_model(&mut self, draft: &'a dyn CausalLm, spec: SpecConfig) {
        self.draft = Some(draft);
        self.set_speculation(Some(spec));
    }

    /// Resolves the adapters that requests added from now on name in `adapters` (without it a
    /// request naming one fails).
    pub fn set_adapters(&mut self, adapters: &'a Adapters) {
        self.adapters = Some(adapters);
    }

    /// Writes the prompt cache's entries to `disk` too, and finds entries there (also those of
    /// an earlier process); nothing when the prompt cache is off.
    pub fn set_disk_tier(&mut self, disk: ferrolm_kv::DiskTier) {
        if let Some(pc) = self.prompt_cache.take() {
            self.prompt_cache = Some(PromptCache::with_disk(pc.stats().max_bytes, Some(disk)));
        }
    }

    /// Holds the keys and values of sequences added from now on as `layout` says. Paged with
    /// the prompt cache on, prefixes are kept as shared blocks (the copying prompt cache keeps
    /// only its disk tier). Errors on a device the layout does not run on.
    pub fn set_kv_layout(&mut self, layout: crate::config::KvLayout) -> Result<(), String> {
        self.paged = match layout {
            crate::config::KvLayout::Contiguous => None,
            crate::config::KvLayout::Paged { block_tokens } => Some(PagedKv::new(self.model, block_tokens, self.cfg.prompt_cache_bytes)?),
        };
        if self.paged.as_ref().is_some_and(PagedKv::shares_prefixes) {
            self.prompt_cache = self.prompt_cache.take().map(PromptCache::disk_only);
        }
        Ok(())
    }

    /// Blocks the paged layout's pools have in use over all layers, and their bytes (None when
    /// contiguous).
    pub fn paged_usage(&self) -> Option<(usize, usize)> {
        self.paged.as_ref().map(PagedKv::usage)
    }

    /// Bytes of keys and values held now: the paged pools' referenced blocks (shared ones
    /// once), or the running and waiting sequences' buffers plus the prompt cache's entries.
    pub fn kv_bytes(&self) -> usize {
        if let Some((_, bytes)) = self.paged_usage() {
            return bytes;
        }
        let seqs: usize = self.running.iter().chain(&self.waiting).map(|s| s.cache.bytes()).sum();
        seqs + self.prompt_cache.as_ref().map_or(0, |pc| pc.stats().bytes)
    }

    /// A fresh cache for a sequence, in the configured layout.
    fn fresh_cache(&self) -> SeqCache {
        fresh_in(self.model, self.paged.as_ref())
    }

    /// Waits for the prompt cache's queued disk writes.
    pub fn flush_prompt_cache(&mut self) {
        if let Some(pc) = self.prompt_cache.as_mut() {
            pc.flush();
        }
    }

    /// The prompt cache's counters (None when it is off).
    pub fn prompt_cache_stats(&self) -> Option<PromptCacheStats> {
        if let Some(stats) = self.paged.as_ref().and_then(|p| p.stats(self.prompt_cache.as_ref())) {
            return Some(stats);
        }
        self.prompt_cache.as_ref().map(PromptCache::stats)
    }

    /// The cache tokens the running sequences may hold together.
    pub fn kv_budget_tokens(&self) -> usize {
        self.kv_budget
    }

    /// Queues a request over `cache` (fresh, or holding a prefix of its prompt); returns its id.
    pub fn add(&mut self, req: SeqRequest<'a>, cache: SeqCache) -> u64 {
        self.add_group(vec![req], cache)
    }

    /// Queues a request that continues a checkpointed generation: `emitted` (the tokens it
    /// produced before) are delivered again and then forwarded with the prompt (`Sequence::resume`).
    pub fn add_resumed(&mut self, req: SeqRequest<'a>, cache: SeqCache, emitted: &[ferrolm_core::TokenId]) -> u64 {
        let mut seq = self.sequence(req, cache);
        seq.resume(emitted);
        let id = seq.id;
        self.waiting.push_back(seq);
        id
    }

    /// Queues requests of one prompt (OpenAI's `n` choices): the first prefills it, the others
    /// start from a copy of its cache. Returns the first one's id (the others follow it).
    pub fn add_group(&mut self, reqs: Vec<SeqRequest<'a>>, cache: SeqCache) -> u64 {
        let mut reqs = reqs.into_iter();
        let mut leader = self.sequence(reqs.next().expect("at least one request"), cache);
        for req in reqs {
            let mut follower = self.sequence(req, self.fresh_cache());
            if follower.tokens != leader.tokens {
                follower.fail("the choices of one request must share its prompt".into());
            }
            leader.followers.push(follower);
        }
        let id = leader.id;
        self.waiting.push_back(leader);
        id
    }

    fn sequence(&mut self, req: SeqRequest<'a>, cache: SeqCache) -> Sequence<'a> {
        let id = self.next_id;
        self.next_id += 1;
        let lora = self.resolve_adapter(req.params.adapter.as_deref());
        // Cached prefixes (and shared paged blocks) hold the base model's keys and values: a
        // sequence with adapters computes its whole prompt in a fresh cache of the configured
        // layout (and its rows are not kept or shared, `Sequence::prompt_rows`).
        let cache = match lora {
            Ok(None) => self.cached_prefix(&req.prompt, cache),
            _ if cache.offset() == 0 => self.fresh_cache(),
            _ => cache,
        };
        let mut seq = Sequence::new(id, req, cache);
        match lora {
            Ok(lora) => seq.set_lora(lora),
            Err(e) => seq.fail(e),
        }
        if let Some(spec) = &self.spec {
            let proposer: Box<dyn crate::spec::Proposer + 'a> = match self.draft {
                Some(model) => Box::new(DraftModelProposer::new(model)),
                None => Box::new(NgramProposer::sized(spec)),
            };
            seq.set_proposer(proposer, spec.max_drafts);
        }
        if seq.max_kv_tokens() > self.kv_budget {
            seq.fail(format!("the request needs {} cache tokens, more than the KV budget of {}", seq.max_kv_tokens(), self.kv_budget));
        }
        seq
    }

    /// A request's adapters (`GenerateParams::adapter`) among the mounted ones; an unknown name
    /// (unmounted since the request was checked) is an error for that request.
    fn resolve_adapter(&self, spec: Option<&str>) -> Result<Option<Arc<LoraStack>>, String> {
        match (spec, self.adapters) {
            (None, _) | (Some(NONE), _) => Ok(None),
            (Some(spec), Some(adapters)) => adapters.resolve(spec),
            (Some(spec), None) => Err(format!("unknown adapter {spec:?}: this engine has no adapters")),
        }
    }

    /// `cache`, or when it is empty a copy of the longest prefix of `prompt` in the prompt cache.
    fn cached_prefix(&mut self, prompt: &[u32], cache: SeqCache) -> SeqCache {
        if cache.offset() != 0 {
            return cache;
        }
        if let Some(paged) = self.paged.as_mut().filter(|p| p.shares_prefixes()) {
            return paged.take(self.model, prompt, self.prompt_cache.as_mut()).unwrap_or_else(|| paged.fresh(self.model));
        }
        let (model, paged) = (self.model, self.paged.as_ref());
        let fresh = || paged.map_or_else(|| model.make_cache(), |p| p.fresh(model));
        let Some(pc) = self.prompt_cache.as_mut() else {
            return if self.paged.is_some() { fresh() } else { cache };
        };
        match pc.take(prompt, &fresh) {
            Ok(Some(hit)) => hit.cache,
            Ok(None) => fresh(),
            Err(e) => {
                tracing::warn!("prompt cache: a hit could not be copied ({e}); computing the prompt");
                self.fresh_cache()
            }
        }
    }

    pub fn is_idle(&self) -> bool {
        self.running.is_empty() && self.waiting.is_empty()
    }

    pub fn running(&self) -> usize {
        self.running.len()
    }

    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// One engine step. `interrupted` tells a long captured decode (one sequence alone) that
    /// new work waits to be admitted.
    pub fn step(&mut self, interrupted: &dyn Fn() -> bool) -> StepReport {
        let mut report = StepReport::default();
        self.retire(&mut report);
        self.admit();
        self.fork_ready();
        report.preempted = self.preempt();
        self.running.iter_mut().for_each(Sequence::propose);
        self.draft_together();
        if !self.captured_greedy(interrupted) {
            let plan = scheduler::plan(&self.cfg, &self.views());
            (report.seqs, report.tokens) = (plan.decode.len() + plan.prompt.len(), plan.tokens());
            report.drafted = plan.tokens() - plan.decode.len() - plan.prompt.iter().map(|p| p.1).sum::<usize>();
            report.masks = self.run(&plan);
        }
        if let Some(paged) = self.paged.as_mut() {
            paged.register_running(&self.running);
        }
        self.retire(&mut report);
        report
    }

    /// The draft model's guesses for every sequence that asked for them this step, batched:
    /// one draft forward per guess over all of them (`spec::draft_together`).
    fn draft_together(&mut self) {
        let Some(model) = self.draft else { return };
        let mut jobs: Vec<_> = self.running.iter_mut().filter_map(Sequence::draft_job).collect();
        if jobs.is_empty() {
            return;
        }
        if let Err(e) = crate::spec::draft_together(model, &mut jobs) {
            tracing::warn!("draft model: {e}; no drafts this step");
            jobs.iter_mut().for_each(|j| j.drafts.clear());
        }
    }

    /// Writes every durable sequence's emitted tokens to its log now (graceful shutdown).
    pub fn checkpoint_all(&mut self) {
        self.running.iter_mut().chain(self.waiting.iter_mut()).for_each(Sequence::checkpoint);
    }

    /// Ends every sequence with `message` (after a step that panicked outside any sequence's
    /// forward, when nothing in the batch can be trusted).
    pub fn fail_all(&mut self, message: &str) {
        for seq in self.running.drain(..).chain(self.waiting.drain(..)) {
            let mut seq = seq;
            seq.fail(message.to_string());
            seq.retire();
        }
    }

    fn views(&self) -> Vec<SeqView> {
        self.running.iter().map(|s| s.view()).collect()
    }

    /// Sends the end of every sequence that ended (or was cancelled) and drops it.
    fn retire(&mut self, report: &mut StepReport) {
        for seq in self.running.iter_mut().chain(self.waiting.iter_mut()) {
            seq.check_cancelled();
        }
        let (done, running): (Vec<_>, Vec<_>) = self.running.drain(..).partition(|s| s.is_done());
        self.running = running;
        let (done_waiting, waiting): (Vec<_>, Vec<_>) = self.waiting.drain(..).partition(|s| s.is_done());
        self.waiting = waiting.into();
        for seq in done.into_iter().chain(done_waiting) {
            let (id, prompt_rows) = (seq.id, seq.prompt_rows());
            if let Some(paged) = self.paged.as_mut() {
                paged.forget(id);
            }
            let cache = seq.retire();
            report.retired.push((id, self.keep_prompt(prompt_rows, cache)));
        }
    }

    /// Puts the keys and values of a finished sequence's prompt rows into the prompt cache (they
    /// continue bit for bit as an uncached prompt would); returns the cache when it is not kept.
    fn keep_prompt(&mut self, prompt_rows: Option<Vec<u32>>, mut cache: SeqCache) -> SeqCache {
        let sharing = self.paged.as_ref().is_some_and(PagedKv::shares_prefixes);
        let Some(tokens) = prompt_rows.filter(|_| sharing || self.prompt_cache.is_some()) else { return cache };
        let extra = cache.offset().saturating_sub(tokens.len());
        if tokens.is_empty() || cache.offset() < tokens.len() {
            return cache;
        }
        // A sliding window that moved on past the prompt trims back only part way: the block
        // index still takes the blocks and gives the disk tier its copy of the prompt rows.
        let trimmed = cache.trim(extra) == extra;
        match (self.paged.as_mut().filter(|_| sharing), self.prompt_cache.as_mut()) {
            (Some(paged), disk) => paged.keep(tokens, cache, disk, self.model),
            (None, Some(pc)) if trimmed => pc.put(tokens, cache),
            (None, Some(_)) => return cache,
            (None, None) => unreachable!("checked above"),
        }
        self.fresh_cache()
    }

    fn admit(&mut self) {
        let waiting: Vec<SeqView> = self.waiting.iter().map(|s| s.view()).collect();
        let n = scheduler::admit(&self.cfg, self.kv_budget, &self.views(), &waiting);
        for mut seq in self.waiting.drain(..n) {
            seq.start_clock();
            self.running.push(seq);
        }
    }

    /// Starts the followers of every sequence whose prompt is in (they decode from this step).
    fn fork_ready(&mut self) {
        let mut started = Vec::new();
        for seq in self.running.iter_mut().filter(|s| s.ready_to_fork()) {
            for follower in std::mem::take(&mut seq.followers) {
                started.push(seq.fork(follower, fresh_in(self.model, self.paged.as_ref())));
            }
        }
        self.running.extend(started);
    }

    /// Preempts the newest sequences while the running ones outgrow the budget: their caches
    /// are dropped and they wait at the head of the queue, to be recomputed.
    fn preempt(&mut self) -> usize {
        let victims = scheduler::preempt(self.kv_budget, &self.views());
        for &i in &victims {
            let mut seq = self.running.remove(i);
            seq.preempt(self.fresh_cache());
            self.waiting.push_front(seq);
        }
        victims.len()
    }

    /// Runs one planned step; a failure (error or panic) ends the planned sequences with it,
    /// and only them. Returns the time its grammar masks took.
    fn run(&mut self, plan: &Plan) -> MaskTimes {
        if plan.is_empty() {
            return MaskTimes::default();
        }
        let outcome = std::panic::catch_unwind(AssertUnwindSafe(|| self.forward_and_sample(plan)));
        let message = match outcome {
            Ok(Ok(times)) => return times,
            Ok(Err(e)) => e.to_string(),
            Err(panic) => crate::service::panic_message(panic),
        };
        for i in plan.decode.iter().chain(&plan.prompt).map(|p| p.0) {
            self.running[i].fail(message.clone());
        }
        MaskTimes::default()
    }

    /// One `forward_hidden` over the plan's rows (`spans::forward_spans`), logits for the
    /// decode rows, each sequence's sampled (and its drafts verified) by itself.
    fn forward_and_sample(&mut self, plan: &Plan) -> candle_core::Result<MaskTimes> {
        // Per running sequence: None (not in this step) or its rows.
        let mut rows: Vec<Option<Rows>> = vec![None; self.running.len()];
        plan.decode.iter().for_each(|&(i, n)| rows[i] = Some(Rows::Decode(n)));
        plan.prompt.iter().for_each(|&(i, n)| rows[i] = Some(Rows::Prompt(n)));
        let (model, schedule) = (self.model, self.masks);
        let (hidden, first, times) = {
            // Constrained decode rows' first masks, computed around the forward (`masks.rs`).
            let mut jobs = Vec::new();
            let (index, spans): (Vec<usize>, Vec<_>) = self.running.iter_mut().zip(&rows).enumerate()
                .filter_map(|(i, (seq, r))| r.map(|r| (i, seq.input_with_mask(r, &mut jobs)))).unzip();
            let cpu = model.device().is_cpu();
            let (forwarded, times) = masks::with_forward(schedule, cpu, &mut jobs, || crate::spans::forward_spans(model, spans));
            let (hidden, first) = forwarded?;
            let mut by_seq = vec![None; self.running.len()];
            index.into_iter().zip(first).for_each(|(i, f)| by_seq[i] = f);
            (hidden, by_seq, times)
        };
        if plan.decode.is_empty() {
            return Ok(times);
        }
        let logits = self.model.project_logits(&hidden)?;
        let argmax = self.batch_argmax(&logits, plan)?;
        for &(i, n) in &plan.decode {
            let (seq, first) = (&mut self.running[i], first[i].expect("a decode span"));
            match &argmax {
                Some(tokens) if seq.samples_plain_argmax() => seq.deliver_argmax(tokens[first + n - 1]),
                _ => {
                    if let Err(e) = seq.verify(&logits, first) {
                        seq.fail(e.to_string());
                    }
                }
            }
        }
        Ok(times)
    }

    /// On a device, when two or more sequences take a plain argmax: every decode row's argmax
    /// in one launch and one read-back (else each sequence samples its own row: launches and a
    /// read-back per sequence).
    fn batch_argmax(&self, logits: &Tensor, plan: &Plan) -> candle_core::Result<Option<Vec<u32>>> {
        if logits.device().is_cpu() {
            return Ok(None);
        }
        let plain = plan.decode.iter().filter(|&&(i, _)| self.running[i].samples_plain_argmax()).count();
        if plain < 2 {
            return Ok(None);
        }
        ferrolm_backend::ops::argmax_rows(logits)?.map(|t| t.to_vec1::<u32>()).transpose()
    }

    /// One plain greedy sequence alone, already decoding, on a device with a captured step:
    /// decode through the step graph (`graph_decode`) until it ends or new work waits. Returns
    /// whether it ran.
    fn captured_greedy(&mut self, interrupted: &dyn Fn() -> bool) -> bool {
        let [seq] = &mut self.running[..] else { return false };
        // One pending token: a resumed sequence first forwards its saved tokens as one decode row.
        let one_pending = matches!(seq.want(), scheduler::Want::Decode { pending: 1, .. });
        let decoding = one_pending && seq.generated() > 0 && !seq.speculates() && !seq.is_constrained() && seq.lora().is_none();
        if !self.waiting.is_empty() || !decoding || !seq.is_plain_greedy() || !use_static_decode(self.model, &self.graph) {
            return false;
        }
        if self.decoder.is_none() {
            match GraphDecoder::new(self.model, self.graph) {
                Ok(Some(d)) => self.decoder = Some(d),
                _ => return false,
            }
        }
        let decoder = self.decoder.as_mut().expect("made above");
        let mut cache = std::mem::replace(&mut seq.cache, SeqCache::new(Vec::new()));
        let (first, n) = (*seq.tokens.last().expect("a decoding sequence has tokens"), seq.remaining());
        let ran = decoder.run(self.model, &mut cache, first, n, &mut |t| {
            seq.deliver(t, None);
            // A span fill would append ends the captured run: the engine step verifies it.
            !seq.is_done() && !interrupted() && !seq.fill_ready()
        });
        seq.cache = cache;
        match ran {
            Ok(Some(_)) => true,
            Ok(None) => false,
            Err(e) => {
                seq.fail(e.to_string());
                true
            }
        }
    }
}

/// A fresh cache of `model`, paged when `paged` is set.
fn fresh_in(model: &dyn CausalLm, paged: Option<&PagedKv>) -> SeqCache {
    match paged {
        Some(p) => p.fresh(model),
        None => model.make_cache(),
    }
}

/// A sequence's rows in a step.
#[derive(Clone, Copy)]
enum Rows {
    Prompt(usize),
    /// The pending token and drafts: 1 + drafts.
    Decode(usize),
}

impl<'a> Sequence<'a> {
    /// This sequence's rows for the next forward.
    fn input(&mut self, rows: Rows) -> SeqInput<'_> {
        match rows {
            Rows::Prompt(n) => {
                let (start, lora) = (self.cache.offset(), self.lora().cloned());
                SeqInput::prompt(&self.tokens[start..start + n], &mut self.cache).with_lora(lora)
            }
            Rows::Decode(n) => self.decode_input(n),
        }
    }

    /// [`Sequence::input`], pushing the job that computes a constrained decode row's first
    /// mask onto `jobs`.
    fn input_with_mask<'s>(&'s mut self, rows: Rows, jobs: &mut Vec<MaskJob<'s>>) -> SeqInput<'s> {
        match rows {
            Rows::Prompt(_) => self.input(rows),
            Rows::Decode(n) => {
                let (input, job) = self.decode_parts(n);
                jobs.extend(job);
                input
            }
        }
    }
}
