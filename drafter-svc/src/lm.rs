//! Drafting with a language model that shares the target's tokenizer: K sequential decode
//! steps on the drafter's own engine (its cache keyed by session, so successive steps reuse
//! it). In sampling mode each token is drawn from q, the drafter's distribution warped with
//! the target's parameters, and q is returned so acceptance stays exact.

use rand::Rng;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use specd_model::{Engine, SamplingParams, ScoreRequest, SparseDist, argmax, warp};

use crate::error::DrafterError;

pub struct LmDrafter {
    engine: Engine,
}

impl LmDrafter {
    pub fn new(engine: Engine) -> Self {
        Self { engine }
    }

    pub fn engine(&self) -> &Engine {
        &self.engine
    }

    /// Proposes `k` tokens after `context` with their q distributions.
    pub async fn propose(
        &self,
        session: &str,
        context: &[u32],
        k: usize,
        sampling: &SamplingParams,
        seed: u64,
    ) -> Result<(Vec<u32>, Vec<SparseDist>), DrafterError> {
        let sequence = format!("draft:{session}");
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut context = context.to_vec();
        let limit = self.engine.info().context_length;
        let mut tokens = Vec::with_capacity(k);
        let mut qs = Vec::with_capacity(k);
        for _ in 0..k {
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
        Ok((tokens, qs))
    }
}
