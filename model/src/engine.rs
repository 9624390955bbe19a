//! The model on its own thread. Callers send scoring jobs over a bounded channel and get
//! replies on oneshots, so async code never blocks on a forward pass. Jobs that are waiting
//! when the thread becomes free are scored together in ONE batched forward pass.
//!
//! A job carries a sequence's FULL token context: the engine reuses the longest prefix it
//! has cached for that sequence and computes the rest, so rollback after a rejected draft is
//! simply a shorter context next time, and a cache miss costs time, never correctness.

use std::collections::VecDeque;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TryRecvError, TrySendError};
use std::time::Instant;

use tokio::sync::oneshot;

use crate::cache_store::CacheStore;
use crate::chat::ChatTemplate;
use crate::config::{LlamaConfig, string};
use crate::error::{ModelError, Result};
use crate::gguf::GgufFile;
use crate::kv_cache::KvCache;
use crate::llama::{Llama, SequenceStep};
use crate::tokenizer::TextTokenizer;
use pass_record::PassLog;
pub use pass_record::PassRecord;
use returns::Returns;
pub use types::{
    DEFAULT_RETURN_WAIT_SHARE, EngineOptions, Logits, ModelInfo, PrefillOrder, ScoreRequest, Scores,
};

enum Job {
    Score {
        request: ScoreRequest,
        reply: oneshot::Sender<Result<Scores>>,
        queued_at: Instant,
        /// Prompt tokens earlier passes computed for this job (chunked prefill).
        prefilled: usize,
        /// Passes this job sat out for want of prompt budget (see `prefill_order`).
        waited: usize,
        /// The cache those passes built. It travels with the job, not in the cache store, so
        /// eviction between chunks cannot undo them (two prompts evicting each other's
        /// caches would never finish).
        partial: Option<KvCache>,
    },
    Release {
        sequence: String,
    },
}

/// A handle to the engine thread; cheap to clone.
#[derive(Clone)]
pub struct Engine {
    jobs: SyncSender<Job>,
    info: Arc<ModelInfo>,
    /// Jobs submitted and not yet taken by the engine thread.
    waiting: Arc<AtomicUsize>,
    /// Recent seconds of engine time per job (an f64's bits), for wait estimates.
    seconds_per_job: Arc<AtomicU64>,
    /// The model the engine thread runs, for its forward-pass profile.
    llama: Arc<Llama>,
    /// Every pass, while a benchmark records them.
    pass_log: Arc<PassLog>,
}

/// Everything loaded from one GGUF file.
pub struct LoadedModel {
    pub engine: Engine,
    pub tokenizer: Arc<TextTokenizer>,
    pub chat_template: Option<Arc<ChatTemplate>>,
    pub config: LlamaConfig,
}

/// The text side of a model: what an orchestrator needs without loading any weights.
pub struct TextModel {
    pub tokenizer: Arc<TextTokenizer>,
    pub chat_template: Option<Arc<ChatTemplate>>,
    pub config: LlamaConfig,
}

/// Reads the tokenizer, chat template and hyper-parameters of a GGUF (metadata only).
pub fn load_text_model(path: &Path) -> Result<TextModel> {
    text_model(&GgufFile::open(path)?)
}

fn text_model(file: &GgufFile) -> Result<TextModel> {
    let tokenizer = Arc::new(TextTokenizer::from_gguf(&file.content)?);
    let chat_template = match string(&file.content, "tokenizer.chat_template") {
        Ok(source) => {
            let token = |id: Option<u32>| id.and_then(|i| tokenizer.token_text(i)).unwrap_or_default();
            let eos = tokenizer.end_of_generation().first().copied();
            Some(Arc::new(ChatTemplate::new(
                &source,
                token(tokenizer.bos()),
                token(eos),
            )?))
        }
        Err(_) => None,
    };
    let config = LlamaConfig::from_gguf(&file.content)?;
    if tokenizer.vocab_size() > config.vocab_size {
        return Err(ModelError::Tokenizer(format!(
            "tokenizer has {} tokens but the model only {}",
            tokenizer.vocab_size(),
            config.vocab_size
        )));
    }
    Ok(TextModel {
        tokenizer,
        chat_template,
        config,
    })
}

/// Loads a GGUF model and starts its engine thread.
pub fn load(path: &Path, options: EngineOptions) -> Result<LoadedModel> {
    let mut file = GgufFile::open(path)?;
    let TextModel {
        tokenizer,
        chat_template,
        ..
    } = text_model(&file)?;
    let device = options.device.open()?;
    let llama = Llama::load(&mut file, &device)?;
    let config = llama.config().clone();
    let info = ModelInfo {
        name: string(&file.content, "general.name").unwrap_or_else(|_| {
            path.file_stem()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_default()
        }),
        architecture: string(&file.content, "general.architecture")?,
        tokenizer_identity: tokenizer.identity().to_string(),
        vocab_size: config.vocab_size,
        context_length: config.context_length,
        n_layer: config.n_layer,
        n_embd: config.n_embd,
    };
    let engine = Engine::spawn(llama, info, &options)?;
    Ok(LoadedModel {
        engine,
        tokenizer,
        chat_template,
        config,
    })
}

impl Engine {
    fn spawn(llama: Llama, info: ModelInfo, options: &EngineOptions) -> Result<Self> {
        let llama = Arc::new(llama);
        let (jobs, queue) = std::sync::mpsc::sync_channel(options.max_queue.max(1));
        let waiting = Arc::new(AtomicUsize::new(0));
        let seconds_per_job = Arc::new(AtomicU64::new(0f64.to_bits()));
        let pass_log = Arc::new(PassLog::default());
        let worker = Worker {
            pass_log: pass_log.clone(),
            waiting: waiting.clone(),
            seconds_per_job: seconds_per_job.clone(),
            cache: CacheStore::new(options.max_cache_bytes),
            llama: llama.clone(),
            max_batch_tokens: options.max_batch_tokens.max(1),
            prefill_chunk: options.prefill_chunk,
            prefill_order: options.prefill_order,
            batch_wait: options.batch_wait,
            deferred: VecDeque::new(),
            returns: Returns::new(options.return_wait_share),
            last_pass_end: None,
            passes: 0,
            share_prefixes: options.share_prefixes,
        };
        std::thread::Builder::new()
            .name("specd-engine".into())
            .spawn(move || worker.run(queue))
            .map_err(|e| ModelError::Device(format!("cannot start the engine thread: {e}")))?;
        Ok(Self {
            jobs,
            info: Arc::new(info),
            waiting,
            seconds_per_job,
            llama,
            pass_log,
        })
    }

    /// Starts timing every forward pass by phase (see [`crate::host::ForwardProfile`]).
    pub fn start_profile(&self) {
        self.llama.start_profile();
    }

    /// The forward-pass profile since [`Engine::start_profile`]; stops profiling.
    pub fn take_profile(&self) -> Option<crate::host::ForwardProfile> {
        self.llama.take_profile()
    }

    pub fn info(&self) -> &ModelInfo {
        &self.info
    }

    /// Jobs waiting for the engine thread now.
    pub fn queue_depth(&self) -> usize {
        self.waiting.load(Ordering::Relaxed)
    }

    /// How long a job submitted now would likely wait before its pass starts: the jobs
    /// ahead of it times the recent engine time per job (zero until a pass has run).
    pub fn expected_wait(&self) -> std::time::Duration {
        let per_job = f64::from_bits(self.seconds_per_job.load(Ordering::Relaxed));
        std::time::Duration::from_secs_f64((self.queue_depth() as f64 * per_job).max(0.0))
    }

    fn submit(&self, request: ScoreRequest) -> Result<oneshot::Receiver<Result<Scores>>> {
        let (reply, receiver) = oneshot::channel();
        let job = Job::Score {
            request,
            reply,
            queued_at: Instant::now(),
            prefilled: 0,
            waited: 0,
            partial: None,
        };
        self.waiting.fetch_add(1, Ordering::Relaxed);
        match self.jobs.try_send(job) {
            Ok(()) => Ok(receiver),
            Err(error) => {
                self.waiting.fetch_sub(1, Ordering::Relaxed);
                Err(match error {
                    TrySendError::Full(_) => ModelError::Overloaded,
                    TrySendError::Disconnected(_) => ModelError::EngineStopped,
                })
            }
        }
    }

    /// Scores from async code; the forward pass runs on the engine thread.
    pub async fn score(&self, request: ScoreRequest) -> Result<Scores> {
        self.submit(request)?
            .await
            .map_err(|_| ModelError::EngineStopped)?
    }

    /// Scores from synchronous code (not from inside an async runtime).
    pub fn score_blocking(&self, request: ScoreRequest) -> Result<Scores> {
        self.submit(request)?
            .blocking_recv()
            .map_err(|_| ModelError::EngineStopped)?
    }

    /// Drops a sequence's cache (its session ended).
    pub fn release(&self, sequence: &str) {
        let _ = self.jobs.try_send(Job::Release {
            sequence: sequence.to_string(),
        });
    }
}

struct Worker {
    pass_log: Arc<PassLog>,
    waiting: Arc<AtomicUsize>,
    seconds_per_job: Arc<AtomicU64>,
    llama: Arc<Llama>,
    cache: CacheStore,
    max_batch_tokens: usize,
    prefill_chunk: usize,
    prefill_order: PrefillOrder,
    batch_wait: std::time::Duration,
    /// Jobs taken from the queue that run in a later pass (a chunked prompt's rest, or a
    /// second job for a sequence already in the pass), oldest first.
    deferred: VecDeque<Job>,
    returns: Returns,
    /// When the previous pass ended: the time since is the engine's idle gap (logged).
    last_pass_end: Option<Instant>,
    /// Forward passes run so far.
    passes: u64,
    /// See [`EngineOptions::share_prefixes`].
    share_prefixes: bool,
}

/// What the pass being formed has taken: tokens in all, and prompt tokens it may still take.
struct Budget {
    total: usize,
    prefill_left: usize,
    /// Prompt tokens taken (a pass computing a prompt is busy with real work: it does not
    /// wait for returning sequences).
    prompt: usize,
}

/// A validated job, ready to run: its cache, the tokens to append and where logits are due.
struct Planned {
    sequence: String,
    cache: KvCache,
    new_tokens: Vec<u32>,
    logits_at: Vec<usize>,
    reused: usize,
    reply: oneshot::Sender<Result<Scores>>,
    queued_at: Instant,
    prefilled: usize,
    waited: usize,
    /// Set when this pass computes only a chunk of the prompt: the job, to resume.
    resume: Option<ScoreRequest>,
}

impl Worker {
    fn run(mut self, queue: Receiver<Job>) {
        loop {
            // Jobs carried from earlier passes go first; each is looked at once per pass, so
            // one that cannot join this pass waits for the next instead of spinning here.
            let mut carried = std::mem::take(&mut self.deferred);
            if self.prefill_order == PrefillOrder::LeastLeft {
                prefill_order::sort(&mut carried, self.prefill_chunk);
            }
            let first = match carried.pop_front() {
                Some(job) => job,
                None => match queue.recv() {
                    Ok(job) => self.took(job),
                    Err(_) => return, // every handle dropped
                },
            };
            let mut batch = Vec::new();
            let mut tokens = Budget {
                total: 0,
                prefill_left: if self.prefill_chunk == 0 {
                    usize::MAX
                } else {
                    self.prefill_chunk
                },
                prompt: 0,
            };
            self.admit(first, &mut batch, &mut tokens);
            let deadline = Instant::now() + self.batch_wait;
            while tokens.total < self.max_batch_tokens {
                let next = match carried.pop_front() {
                    Some(job) => job,
                    None => match queue.try_recv() {
                        Ok(job) => self.took(job),
                        Err(TryRecvError::Disconnected) => break,
                        Err(TryRecvError::Empty) => {
                            let now = Instant::now();
                            if now >= deadline {
                                break;
                            }
                            match queue.recv_timeout(deadline - now) {
                                Ok(job) => self.took(job),
                                Err(_) => break,
                            }
                        }
                    },
                };
                self.admit(next, &mut batch, &mut tokens);
            }
            // The sequences the previous pass answered are usually on their way back: a short
            // wait lets them share this pass rather than form the next one (`returns`).
            while !batch.is_empty() && tokens.prompt == 0 && tokens.total < self.max_batch_tokens {
                let Some(deadline) = self.returns.wait_until() else {
                    break;
                };
                match queue.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                    Ok(job) => {
                        let job = self.took(job);
                        self.admit(job, &mut batch, &mut tokens);
                    }
                    Err(_) => break,
                }
            }
            // Carried jobs that did not fit are older than anything deferred in this pass.
            while let Some(job) = carried.pop_back() {
                self.deferred.push_front(job);
            }
            if !batch.is_empty() {
                self.run_batch(batch);
            }
        }
    }

    fn took(&mut self, job: Job) -> Job {
        match &job {
            Job::Score {
                request, queued_at, ..
            } => {
                self.waiting.fetch_sub(1, Ordering::Relaxed);
                self.returns.arrived(&request.sequence, *queued_at);
            }
            Job::Release { sequence } => self.returns.gone(sequence),
        }
        job
    }

    /// Adds a job to the batch being formed (a prompt perhaps only in part), defers it to a
    /// later pass, or answers it at once if it is invalid.
    fn admit(&mut self, job: Job, batch: &mut Vec<Planned>, tokens: &mut Budget) {
        let request = match &job {
            Job::Release { sequence } => {
                self.cache.remove(sequence);
                return;
            }
            // The caller gave up (deadline, disconnect) while the job waited: skip it.
            Job::Score { reply, .. } if reply.is_closed() => return,
            Job::Score { request, .. } => request,
        };
        if batch.iter().any(|p| p.sequence == request.sequence) {
            // One sequence appears once per pass; it goes in the next one.
            self.deferred.push_back(job);
            return;
        }
        let Job::Score {
            request,
            reply,
            queued_at,
            prefilled,
            waited,
            partial,
        } = job
        else {
            unreachable!("releases returned above")
        };
        let (cache, mut new_tokens, mut logits_at, reused) = match self.plan(&request, partial) {
            Ok(planned) => planned,
            Err(e) => {
                let _ = reply.send(Err(e));
                return;
            }
        };
        // Tokens before the first logit are prompt: they spend the pass's prefill budget.
        // What does not fit runs in later passes.
        let prompt = logits_at.first().copied().unwrap_or(new_tokens.len());
        let resume = if prompt <= tokens.prefill_left {
            tokens.prefill_left -= prompt;
            tokens.prompt += prompt;
            None
        } else if tokens.prefill_left > 0 {
            new_tokens.truncate(tokens.prefill_left);
            logits_at.clear();
            tokens.prompt += tokens.prefill_left;
            tokens.prefill_left = 0;
            Some(request.clone())
        } else {
            // No budget left in this pass: the job, with its cache, waits for the next.
            self.deferred.push_back(Job::Score {
                request,
                reply,
                queued_at,
                prefilled,
                waited: waited + 1,
                partial: Some(cache),
            });
            return;
        };
        tokens.total += new_tokens.len();
        batch.push(Planned {
            sequence: request.sequence,
            cache,
            new_tokens,
            logits_at,
            reused,
            reply,
            queued_at,
            prefilled,
            waited,
            resume,
        });
    }

    #[allow(clippy::type_complexity)]
    fn plan(
        &mut self,
        request: &ScoreRequest,
        partial: Option<KvCache>,
    ) -> Result<(KvCache, Vec<u32>, Vec<usize>, usize)> {
        let cfg = self.llama.config();
        let len = request.context.len();
        if request.logits_from >= len {
            return Err(ModelError::InvalidRequest(format!(
                "logits requested from position {} of a {len}-token context",
                request.logits_from
            )));
        }
        if len > cfg.context_length {
            return Err(ModelError::ContextOverflow {
                requested: len,
                limit: cfg.context_length,
            });
        }
        if let Some(&id) = request.context.iter().find(|&&id| id as usize >= cfg.vocab_size) {
            return Err(ModelError::TokenOutOfRange {
                id,
                vocab: cfg.vocab_size,
            });
        }
        let mut cache = match partial.or_else(|| self.cache.take(&request.sequence)) {
            Some(cache) => cache,
            None => self.llama.new_cache()?,
        };
        // Positions that need logits must be recomputed, even if cached.
        let mut keep = cache.common_prefix_len(&request.context).min(request.logits_from);
        // Another sequence's cache may hold more of this context (a shared system prompt or
        // document); its positions are exactly what this sequence would compute.
        let copy = if self.share_prefixes {
            self.cache
                .shared_prefix_copy(&request.context, request.logits_from, keep)?
        } else {
            None
        };
        if let Some((copy, shared)) = copy {
            cache = copy;
            keep = shared;
        }
        cache.truncate(keep);
        let new_tokens = request.context[keep..].to_vec();
        let logits_at = (request.logits_from - keep..len - keep).collect();
        Ok((cache, new_tokens, logits_at, keep))
    }

    fn run_batch(&mut self, mut batch: Vec<Planned>) {
        let started = Instant::now();
        self.passes += 1;
        let batch_size = batch.len();
        let batch_tokens: usize = batch.iter().map(|p| p.new_tokens.len()).sum();
        let prompt_tokens = |p: &Planned| p.new_tokens.len().saturating_sub(p.logits_at.len());
        let batch_prompt_tokens: usize = batch.iter().map(prompt_tokens).sum();
        let result = {
            let mut steps: Vec<SequenceStep<'_>> = batch
                .iter_mut()
                .map(|p| SequenceStep {
                    cache: &mut p.cache,
                    tokens: &p.new_tokens,
                    logits_at: &p.logits_at,
                })
                .collect();
            self.llama.forward_rows(&mut steps)
        };
        let forward_seconds = started.elapsed().as_secs_f64();
        let idle_seconds = self
            .last_pass_end
            .map_or(0.0, |end| (started - end).as_secs_f64());
        self.last_pass_end = Some(Instant::now());
        PassRecord {
            sequences: batch_size,
            tokens: batch_tokens,
            prompt_tokens: batch_prompt_tokens,
            forward_seconds,
            idle_seconds,
        }
        .emit(&self.pass_log);
        let per_job = forward_seconds / batch_size.max(1) as f64;
        let old = f64::from_bits(self.seconds_per_job.load(Ordering::Relaxed));
        let ema = if old == 0.0 {
            per_job
        } else {
            old + 0.2 * (per_job - old)
        };
        self.seconds_per_job.store(ema.to_bits(), Ordering::Relaxed);
        let vocab = self.llama.config().vocab_size;
        match result {
            Ok(all_logits) => {
                let all_logits = Arc::new(all_logits);
                let mut rows_before = 0;
                let mut resumed = Vec::new();
                let mut answered = Vec::with_capacity(batch_size);
                for planned in batch {
                    // Rows are in batch order; a prompt chunk's job has none.
                    let (first_row, rows) = (rows_before, planned.logits_at.len());
                    rows_before += rows;
                    let others_prompt_tokens = batch_prompt_tokens - prompt_tokens(&planned);
                    if let Some(request) = planned.resume {
                        resumed.push(Job::Score {
                            request,
                            reply: planned.reply,
                            queued_at: planned.queued_at,
                            prefilled: planned.prefilled + planned.new_tokens.len(),
                            waited: planned.waited,
                            partial: Some(planned.cache),
                        });
                        continue;
                    }
                    let scores = Scores {
                        logits: Logits::new(all_logits.clone(), first_row * vocab, rows * vocab),
                        vocab,
                        reused: planned.reused.saturating_sub(planned.prefilled),
                        computed: planned.new_tokens.len() + planned.prefilled,
                        batch_size,
                        batch_tokens,
                        others_prompt_tokens,
                        queue_seconds: (started - planned.queued_at).as_secs_f64(),
                        forward_seconds,
                        pass: self.passes,
                    };
                    answered.push(planned.sequence.clone());
                    self.cache.put(planned.sequence, planned.cache);
                    let _ = planned.reply.send(Ok(scores));
                }
                self.returns.answered(answered, forward_seconds);
                // The rest of chunked prompts run in later passes, in `prefill_order`.
                self.deferred.extend(resumed);
            }
            Err(e) => {
                self.returns.answered(Vec::new(), forward_seconds);
                let message = e.to_string();
                for planned in batch {
                    // The cache may hold partial writes beyond its committed length, which
                    // the next use overwrites; it stays consistent.
                    self.cache.put(planned.sequence, planned.cache);
                    let _ = planned.reply.send(Err(ModelError::Forward(message.clone())));
                }
            }
        }
        self.cache.enforce_bound();
    }
}

mod pass_record;
mod prefill_order;
mod returns;
#[cfg(test)]
mod tests;
mod types;
