//! What the engine reports about each forward pass: a debug line (target
//! `specd_model::engine::pass`, for a pass log) and metrics through the `metrics` facade,
//! which a serving binary exports to Prometheus and which cost nothing where no recorder is
//! installed. The metrics split the engine's time by what a pass carried, since prompt
//! chunks and decode (or verify) rows scale so differently: `specd_engine_pass_seconds`
//! (`kind` = `prompt` for a pass with any prompt tokens, `decode` otherwise; its sum is the
//! time spent in such passes), `specd_engine_idle_seconds` (the gap before each pass),
//! `specd_engine_prompt_tokens_total` and `specd_engine_scored_tokens_total` (tokens whose
//! logits a pass computed: decode and verify rows; `kind` as for the pass that scored them).

/// One forward pass, as measured by the engine's loop.
pub(super) struct PassRecord {
    pub sequences: usize,
    pub tokens: usize,
    pub prompt_tokens: usize,
    pub forward_seconds: f64,
    pub idle_seconds: f64,
}

impl PassRecord {
    /// Logs the pass and records its metrics.
    pub fn emit(&self) {
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
