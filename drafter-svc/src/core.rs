//! Drafting, independent of transport: the gRPC handler and the in-process all-in-one mode
//! both call [`DrafterCore::propose`].

use std::time::Instant;

use specd_common::convert::{distribution_to_proto, sampling_from_proto};
use specd_model::SparseDist;
use specd_proto::v1 as pb;

use crate::error::DrafterError;
use crate::lm::LmDrafter;
use crate::ngram::{self, NgramConfig};

/// Most draft tokens one request may ask for.
pub const MAX_PROPOSAL_TOKENS: usize = 64;
/// Most context tokens a request may carry.
pub const MAX_CONTEXT_TOKENS: usize = 1 << 20;

pub struct DrafterCore {
    ngram: NgramConfig,
    lm: Option<LmDrafter>,
}

impl DrafterCore {
    pub fn new(ngram: NgramConfig, lm: Option<LmDrafter>) -> Self {
        Self { ngram, lm }
    }

    /// The LM drafter's model identity, if it has one (the n-gram drafter works on any ids).
    pub fn identity(&self) -> Option<pb::ModelIdentity> {
        self.lm
            .as_ref()
            .map(|lm| specd_common::convert::identity_of(lm.engine().info()))
    }

    pub fn capabilities(&self) -> Vec<String> {
        let mut kinds = vec!["ngram".to_string()];
        if self.lm.is_some() {
            kinds.push("lm".into());
        }
        kinds
    }

    pub async fn propose(&self, request: pb::ProposeRequest) -> Result<pb::ProposeResponse, DrafterError> {
        let started = Instant::now();
        if request.context.is_empty() {
            return Err(DrafterError::InvalidArgument("context is empty".into()));
        }
        if request.context.len() > MAX_CONTEXT_TOKENS {
            return Err(DrafterError::InvalidArgument(format!(
                "context has {} tokens; at most {MAX_CONTEXT_TOKENS}",
                request.context.len()
            )));
        }
        let k = request.max_tokens as usize;
        if k > MAX_PROPOSAL_TOKENS {
            return Err(DrafterError::InvalidArgument(format!(
                "max_tokens is {k}; at most {MAX_PROPOSAL_TOKENS}"
            )));
        }
        let kind = pb::DrafterKind::try_from(request.kind)
            .map_err(|_| DrafterError::InvalidArgument(format!("unknown drafter kind {}", request.kind)))?;
        let (tokens, qs, confidence, match_length, computed_context, catch_up_seconds) = match kind {
            pb::DrafterKind::Unspecified | pb::DrafterKind::Ngram => {
                let p = ngram::propose(&request.context, k, self.ngram);
                // Deterministic: each proposed token has q = 1.
                let qs = p.tokens.iter().map(|&t| SparseDist::point(t)).collect();
                (p.tokens, qs, p.confidence, p.match_length as u32, 0, 0.0)
            }
            pb::DrafterKind::Lm => {
                let lm = self.lm.as_ref().ok_or(DrafterError::KindUnavailable("lm"))?;
                if request.session_id.is_empty() || request.session_id.len() > 256 {
                    return Err(DrafterError::InvalidArgument(
                        "session_id must be 1 to 256 bytes".into(),
                    ));
                }
                let sampling = sampling_from_proto(request.sampling.as_ref());
                sampling
                    .validate()
                    .map_err(|e| DrafterError::InvalidArgument(e.to_string()))?;
                let proposal = lm
                    .propose(&request.session_id, &request.context, k, &sampling, request.seed)
                    .await?;
                let confidence = proposal.qs.first().map_or(0.0, |q: &SparseDist| q.probs[0]);
                (
                    proposal.tokens,
                    proposal.qs,
                    confidence,
                    0,
                    proposal.computed_context as u32,
                    proposal.catch_up_seconds,
                )
            }
        };
        let vocab = self
            .lm
            .as_ref()
            .map_or(usize::MAX, |lm| lm.engine().info().vocab_size);
        Ok(pb::ProposeResponse {
            tokens,
            q: qs.iter().map(|q| distribution_to_proto(q, vocab)).collect(),
            confidence,
            match_length,
            draft_seconds: started.elapsed().as_secs_f64(),
            computed_context,
            catch_up_seconds,
        })
    }
}
