//! Decode attention over quantized keys with the int8 query on VNNI (`cpu::decode_q8`, the
//! default when activations are not kept exact): the output equals a float64 reference of the
//! same arithmetic (the query rounded to int8 per 32-value block, integer q8·codes, group scales
//! and biases, softmax, values dequantized), and is measurably away from the unrounded query's
//! result, so the comparison can fail. Own test binary: it needs 8-bit activations on, process
//! wide, while `kv_quant_attention` keeps them exact.

use candle_core::{Device, Tensor};
use ferrolm_backend::attention::{attend_quant, AttentionParams, Positions};
use ferrolm_backend::kv_quant::{quantize, rotate_rows, KvQuant};

mod common;

fn int8_path() -> bool {
    ferrolm_backend::cpu::set_exact_activations(false);
    let on = ferrolm_backend::cpu::decode_q8::wanted();
    if !on {
        eprintln!("skipped: no AVX-512 VNNI on this CPU");
    }
    on
}

/// Reference decode attention in f64 over rows `[hkv, s, row_bytes]`: scores per key
/// Σ_g scale_g·Σ q̃_i·code_i + bias_g·Σ q_i with q̃ the rounded query (`rounded`) or q itself.
#[allow(clippy::too_many_arguments)]
fn reference(quant: KvQuant, q: &[f32], k: &[u8], v: &[u8], hq: usize, hkv: usize, s: usize, d: usize, keys: (usize, usize), rounded: bool) -> Vec<f64> {
    let rb = quant.row_bytes(d);
    let row = |data: &'_ [u8], h: usize, t: usize| -> Vec<u8> { data[(h * s + t) * rb..(h * s + t + 1) * rb].to_vec() };
    let mut out = Vec::new();
    for qh in 0..hq {
        let h = qh / (hq / hkv);
        let mut qr = q[qh * d..(qh + 1) * d].to_vec();
        if quant.rotate {
            rotate_rows(&mut qr, d);
        }
        let qt: Vec<f64> = if rounded { common::rounded_query(&qr) } else { qr.iter().map(|x| *x as f64).collect() };
        let scores: Vec<f64> = (keys.0..keys.1)
            .map(|t| {
                let r = row(k, h, t);
                let mut dot = 0f64;
                for g in 0..d / quant.group {
                    let (sc, bias) = quant.scale_bias(&r, d, g);
                    let idx = g * quant.group..(g + 1) * quant.group;
                    let codes: f64 = idx.clone().map(|i| qt[i] * quant.code(&r, i) as f64).sum();
                    let qsum: f64 = idx.map(|i| qr[i] as f64).sum();
                    dot += sc as f64 * codes + bias as f64 * qsum;
                }
                dot / (d as f64).sqrt()
            })
            .collect();
        let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let w: Vec<f64> = scores.iter().map(|x| (x - max).exp()).collect();
        let total: f64 = w.iter().sum();
        let mut o = vec![0f64; d];
        for (t, wt) in (keys.0..keys.1).zip(&w) {
            let r = row(v, h, t);
            for (i, oi) in o.iter_mut().enumerate() {
                let (sc, bias) = quant.scale_bias(&r, d, i / quant.group);
                *oi += wt / total * (quant.code(&r, i) as f64 * sc as f64 + bias as f64);
            }
        }
        if quant.rotate {
            common::fwht(&mut o);
        }
        out.extend(o);
    }
    out
}

fn formats() -> Vec<KvQuant> {
    let rotated = [(8, 32), (8, 64), (8, 128), (4, 32), (4, 64)].map(|(b, g)| KvQuant::new(b, g).unwrap());
    rotated.iter().flat_map(|q| [*q, q.with_rotation(false)]).collect()
}

#[test]
fn int8_decode_matches_the_f64_reference() {
    if !int8_path() {
        return;
    }
    let dev = Device::Cpu;
    for quant in formats() {
        for (d, hq, hkv, s, window) in [(64, 14, 2, 300, None), (128, 8, 2, 700, Some(500)), (256, 3, 3, 90, None), (128, 1, 1, 64, None)] {
            if quant.check_head_dim(d).is_err() {
                continue;
            }
            let q = Tensor::randn(0f32, 1.0, (1, hq, d), &dev).unwrap();
            let make = || quantize(quant, &(Tensor::randn(0f32, 1.0, (hkv, s, d), &dev).unwrap() + 0.7).unwrap()).unwrap();
            let (k, v) = (make(), make());
            let p = AttentionParams { scale: 1.0 / (d as f32).sqrt(), window, softcap: None };
            let pos = Positions { query_start: s - 1, key_start: 0 };
            let ours = attend_quant(&q, &k, &v, Some(quant), pos, &p).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let (qv, kv, vv) = (q.flatten_all().unwrap().to_vec1::<f32>().unwrap(), k.flatten_all().unwrap().to_vec1::<u8>().unwrap(), v.flatten_all().unwrap().to_vec1::<u8>().unwrap());
            let keys = (window.map_or(0, |w| s - w), s);
            let want = reference(quant, &qv, &kv, &vv, hq, hkv, s, d, keys, true);
            let unrounded = reference(quant, &qv, &kv, &vv, hq, hkv, s, d, keys, false);
            let diff = |r: &[f64]| ours.iter().zip(r).map(|(a, b)| (*a as f64 - b).abs()).fold(0f64, f64::max);
            let (err, off) = (diff(&want), diff(&unrounded));
            let name = format!("{} d{d} hq{hq} hkv{hkv} s{s}", quant.name());
            assert!(err < 2e-5, "{name}: {err} from the reference of the int8 arithmetic");
            assert!(off > 10.0 * err.max(1e-6), "{name}: {off} from the unrounded query (the int8 path did not run?)");
        }
    }
}

/// The int8 path keeps the batch guarantee: several sequences' decode rows in one pass give
/// each the bits it gets alone.
#[test]
fn int8_decode_batch_equals_each_alone() {
    if !int8_path() {
        return;
    }
    let dev = Device::Cpu;
    for quant in [KvQuant::new(8, 32).unwrap(), KvQuant::new(4, 64).unwrap().with_rotation(false)] {
        let data: Vec<(Tensor, Tensor, Tensor, usize)> = [1, 70, 1000]
            .iter()
            .map(|&s| {
                let make = || quantize(quant, &Tensor::randn(0f32, 1.0, (2, s, 64), &dev).unwrap()).unwrap();
                (Tensor::randn(0f32, 1.0, (1, 8, 64), &dev).unwrap(), make(), make(), s)
            })
            .collect();
        common::assert_batch_equals_alone(&data, quant);
    }
}

/// TurboQuant keys on the int8 path, read in place across the two stored halves (a key row
/// starts in the first and ends in the second): the output equals the f64 reference of the
/// scheme with the rounded query within 2e-5, and is measurably away from the unrounded one.
#[test]
fn int8_turbo_decode_matches_the_f64_reference() {
    if !int8_path() {
        return;
    }
    let dev = Device::Cpu;
    for quant in [(8, 3), (4, 3), (8, 2), (4, 4)].map(|(k, v)| KvQuant::turbo(k, v).unwrap()) {
        for (d, hq, hkv, s, window) in [(64, 14, 2, 300, None), (128, 8, 2, 700, Some(500)), (256, 3, 3, 90, None), (192, 2, 1, 64, None)] {
            let q = Tensor::randn(0f32, 1.0, (1, hq, d), &dev).unwrap();
            let (k, v) = common::turbo_kv(quant, hkv, s, d);
            let p = AttentionParams { scale: 1.0 / (d as f32).sqrt(), window, softcap: None };
            let pos = Positions { query_start: s - 1, key_start: 0 };
            let ours = attend_quant(&q, &k, &v, Some(quant), pos, &p).unwrap();
            let qv = q.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let reference = common::TurboRef::new(quant, &k, &v, d);
            let scale = 1.0 / (d as f64).sqrt();
            let err = common::max_diff(&ours, &reference.attend_rows(&qv, hq, s - 1, window, scale, true));
            let off = common::max_diff(&ours, &reference.attend_rows(&qv, hq, s - 1, window, scale, false));
            let name = format!("{} d{d} hq{hq} hkv{hkv} s{s}", quant.name());
            assert!(err < 2e-5, "{name}: {err} from the reference of the int8 arithmetic");
            assert!(off > 10.0 * err.max(1e-6), "{name}: {off} from the unrounded query (the int8 path did not run?)");
        }
    }
}
