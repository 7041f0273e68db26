//! Debug aid: writes the logits after each of the given tokens (prompt ids from argv as JSON).
use candle_core::Device;
use ferrolm_models::{ModelSource, SeqInput};
fn main() {
    let args: Vec<String> = std::env::args().collect();
    let src = ModelSource::open(std::path::Path::new(&args[1])).unwrap();
    let model = ferrolm_models::load(&src, &Device::Cpu).unwrap();
    let ids: Vec<u32> = serde_json::from_str(&args[2]).unwrap();
    let mut cache = model.make_cache();
    let n = ids.len();
    model
        .forward_hidden(&mut [SeqInput {
            tokens: &ids[..n - 1],
            cache: &mut cache,
        }])
        .unwrap();
    let h = model
        .forward_hidden(&mut [SeqInput {
            tokens: &ids[n - 1..],
            cache: &mut cache,
        }])
        .unwrap();
    let l: Vec<f32> = model
        .project_logits(&h)
        .unwrap()
        .squeeze(0)
        .unwrap()
        .to_vec1()
        .unwrap();
    let bytes: Vec<u8> = l.iter().flat_map(|x| x.to_le_bytes()).collect();
    std::fs::write(&args[3], bytes).unwrap();
}
