//! Attention over quantized rows in paged blocks (`attend_paged_quant`, and
//! `attend_decode_batch_paged` with quantized queries): the kernels read the rows through the
//! block table, and every result is bit-identical to the same rows held contiguously
//! (`attend_quant`, `attend_prompt_quant`, `attend_decode_batch`) — decode (the int8 query path
//! and, with exact activations, the float one), the tiled prompt kernel, the decode batch with
//! verified rows, the per-row fallback (two rows), 8 and 4 bits, rotated or not, a sliding
//! window, blocks scattered over the pool.

use candle_core::{Device, Tensor};
use ferrolm_backend::attention::{attend_decode_batch, attend_decode_batch_paged, attend_paged_quant, attend_prompt_quant, attend_quant, AttentionParams, DecodeQuery, Positions};
use ferrolm_backend::kv_quant::{quantize, KvQuant};
use ferrolm_backend::paged::BlockTable;

/// Quantized rows `[hkv, s, row]` and the same rows in a U8 pool `[blocks, hkv, bt, row]` whose
/// other blocks hold noise, at the blocks of the returned table (in scrambled order).
fn paged_copy(rows: &Tensor, bt: usize, quant: KvQuant, d: usize) -> (Tensor, BlockTable) {
    let (hkv, s, width) = rows.dims3().unwrap();
    let used = s.div_ceil(bt);
    let pool_blocks = 2 * used + 3;
    let blocks: Vec<usize> = (0..used).map(|i| 2 * (used - 1 - i) + 1).collect();
    let noise = Tensor::randn(0f32, 3.0, (pool_blocks, hkv, bt, d), &Device::Cpu).unwrap();
    let pool = quantize(quant, &noise).unwrap();
    assert_eq!(pool.dims()[3], width);
    for (i, &b) in blocks.iter().enumerate() {
        let n = (s - i * bt).min(bt);
        let part = rows.narrow(1, i * bt, n).unwrap().unsqueeze(0).unwrap().contiguous().unwrap();
        let whole = pool.narrow(0, b, 1).unwrap().contiguous().unwrap().slice_assign(&[0..1, 0..hkv, 0..n, 0..width], &part).unwrap();
        pool.slice_set(&whole, 0, b).unwrap();
    }
    (pool, BlockTable { blocks, block_tokens: bt, tokens: s })
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect()
}

fn formats() -> Vec<KvQuant> {
    [(8, 32), (4, 32), (4, 64)].iter().flat_map(|&(b, g)| {
        let q = KvQuant::new(b, g).unwrap();
        [q, q.with_rotation(false)]
    }).collect()
}

#[test]
fn paged_quantized_rows_give_the_contiguous_bits() {
    let dev = Device::Cpu;
    let (hq, hkv, d) = (6, 2, 64);
    for exact in [false, true] {
        ferrolm_backend::cpu::set_exact_activations(exact);
        for quant in formats() {
            for bt in [16, 32] {
                for (s, window) in [(1, None), (37, None), (200, None), (200, Some(50))] {
                    let rows = |_| quantize(quant, &Tensor::randn(0f32, 1.0, (hkv, s, d), &dev).unwrap()).unwrap();
                    let (k, v) = (rows(0), rows(1));
                    let ((kp, table), (vp, vtable)) = (paged_copy(&k, bt, quant, d), paged_copy(&v, bt, quant, d));
                    assert_eq!(table, vtable);
                    let p = AttentionParams { scale: 0.125, window, softcap: None };
                    let name = format!("{} exact {exact} bt {bt} s {s} window {window:?}", quant.name());
                    let paged = |q: &Tensor, pos, prompt| attend_paged_quant(q, &kp, &vp, Some(quant), &table, pos, &p, prompt).unwrap();
                    // One decode row at the end.
                    let q = Tensor::randn(0f32, 1.0, (1, hq, d), &dev).unwrap();
                    let pos = Positions { query_start: s - 1, key_start: 0 };
                    assert_eq!(bits(&paged(&q, pos, false)), bits(&attend_quant(&q, &k, &v, Some(quant), pos, &p).unwrap()), "decode {name}");
                    // The last t rows as a prompt chunk.
                    let t = s.min(9);
                    let q = Tensor::randn(0f32, 1.0, (t, hq, d), &dev).unwrap();
                    let pos = Positions { query_start: s - t, key_start: 0 };
                    assert_eq!(bits(&paged(&q, pos, true)), bits(&attend_prompt_quant(&q, &k, &v, Some(quant), pos, &p).unwrap()), "prompt {name}");
                    if s < 3 {
                        continue;
                    }
                    // Two rows outside a prompt: the per-row fallback (rows dequantized).
                    let q2 = Tensor::randn(0f32, 1.0, (2, hq, d), &dev).unwrap();
                    let pos2 = Positions { query_start: s - 2, key_start: 0 };
                    assert_eq!(bits(&paged(&q2, pos2, false)), bits(&attend_quant(&q2, &k, &v, Some(quant), pos2, &p).unwrap()), "two rows {name}");
                    // Three verified rows (a speculative check) in a batch beside a one-row query.
                    let (q3, q1) = (Tensor::randn(0f32, 1.0, (3, hq, d), &dev).unwrap(), Tensor::randn(0f32, 1.0, (1, hq, d), &dev).unwrap());
                    let pos3 = Positions { query_start: s - 3, key_start: 0 };
                    let pos1 = Positions { query_start: s - 1, key_start: 0 };
                    let q = Some(quant);
                    let contiguous = [DecodeQuery { q: &q3, k: &k, v: &v, quant: q, pos: pos3 }, DecodeQuery { q: &q1, k: &k, v: &v, quant: q, pos: pos1 }];
                    let in_blocks = [DecodeQuery { q: &q3, k: &kp, v: &vp, quant: q, pos: pos3 }, DecodeQuery { q: &q1, k: &kp, v: &vp, quant: q, pos: pos1 }];
                    let want = attend_decode_batch(&contiguous, &p).unwrap();
                    assert_eq!(bits(&attend_decode_batch_paged(&in_blocks, &[&table, &table], &p).unwrap()), bits(&want), "batch {name}");
                    // One decode query alone through the batch entry (its single-row path).
                    let want = attend_decode_batch(&contiguous[1..], &p).unwrap();
                    assert_eq!(bits(&attend_decode_batch_paged(&in_blocks[1..], &[&table], &p).unwrap()), bits(&want), "lone {name}");
                }
            }
        }
    }
    ferrolm_backend::cpu::set_exact_activations(false);
}

/// Float pools are not read as quantized rows, nor rows of another width.
#[test]
fn pools_of_other_rows_are_refused() {
    let dev = Device::Cpu;
    let quant = KvQuant::new(8, 32).unwrap();
    let rows = quantize(quant, &Tensor::randn(0f32, 1.0, (2, 40, 64), &dev).unwrap()).unwrap();
    let (pool, table) = paged_copy(&rows, 16, quant, 64);
    let q = Tensor::randn(0f32, 1.0, (1, 4, 64), &dev).unwrap();
    let p = AttentionParams { scale: 0.125, window: None, softcap: None };
    let pos = Positions { query_start: 39, key_start: 0 };
    assert!(attend_paged_quant(&q, &pool, &pool, Some(KvQuant::new(4, 32).unwrap()), &table, pos, &p, false).is_err());
    let floats = Tensor::randn(0f32, 1.0, (5, 2, 16, 64), &dev).unwrap();
    assert!(attend_paged_quant(&q, &floats, &floats, Some(quant), &table, pos, &p, false).is_err());
    assert!(attend_paged_quant(&q, &pool, &pool, Some(quant), &table, pos, &p, false).is_ok());
}

/// Decode attention over 4,096 keys of SmolLM2's shape (9 query heads, 3 kv heads, head size
/// 64) in q8g32 and q4g32 rows, contiguous and in blocks of 32 scattered over the pool: the best
/// time per call of several interleaved rounds (docs/paged_kv.md; `#[ignore]`: a measurement,
/// run with `--ignored --nocapture`).
#[test]
#[ignore = "a measurement"]
fn quantized_decode_attention_time_by_layout() {
    let dev = Device::Cpu;
    let (hq, hkv, d, s, bt) = (9, 3, 64, 4096, 32);
    let p = AttentionParams { scale: 0.125, window: None, softcap: None };
    for quant in [KvQuant::new(8, 32).unwrap(), KvQuant::new(4, 32).unwrap()] {
        let rows = |_| quantize(quant, &Tensor::randn(0f32, 1.0, (hkv, s, d), &dev).unwrap()).unwrap();
        let (k, v) = (rows(0), rows(1));
        let ((kp, table), (vp, _)) = (paged_copy(&k, bt, quant, d), paged_copy(&v, bt, quant, d));
        let q = Tensor::randn(0f32, 1.0, (1, hq, d), &dev).unwrap();
        let pos = Positions { query_start: s - 1, key_start: 0 };
        let mut best = [f64::MAX; 2];
        for _round in 0..5 {
            let t = std::time::Instant::now();
            for _ in 0..200 {
                attend_quant(&q, &k, &v, Some(quant), pos, &p).unwrap();
            }
            best[0] = best[0].min(t.elapsed().as_secs_f64() / 200.0);
            let t = std::time::Instant::now();
            for _ in 0..200 {
                attend_paged_quant(&q, &kp, &vp, Some(quant), &table, pos, &p, false).unwrap();
            }
            best[1] = best[1].min(t.elapsed().as_secs_f64() / 200.0);
        }
        for (layout, t) in ["contiguous", "paged32"].iter().zip(best) {
            println!("{{\"figure\":\"attention\",\"kv\":\"{}\",\"keys\":{s},\"layout\":\"{layout}\",\"us_per_call\":{:.2}}}", quant.name(), t * 1e6);
        }
    }
}
