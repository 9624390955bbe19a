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
            queue_seconds: scores.queue_seconds,
            forward_seconds: scores.forward_seconds,
            replica: self.replica.clone(),
        })
    }
}
