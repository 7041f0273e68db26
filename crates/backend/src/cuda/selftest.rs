//! Checks of ferrolm's CUDA kernels against candle compositions on the device, on fresh random
//! data each run (`ferrolm gpu-check` runs them on the GPU machine). Each check reports the
//! largest relative error (max |got − want| / max |want|) and its bound, or an exact comparison.

use super::ops::{self, DecodeAttention, RopeTables};
use super::Pos;
use crate::attention::{attend_generic, AttentionParams, Positions};
use crate::rope::{Rope, RopeStyle};
use candle_core::{DType, Device, Result, Tensor};

pub struct Check {
    pub name: String,
    pub error: f64,
    pub bound: f64,
}

impl Check {
    pub fn passed(&self) -> bool {
        self.error.is_finite() && self.error <= self.bound
    }
}

fn rel(got: &Tensor, want: &Tensor) -> Result<f64> {
    let got = got.to_dtype(DType::F32)?.flatten_all()?;
    let want = want.to_dtype(DType::F32)?.flatten_all()?;
    let diff = (got - &want)?.abs()?.max(0)?.to_scalar::<f32>()? as f64;
    let scale = want.abs()?.max(0)?.to_scalar::<f32>()? as f64;
    Ok(diff / scale.max(1e-30))
}

fn randn(shape: impl Into<candle_core::Shape>, dtype: DType, dev: &Device) -> Result<Tensor> {
    Tensor::randn(0f32, 1.0, shape, dev)?.to_dtype(dtype)
}

fn need<T>(x: Option<T>, what: &str) -> Result<T> {
    x.ok_or_else(|| candle_core::Error::Msg(format!("{what}: the kernel declined its inputs")))
}

/// Runs every check on `dev` (a CUDA device).
pub fn run(dev: &Device) -> Result<Vec<Check>> {
    let mut out = Vec::new();
    let bf = DType::BF16;
    for cols in [576, 4096] {
        let x = randn((5, cols), bf, dev)?;
        let r = randn((5, cols), bf, dev)?;
        let w = (randn(cols, DType::F32, dev)? + 1.0)?;
        let got = need(ops::rms_norm(&x, &w, 1e-5)?, "rms_norm")?;
        let want = candle_nn::ops::rms_norm(&x.to_dtype(DType::F32)?, &w, 1e-5)?;
        out.push(Check { name: format!("rmsnorm bf16 cols={cols}"), error: rel(&got, &want)?, bound: 1e-2 });
        let (sum, normed) = need(ops::add_rms_norm(&x, &r, &w, 1e-5)?, "add_rms_norm")?;
        let want_sum = (&x + &r)?;
        out.push(Check { name: format!("add+rmsnorm sum cols={cols}"), error: rel(&sum, &want_sum)?, bound: 1e-2 });
        let want = candle_nn::ops::rms_norm(&sum.to_dtype(DType::F32)?, &w, 1e-5)?;
        out.push(Check { name: format!("add+rmsnorm norm cols={cols}"), error: rel(&normed, &want)?, bound: 1e-2 });
    }
    for style in [RopeStyle::HalfSplit, RopeStyle::Interleaved] {
        let rope = Rope::new(style, 128, 500000.0, 4096, None, dev)?;
        let x = randn((3, 8, 128), bf, dev)?;
        let got = rope.apply(&x, 1000)?;
        let want = rope.apply_generic(&x.to_dtype(DType::F32)?, 1000)?;
        out.push(Check { name: format!("rope {style:?} host pos"), error: rel(&got, &want)?, bound: 1e-2 });
        let one = x.narrow(0, 0, 1)?;
        let pos = Tensor::new(&[1000u32], dev)?;
        let at = rope.apply_at(&one, &pos)?;
        let host = rope.apply(&one, 1000)?;
        out.push(Check { name: format!("rope {style:?} device pos = host pos (exact)"), error: rel(&at, &host)?, bound: 0.0 });
    }
    for (hq, hkv, d, s, window) in [(32, 8, 128, 1500, None), (9, 3, 64, 300, None), (32, 8, 64, 700, Some(256)), (8, 8, 256, 40, None), (16, 2, 128, 5000, None)] {
        out.extend(check_attention(dev, hq, hkv, d, s, window)?);
    }
    let llama = (32, 8, 128);
    for (heads, t, prefix, window, softcap) in [
        ((8, 2, 64), 37, 50, None, None),
        ((8, 2, 64), 64, 50, Some(20), None),
        ((8, 2, 64), 16, 50, None, Some(30.0)),
        (llama, 300, 0, None, None),
        (llama, 200, 77, Some(64), None),
        ((8, 4, 256), 129, 7, None, None),
    ] {
        out.push(check_prefill_attention(dev, heads, t, prefix, window, softcap)?);
    }
    let g = randn((1, 11008), bf, dev)?;
    let u = randn((1, 11008), bf, dev)?;
    let got = need(ops::silu_mul(&g, &u)?, "silu_mul")?;
    let gf = g.to_dtype(DType::F32)?;
    let want = (candle_nn::ops::silu(&gf)? * u.to_dtype(DType::F32)?)?;
    out.push(Check { name: "silu*mul bf16".into(), error: rel(&got, &want)?, bound: 1e-2 });
    // The halves of a stacked gate|up prefill product, read in place: the same bits as copies.
    let gu = randn((37, 2 * 1024), bf, dev)?;
    let (g, u) = (gu.narrow(1, 0, 1024)?, gu.narrow(1, 1024, 1024)?);
    let strided = need(ops::silu_mul(&g, &u)?, "silu_mul strided")?;
    let copied = need(ops::silu_mul(&g.contiguous()?.reshape(37 * 1024)?, &u.contiguous()?.reshape(37 * 1024)?)?, "silu_mul")?;
    out.push(Check { name: "silu*mul of strided halves = of copies (exact)".into(), error: rel(&strided.flatten_all()?, &copied)?, bound: 0.0 });
    for (n, k) in [(576, 576), (2048, 8192), (4096, 4096), (128256, 2048), (1000, 24)] {
        let x = randn((1, k), bf, dev)?;
        let w = (randn((n, k), bf, dev)? * 0.05)?.to_dtype(bf)?;
        let got = need(ops::gemv(&x, &w)?, "gemv")?;
        let want = x.to_dtype(DType::F32)?.matmul(&w.to_dtype(DType::F32)?.t()?)?;
        out.push(Check { name: format!("gemv bf16 {n}x{k}"), error: rel(&got, &want)?, bound: 1e-2 });
    }
    for (n, k) in [(3072, 2048), (4096, 14336), (576, 576), (1000, 24)] {
        out.extend(check_gemv_fused(dev, n, k)?);
    }
    for (hidden, hq, hkv, d, inter, s) in [(512, 8, 2, 64, 1024, 300), (1024, 8, 4, 128, 2816, 1000), (576, 9, 3, 64, 1536, 40)] {
        out.extend(check_decode_layer(dev, hidden, (hq, hkv, d), inter, s)?);
    }
    for (n, k, tied) in [(128256, 2048, false), (3072, 2048, false), (1000, 24, true)] {
        out.extend(check_head_argmax(dev, n, k, tied)?);
    }
    let logits = randn(128256, DType::F32, dev)?;
    let dst = Tensor::zeros(1, DType::U32, dev)?;
    crate::ops::argmax_into(&logits, &dst)?;
    let want = logits.argmax(0)?.to_scalar::<u32>()?;
    let got = dst.to_vec1::<u32>()?[0];
    out.push(Check { name: "argmax (exact)".into(), error: (got != want) as u8 as f64, bound: 0.0 });
    out.push(check_argmax_rows(dev)?);
    for (hq, hkv, d) in [(32, 8, 64), (32, 8, 128), (9, 3, 64), (16, 2, 128)] {
        out.push(check_attention_batch(dev, hq, hkv, d)?);
    }
    out.push(check_graph(dev)?);
    Ok(out)
}

/// Every row's argmax in one pass against each row's own argmax (ties included), exactly.
fn check_argmax_rows(dev: &Device) -> Result<Check> {
    let mut logits = randn((7, 128256), DType::F32, dev)?;
    // Row 3 all equal (first index wins), row 5 with a tie of two maxima.
    let tied = Tensor::ones((1, 128256), DType::F32, dev)?;
    logits = logits.slice_assign(&[3..4, 0..128256], &tied)?;
    let two = Tensor::full(9f32, (1, 2), dev)?;
    logits = logits.slice_assign(&[5..6, 1000..1002], &two)?;
    let got = need(ops::argmax_rows(&logits)?, "argmax_rows")?.to_vec1::<u32>()?;
    let dst = Tensor::zeros(1, DType::U32, dev)?;
    let mut wrong = 0;
    for (r, &g) in got.iter().enumerate() {
        crate::ops::argmax_into(&logits.get(r)?, &dst)?;
        wrong += (dst.to_vec1::<u32>()?[0] != g) as usize;
    }
    Ok(Check { name: "argmax of 7 rows at once = each row's (exact)".into(), error: wrong as f64, bound: 0.0 })
}

/// The batched decode step (rope, append and attention for several sequences of different
/// lengths in one launch) against each sequence's single-row kernel with the append in it:
/// outputs and written rows bit-identical.
fn check_attention_batch(dev: &Device, hq: usize, hkv: usize, d: usize) -> Result<Check> {
    let bf = DType::BF16;
    let p = AttentionParams { scale: (d as f32).powf(-0.5), window: None, softcap: None };
    let positions = [0usize, 63, 64, 65, 700, 2100];
    let rope = Rope::new(RopeStyle::HalfSplit, d, 10000.0, 4096, None, dev)?;
    let (cos, sin, interleaved) = rope.tables()?;
    let tables = RopeTables { cos, sin, interleaved };
    let b = positions.len();
    let q = randn((b, hq, d), bf, dev)?;
    let k = randn((b, hkv, d), bf, dev)?;
    let v = randn((b, hkv, d), bf, dev)?;
    let caches: Vec<(Tensor, Tensor)> = positions
        .iter()
        .map(|&s| Ok((randn((hkv, s + 1 + 37, d), bf, dev)?, randn((hkv, s + 1 + 37, d), bf, dev)?)))
        .collect::<Result<_>>()?;
    let copies: Vec<(Tensor, Tensor)> = caches.iter().map(|(a, c)| Ok((a.copy()?, c.copy()?))).collect::<Result<_>>()?;
    // q, k and v as the side-by-side views of one stacked product's rows, read in place.
    let stacked = Tensor::cat(&[q.flatten_from(1)?, k.flatten_from(1)?, v.flatten_from(1)?], 1)?;
    let (qs, ks, vs) = (stacked.narrow(1, 0, hq * d)?, stacked.narrow(1, hq * d, hkv * d)?, stacked.narrow(1, (hq + hkv) * d, hkv * d)?);
    let batch = ops::DecodeBatch { q: &qs, k: &ks, v: &vs, buffers: &caches, positions: &positions, rope: tables, params: &p };
    let got = need(ops::attend_decode_batch(&batch)?, "attend_decode_batch")?;
    let mut error = 0.0;
    for (i, (&s, (kc, vc))) in positions.iter().zip(&copies).enumerate() {
        let row = |t: &Tensor| t.narrow(0, i, 1)?.contiguous();
        let (kn, vn) = (row(&k)?, row(&v)?);
        let one = DecodeAttention {
            q: &row(&q)?,
            k: &kc.narrow(1, 0, s + 1)?,
            v: &vc.narrow(1, 0, s + 1)?,
            rope: Some(tables),
            pos: Pos::Host(s),
            key_start: 0,
            params: &p,
            append: Some((&kn, &vn)),
        };
        let want = need(ops::attend_decode(&one)?, "attend_decode with append")?;
        error += rel(&got.narrow(0, i, 1)?, &want)?;
        error += rel(&caches[i].0, kc)? + rel(&caches[i].1, vc)?;
    }
    Ok(Check { name: format!("batched decode step hq={hq} hkv={hkv} d={d} = one by one (exact)"), error, bound: 0.0 })
}

/// The fused matrix-vector kernel (norm or silu·mul before, residual add after) against the
/// separate kernels.
fn check_gemv_fused(dev: &Device, n: usize, k: usize) -> Result<Vec<Check>> {
    use ops::GemvInput;
    let bf = DType::BF16;
    let x = randn((1, k), bf, dev)?;
    let u = randn((1, k), bf, dev)?;
    let r = randn((1, n), bf, dev)?;
    let nw = (randn(k, DType::F32, dev)? + 1.0)?;
    let w = (randn((n, k), bf, dev)? * 0.05)?.to_dtype(bf)?;
    let f32 = |t: &Tensor| t.to_dtype(DType::F32);
    let product = |x: &Tensor| x.to_dtype(DType::F32)?.matmul(&f32(&w)?.t()?);
    let normed = need(ops::gemv_fused(GemvInput::Normed(&x, &nw, 1e-5), &w, None)?, "gemv_fused normed")?;
    let want = product(&candle_nn::ops::rms_norm(&f32(&x)?, &nw, 1e-5)?)?;
    let swiglu = need(ops::gemv_fused(GemvInput::SiluMul(&x, &u), &w, Some(&r))?, "gemv_fused silu")?;
    let want_swiglu = (product(&(candle_nn::ops::silu(&f32(&x)?)? * f32(&u)?)?)? + f32(&r)?)?;
    let mut checks = vec![
        Check { name: format!("gemv fused rmsnorm {n}x{k}"), error: rel(&normed, &want)?, bound: 1e-2 },
        Check { name: format!("gemv fused silu*mul + residual {n}x{k}"), error: rel(&swiglu, &want_swiglu)?, bound: 1e-2 },
    ];
    // The SwiGLU epilogue (w as [gate; up]) against the product then silu·up, exactly.
    if let Some(act) = ops::gemv_swiglu(GemvInput::Normed(&x, &nw, 1e-5), &w)? {
        let (g, u) = (normed.narrow(1, 0, n / 2)?.contiguous()?, normed.narrow(1, n / 2, n / 2)?.contiguous()?);
        let want_act = need(ops::silu_mul(&g, &u)?, "silu_mul")?;
        checks.push(Check { name: format!("gemv swiglu epilogue {n}x{k} (exact)"), error: rel(&act, &want_act)?, bound: 0.0 });
    }
    Ok(checks)
}

/// The head's product with the greedy argmax in its kernel against its plain logits and the
/// separate argmax, exactly, twice in a row (its block counter must be back at zero), the
/// second time with a token mirror (the host slot must hold the token and the new position);
/// `ties`: every row the same, so every logit ties and the first index must win.
fn check_head_argmax(dev: &Device, n: usize, k: usize, ties: bool) -> Result<Vec<Check>> {
    use ops::GemvInput;
    let bf = DType::BF16;
    let x = randn((1, k), bf, dev)?;
    let nw = (randn(k, DType::F32, dev)? + 1.0)?;
    let w = match ties {
        true => randn((1, k), bf, dev)?.broadcast_as((n, k))?.contiguous()?,
        false => (randn((n, k), bf, dev)? * 0.05)?.to_dtype(bf)?,
    };
    let input = GemvInput::Normed(&x, &nw, 1e-5);
    let Some(logits) = ops::gemv_logits(input, &w)? else { return Ok(Vec::new()) };
    let want = Tensor::zeros(1, DType::U32, dev)?;
    crate::ops::argmax_into(&logits, &want)?;
    let want = want.to_vec1::<u32>()?[0];
    let (token, pos) = (Tensor::zeros(1, DType::U32, dev)?, Tensor::new(&[7u32], dev)?);
    let Device::Cuda(cuda) = dev else { return Ok(Vec::new()) };
    let mut reader = super::graph::TokenReader::new(cuda)?;
    reader.clear_mirror()?;
    let mut checks = Vec::new();
    for round in 1..=2u32 {
        let launch = || ops::gemv_logits_argmax(input, &w, &token, Some(&pos));
        let (fused, mirrored) = match round {
            1 => (launch(), false),
            _ => reader.mirrored(launch),
        };
        let fused = need(fused?, "gemv_logits_argmax")?;
        let (got, at) = (token.to_vec1::<u32>()?[0], pos.to_vec1::<u32>()?[0]);
        let mirror_wrong = round == 2 && (!mirrored || reader.wait_mirrored(7 + round)? != want);
        let wrong = got != want || at != 7 + round || (ties && got != 0) || mirror_wrong;
        let name = format!("head argmax in the product {n}x{k}{}, step {round} (exact)", if ties { ", all tied" } else { "" });
        checks.push(Check { name, error: wrong as u8 as f64 + rel(&fused, &logits)?, bound: 0.0 });
    }
    Ok(checks)
}

/// Decode attention (host position, over a narrowed view) against the reference composition,
/// and the device-position step over the whole buffer against the host-position one (exact).
fn check_attention(dev: &Device, hq: usize, hkv: usize, d: usize, s: usize, window: Option<usize>) -> Result<Vec<Check>> {
    let bf = DType::BF16;
    let cap = s + 300;
    let p = AttentionParams { scale: (d as f32).powf(-0.5), window, softcap: None };
    let kc = randn((hkv, cap, d), bf, dev)?;
    let vc = randn((hkv, cap, d), bf, dev)?;
    let q = randn((1, hq, d), bf, dev)?;
    let (k, v) = (kc.narrow(1, 0, s)?, vc.narrow(1, 0, s)?);
    let pos = Positions { query_start: s - 1, key_start: 0 };
    let got = crate::attention::attend(&q, &k, &v, pos, &p)?;
    let f = |t: &Tensor| t.to_dtype(DType::F32);
    let want = attend_generic(&f(&q)?, &f(&k)?, &f(&v)?, pos, &p)?;
    let name = format!("attention hq={hq} hkv={hkv} d={d} s={s} window={window:?}");
    let mut checks = vec![Check { name: name.clone(), error: rel(&got, &want)?, bound: 2e-2 }];

    // Static step: append token s-1 (rotated) into a copy of the buffer and attend at a device
    // position; compare with rope + host-position attention over the same keys.
    let rope = Rope::new(RopeStyle::HalfSplit, d, 10000.0, cap + 1, None, dev)?;
    let (cos, sin, interleaved) = rope.tables()?;
    let tables = RopeTables { cos, sin, interleaved };
    let kn = randn((1, hkv, d), bf, dev)?;
    let vn = randn((1, hkv, d), bf, dev)?;
    let (kc2, vc2) = (kc.copy()?, vc.copy()?);
    let posd = Tensor::new(&[(s - 1) as u32], dev)?;
    need(ops::kv_append(&kc2, &vc2, &kn, &vn, Some(tables), Pos::Device(&posd))?.then_some(()), "kv_append")?;
    let a = DecodeAttention { q: &q, k: &kc2, v: &vc2, rope: Some(tables), pos: Pos::Device(&posd), key_start: 0, params: &p, append: None };
    let got_static = need(ops::attend_decode(&a)?, "attend_decode static")?;
    // The same step with the append done inside the attention kernel.
    let (kc4, vc4) = (kc.copy()?, vc.copy()?);
    let fused = DecodeAttention { k: &kc4, v: &vc4, append: Some((&kn, &vn)), ..a };
    let got_fused = need(ops::attend_decode(&fused)?, "attend_decode with append")?;
    let (kc3, vc3) = (kc.copy()?, vc.copy()?);
    kc3.slice_set(&rope.apply(&kn, s - 1)?.transpose(0, 1)?.contiguous()?, 1, s - 1)?;
    vc3.slice_set(&vn.transpose(0, 1)?.contiguous()?, 1, s - 1)?;
    let host = crate::attention::attend(&rope.apply(&q, s - 1)?, &kc3.narrow(1, 0, s)?, &vc3.narrow(1, 0, s)?, pos, &p)?;
    checks.push(Check { name: format!("{name} device pos = host pos (exact)"), error: rel(&got_static, &host)?, bound: 0.0 });
    let written = rel(&kc2.narrow(1, s - 1, 1)?, &kc3.narrow(1, s - 1, 1)?)?;
    checks.push(Check { name: format!("kv append d={d} (exact)"), error: written, bound: 0.0 });
    let appended = rel(&kc4.narrow(1, s - 1, 1)?, &kc3.narrow(1, s - 1, 1)?)? + rel(&vc4.narrow(1, s - 1, 1)?, &vc3.narrow(1, s - 1, 1)?)?;
    checks.push(Check { name: format!("{name} append in kernel (exact)"), error: rel(&got_fused, &got_static)? + appended, bound: 0.0 });
    Ok(checks)
}

/// Prefill attention (several queries after a cached prefix; the fused masked-softmax kernel)
/// against the reference composition in f32.
fn check_prefill_attention(
    dev: &Device,
    (hq, hkv, d): (usize, usize, usize),
    t: usize,
    prefix: usize,
    window: Option<usize>,
    softcap: Option<f32>,
) -> Result<Check> {
    let s = prefix + t;
    let p = AttentionParams { scale: (d as f32).powf(-0.5), window, softcap };
    let q = randn((t, hq, d), DType::BF16, dev)?;
    // Keys and values as the engine passes them: a view of longer cache buffers.
    let k = randn((hkv, s + 40, d), DType::BF16, dev)?.narrow(1, 0, s)?;
    let v = randn((hkv, s + 40, d), DType::BF16, dev)?.narrow(1, 0, s)?;
    let pos = Positions { query_start: prefix, key_start: 0 };
    let got = crate::attention::attend(&q, &k, &v, pos, &p)?;
    let f = |x: &Tensor| x.to_dtype(DType::F32);
    let want = attend_generic(&f(&q)?, &f(&k)?, &f(&v)?, pos, &p)?;
    let name = format!("prefill attention {hq}/{hkv}x{d} t={t} after {prefix} window={window:?} softcap={softcap:?}");
    Ok(Check { name, error: rel(&got, &want)?, bound: 3e-2 })
}

/// A captured graph of (y = x·2, p += 1) replayed three times: p advanced by 3, y written each time.
fn check_graph(dev: &Device) -> Result<Check> {
    let x = randn((4, 64), DType::F32, dev)?;
    let y = Tensor::zeros((4, 64), DType::F32, dev)?;
    let p = Tensor::zeros(1, DType::U32, dev)?;
    let mut step = || -> Result<()> {
        let t = (&x * 2.0)?;
        y.slice_set(&t, 0, 0)?;
        crate::ops::increment(&p)
    };
    crate::graph::warm_up(dev, &mut step)?;
    let g = crate::graph::capture(dev, &mut step)?;
    for _ in 0..3 {
        g.replay()?;
    }
    let n = p.to_vec1::<u32>()?[0];
    let err = rel(&y, &(&x * 2.0)?)? + (n != 4) as u8 as f64;
    Ok(Check { name: "graph capture + replay (exact)".into(), error: err, bound: 0.0 })
}

/// The decode-layer kernel against the five separate kernels it replaces, two consecutive
/// steps (positions s-1 and s, so the in-kernel counters and barrier must reset): the output
/// and the appended cache rows bit-identical.
fn check_decode_layer(dev: &Device, hidden: usize, heads: (usize, usize, usize), inter: usize, s: usize) -> Result<Vec<Check>> {
    use super::layer::{decode_layer, DecodeLayerArgs};
    use ops::GemvInput;
    let (hq, hkv, d) = heads;
    let bf = DType::BF16;
    let cap = s + 64;
    let w = |n: usize, k: usize| -> Result<Tensor> { (randn((n, k), bf, dev)? * (1.0 / (k as f64).sqrt()))?.to_dtype(bf) };
    let (wqkv, wo, wgu, wdown) = (w((hq + 2 * hkv) * d, hidden)?, w(hidden, hq * d)?, w(2 * inter, hidden)?, w(hidden, inter)?);
    let n1 = (randn(hidden, DType::F32, dev)?.affine(0.1, 1.0))?;
    let n2 = (randn(hidden, DType::F32, dev)?.affine(0.1, 1.0))?;
    let p = AttentionParams { scale: (d as f32).powf(-0.5), window: None, softcap: None };
    let rope = Rope::new(RopeStyle::HalfSplit, d, 500000.0, cap, None, dev)?;
    let (cos, sin, interleaved) = rope.tables()?;
    let tables = RopeTables { cos, sin, interleaved };
    let (kc, vc) = (randn((hkv, cap, d), bf, dev)?, randn((hkv, cap, d), bf, dev)?);
    let (kc2, vc2) = (kc.copy()?, vc.copy()?);
    let name = format!("decode layer hidden={hidden} heads={hq}/{hkv} d={d} inter={inter}");
    let mut checks = Vec::new();
    let mut x = randn((1, hidden), bf, dev)?;
    for step in 0..2 {
        let at = s - 1 + step;
        let pos = Tensor::new(&[at as u32], dev)?;
        // The separate kernels.
        let qkv = need(ops::gemv_fused(GemvInput::Normed(&x, &n1, 1e-5), &wqkv, None)?, "qkv")?;
        let q = qkv.narrow(1, 0, hq * d)?.reshape((1, hq, d))?;
        let k = qkv.narrow(1, hq * d, hkv * d)?.reshape((1, hkv, d))?.contiguous()?;
        let v = qkv.narrow(1, (hq + hkv) * d, hkv * d)?.reshape((1, hkv, d))?.contiguous()?;
        let q = q.contiguous()?;
        let a = DecodeAttention { q: &q, k: &kc, v: &vc, rope: Some(tables), pos: Pos::Device(&pos), key_start: 0, params: &p, append: Some((&k, &v)) };
        let attn = need(ops::attend_decode(&a)?, "attention")?;
        let mid = need(ops::gemv_fused(GemvInput::Plain(&attn), &wo, Some(&x))?, "o")?;
        let gu = need(ops::gemv_fused(GemvInput::Normed(&mid, &n2, 1e-5), &wgu, None)?, "gate|up")?;
        let (g, u) = (gu.narrow(1, 0, inter)?.contiguous()?, gu.narrow(1, inter, inter)?.contiguous()?);
        let want = need(ops::gemv_fused(GemvInput::SiluMul(&g, &u), &wdown, Some(&mid))?, "down")?;
        // The one kernel, on its own copy of the caches.
        let args = DecodeLayerArgs {
            x: &x,
            attn_norm: (&n1, 1e-5),
            ffn_norm: (&n2, 1e-5),
            wqkv: &wqkv,
            wo: &wo,
            wgu: &wgu,
            wdown: &wdown,
            heads: hq,
            kv_heads: hkv,
            head_dim: d,
            cache_k: &kc2,
            cache_v: &vc2,
            rope: tables,
            pos: &pos,
            params: &p,
        };
        let got = need(decode_layer(&args)?, "decode layer")?;
        let rows = rel(&kc2.narrow(1, at, 1)?, &kc.narrow(1, at, 1)?)? + rel(&vc2.narrow(1, at, 1)?, &vc.narrow(1, at, 1)?)?;
        let error = rel(&got, &want)? + rows;
        checks.push(Check { name: format!("{name} step {step} = separate kernels (exact)"), error, bound: 0.0 });
        x = want;
    }
    Ok(checks)
}
