//! Sliding-window attention through the rotating cache equals sliding-window attention through
//! the plain cache (which keeps every key), bit for bit, for any chunking: the rotating cache
//! hands attention exactly the keys a window can see, in the same temporal order.

use candle_core::{Device, Tensor};
use ferrolm_backend::attention::Positions;
use ferrolm_backend::{attend, AttentionParams};
use ferrolm_kv::{KvCache, PlainCache, RotatingCache};

#[test]
fn rotating_cache_attention_is_bit_exact_with_the_plain_cache() {
    let dev = Device::Cpu;
    let (hq, hkv, d, window) = (4, 2, 16, 8);
    let params = AttentionParams {
        scale: 0.25,
        window: Some(window),
        softcap: None,
    };
    for chunks in [
        vec![5, 1, 1, 13, 1, 9, 1, 1, 1, 20, 1, 1, 1, 1, 1, 1, 1],
        vec![1; 40],
        vec![30, 30, 1, 1, 7],
    ] {
        let total: usize = chunks.iter().sum();
        let q = Tensor::randn(0f32, 1.0, (total, hq, d), &dev).unwrap();
        let k = Tensor::randn(0f32, 1.0, (hkv, total, d), &dev).unwrap();
        let v = Tensor::randn(0f32, 1.0, (hkv, total, d), &dev).unwrap();
        let mut plain = PlainCache::new(hkv, d, candle_core::DType::F32, &dev);
        let mut rot = RotatingCache::new(hkv, d, window, candle_core::DType::F32, &dev);
        let mut pos = 0;
        for n in chunks {
            let (qs, ks, vs) = (
                q.narrow(0, pos, n).unwrap(),
                k.narrow(1, pos, n).unwrap(),
                v.narrow(1, pos, n).unwrap(),
            );
            let mut out = Vec::new();
            for cache in [&mut plain as &mut dyn KvCache, &mut rot] {
                let kv = cache.update_and_fetch(&ks, &vs).unwrap();
                let p = Positions {
                    query_start: pos,
                    key_start: kv.key_start,
                };
                out.push(attend(&qs, &kv.k, &kv.v, p, &params).unwrap());
            }
            let diff = (&out[0] - &out[1])
                .unwrap()
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            assert_eq!(diff, 0.0, "chunk of {n} at {pos}");
            pos += n;
            assert_eq!(rot.offset(), plain.offset());
        }
        assert!(!rot.is_trimmable(), "evicted by now");
    }
}
