//! Drafting the next step while the verifier scores this one. A prompt-lookup proposal for
//! the context as it will be if every draft of this step is kept is asked for as soon as the
//! step's drafts are known, beside the verifier call. If they are all kept and the verifier's
//! bonus token is the proposal's first token, the rest of the proposal continues the real
//! context and becomes the next step's drafts without a drafter round trip on the step's
//! path; otherwise it is dropped and the next step asks as usual. Drafts never decide what
//! is emitted (acceptance does), so a proposal made for the context it is used with is as
//! good as any: output stays exact.
//!
//! It is asked for only where it is nearly free: prompt lookup (an LM drafter's proposal
//! costs a forward pass per token), and a session whose last verifier pass was its alone
//! (a busy machine would pay for the proposals that get dropped).

use std::sync::Arc;
use std::time::Instant;

use prost::Message;
use tokio::task::JoinHandle;
use tonic::Status;
use tracing::Instrument;

use specd_proto::v1 as pb;

use crate::backend::DrafterBackend;

/// A drafter call for the context after this step, under way.
pub(crate) struct Prefetch {
    /// The context the proposal continues: this step's context and all of its drafts.
    context: Vec<u32>,
    /// The request's encoded size.
    pub bytes_sent: u64,
    call: JoinHandle<(Result<pb::ProposeResponse, Status>, f64)>,
}

/// What became of a prefetch when the next step began.
pub(crate) struct Taken {
    /// The call's seconds and response bytes, if it finished.
    pub finished: Option<(f64, u64)>,
    /// The proposal continuing the real context (the bonus token cut off), if usable.
    pub proposal: Option<pb::ProposeResponse>,
}

impl Prefetch {
    /// Asks `drafter` for up to `max_tokens` tokens after `context` followed by `draft`
    /// (`template` gives the rest of the request), in a task of its own.
    pub(crate) fn start(
        drafter: Arc<dyn DrafterBackend>,
        template: &pb::ProposeRequest,
        draft: &[u32],
        max_tokens: usize,
        span: tracing::Span,
    ) -> Self {
        let context = [template.context.as_slice(), draft].concat();
        let request = pb::ProposeRequest {
            context: context.clone(),
            max_tokens: max_tokens as u32,
            ..template.clone()
        };
        let bytes_sent = request.encoded_len() as u64;
        let call = tokio::spawn(
            async move {
                let started = Instant::now();
                let result = drafter.propose(request).await;
                (result, started.elapsed().as_secs_f64())
            }
            .instrument(span),
        );
        Self {
            context,
            bytes_sent,
            call,
        }
    }

    /// The proposal's use for the step whose context is `context`: its tokens after the
    /// first, if every draft was kept, the bonus token is the proposal's first and the call
    /// has finished. A call still running is not waited for: it finishes on its own (within
    /// the drafter client's deadline) and its answer is dropped.
    pub(crate) async fn take(self, context: &[u32]) -> Taken {
        let unused = Taken {
            finished: None,
            proposal: None,
        };
        if !self.call.is_finished() {
            return unused;
        }
        let Ok((result, seconds)) = self.call.await else {
            return unused;
        };
        let bytes_received = result.as_ref().map_or(0, |r| r.encoded_len() as u64);
        let continues = |response: &pb::ProposeResponse| {
            context.len() == self.context.len() + 1
                && context.starts_with(&self.context)
                && response.tokens.first() == context.last()
                && response.q.len() == response.tokens.len()
        };
        let proposal = result.ok().filter(continues).map(|mut response| {
            response.tokens.remove(0);
            response.q.remove(0);
            response
        });
        Taken {
            finished: Some((seconds, bytes_received)),
            proposal,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A drafter that proposes a fixed continuation whatever the context.
    struct Fixed(Vec<u32>);

    #[tonic::async_trait]
    impl DrafterBackend for Fixed {
        async fn propose(&self, request: pb::ProposeRequest) -> Result<pb::ProposeResponse, Status> {
            let tokens: Vec<u32> = self.0.iter().copied().take(request.max_tokens as usize).collect();
            Ok(pb::ProposeResponse {
                q: tokens
                    .iter()
                    .map(|&t| pb::Distribution {
                        repr: Some(pb::distribution::Repr::Point(t)),
                    })
                    .collect(),
                tokens,
                match_length: 3,
                ..Default::default()
            })
        }
        async fn info(&self) -> Result<pb::InfoResponse, Status> {
            Err(Status::unimplemented("test drafter"))
        }
    }

    async fn finished(draft: &[u32]) -> Prefetch {
        let template = pb::ProposeRequest {
            context: vec![1, 2, 3],
            ..Default::default()
        };
        let prefetch = Prefetch::start(
            Arc::new(Fixed(vec![7, 8, 9])),
            &template,
            draft,
            3,
            tracing::Span::none(),
        );
        while !prefetch.call.is_finished() {
            tokio::task::yield_now().await;
        }
        prefetch
    }

    #[tokio::test]
    async fn a_kept_step_whose_bonus_matches_continues_with_the_rest() {
        let taken = finished(&[4, 5]).await.take(&[1, 2, 3, 4, 5, 7]).await;
        assert!(taken.finished.is_some());
        let proposal = taken.proposal.expect("usable");
        assert_eq!(proposal.tokens, vec![8, 9]);
        assert_eq!(proposal.q.len(), 2);
        assert_eq!(proposal.q[0].repr, Some(pb::distribution::Repr::Point(8)));
    }

    #[tokio::test]
    async fn any_other_outcome_drops_the_proposal() {
        // Another bonus token.
        assert!(
            finished(&[4, 5])
                .await
                .take(&[1, 2, 3, 4, 5, 6])
                .await
                .proposal
                .is_none()
        );
        // A draft rejected: the context is shorter, or differs where the draft was.
        assert!(
            finished(&[4, 5])
                .await
                .take(&[1, 2, 3, 4, 7])
                .await
                .proposal
                .is_none()
        );
        assert!(
            finished(&[4, 5])
                .await
                .take(&[1, 2, 3, 6, 5, 7])
                .await
                .proposal
                .is_none()
        );
        // Generation went on past the step the proposal was for.
        assert!(
            finished(&[4, 5])
                .await
                .take(&[1, 2, 3, 4, 5, 7, 8])
                .await
                .proposal
                .is_none()
        );
    }

    #[tokio::test]
    async fn a_call_still_running_is_not_waited_for() {
        struct Hangs;
        #[tonic::async_trait]
        impl DrafterBackend for Hangs {
            async fn propose(&self, _: pb::ProposeRequest) -> Result<pb::ProposeResponse, Status> {
                std::future::pending().await
            }
            async fn info(&self) -> Result<pb::InfoResponse, Status> {
                std::future::pending().await
            }
        }
        let prefetch = Prefetch::start(
            Arc::new(Hangs),
            &pb::ProposeRequest::default(),
            &[4],
            3,
            tracing::Span::none(),
        );
        let taken = tokio::time::timeout(std::time::Duration::from_secs(5), prefetch.take(&[4, 7]))
            .await
            .expect("take does not wait for the call");
        assert!(taken.finished.is_none() && taken.proposal.is_none());
    }
}
