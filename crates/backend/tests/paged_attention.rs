//! Attention over a paged cache (`attend_paged`, `attend_decode_batch_paged`): the kernels read
//! the rows through a block table, and every result is bit-identical to the same keys and
//! values held contiguously — decode (one row, verified rows), the decode batch, the tiled
//! prompt kernel, f16 and f32 rows, a sliding window, blocks scattered over the pool.

use candle_core::{DType, Device, Tensor};
use ferrolm_backend::attention::{attend, attend_decode_batch, attend_decode_batch_paged, attend_paged, attend_prompt, AttentionParams, DecodeQuery, Positions};
use ferrolm_backend::paged::BlockTable;

/// Contiguous k `[hkv, s, d]` and the same rows in a pool `[blocks, hkv, bt, d]` whose other
/// blocks hold noise, at the blocks listed by the returned table (in scrambled order).
fn paged_copy(k: &Tensor, bt: usize) -> (Tensor, BlockTable) {
    let used = k.dims3().unwrap().1.div_ceil(bt);
    paged_copy_at(k, bt, (0..used).map(|i| 2 * (used - 1 - i) + 1).collect(), 2 * used + 3)
}

/// As [`paged_copy`], the rows in the pool's blocks `blocks` (of `pool_blocks`).
fn paged_copy_at(k: &Tensor, bt: usize, blocks: Vec<usize>, pool_blocks: usize) -> (Tensor, BlockTable) {
    let (hkv, s, d) = k.dims3().unwrap();
    let pool = Tensor::randn(0f32, 1.0, (pool_blocks, hkv, bt, d), &Device::Cpu).unwrap().to_dtype(k.dtype()).unwrap();
    for (i, &b) in blocks.iter().enumerate() {
        let n = (s - i * bt).min(bt);
        let rows = k.narrow(1, i * bt, n).unwrap().unsqueeze(0).unwrap().contiguous().unwrap();
        let mut whole = pool.narrow(0, b, 1).unwrap().contiguous().unwrap();
        whole = whole.slice_assign(&[0..1, 0..hkv, 0..n, 0..d], &rows).unwrap();
        pool.slice_set(&whole, 0, b).unwrap();
    }
    (pool, BlockTable { blocks, block_tokens: bt, tokens: s })
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|x| x.to_bits()).collect()
}

fn kv(hkv: usize, s: usize, d: usize, dt: DType) -> Tensor {
    Tensor::randn(0f32, 1.0, (hkv, s, d), &Device::Cpu).unwrap().to_dtype(dt).unwrap()
}

#[test]
fn paged_rows_give_the_contiguous_bits() {
    let dev = Device::Cpu;
    for dt in [DType::F16, DType::F32] {
        for bt in [16, 32, 64] {
            for (s, window) in [(1, None), (37, None), (200, None), (200, Some(50))] {
                let (hq, hkv, d) = (6, 2, 64);
                let (k, v) = (kv(hkv, s, d, dt), kv(hkv, s, d, dt));
                let ((kp, table), (vp, vtable)) = (paged_copy(&k, bt), paged_copy(&v, bt));
                assert_eq!(table, vtable);
                let p = AttentionParams { scale: 0.125, window, softcap: None };
                // One decode row at the end.
                let q = Tensor::randn(0f32, 1.0, (1, hq, d), &dev).unwrap();
                let pos = Positions { query_start: s - 1, key_start: 0 };
                let want = attend(&q, &k, &v, pos, &p).unwrap();
                assert_eq!(bits(&attend_paged(&q, &kp, &vp, &table, pos, &p, false).unwrap()), bits(&want), "decode {dt:?} bt {bt} s {s}");
                // The last t rows as a prompt chunk.
                let t = s.min(9);
                let q = Tensor::randn(0f32, 1.0, (t, hq, d), &dev).unwrap();
                let pos = Positions { query_start: s - t, key_start: 0 };
                let want = attend_prompt(&q, &k, &v, pos, &p).unwrap();
                assert_eq!(bits(&attend_paged(&q, &kp, &vp, &table, pos, &p, true).unwrap()), bits(&want), "prompt {dt:?} bt {bt} s {s}");
                // Three verified rows (a speculative check) in a batch beside a one-row query.
                if s >= 3 {
                    let (q3, q1) = (Tensor::randn(0f32, 1.0, (3, hq, d), &dev).unwrap(), Tensor::randn(0f32, 1.0, (1, hq, d), &dev).unwrap());
                    let pos3 = Positions { query_start: s - 3, key_start: 0 };
                    let pos1 = Positions { query_start: s - 1, key_start: 0 };
                    let contiguous = [DecodeQuery { q: &q3, k: &k, v: &v, quant: None, pos: pos3 }, DecodeQuery { q: &q1, k: &k, v: &v, quant: None, pos: pos1 }];
                    let paged = [DecodeQuery { q: &q3, k: &kp, v: &vp, quant: None, pos: pos3 }, DecodeQuery { q: &q1, k: &kp, v: &vp, quant: None, pos: pos1 }];
                    let want = attend_decode_batch(&contiguous, &p).unwrap();
                    let got = attend_decode_batch_paged(&paged, &[&table, &table], &p).unwrap();
                    assert_eq!(bits(&got), bits(&want), "batch {dt:?} bt {bt} s {s}");
                }
            }
        }
    }
}

/// A table that lists more tokens than its blocks hold, or a block outside the pool, is an
/// error, not a read out of bounds.
#[test]
fn a_bad_table_is_refused() {
    let k = kv(2, 40, 64, DType::F16);
    let (pool, table) = paged_copy(&k, 16);
    let q = Tensor::randn(0f32, 1.0, (1, 4, 64), &Device::Cpu).unwrap();
    let p = AttentionParams { scale: 0.125, window: None, softcap: None };
    let pos = Positions { query_start: 39, key_start: 0 };
    let too_long = BlockTable { tokens: 49, ..table.clone() };
    assert!(attend_paged(&q, &pool, &pool, &too_long, pos, &p, false).is_err());
    let outside = BlockTable { blocks: vec![0, 1, 99], ..table.clone() };
    assert!(attend_paged(&q, &pool, &pool, &outside, pos, &p, false).is_err());
    let wrong_block = BlockTable { block_tokens: 32, ..table };
    assert!(attend_paged(&q, &pool, &pool, &wrong_block, pos, &p, false).is_err());
}

/// Decode attention over 4,096 keys of SmolLM2's shape (9 query heads, 3 kv heads, head size
/// 64, f16), contiguous and paged with blocks of 16, 32 and 64 tokens scattered over the pool:
/// the best time per call of several interleaved rounds (docs/paged_kv.md; `#[ignore]`: a
/// measurement, run with `--ignored --nocapture`).
#[test]
#[ignore = "a measurement"]
fn decode_attention_time_by_block_size() {
    let (hq, hkv, d) = (9, 3, 64);
    let p = AttentionParams { scale: 0.125, window: None, softcap: None };
    for s in [512, 4096] {
        let (k, v) = (kv(hkv, s, d, DType::F16), kv(hkv, s, d, DType::F16));
        let q = Tensor::randn(0f32, 1.0, (1, hq, d), &Device::Cpu).unwrap();
        let pos = Positions { query_start: s - 1, key_start: 0 };
        let paged: Vec<(usize, (Tensor, BlockTable), (Tensor, BlockTable))> = [16, 32, 64].iter().map(|&bt| (bt, paged_copy(&k, bt), paged_copy(&v, bt))).collect();
        let mut best = vec![f64::MAX; 1 + paged.len()];
        let iters = if s > 1000 { 200 } else { 1000 };
        for _round in 0..5 {
            let t = std::time::Instant::now();
            for _ in 0..iters {
                attend(&q, &k, &v, pos, &p).unwrap();
            }
            best[0] = best[0].min(t.elapsed().as_secs_f64() / iters as f64);
            for (i, (_, (kp, table), (vp, _))) in paged.iter().enumerate() {
                let t = std::time::Instant::now();
                for _ in 0..iters {
                    attend_paged(&q, kp, vp, table, pos, &p, false).unwrap();
                }
                best[i + 1] = best[i + 1].min(t.elapsed().as_secs_f64() / iters as f64);
            }
        }
        let names = ["contiguous", "paged16", "paged32", "paged64"];
        for (name, t) in names.iter().zip(&best) {
            println!("{{\"figure\":\"attention\",\"keys\":{s},\"layout\":\"{name}\",\"us_per_call\":{:.2}}}", t * 1e6);
        }
    }
}

/// This thread's CPU time in ns (`/proc/thread-self/schedstat`'s first field): unlike wall
/// time it does not count the time other processes of a busy machine take the core.
fn thread_cpu_ns() -> u64 {
    let stat = std::fs::read_to_string("/proc/thread-self/schedstat").unwrap();
    stat.split_whitespace().next().unwrap().parse().unwrap()
}

/// One layout's caches of `layers` layers: per layer k, v and the table (None: contiguous).
type Layers = Vec<(Tensor, Tensor, Option<BlockTable>)>;

/// Decode attention's thread CPU time per call (µs) over 4,096 keys of SmolLM2's shape (9
/// query heads, 3 kv heads, head size 64, f16), contiguous and paged with blocks of 16, 32 and
/// 64 tokens in order or scattered over the pool: `warm` reads one layer's 3 MiB again and
/// again (cached), `cold` cycles over 30 layers as a decode step does (94 MiB, from memory).
/// Layouts alternate call batch by call batch; the figure is the median batch. Run with
/// `FERROLM_THREADS=1 --ignored --nocapture` (`#[ignore]`: a measurement, docs/paged_kv.md).
#[test]
#[ignore = "a measurement"]
fn decode_attention_cpu_time_warm_and_cold() {
    let (hq, hkv, d, s) = (9, 3, 64, 4096);
    let p = AttentionParams { scale: 0.125, window: None, softcap: None };
    let q = Tensor::randn(0f32, 1.0, (1, hq, d), &Device::Cpu).unwrap();
    let pos = Positions { query_start: s - 1, key_start: 0 };
    for (name, layers) in [("warm", 1), ("cold", 30)] {
        let contiguous: Layers = (0..layers).map(|_| (kv(hkv, s, d, DType::F16), kv(hkv, s, d, DType::F16), None)).collect();
        // Blocks in order (one sequence's, as the pool hands out fresh blocks) or scattered
        // backwards over a pool of twice the blocks (`paged_copy`, as after blocks were freed).
        let paged = |bt: usize, in_order: bool| -> Layers {
            let used = s / bt;
            let copy = |x: &Tensor| match in_order {
                true => paged_copy_at(x, bt, (0..used).collect(), used),
                false => paged_copy(x, bt),
            };
            contiguous.iter().map(|(k, v, _)| {
                let ((kp, table), (vp, _)) = (copy(k), copy(v));
                (kp, vp, Some(table))
            }).collect()
        };
        let mut layouts = vec![("contiguous".to_string(), contiguous.clone())];
        for in_order in [true, false] {
            for bt in [16, 32, 64] {
                layouts.push((format!("{}{bt}", if in_order { "in_order" } else { "scattered" }), paged(bt, in_order)));
            }
        }
        let mut times: Vec<Vec<f64>> = vec![Vec::new(); layouts.len()];
        // Batches of ~0.1 s: the CPU time advances in scheduler ticks (4 ms).
        let calls = 360;
        for _batch in 0..15 {
            for (i, (_, cache)) in layouts.iter().enumerate() {
                let t = thread_cpu_ns();
                for call in 0..calls {
                    let (k, v, table) = &cache[call % layers];
                    match table {
                        Some(table) => attend_paged(&q, k, v, table, pos, &p, false).unwrap(),
                        None => attend(&q, k, v, pos, &p).unwrap(),
                    };
                }
                times[i].push((thread_cpu_ns() - t) as f64 / 1e3 / calls as f64);
            }
        }
        for ((layout, _), t) in layouts.iter().zip(&mut times) {
            t.sort_by(f64::total_cmp);
            println!("{{\"figure\":\"attention_cpu\",\"keys\":{s},\"cache\":\"{name}\",\"layout\":\"{layout}\",\"median_us\":{:.1},\"min_us\":{:.1}}}", t[t.len() / 2], t[0]);
        }
    }
}
