//! The engine's settings, resolved once when it starts (flags, then the environment's levers):
//! nothing reads the environment while a request runs (DESIGN §3.7).

/// How greedy decode runs through a captured step (`graph_decode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GraphSettings {
    /// Capture the step as a CUDA graph (`FERROLM_CUDA_GRAPH=0`: replay it eagerly).
    pub capture: bool,
    /// Decode steps per graph replay (`FERROLM_GRAPH_STEPS`, 1 to `graph::MIRROR_SLOTS / 2`).
    pub steps: usize,
    /// Captured steps store their tokens into mapped host memory (`FERROLM_TOKEN_MIRROR=0`: a
    /// copy and an event per step).
    pub mirror: bool,
    /// Decode plain greedy requests through the static step on the CPU too (eagerly; slower):
    /// lets the tests drive the GPU code path.
    pub on_cpu: bool,
}

impl Default for GraphSettings {
    fn default() -> Self {
        Self { capture: true, steps: 1, mirror: true, on_cpu: false }
    }
}

impl GraphSettings {
    /// The defaults with the environment's levers applied.
    pub fn from_env() -> Self {
        let var = |name: &str| std::env::var(name).ok();
        let d = Self::default();
        Self {
            capture: var("FERROLM_CUDA_GRAPH").as_deref() != Some("0"),
            steps: var("FERROLM_GRAPH_STEPS")
                .and_then(|v| v.parse::<usize>().ok())
                .unwrap_or(d.steps)
                .clamp(1, ferrolm_backend::graph::MIRROR_SLOTS / 2),
            mirror: var("FERROLM_TOKEN_MIRROR").as_deref() != Some("0"),
            on_cpu: false,
        }
    }
}

/// The prompt cache's disk tier (`--kv-disk`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DiskSettings {
    pub dir: std::path::PathBuf,
    pub max_bytes: u64,
    /// The model's identity (`identity::model_identity`): files of another model are not read.
    pub identity: String,
}

/// How the engine batches: see `scheduler`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchConfig {
    /// Tokens forwarded per step at most (decode rows, then prompt chunks).
    pub max_batch_tokens: usize,
    /// Sequences running at once at most.
    pub max_seqs: usize,
    /// KV-cache memory the running sequences may hold, in bytes.
    pub kv_budget_bytes: usize,
    /// Memory of the prompt cache (prefixes of finished requests, reused by later ones); 0 turns
    /// it off.
    pub prompt_cache_bytes: usize,
}

/// Decode rows and prompt chunks per step by default. Measured on the 2-core dev machine
/// (SmolLM2-135M Q4_1; bench/results/batching.md): larger budgets hardly raise prefill speed
/// and lengthen the steps that running decodes wait through.
pub const DEFAULT_MAX_BATCH_TOKENS: usize = 512;

/// Sequences at once by default.
pub const DEFAULT_MAX_SEQS: usize = 64;

impl Default for BatchConfig {
    fn default() -> Self {
        Self {
            max_batch_tokens: DEFAULT_MAX_BATCH_TOKENS,
            max_seqs: DEFAULT_MAX_SEQS,
            kv_budget_bytes: default_kv_budget(),
            prompt_cache_bytes: default_prompt_cache(),
        }
    }
}

/// An eighth of the memory the system reports available, at most 2 GiB.
pub fn default_prompt_cache() -> usize {
    (default_kv_budget() / 4).min(2 << 30)
}

/// Half the memory the system reports available (`MemAvailable`), else 4 GiB.
pub fn default_kv_budget() -> usize {
    let available = std::fs::read_to_string("/proc/meminfo").ok().and_then(|m| {
        let line = m.lines().find(|l| l.starts_with("MemAvailable:"))?;
        let kb: usize = line.split_whitespace().nth(1)?.parse().ok()?;
        Some(kb * 1024)
    });
    available.map_or(4 << 30, |b| b / 2)
}

/// How the layers hold keys and values (`--kv-layout`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KvLayout {
    /// One growing buffer per sequence and layer (`PlainCache`).
    #[default]
    Contiguous,
    /// Blocks of `block_tokens` tokens in a pool per layer, shared between sequences by
    /// reference (`ferrolm_kv::PagedCache`, docs/paged_kv.md). CPU only.
    Paged { block_tokens: usize },
}

/// Tokens per block by default: the fastest of 16, 32 and 64 in decode attention at 4k keys
/// (docs/paged_kv.md, `paged_attention::decode_attention_time_by_block_size`).
pub const DEFAULT_BLOCK_TOKENS: usize = 32;

impl KvLayout {
    /// From `--kv-layout paged|contiguous` and `--kv-block-size` (16, 32 or 64).
    pub fn from_flags(layout: &str, block_tokens: usize) -> Result<Self, String> {
        match layout {
            "contiguous" => Ok(Self::Contiguous),
            "paged" if [16, 32, 64].contains(&block_tokens) => Ok(Self::Paged { block_tokens }),
            "paged" => Err(format!("--kv-block-size {block_tokens}: expected 16, 32 or 64")),
            other => Err(format!("--kv-layout {other}: expected paged or contiguous")),
        }
    }
}
