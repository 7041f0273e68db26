//! `ferrolm dump-logits` (hidden): teacher-forced logits for correctness checks against other
//! implementations (transformers on the GPU machine: scripts/gpu/checks.py).
//!
//! The first `--from` ids go through one prefill, then each later id is decoded alone, and the f32
//! logits after each of them are written as rows of `--out` (little-endian, (len − from) × vocab),
//! so both the batched prefill and the single-token decode path are exercised.

use crate::{CliError, CliResult};
use candle_core::DType;
use ferrolm_engine::bundle;
use ferrolm_models::{ModelSource, SeqInput};
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct Args {
    #[arg(long)]
    model: PathBuf,
    /// Token ids as a JSON array.
    #[arg(long)]
    ids: String,
    #[arg(long)]
    out: PathBuf,
    #[arg(long, default_value = "cpu")]
    device: String,
    /// How many ids the prefill takes (default: all but the last).
    #[arg(long)]
    from: Option<usize>,
    /// Split the model over N ranks (see `ferrolm serve --tensor-parallel`): the sharded
    /// model's logits, to compare with the unsplit one's (scripts/gpu/tp_check.sh).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    tensor_parallel: u32,
}

pub fn run(args: Args) -> CliResult<()> {
    let ids: Vec<u32> = serde_json::from_str(&args.ids).map_err(|e| CliError::usage(format!("--ids: {e}")))?;
    let from = args.from.unwrap_or(ids.len().saturating_sub(1));
    if from == 0 || from >= ids.len() {
        return Err(CliError::usage("--from must be in 1..len(ids)"));
    }
    let model = match args.tensor_parallel {
        1 => {
            let device = ferrolm_backend::parse_device(&args.device).map_err(CliError::usage)?;
            let src = ModelSource::open(&args.model).map_err(CliError::usage)?;
            ferrolm_models::load(&src, &device).map_err(CliError::usage)?
        }
        n => {
            let b = bundle::load_parallel(Some(&args.model), &args.device, n as usize).map_err(CliError::usage)?;
            b.model
        }
    };
    let rows = teacher_forced(model.as_ref(), &ids, from).map_err(CliError::runtime)?;
    let bytes: Vec<u8> = rows.iter().flat_map(|x| x.to_le_bytes()).collect();
    std::fs::write(&args.out, bytes).map_err(|e| CliError::runtime(format!("{}: {e}", args.out.display())))
}

fn teacher_forced(model: &dyn ferrolm_models::CausalLm, ids: &[u32], from: usize) -> candle_core::Result<Vec<f32>> {
    let mut cache = model.make_cache();
    model.forward_hidden(&mut [SeqInput::prompt(&ids[..from], &mut cache)])?;
    let mut out = Vec::new();
    for i in from..ids.len() {
        let h = model.forward_hidden(&mut [SeqInput::decode(&ids[i..=i], &mut cache)])?;
        out.extend(model.project_logits(&h)?.to_dtype(DType::F32)?.squeeze(0)?.to_vec1::<f32>()?);
    }
    Ok(out)
}
