use super::{BatchRows, FusedLinear};
use crate::lora::{self, Target};
use crate::RowKind;
use candle_core::{Result, Tensor};
use ferrolm_backend::attention::{attend_decode_batch, attend_decode_batch_paged, attend_paged_quant, attend_prompt_quant, DecodeQuery, Positions};
use ferrolm_backend::paged::BlockTable;
use ferrolm_backend::attention_device::{append_and_attend, append_and_attend_batch, has_kernels, StaticStep};
use ferrolm_backend::norm::RmsNorm;
use ferrolm_backend::{AttentionParams, Linear, Rope, RowInput};
use ferrolm_kv::KvCache;
use std::sync::Arc;

pub struct SelfAttentionConfig {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub params: AttentionParams,
}

/// Multi-head self-attention with grouped KV heads, RoPE, optional per-head q/k norms (Gemma 3).
pub struct SelfAttention {
    /// Q, K and V projections (stacked where the backend can).
    pub qkv: FusedLinear,
    pub o: Linear,
    pub q_norm: Option<RmsNorm>,
    pub k_norm: Option<RmsNorm>,
    pub rope: Arc<Rope>,
    pub cfg: SelfAttentionConfig,
}

/// The rows left after the batched decode rows: spans from `done` on, whose q, k and v (split into
/// heads) start at row `first_row` of the batch.
struct Rest<'a> {
    done: usize,
    first_row: usize,
    q: &'a Tensor,
    k: &'a Tensor,
    v: &'a Tensor,
}

impl SelfAttention {
    /// x `[tokens, hidden]` holding every sequence's rows (`rows`); `caches[i]` is this layer's
    /// cache of sequence i. Returns `[tokens, hidden]`.
    pub fn forward(
        &self,
        x: &Tensor,
        rows: &BatchRows,
        caches: &mut [&mut dyn KvCache],
    ) -> Result<Tensor> {
        self.forward_adapted(x, rows, caches, None)
    }

    /// [`SelfAttention::forward`] with each sequence's LoRA adapters (`rows.lora`) added to the
    /// q/k/v/o products of decoder layer `layer` (None: no adapters).
    pub fn forward_adapted(
        &self,
        x: &Tensor,
        rows: &BatchRows,
        caches: &mut [&mut dyn KvCache],
        layer: Option<usize>,
    ) -> Result<Tensor> {
        let mut qkv = self.qkv.forward_rows(x, rows.decode_rows)?;
        if let Some(i) = layer {
            for (y, target) in qkv.iter_mut().zip([Target::Q, Target::K, Target::V]) {
                *y = lora::apply(rows, i, target, x, y.clone())?;
            }
        }
        let tokens = x.dims()[0];
        // The leading one-token decode rows in one launch where the device has the kernel,
        // read in place from the products' outputs when no q/k norm comes between.
        let (mut outs, done) = match self.q_norm.is_none() {
            true => match self.decode_batch_on_device(&qkv[0], &qkv[1], &qkv[2], rows, caches)? {
                Some((out, n)) => (vec![out], n),
                None => (Vec::new(), 0),
            },
            false => (Vec::new(), 0),
        };
        // The other rows split into heads (copies), normed where the model norms q and k.
        let start = rows.spans.get(done).map_or(tokens, |s| s.row);
        if start == tokens {
            return self.output(outs, rows, layer);
        }
        let rest = qkv.iter().map(|t| t.narrow(0, start, tokens - start)).collect::<Result<Vec<_>>>()?;
        let (q, k, v) = self.heads(rest, tokens - start)?;
        let (q, k) = match (&self.q_norm, &self.k_norm) {
            (Some(qn), Some(kn)) => (qn.forward(&q)?, kn.forward(&k)?),
            _ => (q, k),
        };
        if done == 0 && self.q_norm.is_some() {
            let flat = |t: &Tensor| t.flatten_from(1);
            if let Some((out, n)) = self.decode_batch_on_device(&flat(&q)?, &flat(&k)?, &flat(&v)?, rows, caches)? {
                outs.push(out);
                let rest = Rest { done: n, first_row: start, q: &q, k: &k, v: &v };
                return self.forward_rest(outs, rest, rows, caches, layer);
            }
        }
        let rest = Rest { done, first_row: start, q: &q, k: &k, v: &v };
        self.forward_rest(outs, rest, rows, caches, layer)
    }

    /// Attention for the spans from `rest.done` on, after `outs` (the rows before), then the
    /// output product.
    fn forward_rest(
        &self,
        mut outs: Vec<Tensor>,
        rest: Rest<'_>,
        rows: &BatchRows,
        caches: &mut [&mut dyn KvCache],
        layer: Option<usize>,
    ) -> Result<Tensor> {
        let (q, k, v, done) = (rest.q, rest.k, rest.v, rest.done);
        // Each other sequence's queries, rotated, and the keys and values it attends over (its
        // new ones appended to its cache).
        let mut seqs = Vec::with_capacity(rows.spans.len());
        for (span, cache) in rows.spans.iter().zip(caches.iter_mut()).skip(done) {
            let part = |t: &Tensor| t.narrow(0, span.row - rest.first_row, span.len);
            let qs = self.rope.apply(&part(q)?, span.position)?;
            let ks = self.rope.apply(&part(k)?, span.position)?;
            let kv = cache.update_and_fetch(&ks.transpose(0, 1)?, &part(v)?.transpose(0, 1)?)?;
            let pos = Positions { query_start: span.position, key_start: kv.key_start };
            seqs.push((qs, kv, pos));
        }
        let decode = rows.spans[done..].iter().take_while(|s| s.kind == RowKind::Decode).count();
        if decode > 0 {
            let queries: Vec<DecodeQuery> = seqs[..decode].iter().map(|(q, kv, pos)| DecodeQuery { q, k: &kv.k, v: &kv.v, quant: kv.quant, pos: *pos }).collect();
            let tables: Vec<Option<&BlockTable>> = seqs[..decode].iter().map(|(_, kv, _)| kv.table.as_ref()).collect();
            outs.push(decode_attention(&queries, &tables, &self.cfg.params)?);
        }
        for (q, kv, pos) in &seqs[decode..] {
            outs.push(match &kv.table {
                Some(table) => attend_paged_quant(q, &kv.k, &kv.v, kv.quant, table, *pos, &self.cfg.params, true)?,
                None => attend_prompt_quant(q, &kv.k, &kv.v, kv.quant, *pos, &self.cfg.params)?,
            });
        }
        self.output(outs, rows, layer)
    }

    /// The output product of the attention rows (`outs` in row order), LoRA added.
    fn output(&self, mut outs: Vec<Tensor>, rows: &BatchRows, layer: Option<usize>) -> Result<Tensor> {
        let attn = if outs.len() == 1 {
            outs.pop().unwrap()
        } else {
            Tensor::cat(&outs, 0)?
        };
        let y = self.o.forward_rows(&attn, rows.decode_rows)?;
        match layer {
            Some(i) => lora::apply(rows, i, Target::O, &attn, y),
            None => Ok(y),
        }
    }

    /// One token at the device position `pos`, its key and value written in place into the
    /// whole buffers `cache_k`, `cache_v` (see `CausalLm::decode_static`): returns the residual
    /// stream after this block, `x + o(attention(norm(x)))`, with the norm fused into the QKV
    /// product and the residual add into the output product where the backend can.
    pub fn forward_static(&self, x: &Tensor, norm: &RmsNorm, pos: &Tensor, cache_k: &Tensor, cache_v: &Tensor) -> Result<Tensor> {
        let c = &self.cfg;
        let (q, k, v) = self.heads(self.qkv.forward_row(RowInput::Normed(x, norm))?, 1)?;
        let (q, k) = match (&self.q_norm, &self.k_norm) {
            (Some(qn), Some(kn)) => (qn.forward(&q)?, kn.forward(&k)?),
            _ => (q, k),
        };
        let step = StaticStep { q: &q, k: &k, v: &v, rope: &self.rope, cache_k, cache_v, pos, params: &c.params };
        self.o.forward_row(RowInput::Plain(&append_and_attend(&step)?), Some(x))
    }

    /// On a device with the batched decode kernel (CUDA): the leading one-token decode spans,
    /// two or more, rotated, appended to their caches' whole buffers and attended in one launch
    /// instead of several launches per sequence. Returns their output rows and how many spans
    /// they were; None (nothing written) on CPU, for one sequence, or when a cache keeps no
    /// whole buffers (sliding windows, quantized KV).
    fn decode_batch_on_device(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        rows: &BatchRows,
        caches: &mut [&mut dyn KvCache],
    ) -> Result<Option<(Tensor, usize)>> {
        if !has_kernels(q.device()) {
            return Ok(None);
        }
        let n = rows.spans.iter().take_while(|s| s.kind == RowKind::Decode && s.len == 1).count();
        if n < 2 {
            return Ok(None);
        }
        let mut buffers = Vec::with_capacity(n);
        for (span, cache) in rows.spans[..n].iter().zip(caches.iter_mut()) {
            if cache.offset() != span.position {
                return Ok(None);
            }
            match cache.static_buffers(1)? {
                Some(b) => buffers.push(b),
                None => return Ok(None),
            }
        }
        let positions: Vec<usize> = rows.spans[..n].iter().map(|s| s.position).collect();
        let first = |t: &Tensor| t.narrow(0, 0, n);
        let out = append_and_attend_batch(&first(q)?, &first(k)?, &first(v)?, &buffers, &positions, &self.rope, &self.cfg.params)?;
        let Some(out) = out else { return Ok(None) };
        for cache in caches[..n].iter_mut() {
            cache.commit_static(1)?;
        }
        Ok(Some((out, n)))
    }

    /// The Q, K and V projections' outputs `[tokens, ·]` split into heads.
    fn heads(&self, qkv: Vec<Tensor>, tokens: usize) -> Result<(Tensor, Tensor, Tensor)> {
        let c = &self.cfg;
        let [q, k, v]: [Tensor; 3] = qkv
            .try_into()
            .map_err(|_| candle_core::Error::Msg("qkv: expected three projections".into()))?;
        Ok((
            q.reshape((tokens, c.heads, c.head_dim))?,
            k.reshape((tokens, c.kv_heads, c.head_dim))?,
            v.reshape((tokens, c.kv_heads, c.head_dim))?,
        ))
    }

    pub fn weight_bytes(&self) -> usize {
        self.qkv.weight_bytes() + self.o.weight_bytes()
    }
}

/// The decode rows' attention: over paged caches through their block tables, over contiguous
/// ones directly; a batch mixing both (a cache handed in from outside) one sequence at a time,
/// which gives the same bits (every row is computed as alone).
fn decode_attention(queries: &[DecodeQuery<'_>], tables: &[Option<&BlockTable>], params: &ferrolm_backend::AttentionParams) -> Result<Tensor> {
    if tables.iter().all(Option::is_none) {
        return attend_decode_batch(queries, params);
    }
    if let Some(tables) = tables.iter().copied().collect::<Option<Vec<&BlockTable>>>() {
        return attend_decode_batch_paged(queries, &tables, params);
    }
    let outs = queries.iter().zip(tables).map(|(q, t)| decode_attention(std::slice::from_ref(q), &[*t], params)).collect::<Result<Vec<_>>>()?;
    Tensor::cat(&outs, 0)
}
