//! The draft half of a speculative step: asking the drafter (or taking the proposal a
//! prefetch brought, see [`crate::prefetch`]) and choosing K from it with the session's
//! policy; and starting the next step's prefetch beside the verifier call.

use std::time::Instant;

use prost::Message;
use specd_common::convert::{distribution_from_proto, sampling_to_proto};
use specd_model::{Sampler, SparseDist};
use specd_proto::v1 as pb;

use super::{Generator, Totals};
use crate::adaptive::bucket;
use crate::prefetch::Prefetch;
use crate::request::{Drafter, GenerationParams};
use crate::session::Session;

impl Generator {
    /// Up to `cap` draft tokens, their q distributions and their acceptance group; empty when
    /// speculation is off, does not pay, or the drafter fails. A `prefetched` proposal (one
    /// that continues `context`, see [`crate::prefetch`]) stands in for the drafter call.
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn draft(
        &self,
        session: &mut Session,
        context: &[u32],
        params: &GenerationParams,
        cap: usize,
        sampler: &mut Sampler,
        totals: &mut Totals,
        prefetched: Option<pb::ProposeResponse>,
    ) -> (Vec<u32>, Vec<SparseDist>, usize) {
        let cap = cap.min(params.max_k);
        let Some(drafter) = self.drafter.as_ref().filter(|_| params.speculate && cap > 0) else {
            session.policy.skip(&self.costs);
            return (vec![], vec![], 0);
        };
        // An LM drafter pays per token, so K is chosen before drafting; prompt lookup is
        // nearly free, so it proposes the most and K is chosen from what it found.
        let per_token = params.drafter == Drafter::Lm;
        // No proposal could pay (a busy verifier, a session whose drafts fail): the drafter
        // is not asked, which spares its round trip and both processes' CPU.
        if !per_token && !params.fixed_k && !session.policy.worth_drafting(cap, &self.costs) {
            session.policy.skip(&self.costs);
            return (vec![], vec![], 0);
        }
        let ask = if per_token && !params.fixed_k {
            session.policy.choose(cap, 0, &self.costs)
        } else {
            cap
        };
        if ask == 0 {
            return (vec![], vec![], 0);
        }
        let from_prefetch = prefetched.is_some() && !per_token;
        let response = match prefetched.filter(|_| !per_token) {
            Some(mut response) => {
                response.tokens.truncate(ask);
                response.q.truncate(ask);
                // No drafter time on this step's path.
                self.costs.record_draft(response.tokens.len(), 0.0, false);
                response
            }
            None => {
                let request = pb::ProposeRequest {
                    session_id: session.id.clone(),
                    context: context.to_vec(),
                    max_tokens: ask as u32,
                    kind: match params.drafter {
                        Drafter::Ngram => pb::DrafterKind::Ngram,
                        Drafter::Lm => pb::DrafterKind::Lm,
                    } as i32,
                    sampling: Some(sampling_to_proto(&params.sampling)),
                    seed: (sampler.uniform() * u64::MAX as f64) as u64,
                };
                totals.bytes_sent += request.encoded_len() as u64;
                let started = Instant::now();
                let result = drafter.propose(request).await;
                let seconds = started.elapsed().as_secs_f64();
                totals.draft_seconds += seconds;
                totals.drafter_calls += 1;
                let response = match result {
                    Ok(r) => r,
                    Err(status) => {
                        // Logged once per breaker transition (warn) rather than once per step.
                        tracing::debug!(code = ?status.code(), message = status.message(), "drafter failed; decoding this step without drafts");
                        return (vec![], vec![], 0);
                    }
                };
                totals.bytes_received += response.encoded_len() as u64;
                self.costs.record_draft(response.tokens.len(), seconds, per_token);
                response
            }
        };
        let vocab = self.text.config.vocab_size;
        let qs: Result<Vec<SparseDist>, String> = response
            .q
            .iter()
            .map(|d| distribution_from_proto(d, vocab))
            .collect();
        let valid = response.tokens.len() <= ask
            && response.q.len() == response.tokens.len()
            && response.tokens.iter().all(|&t| (t as usize) < vocab);
        let qs = match (valid, qs) {
            (true, Ok(qs)) => qs,
            _ => {
                tracing::warn!("drafter sent an inconsistent proposal; decoding this step without drafts");
                return (vec![], vec![], 0);
            }
        };
        let k = if params.fixed_k || per_token {
            response.tokens.len()
        } else {
            let k = session.policy.choose(
                response.tokens.len(),
                bucket(response.match_length as usize),
                &self.costs,
            );
            session.policy.record_ask(k > 0);
            k
        };
        if k > 0 {
            totals.drafted_steps += 1;
            totals.prefetched_steps += u32::from(from_prefetch);
        }
        (
            response.tokens[..k].to_vec(),
            qs[..k].to_vec(),
            bucket(response.match_length as usize),
        )
    }

    /// Asks for the next step's prompt-lookup proposal beside this step's verifier call (see
    /// [`crate::prefetch`]), where it is nearly free: prefetching on, prompt lookup, this step
    /// drafted, the session's last pass was its alone, and a next step could draft.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn start_prefetch(
        &self,
        session: &Session,
        context: &[u32],
        draft: &[u32],
        params: &GenerationParams,
        remaining: usize,
        verifier_alone: bool,
        step_span: &tracing::Span,
    ) -> Option<Prefetch> {
        // Room for a next step with drafts once this one keeps every draft and its bonus.
        let next_cap = remaining.saturating_sub(draft.len() + 2).min(params.max_k);
        let drafter = self.drafter.as_ref().filter(|_| {
            self.prefetch_drafts
                && verifier_alone
                && !draft.is_empty()
                && params.speculate
                && params.drafter == Drafter::Ngram
                && next_cap > 0
        })?;
        let template = pb::ProposeRequest {
            session_id: session.id.clone(),
            context: context.to_vec(),
            max_tokens: 0,
            kind: pb::DrafterKind::Ngram as i32,
            sampling: Some(sampling_to_proto(&params.sampling)),
            // Prompt lookup draws nothing.
            seed: 0,
        };
        let span =
            tracing::info_span!(parent: step_span, "draft", drafter = ?params.drafter, prefetch = true);
        Some(Prefetch::start(
            drafter.clone(),
            &template,
            draft,
            next_cap + 1,
            span,
        ))
    }
}
