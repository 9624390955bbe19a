//! The public `specd.v1.Orchestrator` gRPC service over the [`Generator`].

use std::sync::Arc;

use specd_proto::v1 as pb;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status};
use tracing::Instrument;

use crate::OrchestratorError;
use crate::auth::Caller;
use crate::generate::Generator;
use crate::pool::breaker_to_proto;

#[derive(Clone)]
pub struct OrchestratorService {
    generator: Arc<Generator>,
}

impl OrchestratorService {
    pub fn new(generator: Arc<Generator>) -> Self {
        Self { generator }
    }
}

/// The authenticated caller the API-key interceptor attached, if authentication is on.
fn caller<T>(request: &Request<T>) -> Option<Arc<Caller>> {
    request.extensions().get::<Arc<Caller>>().cloned()
}

/// Charges a finished request's tokens (prompt and completion) to its key.
fn charge(caller: Option<&Caller>, result: &Result<pb::GenerateResponse, OrchestratorError>) {
    if let (Some(caller), Ok(response)) = (caller, result)
        && let Some(usage) = &response.usage
    {
        caller.charge(u64::from(usage.prompt_tokens) + u64::from(usage.completion_tokens));
    }
}

#[tonic::async_trait]
impl specd_proto::Orchestrator for OrchestratorService {
    #[tracing::instrument(skip_all, fields(session = %request.get_ref().session_id))]
    async fn generate(
        &self,
        request: Request<pb::GenerateRequest>,
    ) -> Result<Response<pb::GenerateResponse>, Status> {
        let caller = caller(&request);
        let owner = caller.as_ref().map(|c| c.key_id.as_str());
        let response = self.generator.generate_as(request.get_ref(), None, owner).await;
        charge(caller.as_deref(), &response);
        Ok(Response::new(response?))
    }

    type GenerateStreamStream = ReceiverStream<Result<pb::GenerateStreamResponse, Status>>;

    async fn generate_stream(
        &self,
        request: Request<pb::GenerateRequest>,
    ) -> Result<Response<Self::GenerateStreamStream>, Status> {
        let (tx, rx) = tokio::sync::mpsc::channel(64);
        let (chunk_tx, mut chunk_rx) = tokio::sync::mpsc::channel::<pb::TokenChunk>(64);
        let generator = self.generator.clone();
        let caller = caller(&request);
        let request = request.into_inner();
        let events = tx.clone();
        // Chunks become stream events; when the client goes, the forwarder stops and the
        // generation sees a closed channel and ends.
        let forward = tokio::spawn(async move {
            while let Some(chunk) = chunk_rx.recv().await {
                let event = pb::GenerateStreamResponse {
                    event: Some(pb::generate_stream_response::Event::Chunk(chunk)),
                };
                if events.send(Ok(event)).await.is_err() {
                    break;
                }
            }
        });
        let span = tracing::info_span!("generate_stream", session = %request.session_id);
        tokio::spawn(
            async move {
                let owner = caller.as_ref().map(|c| c.key_id.as_str());
                let result = generator.generate_as(&request, Some(&chunk_tx), owner).await;
                charge(caller.as_deref(), &result);
                drop(chunk_tx);
                let _ = forward.await;
                let last = result.map(|done| pb::GenerateStreamResponse {
                    event: Some(pb::generate_stream_response::Event::Done(done)),
                });
                let _ = tx.send(last.map_err(Status::from)).await;
            }
            .instrument(span),
        );
        Ok(Response::new(ReceiverStream::new(rx)))
    }

    async fn replicas(
        &self,
        _request: Request<pb::ReplicasRequest>,
    ) -> Result<Response<pb::ReplicasResponse>, Status> {
        let generator = &self.generator;
        let (retries, failovers) = generator.pool.as_ref().map(|p| p.totals()).unwrap_or_default();
        Ok(Response::new(pb::ReplicasResponse {
            verifiers: generator.pool.as_ref().map(|p| p.status()).unwrap_or_default(),
            drafter_breaker: generator
                .drafter
                .as_ref()
                .and_then(|d| d.breaker_state())
                .map_or(pb::BreakerState::Unspecified, breaker_to_proto) as i32,
            retries,
            failovers,
        }))
    }

    async fn info(&self, _request: Request<pb::InfoRequest>) -> Result<Response<pb::InfoResponse>, Status> {
        let info = self.generator.verifier.info().await?;
        Ok(Response::new(pb::InfoResponse {
            model: info.model,
            capabilities: vec!["generate".into(), "generate_stream".into()],
            version: env!("CARGO_PKG_VERSION").into(),
        }))
    }
}
