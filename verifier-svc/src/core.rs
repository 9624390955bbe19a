//! Target scoring, independent of transport: the gRPC handler and the in-process all-in-one
//! mode both call [`VerifierCore::verify`]. A request carries the session's full context plus
//! the draft; the engine reuses whatever prefix it has cached for the session and scores the
//! rest, and the K + 1 next-token distributions go back in the smallest exact form the
//! caller's acceptance needs.

use specd_common::convert::{distribution_to_proto, identity_of, sampling_from_proto};
use specd_model::{Engine, ModelInfo, ScoreRequest, SparseDist, argmax, warp};
use specd_proto::v1 as pb;
use tracing::Instrument;

use crate::error::VerifierError;

/// Most draft tokens one request may carry.
pub const MAX_DRAFT_TOKENS: usize = 64;

pub struct VerifierCore {
    engine: Engine,
    replica: String,
}

impl VerifierCore {
    pub fn new(engine: Engine, replica: String) -> Self {
        Self { engine, replica }
    }

    pub fn model(&self) -> &ModelInfo {
        self.engine.info()
    }

    pub fn identity(&self) -> pb::ModelIdentity {
        identity_of(self.engine.info())
    }

    pub fn release(&self, session_id: &str) {
        self.engine.release(session_id);
    }

    /// Scoring jobs waiting for the model.
    pub fn queue_depth(&self) -> usize {
        self.engine.queue_depth()
    }

    /// Refuses a call at once (ResourceExhausted) when the queue ahead of it would likely
    /// outlast its deadline: better an immediate "overloaded" the caller can take elsewhere
    /// than a DeadlineExceeded after waiting the whole deadline out.
    pub fn admit(&self, deadline: Option<std::time::Duration>) -> Result<(), VerifierError> {
        let Some(deadline) = deadline else { return Ok(()) };
        let wait = self.engine.expected_wait();
        if wait > deadline {
            return Err(VerifierError::Busy(format!(
                "the queue ahead ({} jobs) would take about {} ms, more than the call's deadline of {} ms",
                self.engine.queue_depth(),
                wait.as_millis(),
                deadline.as_millis()
            )));
        }
        Ok(())
    }

    /// Scores `context + draft` and returns `draft.len() + 1` distributions.
    pub async fn verify(&self, request: pb::VerifyRequest) -> Result<pb::VerifyResponse, VerifierError> {
        let info = self.engine.info();
        if request.session_id.is_empty() || request.session_id.len() > 256 {
            return Err(VerifierError::InvalidArgument(
                "session_id must be 1 to 256 bytes".into(),
            ));
        }
        if request.context.is_empty() {
            return Err(VerifierError::InvalidArgument("context is empty".into()));
        }
        if request.draft.len() > MAX_DRAFT_TOKENS {
            return Err(VerifierError::InvalidArgument(format!(
                "draft has {} tokens; at most {MAX_DRAFT_TOKENS}",
                request.draft.len()
            )));
        }
        let mode = pb::DistributionMode::try_from(request.mode).map_err(|_| {
            VerifierError::InvalidArgument(format!("unknown distribution mode {}", request.mode))
        })?;
        let sampling = sampling_from_proto(request.sampling.as_ref());
        sampling
            .validate()
            .map_err(|e| VerifierError::InvalidArgument(e.to_string()))?;
        let total = request.context.len() + request.draft.len();
        if total > info.context_length {
            return Err(VerifierError::ContextTooLong {
                requested: total,
                limit: info.context_length,
            });
        }
        let logits_from = request.context.len() - 1;
        let mut context = request.context;
        context.extend_from_slice(&request.draft);
        // Queue wait and the batched forward pass, as one span.
        let engine_span = tracing::info_span!("engine.score", tokens = context.len());
        let scores = self
            .engine
            .score(ScoreRequest {
                sequence: request.session_id,
                context,
                logits_from,
            })
            .instrument(engine_span)
            .await?;
        let vocab = scores.vocab;
        let positions = (0..scores.rows())
            .map(|i| {
                let row = scores.row(i);
                match mode {
                    pb::DistributionMode::Logits => pb::Distribution {
                        repr: Some(pb::distribution::Repr::Logits(pb::DenseDistribution {
                            values: row.to_vec(),
                        })),
                    },
                    pb::DistributionMode::Warped if !sampling.is_greedy() => {
                        distribution_to_proto(&warp(row, &sampling), vocab)
                    }
                    // Greedy acceptance needs the argmax only.
                    _ => distribution_to_proto(&SparseDist::point(argmax(row)), vocab),
                }
            })
            .collect();
        Ok(pb::VerifyResponse {
            positions,
            reused_tokens: scores.reused as u32,
            computed_tokens: scores.computed as u32,
            batch_size: scores.batch_size as u32,
            batch_tokens: scores.batch_tokens as u32,
            others_prompt_tokens: scores.others_prompt_tokens as u32,
            queue_seconds: scores.queue_seconds,
            forward_seconds: scores.forward_seconds,
            replica: self.replica.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use specd_model::EngineOptions;
    use specd_model::synthetic::{SyntheticSpec, write_tiny_llama};

    use super::*;

    #[tokio::test(flavor = "multi_thread")]
    async fn a_queue_longer_than_the_deadline_is_refused_at_once() {
        let file = tempfile::NamedTempFile::new().unwrap();
        // Big enough that a pass takes a while, so a queue builds behind it.
        let spec = SyntheticSpec {
            n_embd: 128,
            n_ff: 384,
            n_head: 4,
            n_head_kv: 2,
            n_layer: 4,
            context_length: 1024,
            ..SyntheticSpec::default()
        };
        write_tiny_llama(file.path(), &spec).unwrap();
        let loaded = specd_model::load(
            file.path(),
            EngineOptions {
                max_batch_tokens: 1,
                ..EngineOptions::default()
            },
        )
        .unwrap();
        let core = Arc::new(VerifierCore::new(loaded.engine, "test".into()));
        let request = |i: usize| pb::VerifyRequest {
            session_id: format!("s{i}"),
            context: (0..400).map(|t| 3 + (t % 250) as u32).collect(),
            ..Default::default()
        };
        core.verify(request(0)).await.unwrap(); // one pass measured
        let jobs: Vec<_> = (1..9)
            .map(|i| {
                let core = core.clone();
                tokio::spawn(async move { core.verify(request(i)).await })
            })
            .collect();
        let mut refused = false;
        let started = std::time::Instant::now();
        while started.elapsed() < Duration::from_secs(10) {
            if core.queue_depth() > 2 {
                let error = core.admit(Some(Duration::from_nanos(1))).unwrap_err();
                assert!(error.to_string().contains("deadline"), "{error}");
                assert_eq!(tonic::Status::from(error).code(), tonic::Code::ResourceExhausted);
                refused = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        assert!(refused, "the queue never built up");
        core.admit(None).expect("no deadline, no refusal");
        core.admit(Some(Duration::from_secs(600)))
            .expect("a generous deadline is admitted");
        for job in jobs {
            job.await.unwrap().unwrap();
        }
    }
}
