//! What the engine reports about each forward pass: a debug line (target
//! `specd_model::engine::pass`, for a pass log) and metrics through the `metrics` facade,
//! which a serving binary exports to Prometheus and which cost nothing where no recorder is
//! installed. The metrics split the engine's time by what a pass carried, since prompt
//! chunks and decode (or verify) rows scale so differently: `specd_engine_pass_seconds`
//! (`kind` = `prompt` for a pass with any prompt tokens, `decode` otherwise; its sum is the
//! time spent in such passes), `specd_engine_idle_seconds` (the gap before each pass),
//! `specd_engine_prompt_tokens_total` and `specd_engine_scored_tokens_total` (tokens whose
//! logits a pass computed: decode and verify rows; `kind` as for the pass that scored them).
//! A benchmark can also keep every pass in memory ([`Engine::start_pass_log`]), to price
//! what it replays on what the passes of its own run cost.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use super::Engine;

/// One forward pass, as measured by the engine's loop.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PassRecord {
    /// Sequences in the pass, and the tokens it computed over all of them.
    pub sequences: usize,
    pub tokens: usize,
    /// Of `tokens`, those computed for a prompt (no logits wanted).
    pub prompt_tokens: usize,
    /// The forward pass, and the engine's idle time before it.
    pub forward_seconds: f64,
    pub idle_seconds: f64,
}

impl PassRecord {
    /// Logs the pass, records its metrics and keeps it in `log` if that is recording.
    pub(super) fn emit(&self, log: &PassLog) {
        log.push(self);
        tracing::debug!(
            target: "specd_model::engine::pass",
            sequences = self.sequences,
            tokens = self.tokens,
            prompt_tokens = self.prompt_tokens,
            forward_ms = self.forward_seconds * 1e3,
            idle_ms = self.idle_seconds * 1e3,
            "forward pass"
        );
        let kind = if self.prompt_tokens > 0 {
            "prompt"
        } else {
            "decode"
        };
        metrics::histogram!("specd_engine_pass_seconds", "kind" => kind).record(self.forward_seconds);
        metrics::histogram!("specd_engine_idle_seconds").record(self.idle_seconds);
        metrics::counter!("specd_engine_prompt_tokens_total").increment(self.prompt_tokens as u64);
        metrics::counter!("specd_engine_scored_tokens_total", "kind" => kind)
            .increment(self.tokens.saturating_sub(self.prompt_tokens) as u64);
    }
}

/// The passes kept while recording (off by default: one atomic load a pass).
#[derive(Debug, Default)]
pub(super) struct PassLog {
    recording: AtomicBool,
    passes: Mutex<Vec<PassRecord>>,
}

impl PassLog {
    fn push(&self, pass: &PassRecord) {
        if self.recording.load(Ordering::Relaxed) {
            self.passes.lock().unwrap_or_else(|e| e.into_inner()).push(*pass);
        }
    }
}

impl Engine {
    /// Starts keeping every forward pass (sequences, tokens, prompt tokens, seconds), from an
    /// empty log.
    pub fn start_pass_log(&self) {
        self.pass_log
            .passes
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
        self.pass_log.recording.store(true, Ordering::Relaxed);
    }

    /// The passes since [`Engine::start_pass_log`], in order; stops keeping them.
    pub fn take_pass_log(&self) -> Vec<PassRecord> {
        self.pass_log.recording.store(false, Ordering::Relaxed);
        std::mem::take(&mut *self.pass_log.passes.lock().unwrap_or_else(|e| e.into_inner()))
    }
}
