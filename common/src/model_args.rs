//! The flags every binary that runs a model takes, and loading the model they describe
//! (fetching the default model on first use).

use std::path::PathBuf;

use specd_model::{DeviceSpec, EngineOptions, LoadedModel, ModelError, PrefillOrder};

#[derive(Debug, Clone, clap::Args)]
pub struct ModelArgs {
    /// Path of a llama-architecture GGUF model; default: SmolLM2-135M-Instruct Q4_1, fetched
    /// once into the model cache ($SPECD_MODEL_DIR or ~/.cache/specd/models).
    #[arg(long, env = "SPECD_MODEL")]
    pub model: Option<PathBuf>,
    /// Device to run the model on: cpu, cuda or cuda:N (cuda needs a `--features cuda` build).
    #[arg(long, env = "SPECD_DEVICE", default_value = "cpu")]
    pub device: DeviceSpec,
    /// CPU threads for the model's kernels (0: all cores).
    #[arg(long, env = "SPECD_THREADS", default_value_t = 0)]
    pub threads: usize,
    /// KV cache memory kept across requests, in MiB; least recently used sessions are evicted.
    #[arg(long, env = "SPECD_MAX_CACHE_MB", default_value_t = 1024)]
    pub max_cache_mb: usize,
    /// Most new tokens scored in one batched forward pass.
    #[arg(long, env = "SPECD_MAX_BATCH_TOKENS", default_value_t = 512)]
    pub max_batch_tokens: usize,
    /// Scoring jobs that may wait for the model; more are refused at once (overload).
    #[arg(long, env = "SPECD_MAX_QUEUE", default_value_t = 256)]
    pub max_queue: usize,
    /// Most prompt tokens computed per forward pass, over all sequences (0: no limit); longer
    /// prompts take several passes, shared with other sessions' decode steps.
    #[arg(long, env = "SPECD_PREFILL_CHUNK", default_value_t = 64)]
    pub prefill_chunk: usize,
    /// Which waiting prompt takes a pass's prompt tokens: least-left (the prompt with least
    /// left, aged so none starves: prompts arriving together finish one after another, a
    /// lower median time to first token) or turns (a chunk each: they finish together,
    /// sometimes a lower 99th percentile).
    #[arg(long, env = "SPECD_PREFILL_ORDER", default_value = "least-left")]
    pub prefill_order: PrefillOrder,
    /// Microseconds a forward pass may wait for more jobs to batch once one is ready.
    #[arg(long, env = "SPECD_BATCH_WAIT_US", default_value_t = 0)]
    pub batch_wait_us: u64,
    /// How long a forward pass may wait for the sequences the previous pass answered (they
    /// are on their way back), as a share of that pass's time; also bounded by their measured
    /// turnaround. 0: never wait.
    #[arg(long, env = "SPECD_RETURN_WAIT_SHARE", default_value_t = specd_model::engine::DEFAULT_RETURN_WAIT_SHARE)]
    pub return_wait_share: f64,
    /// Let a session start from another session's cached prefix (a shared system prompt or
    /// document) rather than computing it (true/false). False isolates sessions: each pays
    /// its own prefill, and no one's time to first token reveals what others sent.
    #[arg(long, env = "SPECD_SHARE_PREFIXES", default_value_t = true, action = clap::ArgAction::Set)]
    pub share_prefixes: bool,
}

impl ModelArgs {
    /// Sets the compute thread count. Call first thing in `main`, before other threads exist.
    pub fn apply_threads(&self) {
        specd_model::set_compute_threads(self.threads);
    }

    /// The model path, fetching the default model if none was given.
    pub fn resolve_path(&self) -> Result<PathBuf, ModelError> {
        match &self.model {
            Some(path) => Ok(path.clone()),
            None => specd_model::fetch::ensure_default_model(),
        }
    }

    pub fn engine_options(&self) -> EngineOptions {
        EngineOptions {
            device: self.device,
            max_cache_bytes: self.max_cache_mb << 20,
            max_batch_tokens: self.max_batch_tokens,
            max_queue: self.max_queue,
            prefill_chunk: self.prefill_chunk,
            prefill_order: self.prefill_order,
            batch_wait: std::time::Duration::from_micros(self.batch_wait_us),
            return_wait_share: self.return_wait_share,
            share_prefixes: self.share_prefixes,
        }
    }

    pub fn load(&self) -> Result<LoadedModel, ModelError> {
        specd_model::load(&self.resolve_path()?, self.engine_options())
    }
}
