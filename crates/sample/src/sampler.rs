//! The per-request sampler: processors, (mask), log-softmax, filters, categorical draw.
//!
//! The engine calls [`Sampler::sample`] once per step with that step's logits and the history
//! (prompt + generated ids). CPU logits are read in place (no copy of the vocabulary); other
//! devices run the chain on the device and bring back only the token (see `device.rs`).

use crate::categorical::{self, inv_temperature};
use crate::device;
use crate::dist::Dist;
use crate::filters::{Filters, Kept, Xtc};
use crate::logprobs;
use crate::processors::Processors;
use crate::rng::{fresh_seed, StepRng};
use crate::select::Cand;
use crate::validate::validate_for_vocab;
use crate::view::View;
use candle_core::{DType, Device, Storage, Tensor};
use ferrolm_core::{Error, Result, SamplingParams, TokenLogprobs};

/// Where the chain runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Path {
    /// On the host for CPU tensors, on the device otherwise.
    #[default]
    Auto,
    /// Always copy the logits to the host (reference path).
    Host,
    /// The device path even for CPU tensors (to test it without a GPU).
    Device,
}

/// What the sampler needs to know about the model.
#[derive(Clone, Debug, Default)]
pub struct SamplerConfig {
    /// Width of the logits (mlx checks top_k against it), not the tokenizer's vocabulary.
    pub vocab_size: usize,
    /// Ids XTC never removes; mlx_lm.server passes `tokenizer.encode("\n") + eos_token_ids`.
    pub xtc_special_tokens: Vec<u32>,
    pub path: Path,
}

/// A grammar mask, applied after the processors and before the log-softmax.
#[derive(Clone, Copy, Debug)]
pub enum Mask<'a> {
    /// Bit i of word i / 32 set: token i allowed (llguidance's layout). Host-side bitset.
    Allowed(&'a [u32]),
    /// Added to the logits: 0 where allowed, -inf where banned. Same device and length.
    Additive(&'a Tensor),
}

/// A step's token, possibly still on the device (see [`Sampler::sample_deferred`]).
#[derive(Clone, Debug)]
pub enum Draw {
    Ready(Sampled),
    /// A `[1]` u32 tensor on the logits' device; reading it waits for the device.
    OnDevice(Tensor),
}

impl Draw {
    /// The token as a `[1]` u32 tensor on `device` (no read-back when it is already there).
    pub fn token_tensor(&self, device: &Device) -> Result<Tensor> {
        match self {
            Draw::OnDevice(t) => Ok(t.clone()),
            Draw::Ready(s) => Tensor::new(&[s.token], device).map_err(Error::internal),
        }
    }

    /// Reads the token (and its logprobs, when they were asked for).
    pub fn resolve(self) -> Result<Sampled> {
        match self {
            Draw::Ready(s) => Ok(s),
            Draw::OnDevice(t) => {
                let token = t.flatten_all().and_then(|t| t.get(0)).and_then(|t| t.to_scalar::<u32>());
                Ok(Sampled { token: token.map_err(Error::internal)?, logprobs: None })
            }
        }
    }
}

/// One step's result.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampled {
    pub token: u32,
    /// Present when the request asked for logprobs.
    pub logprobs: Option<TokenLogprobs>,
}

#[derive(Clone, Debug)]
pub struct Sampler {
    pub(crate) temperature: f32,
    pub(crate) filters: Filters,
    pub(crate) processors: Processors,
    pub(crate) logprobs: Option<usize>,
    seed: u64,
    step: u64,
    vocab: usize,
    path: Path,
    pub(crate) host_fallbacks: u64,
}

impl Sampler {
    /// Validates `params` (mlx's messages) and builds the sampler.
    pub fn new(params: &SamplingParams, cfg: &SamplerConfig) -> std::result::Result<Self, String> {
        validate_for_vocab(params, cfg.vocab_size)?;
        let mut special = cfg.xtc_special_tokens.clone();
        special.sort_unstable();
        special.dedup();
        let p = params;
        let filters = Filters {
            top_p: (p.top_p > 0.0 && p.top_p < 1.0).then_some(p.top_p),
            min_p: (p.min_p != 0.0).then_some((p.min_p, p.min_tokens_to_keep)),
            xtc: (p.xtc_probability > 0.0).then_some(Xtc {
                probability: p.xtc_probability,
                threshold: p.xtc_threshold,
                special,
            }),
            top_k: (p.top_k > 0).then_some(p.top_k),
        };
        Ok(Sampler {
            temperature: p.temperature,
            filters,
            processors: Processors::new(p),
            logprobs: p.logprobs,
            seed: p.seed.unwrap_or_else(fresh_seed),
            step: 0,
            vocab: cfg.vocab_size,
            path: cfg.path,
            host_fallbacks: 0,
        })
    }

    /// The seed in use (drawn fresh when the request gave none).
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Index of the next step; each step draws from its own (seed, step) stream.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// Repositions the stream, e.g. after a speculative rollback or when resuming a checkpoint.
    pub fn set_step(&mut self, step: u64) {
        self.step = step;
    }

    /// Counts a step whose token the engine took from an argmax over the whole batch (a plain
    /// greedy step needs nothing else from the sampler; the count keeps the step numbering
    /// that seeded draws and resumption use).
    pub fn skip_step(&mut self) {
        self.step += 1;
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// Plain argmax: temperature 0, no logit processors and no logprobs. Such a step can run
    /// entirely on the device (the engine's captured decode does its own argmax).
    pub fn is_plain_greedy(&self) -> bool {
        self.is_greedy() && self.processors.is_empty() && self.logprobs.is_none()
    }

    /// Whether `sample` reads the history (penalties); the engine may pass `&[]` otherwise.
    pub fn needs_history(&self) -> bool {
        self.processors.needs_history()
    }

    /// Steps where the device path had to copy the logits to the host (see `device.rs`).
    pub fn host_fallbacks(&self) -> u64 {
        self.host_fallbacks
    }

    /// Samples one token from logits `[vocab]` or `[1, vocab]` (f32, bf16 or f16, any device).
    pub fn sample(&mut self, logits: &Tensor, history: &[u32]) -> Result<Sampled> {
        self.sample_masked(logits, history, None)
    }

    pub fn sample_masked(&mut self, logits: &Tensor, history: &[u32], mask: Option<Mask>) -> Result<Sampled> {
        let logits = logits.flatten_all().map_err(Error::internal)?;
        let step = self.next_step();
        let on_cpu = matches!(logits.device(), Device::Cpu);
        let host = match self.path {
            Path::Auto => on_cpu,
            Path::Host => true,
            Path::Device => false,
        };
        if host {
            self.sample_tensor_on_host(&logits, history, mask, step)
        } else {
            device::sample(self, &logits, history, mask, step)
        }
    }

    /// Like [`Sampler::sample_masked`], but a greedy step with no processors, mask or logprobs on a
    /// non-CPU device is not read back: the token stays a `[1]` u32 tensor on the device, so the
    /// engine can feed it to the next forward before reading it (DESIGN §3, pipelined decode).
    pub fn sample_deferred(&mut self, logits: &Tensor, history: &[u32], mask: Option<Mask>) -> Result<Draw> {
        let on_device = !matches!(logits.device(), Device::Cpu) && self.path != Path::Host;
        if on_device && self.is_greedy() && self.processors.is_empty() && mask.is_none() && self.logprobs.is_none() {
            self.next_step();
            let flat = logits.flatten_all().map_err(Error::internal)?;
            self.check_width(flat.dim(0).map_err(Error::internal)?)?;
            let token = device::argmax(&flat).map_err(Error::internal)?;
            return Ok(Draw::OnDevice(token));
        }
        self.sample_masked(logits, history, mask).map(Draw::Ready)
    }

    /// Samples from host logits (the reference path; also what CPU tensors use, in place).
    pub fn sample_slice(&mut self, logits: &[f32], history: &[u32], allowed: Option<&[u32]>) -> Result<Sampled> {
        let step = self.next_step();
        let mask = allowed.map(HostMask::Allowed).unwrap_or(HostMask::None);
        self.run_host(logits, history, mask, true, step)
    }

    fn next_step(&mut self) -> u64 {
        let s = self.step;
        self.step += 1;
        s
    }

    fn sample_tensor_on_host(
        &self,
        logits: &Tensor,
        history: &[u32],
        mask: Option<Mask>,
        step: u64,
    ) -> Result<Sampled> {
        let add;
        let host_mask = match mask {
            None => HostMask::None,
            Some(Mask::Allowed(bits)) => HostMask::Allowed(bits),
            Some(Mask::Additive(t)) => {
                add = to_host_vec(t)?;
                HostMask::Additive(&add)
            }
        };
        with_host_slice(logits, |x| self.run_host(x, history, host_mask, true, step))?
    }

    /// The whole chain on host logits. `process` = false when the processors already ran (the
    /// device path's fallback).
    pub(crate) fn run_host(
        &self,
        base: &[f32],
        history: &[u32],
        mask: HostMask,
        process: bool,
        step: u64,
    ) -> Result<Sampled> {
        let mut d = self.prepare(base, history, mask, process)?;
        let pending = self.logprobs.map(|n| logprobs::capture(&mut d, n));
        let chosen = if self.is_greedy() {
            let id = d.argmax();
            Cand::new(d.view.get(id as usize), id)
        } else {
            let mut rng = StepRng::for_step(self.seed, step);
            let kept = self.filters.apply(&mut d, &mut rng);
            self.draw(&mut d, kept, rng.uniform())
        };
        Ok(Sampled { token: chosen.id, logprobs: pending.map(|p| p.finish(chosen.id, chosen.x)) })
    }

    /// Processors and mask over a borrowed view of the logits.
    fn prepare<'a>(&self, base: &'a [f32], history: &[u32], mask: HostMask, process: bool) -> Result<Dist<'a>> {
        self.check_width(base.len())?;
        let mut view = View::new(base);
        if process && !self.processors.is_empty() {
            let read = |id: u32| base[id as usize];
            view.set_many(&self.processors.updates(history, base.len(), &read));
        }
        match mask {
            HostMask::None => {}
            HostMask::Allowed(bits) => view.apply_allowed(bits),
            HostMask::Additive(m) if m.len() == base.len() => view.apply_additive(m),
            HostMask::Additive(_) => return Err(Error::internal("mask and logits differ in length")),
        }
        Ok(Dist::new(view))
    }

    /// What step `step` would draw from, without drawing (tests, debugging): the reported
    /// logprobs of every token and the final probability of every kept token.
    pub fn explain(&self, logits: &[f32], history: &[u32], step: u64) -> Result<Explained> {
        let mut d = self.prepare(logits, history, HostMask::None, true)?;
        let lse = d.log_normalizer();
        let logprobs = (0..d.view.len()).map(|i| d.view.get(i) - lse).collect();
        if self.is_greedy() {
            return Ok(Explained { logprobs, kept: vec![(d.argmax(), 1.0)] });
        }
        let mut rng = StepRng::for_step(self.seed, step);
        let inv_t = inv_temperature(self.temperature);
        let list = match self.filters.apply(&mut d, &mut rng) {
            Kept::List(l) => l,
            Kept::Floor(f) => {
                (0..d.view.len()).map(|i| Cand::new(d.view.get(i), i as u32)).filter(|c| c.x >= f).collect()
            }
        };
        let shift = list.iter().map(|c| c.x).fold(f32::NEG_INFINITY, f32::max);
        let w: Vec<f64> = list.iter().map(|c| crate::fastmath::weight(c.x, shift, inv_t) as f64).collect();
        let total: f64 = w.iter().sum();
        let mut kept: Vec<(u32, f64)> =
            list.iter().zip(&w).filter(|(c, _)| c.x > f32::NEG_INFINITY).map(|(c, &w)| (c.id, w / total)).collect();
        kept.sort_unstable_by_key(|k| k.0);
        Ok(Explained { logprobs, kept })
    }

    fn draw(&self, d: &mut Dist, kept: Kept, u: f64) -> Cand {
        let inv_t = inv_temperature(self.temperature);
        let picked = match kept {
            Kept::List(mut l) => {
                // One canonical order, so the host and device paths pick the same token.
                l.sort_unstable_by_key(|c| c.id);
                categorical::from_list(&l, inv_t, u)
            }
            Kept::Floor(f) => categorical::from_floor(d, f, inv_t, u),
        };
        // Only when every logit is -inf or NaN: fall back to the argmax, as greedy would.
        picked.unwrap_or_else(|| {
            let id = d.argmax();
            Cand::new(d.view.get(id as usize), id)
        })
    }

    /// The logits must be as wide as the vocabulary the parameters were checked against.
    pub(crate) fn check_width(&self, width: usize) -> Result<()> {
        if self.vocab != 0 && width != self.vocab {
            return Err(Error::internal(format!(
                "logits have {width} entries, the sampler was built for {}",
                self.vocab
            )));
        }
        if width == 0 {
            return Err(Error::internal("empty logits"));
        }
        if let Some(k) = self.filters.top_k.filter(|&k| !self.is_greedy() && k >= width) {
            return Err(Error::InvalidRequest(format!(
                "`top_k` has to be an integer in the (0, {width}) interval, but is {k}."
            )));
        }
        Ok(())
    }
}

/// See [`Sampler::explain`].
#[derive(Clone, Debug, PartialEq)]
pub struct Explained {
    /// The reported distribution: processed logits minus their logsumexp.
    pub logprobs: Vec<f32>,
    /// Tokens the filters kept (finite logits, as mlx's -inf masking tells them), by id, with
    /// their probabilities (the argmax alone when greedy).
    pub kept: Vec<(u32, f64)>,
}

/// A mask already on the host.
#[derive(Clone, Copy)]
pub(crate) enum HostMask<'a> {
    None,
    Allowed(&'a [u32]),
    Additive(&'a [f32]),
}

/// Runs `f` on the f32 contents of a 1-D tensor: in place for contiguous CPU f32 tensors,
/// otherwise after a conversion or copy.
pub(crate) fn with_host_slice<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
    let t = if t.dtype() == DType::F32 { t.clone() } else { t.to_dtype(DType::F32).map_err(Error::internal)? };
    {
        let (storage, layout) = t.storage_and_layout();
        if let (Storage::Cpu(cpu), Some((a, b))) = (&*storage, layout.contiguous_offsets()) {
            let s = cpu.as_slice::<f32>().map_err(Error::internal)?;
            return Ok(f(&s[a..b]));
        }
    }
    Ok(f(&to_host_vec(&t)?))
}

pub(crate) fn to_host_vec(t: &Tensor) -> Result<Vec<f32>> {
    t.flatten_all().and_then(|t| t.to_dtype(DType::F32)).and_then(|t| t.to_vec1::<f32>()).map_err(Error::internal)
}
