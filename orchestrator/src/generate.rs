//! The speculative decoding loop. Per step: ask the drafter for up to K tokens (skipped when
//! speculation is off or the drafter fails: speculation is never a dependency), choose how
//! many to verify (adaptive K), score context + draft in one verifier pass, accept locally
//! (greedy or exact rejection sampling), then emit the accepted tokens with eos, stop-string
//! and length checks. The session's context changes only when a request succeeds.

use std::sync::Arc;
use std::time::Instant;

use tokio::sync::Semaphore;
use tracing::Instrument;
use tracing::field::Empty;

use prost::Message;
use specd_common::convert::{distribution_from_proto, sampling_to_proto};
use specd_model::{Sampler, SparseDist, TextModel};
use specd_proto::v1 as pb;

use crate::acceptance::{accept_greedy, accept_sampled};
use crate::adaptive::bucket;
use crate::backend::{DrafterBackend, VerifierBackend};
use crate::costs::{CostModel, DraftPricing, VerifyCall};
use crate::error::OrchestratorError;
use crate::observe;
use crate::pool::VerifierPool;
use crate::request::{Drafter, GenerationParams, Input, Limits, validate};
use crate::session::{Session, SessionStore};
use crate::setup::GeneratorSettings;
use crate::stop::StopMatcher;

/// Receives text as it is accepted (streaming); `None` for unary calls.
pub type ChunkSink<'a> = Option<&'a tokio::sync::mpsc::Sender<pb::TokenChunk>>;

pub struct Generator {
    pub verifier: Arc<dyn VerifierBackend>,
    pub drafter: Option<Arc<dyn DrafterBackend>>,
    /// The remote verifier pool behind `verifier`, for status reports.
    pub pool: Option<Arc<VerifierPool>>,
    pub text: TextModel,
    pub costs: Arc<CostModel>,
    pub sessions: SessionStore,
    pub limits: Limits,
    /// Requests served at once; when none is free, new ones are refused at once.
    admission: Arc<Semaphore>,
    max_concurrent_requests: usize,
}

/// Where a request's first step (prompt processing) left its clock and totals.
struct FirstStep {
    seconds: f64,
    tokens: usize,
    forward_seconds: f64,
    draft_seconds: f64,
    verify_seconds: f64,
}

impl FirstStep {
    /// The clock (`seconds` since the request started), the tokens generated and the
    /// running totals as the first step leaves them.
    fn at(seconds: f64, tokens: usize, totals: &Totals) -> Self {
        Self {
            seconds,
            tokens,
            forward_seconds: totals.forward_seconds,
            draft_seconds: totals.draft_seconds,
            verify_seconds: totals.verify_seconds,
        }
    }
}

/// Running totals of one request.
#[derive(Default)]
struct Totals {
    proposed: u32,
    accepted: u32,
    verifier_calls: u32,
    drafter_calls: u32,
    drafted_steps: u32,
    bytes_sent: u64,
    bytes_received: u64,
    draft_seconds: f64,
    verify_seconds: f64,
    retries: u32,
    failovers: u32,
    batch_size_sum: u64,
    queue_seconds: f64,
    forward_seconds: f64,
}

impl Generator {
    pub fn new(
        verifier: Arc<dyn VerifierBackend>,
        drafter: Option<Arc<dyn DrafterBackend>>,
        text: TextModel,
        settings: GeneratorSettings,
    ) -> Self {
        let max_concurrent_requests = settings.max_concurrent_requests.max(1);
        Self {
            verifier,
            drafter,
            pool: None,
            text,
            costs: Arc::new(CostModel::default()),
            sessions: SessionStore::new(settings.session_ttl, settings.max_sessions),
            limits: settings.limits,
            admission: Arc::new(Semaphore::new(max_concurrent_requests)),
            max_concurrent_requests,
        }
    }

    /// Generates for an anonymous caller (no authentication).
    pub async fn generate(
        &self,
        request: &pb::GenerateRequest,
        sink: ChunkSink<'_>,
    ) -> Result<pb::GenerateResponse, OrchestratorError> {
        self.generate_as(request, sink, None).await
    }

    /// Generates for the caller identified by API key id `owner`: new sessions belong to it,
    /// and it may continue only its own.
    pub async fn generate_as(
        &self,
        request: &pb::GenerateRequest,
        sink: ChunkSink<'_>,
        owner: Option<&str>,
    ) -> Result<pb::GenerateResponse, OrchestratorError> {
        let _admitted = self.admission.clone().try_acquire_owned().map_err(|_| {
            OrchestratorError::ResourceExhausted(format!(
                "the orchestrator is serving its limit of {} requests; retry later",
                self.max_concurrent_requests
            ))
        })?;
        let params = validate(request, &self.limits, self.text.config.vocab_size)?;
        let mut session = match &params.session_id {
            Some(id) => self.sessions.acquire(id, owner)?,
            None => self.sessions.create(owner)?,
        };
        let session_id = session.id.clone();
        let result = self.generate_in(&mut session, &params, sink).await;
        drop(session);
        if result.is_err() && params.session_id.is_none() {
            // A session created for a request that failed was never shown to anyone.
            self.sessions.remove(&session_id);
        } else {
            self.sessions.touch(&session_id);
        }
        observe::sessions(self.sessions.len());
        result
    }

    /// Runs one request on a session it holds; the session changes only on success.
    async fn generate_in(
        &self,
        session: &mut Session,
        params: &GenerationParams,
        sink: ChunkSink<'_>,
    ) -> Result<pb::GenerateResponse, OrchestratorError> {
        let (context, prompt_tokens, history) = self.build_context(session, &params.input)?;
        let limit = self.text.config.context_length;
        if context.len() >= limit {
            return Err(OrchestratorError::InvalidArgument(format!(
                "the prompt (with the session's earlier context) is {} tokens; the model's context holds {limit}",
                context.len()
            )));
        }
        let max_tokens = params.max_tokens.min(limit - context.len());
        let (context, mut response) = self.run(session, context, params, max_tokens, sink).await?;
        if let Some(mut history) = history {
            history.push(specd_model::ChatMessage::new("assistant", response.text.clone()));
            session.messages = history;
        }
        response.usage = Some(pb::Usage {
            prompt_tokens: prompt_tokens as u32,
            completion_tokens: response.token_ids.len() as u32,
            context_tokens: context.len() as u32,
        });
        session.context = context;
        response.session_id = session.id.clone();
        Ok(response)
    }

    /// The full context for this request: the session's plus the new input. Chat input is
    /// rendered with the model's template over the whole conversation.
    #[allow(clippy::type_complexity)]
    fn build_context(
        &self,
        session: &Session,
        input: &Input,
    ) -> Result<(Vec<u32>, usize, Option<Vec<specd_model::ChatMessage>>), OrchestratorError> {
        let tokenizer = &self.text.tokenizer;
        let encode = |text: &str| {
            tokenizer
                .encode(text)
                .map_err(|e| OrchestratorError::InvalidArgument(format!("cannot tokenize the input: {e}")))
        };
        match input {
            Input::Prompt(text) => {
                let mut ids = encode(text)?;
                if !session.context.is_empty() && ids.first().copied() == tokenizer.bos() {
                    ids.remove(0); // a continuation does not restart the sequence
                }
                let mut context = session.context.clone();
                let n = ids.len();
                context.extend(ids);
                Ok((context, n, None))
            }
            Input::Chat(messages) => {
                let template = self.text.chat_template.as_ref().ok_or_else(|| {
                    OrchestratorError::InvalidArgument(
                        "this model has no chat template; send a prompt".into(),
                    )
                })?;
                let mut history = session.messages.clone();
                history.extend(messages.iter().cloned());
                let render = |m: &[specd_model::ChatMessage]| {
                    template
                        .render(m, true)
                        .map_err(|e| OrchestratorError::InvalidArgument(e.to_string()))
                };
                if session.messages.is_empty() && !session.context.is_empty() {
                    let ids = encode(&render(messages)?)?;
                    let n = ids.len();
                    let mut context = session.context.clone();
                    context.extend(ids);
                    return Ok((context, n, Some(history)));
                }
                let context = encode(&render(&history)?)?;
                let n = context.len().saturating_sub(session.context.len());
                Ok((context, n, Some(history)))
            }
        }
    }

    async fn run(
        &self,
        session: &mut Session,
        mut context: Vec<u32>,
        params: &GenerationParams,
        max_tokens: usize,
        sink: ChunkSink<'_>,
    ) -> Result<(Vec<u32>, pb::GenerateResponse), OrchestratorError> {
        let started = Instant::now();
        let tokenizer = self.text.tokenizer.clone();
        let vocab = self.text.config.vocab_size;
        let greedy = params.sampling.is_greedy();
        let mut sampler = Sampler::new(params.seed);
        let mut decoder = tokenizer.stream_decoder();
        let mut stop = StopMatcher::new(params.stop.clone());
        let mut totals = Totals::default();
        let mut generated: Vec<u32> = Vec::new();
        let mut text = String::new();
        let mut finish = pb::FinishReason::Length;
        let mut k_sum = 0usize;
        // The first step (prompt processing), excluded from decode speed.
        let mut first_step: Option<FirstStep> = None;
        let mut step = 0u32;
        'steps: while generated.len() < max_tokens {
            step += 1;
            let remaining = max_tokens - generated.len();
            let step_span = tracing::info_span!(
                "step",
                session = %session.id,
                step,
                k = Empty,
                accepted = Empty,
                bonus = Empty,
            );
            let draft_span =
                tracing::info_span!(parent: &step_span, "draft", drafter = ?params.drafter, proposed = Empty);
            let draft_started = Instant::now();
            let StepDraft {
                tokens: draft,
                q,
                bucket,
                unverified_first,
            } = self
                .draft(
                    session,
                    &context,
                    params,
                    remaining - 1,
                    &mut sampler,
                    &mut totals,
                )
                .instrument(draft_span.clone())
                .await;
            draft_span.record("proposed", draft.len());
            step_span.record("k", draft.len());
            observe::hop("draft", draft_started);
            k_sum += draft.len();
            let request = pb::VerifyRequest {
                session_id: session.id.clone(),
                context: context.clone(),
                draft: draft.clone(),
                sampling: Some(sampling_to_proto(&params.sampling)),
                mode: if greedy {
                    pb::DistributionMode::Argmax
                } else {
                    pb::DistributionMode::Warped
                } as i32,
            };
            let bytes_sent = request.encoded_len() as u64;
            totals.bytes_sent += bytes_sent;
            let verify_span = tracing::info_span!(
                parent: &step_span,
                "verify",
                bytes_sent,
                bytes_received = Empty,
                replica = Empty,
                attempts = Empty,
                failovers = Empty,
                computed = Empty,
            );
            let verify_started = Instant::now();
            let verified = self
                .verifier
                .verify(request)
                .instrument(verify_span.clone())
                .await
                .map_err(|s| OrchestratorError::downstream("verifier", s))?;
            observe::hop("verify", verify_started);
            totals.retries += verified.attempts - 1;
            totals.failovers += verified.failovers;
            let response = verified.response;
            let bytes_received = response.encoded_len() as u64;
            verify_span.record("bytes_received", bytes_received);
            verify_span.record("replica", verified.replica.as_str());
            verify_span.record("attempts", verified.attempts);
            verify_span.record("failovers", verified.failovers);
            verify_span.record("computed", response.computed_tokens);
            let verify_seconds = verify_started.elapsed().as_secs_f64();
            // Every pass is a point of the verifier's cost curve (time by tokens in the pass),
            // whoever else was in it; its size and sessions feed the load the policy sees.
            self.costs.record_verify(VerifyCall {
                batch_size: response.batch_size,
                batch_tokens: response.batch_tokens,
                others_prompt_tokens: response.others_prompt_tokens,
                forward_seconds: response.forward_seconds,
                queue_seconds: response.queue_seconds,
                call_seconds: verify_seconds,
                // Tokens this call computed beyond the drafts and the last accepted one: its
                // prompt (or a context the replica had not cached), whose earlier chunks'
                // passes count in its queue wait.
                computed_context: response.computed_tokens.saturating_sub(draft.len() as u32 + 1),
            });
            totals.verify_seconds += verify_seconds;
            totals.verifier_calls += 1;
            totals.batch_size_sum += u64::from(response.batch_size.max(1));
            totals.queue_seconds += response.queue_seconds;
            totals.forward_seconds += response.forward_seconds;
            totals.bytes_received += bytes_received;
            if response.positions.len() != draft.len() + 1 {
                return Err(OrchestratorError::Internal(format!(
                    "verifier returned {} positions for {} drafts",
                    response.positions.len(),
                    draft.len()
                )));
            }
            let p: Vec<SparseDist> = response
                .positions
                .iter()
                .map(|d| distribution_from_proto(d, vocab))
                .collect::<Result<_, _>>()
                .map_err(|e| OrchestratorError::Internal(format!("verifier sent a bad distribution: {e}")))?;
            let accept_started = Instant::now();
            let outcome = tracing::info_span!(parent: &step_span, "accept", k = draft.len()).in_scope(|| {
                if greedy {
                    let target: Vec<u32> = p.iter().map(|d| d.ids[0]).collect();
                    accept_greedy(&draft, &target)
                } else {
                    accept_sampled(&draft, &q, &p, &mut || sampler.uniform())
                }
            });
            observe::hop("accept", accept_started);
            // The bonus token: every draft accepted, one more from the target for free.
            let bonus = outcome.accepted == draft.len() && !draft.is_empty();
            step_span.record("accepted", outcome.accepted);
            step_span.record("bonus", bonus);
            observe::step(draft.len(), outcome.accepted);
            session.policy.record(draft.len(), outcome.accepted, bucket);
            if let Some(first) = unverified_first {
                session.policy.record_unverified(bucket, first == outcome.next);
            }
            tracing::debug!(
                k = draft.len(),
                accepted = outcome.accepted,
                alpha = session.policy.alpha(bucket),
                verify_ms = verify_seconds * 1e3,
                forward_ms = response.forward_seconds * 1e3,
                queue_ms = response.queue_seconds * 1e3,
                computed = response.computed_tokens,
                "speculative step"
            );
            totals.proposed += draft.len() as u32;
            totals.accepted += outcome.accepted as u32;
            let mut chunk = pb::TokenChunk::default();
            for token in outcome.tokens(&draft) {
                context.push(token);
                if tokenizer.is_end_of_generation(token) {
                    finish = pb::FinishReason::Eos;
                    emit(sink, chunk).await;
                    break 'steps;
                }
                generated.push(token);
                chunk.token_ids.push(token);
                let piece = decoder
                    .push(token)
                    .map_err(|e| OrchestratorError::Internal(e.to_string()))?;
                let check = stop.push(&piece);
                chunk.text.push_str(&check.release);
                text.push_str(&check.release);
                if check.stopped {
                    finish = pb::FinishReason::Stop;
                    emit(sink, chunk).await;
                    break 'steps;
                }
                if generated.len() >= max_tokens {
                    break;
                }
            }
            if first_step.is_none() {
                first_step = Some(FirstStep::at(
                    started.elapsed().as_secs_f64(),
                    generated.len(),
                    &totals,
                ));
            }
            if !emit(sink, chunk).await {
                finish = pb::FinishReason::Unspecified; // the client went away
                break;
            }
        }
        if finish != pb::FinishReason::Stop {
            let rest = stop.finish();
            if !rest.is_empty() {
                text.push_str(&rest);
                emit(
                    sink,
                    pb::TokenChunk {
                        text: rest,
                        token_ids: vec![],
                    },
                )
                .await;
            }
        }
        let decode_seconds = started.elapsed().as_secs_f64();
        observe::request(generated.len(), totals.proposed, totals.accepted);
        // A generation that ended in its first step has no decode phase.
        let first = first_step.unwrap_or_else(|| FirstStep::at(decode_seconds, generated.len(), &totals));
        let (ttft, first_tokens) = (first.seconds, first.tokens);
        let later_tokens = generated.len().saturating_sub(first_tokens);
        let stats = pb::SpeculationStats {
            proposed: totals.proposed,
            accepted: totals.accepted,
            verifier_calls: totals.verifier_calls,
            drafter_calls: totals.drafter_calls,
            mean_accepted_length: generated.len() as f64 / f64::from(totals.verifier_calls.max(1)),
            acceptance_rate: if totals.proposed == 0 {
                0.0
            } else {
                f64::from(totals.accepted) / f64::from(totals.proposed)
            },
            bytes_sent: totals.bytes_sent,
            bytes_received: totals.bytes_received,
            draft_seconds: totals.draft_seconds,
            verify_seconds: totals.verify_seconds,
            decode_seconds,
            tokens_per_second: if later_tokens == 0 {
                0.0
            } else {
                later_tokens as f64 / (decode_seconds - ttft).max(1e-9)
            },
            time_to_first_token_seconds: ttft,
            retries: totals.retries,
            failovers: totals.failovers,
            mean_batch_size: totals.batch_size_sum as f64 / f64::from(totals.verifier_calls.max(1)),
            verifier_queue_seconds: totals.queue_seconds,
            verifier_forward_seconds: totals.forward_seconds,
            decode_forward_seconds: totals.forward_seconds - first.forward_seconds,
            decode_draft_seconds: totals.draft_seconds - first.draft_seconds,
            decode_verify_seconds: totals.verify_seconds - first.verify_seconds,
            mean_k: if totals.drafted_steps == 0 {
                0.0
            } else {
                k_sum as f64 / f64::from(totals.drafted_steps)
            },
        };
        let response = pb::GenerateResponse {
            session_id: String::new(),
            text,
            token_ids: generated,
            finish_reason: finish as i32,
            usage: None,
            stats: Some(stats),
        };
        Ok((context, response))
    }

    /// Up to `cap` draft tokens, their q distributions and their acceptance group; empty when
    /// speculation is off, does not pay, or the drafter fails.
    async fn draft(
        &self,
        session: &mut Session,
        context: &[u32],
        params: &GenerationParams,
        cap: usize,
        sampler: &mut Sampler,
        totals: &mut Totals,
    ) -> StepDraft {
        let cap = cap.min(params.max_k);
        let Some(drafter) = self.drafter.as_ref().filter(|_| params.speculate && cap > 0) else {
            session.policy.skip(&self.costs);
            return StepDraft::default();
        };
        // An LM drafter pays per token, so K is chosen before drafting; prompt lookup is
        // nearly free, so it proposes the most and K is chosen from what it found.
        let per_token = params.drafter == Drafter::Lm;
        let pricing = if per_token {
            DraftPricing::PerToken
        } else {
            DraftPricing::PerCall
        };
        session.policy.set_pricing(pricing);
        // No proposal could pay (a busy verifier, a session whose drafts fail): the drafter
        // is not asked, which spares its round trip and both processes' CPU.
        if !per_token && !params.fixed_k && !session.policy.worth_drafting(cap, &self.costs) {
            session.policy.skip(&self.costs);
            return StepDraft::default();
        }
        let ask = if per_token && !params.fixed_k {
            session.policy.choose(cap, 0, &self.costs)
        } else {
            cap
        };
        if ask == 0 {
            return StepDraft::default();
        }
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
                return StepDraft::default();
            }
        };
        totals.bytes_received += response.encoded_len() as u64;
        self.costs
            .record_draft(response.tokens.len(), seconds, pricing, response.catch_up_seconds);
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
                return StepDraft::default();
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
        }
        // A point-mass proposal the policy chose not to verify still tells it something
        // once the step's token is known (see `KPolicy::record_unverified`).
        let unverified_first = match (response.tokens.first(), qs.first()) {
            (Some(&first), Some(q)) if k == 0 && !per_token && q.ids.len() == 1 => Some(first),
            _ => None,
        };
        StepDraft {
            tokens: response.tokens[..k].to_vec(),
            q: qs[..k].to_vec(),
            bucket: bucket(response.match_length as usize),
            unverified_first,
        }
    }
}

/// What a step verifies: its drafts with their q distributions and acceptance group, and
/// the first token of a proposal it chose not to verify.
#[derive(Default)]
struct StepDraft {
    tokens: Vec<u32>,
    q: Vec<SparseDist>,
    bucket: usize,
    unverified_first: Option<u32>,
}

/// Sends a non-empty chunk to a streaming client; false when the client has gone.
async fn emit(sink: ChunkSink<'_>, chunk: pb::TokenChunk) -> bool {
    match sink {
        Some(tx) if !chunk.text.is_empty() || !chunk.token_ids.is_empty() => tx.send(chunk).await.is_ok(),
        Some(tx) => !tx.is_closed(),
        None => true,
    }
}
