//! Drafting with a language model that shares the target's tokenizer: K sequential decode
//! steps on the drafter's own engine (its cache keyed by session, so successive steps reuse
//! it). In sampling mode each token is drawn from q, the drafter's distribution warped with
//! the target's parameters, and q is returned so acceptance stays exact.

use std::sync::atomic::{AtomicU64, Ordering};

use rand::Rng;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use specd_model::{Engine, SamplingParams, ScoreRequest, SparseDist, argmax, warp};

use crate::error::DrafterError;

pub struct LmDrafter {
    engine: Engine,
    /// Recent forward time of a pass of one token (`f64` bits; 0 until one is seen): what a
    /// call's first pass takes when it has no context to catch up on.
    one_token_pass: AtomicU64,
}

/// Weight of the newest one-token pass in [`LmDrafter::one_token_pass`].
const ONE_TOKEN_PASS_WEIGHT: f64 = 0.2;

/// A proposal: drafts and their q distributions, the context tokens the model computed
/// before the first draft (those its cache lacked), and the seconds that took.
pub struct LmProposal {
    pub tokens: Vec<u32>,
    pub qs: Vec<SparseDist>,
    pub computed_context: usize,
    pub catch_up_seconds: f64,
}

impl LmDrafter {
    pub fn new(engine: Engine) -> Self {
        Self {
            engine,
            one_token_pass: AtomicU64::new(0),
        }
    }

    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// Proposes `k` tokens after `context` (see [`LmProposal`]).
    pub async fn propose(
        &self,
        session: &str,
        context: &[u32],
        k: usize,
        sampling: &SamplingParams,
        seed: u64,
    ) -> Result<LmProposal, DrafterError> {
        let sequence = format!("draft:{session}");
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut context = context.to_vec();
        let limit = self.engine.info().context_length;
        let mut tokens = Vec::with_capacity(k);
        let mut qs = Vec::with_capacity(k);
        let mut computed_context = 0;
        let mut first_pass_seconds = 0.0;
        for step in 0..k {
            if context.len() >= limit {
                break;
            }
            let scores = self
                .engine
                .score(ScoreRequest {
                    sequence: sequence.clone(),
                    logits_from: context.len() - 1,
                    context: context.clone(),
                })
                .await?;
            if step == 0 {
                // The pass also computed the last context token, whose logits it returns.
                computed_context = scores.computed.saturating_sub(1);
                first_pass_seconds = scores.forward_seconds;
            }
            if scores.batch_tokens == 1 {
                self.record_one_token_pass(scores.forward_seconds);
            }
            let row = scores.row(0);
            let (token, q) = if sampling.is_greedy() {
                let token = argmax(row);
                (token, SparseDist::point(token))
            } else {
                let q = warp(row, sampling);
                (q.sample_with(rng.random::<f64>()), q)
            };
            tokens.push(token);
            qs.push(q);
            context.push(token);
        }
        let catch_up_seconds = if computed_context > 0 {
            (first_pass_seconds - f64::from_bits(self.one_token_pass.load(Ordering::Relaxed))).max(0.0)
        } else {
            0.0
        };
        Ok(LmProposal {
            tokens,
            qs,
            computed_context,
            catch_up_seconds,
        })
    }

    fn record_one_token_pass(&self, seconds: f64) {
        let old = f64::from_bits(self.one_token_pass.load(Ordering::Relaxed));
        let new = if old > 0.0 {
            old + ONE_TOKEN_PASS_WEIGHT * (seconds - old)
        } else {
            seconds
        };
        self.one_token_pass.store(new.to_bits(), Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use specd_model::synthetic::{SyntheticSpec, write_tiny_llama};
    use specd_model::{EngineOptions, SamplingParams};

    use super::*;

    #[tokio::test]
    async fn reports_the_context_its_cache_lacked() {
        let file = tempfile::NamedTempFile::new().unwrap();
        write_tiny_llama(file.path(), &SyntheticSpec::default()).unwrap();
        let loaded = specd_model::load(file.path(), EngineOptions::default()).unwrap();
        let drafter = LmDrafter::new(loaded.engine);
        let greedy = SamplingParams::GREEDY;
        let mut context: Vec<u32> = (0..40).map(|t| 3 + t % 50).collect();
        // A session's first ask computes its whole prompt before the last token's logits.
        let first = drafter.propose("s", &context, 3, &greedy, 0).await.unwrap();
        assert_eq!(first.computed_context, 39);
        assert!(first.catch_up_seconds > 0.0);
        let drafts = first.tokens;
        // The next step kept one draft and added a token of its own, the last one: the kept
        // draft is cached from drafting, so no context is caught up on.
        context.extend([drafts[0], 7]);
        let next = drafter.propose("s", &context, 3, &greedy, 0).await.unwrap();
        assert_eq!(next.computed_context, 0);
        assert_eq!(next.catch_up_seconds, 0.0);
        let drafts = next.tokens;
        // All three kept: the last draft was never fed to the model, so it is caught up on.
        context.extend(drafts);
        context.push(9);
        let all_kept = drafter.propose("s", &context, 3, &greedy, 0).await.unwrap();
        assert_eq!(all_kept.computed_context, 1);
        // Another session's first ask computes its own prompt.
        let other: Vec<u32> = (0..30).map(|t| 60 + t).collect();
        let other = drafter.propose("t", &other, 1, &greedy, 0).await.unwrap();
        assert_eq!(other.computed_context, 29);
    }
}
