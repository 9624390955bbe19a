//! What callers hand the engine and get back: its options, a scoring request, the scores,
//! and the identity of the model it runs.

use std::sync::Arc;

use serde::Serialize;

use crate::device::DeviceSpec;

/// The default of [`EngineOptions::return_wait_share`].
pub const DEFAULT_RETURN_WAIT_SHARE: f64 = 0.5;

/// Which waiting prompt takes a pass's prompt budget (`EngineOptions::prefill_chunk`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PrefillOrder {
    /// The prompt with least left, aged so a long one is not starved (`prefill_order.rs`):
    /// prompts that arrive together reach decoding one after another, so the first ones
    /// answer sooner (lower median time to first token), the last ones no sooner.
    #[default]
    LeastLeft,
    /// Prompts take turns, a chunk each: prompts that arrive together finish together
    /// (a higher median time to first token, sometimes a lower 99th percentile).
    Turns,
}

impl std::str::FromStr for PrefillOrder {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "least-left" => Ok(Self::LeastLeft),
            "turns" => Ok(Self::Turns),
            other => Err(format!(
                "unknown prefill order `{other}` (use least-left or turns)"
            )),
        }
    }
}

/// Engine limits and placement.
#[derive(Debug, Clone)]
pub struct EngineOptions {
    pub device: DeviceSpec,
    /// Bytes of KV cache kept across requests; least recently used sequences are evicted.
    pub max_cache_bytes: usize,
    /// Most new tokens scored in one batched forward pass.
    pub max_batch_tokens: usize,
    /// Jobs that may wait for the engine; more are refused with `Overloaded`.
    pub max_queue: usize,
    /// Most prompt tokens (tokens that need no logits) computed per pass, over all sequences
    /// (0: no limit). Decode and verify steps always join the next pass; long prompts are
    /// computed a chunk per pass beside them, so a new prompt does not stall every running
    /// session for its whole prefill.
    pub prefill_chunk: usize,
    /// Which waiting prompt takes the prompt budget first.
    pub prefill_order: PrefillOrder,
    /// How long a pass may wait for more jobs to batch once one is ready (zero: start at once).
    pub batch_wait: std::time::Duration,
    /// How long a pass may wait for the sequences the previous pass answered (on their way
    /// back), as a share of that pass's time; also bounded by their measured turnaround
    /// (0: never wait). See `engine/returns.rs`.
    pub return_wait_share: f64,
    /// Let a sequence start from a copy of the prefix another sequence's cache shares with it
    /// (a system prompt, a repeated document). Off, every sequence computes its own prompt:
    /// no session's time to first token depends on what other sessions sent.
    pub share_prefixes: bool,
}

impl Default for EngineOptions {
    fn default() -> Self {
        Self {
            device: DeviceSpec::Cpu,
            max_cache_bytes: 1 << 30,
            max_batch_tokens: 512,
            max_queue: 256,
            prefill_chunk: 64,
            prefill_order: PrefillOrder::LeastLeft,
            batch_wait: std::time::Duration::ZERO,
            return_wait_share: DEFAULT_RETURN_WAIT_SHARE,
            share_prefixes: true,
        }
    }
}

/// What a model is: compared across services so that drafter and verifier agree.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ModelInfo {
    pub name: String,
    pub architecture: String,
    pub tokenizer_identity: String,
    pub vocab_size: usize,
    pub context_length: usize,
    pub n_layer: usize,
    pub n_embd: usize,
}

/// Score a sequence: make the engine hold `context` and return logits at positions
/// `logits_from..context.len()` (the logits at position i predict token i + 1).
#[derive(Debug, Clone)]
pub struct ScoreRequest {
    pub sequence: String,
    pub context: Vec<u32>,
    pub logits_from: usize,
}

/// One request's logits: a window of its forward pass's logits, which every request the
/// pass served shares (a batched pass's replies copy nothing). Reads as a `[f32]`.
#[derive(Clone)]
pub struct Logits {
    pass: Arc<Vec<f32>>,
    start: usize,
    len: usize,
}

impl Logits {
    /// Values `start..start + len` of a pass's logits.
    pub(crate) fn new(pass: Arc<Vec<f32>>, start: usize, len: usize) -> Self {
        assert!(start + len <= pass.len(), "a window inside the pass's logits");
        Self { pass, start, len }
    }
}

impl std::ops::Deref for Logits {
    type Target = [f32];

    fn deref(&self) -> &[f32] {
        &self.pass[self.start..self.start + self.len]
    }
}

impl PartialEq for Logits {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl std::fmt::Debug for Logits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Logits({} values)", self.len)
    }
}

/// Logits for the requested positions, row-major `[rows, vocab]`.
#[derive(Debug, Clone)]
pub struct Scores {
    pub logits: Logits,
    pub vocab: usize,
    /// Context tokens served from the cache.
    pub reused: usize,
    /// Context tokens run through the model for this request.
    pub computed: usize,
    /// Sequences in the forward pass that served this request, and the tokens it computed.
    pub batch_size: usize,
    pub batch_tokens: usize,
    /// Of `batch_tokens`, the prompt tokens (tokens computed with no logits due) of the
    /// pass's other sequences: work this request's drafts shared the pass with.
    pub others_prompt_tokens: usize,
    /// Time the job waited for the engine, and the forward pass itself.
    pub queue_seconds: f64,
    pub forward_seconds: f64,
    /// The engine's count of forward passes when this one ran (the first is 1).
    pub pass: u64,
}

impl Scores {
    pub fn rows(&self) -> usize {
        self.logits.len() / self.vocab
    }

    pub fn row(&self, i: usize) -> &[f32] {
        &self.logits[i * self.vocab..(i + 1) * self.vocab]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logits_are_their_window_of_the_pass_and_compare_by_value() {
        let pass = Arc::new(vec![0.0, 1.0, 2.0, 3.0, 4.0, 5.0]);
        let second = Logits::new(pass.clone(), 2, 2);
        assert_eq!(&*second, &[2.0, 3.0]);
        assert_eq!(Logits::new(pass.clone(), 6, 0).len(), 0);
        // Equal values in different passes are equal logits; other windows are not.
        assert_eq!(second, Logits::new(Arc::new(vec![2.0, 3.0]), 0, 2));
        assert_ne!(second, Logits::new(pass, 3, 2));
    }

    #[test]
    #[should_panic(expected = "a window inside the pass's logits")]
    fn a_window_past_the_pass_is_refused() {
        Logits::new(Arc::new(vec![0.0; 4]), 2, 3);
    }
}
