//! The orchestrator's view of drafters and verifiers: two small traits, each implemented by
//! the service core in-process (all-in-one mode) and by a gRPC client with a deadline. Both
//! run the same service code; only the transport differs. Errors are gRPC statuses either way.
//! Remote verifiers are used through a [`crate::pool::VerifierPool`]; the remote drafter sits
//! behind a circuit breaker, so a dead drafter costs one refused call per step, not a timeout.

use std::sync::Arc;
use std::time::Duration;

use specd_drafter::{DrafterCore, NgramConfig};
use specd_proto::v1 as pb;
use specd_proto::{DrafterClient, VerifierClient};
use specd_verifier::VerifierCore;
use tonic::Status;
use tonic::transport::{Channel, ClientTlsConfig, Endpoint};
use tower::ServiceExt;
use tower::util::BoxCloneSyncService;

use crate::breaker::{Breaker, BreakerConfig, BreakerState, CircuitBreakerLayer};

/// Largest message the orchestrator accepts from a service (dense distributions are large).
const MAX_MESSAGE_BYTES: usize = 64 << 20;

/// A verifier's answer and how it was obtained.
#[derive(Debug, Clone)]
pub struct Verified {
    pub response: pb::VerifyResponse,
    /// Calls made (1 unless retried).
    pub attempts: u32,
    /// Times the call moved to another replica.
    pub failovers: u32,
    /// The replica that answered.
    pub replica: String,
}

#[tonic::async_trait]
pub trait VerifierBackend: Send + Sync {
    async fn verify(&self, request: pb::VerifyRequest) -> Result<Verified, Status>;
    async fn info(&self) -> Result<pb::InfoResponse, Status>;
    async fn release(&self, session_id: &str);
    /// A name for logs and stats (an address, or "in-process").
    fn name(&self) -> String;
}

#[tonic::async_trait]
pub trait DrafterBackend: Send + Sync {
    async fn propose(&self, request: pb::ProposeRequest) -> Result<pb::ProposeResponse, Status>;
    async fn info(&self) -> Result<pb::InfoResponse, Status>;
    /// The circuit breaker's state, for a remote drafter.
    fn breaker_state(&self) -> Option<BreakerState> {
        None
    }
}

#[tonic::async_trait]
impl VerifierBackend for VerifierCore {
    async fn verify(&self, request: pb::VerifyRequest) -> Result<Verified, Status> {
        Ok(Verified {
            response: VerifierCore::verify(self, request).await?,
            attempts: 1,
            failovers: 0,
            replica: "in-process".into(),
        })
    }

    async fn info(&self) -> Result<pb::InfoResponse, Status> {
        Ok(pb::InfoResponse {
            model: Some(self.identity()),
            capabilities: vec![],
            version: env!("CARGO_PKG_VERSION").into(),
        })
    }

    async fn release(&self, session_id: &str) {
        VerifierCore::release(self, session_id);
    }

    fn name(&self) -> String {
        "in-process".into()
    }
}

#[tonic::async_trait]
impl DrafterBackend for DrafterCore {
    async fn propose(&self, request: pb::ProposeRequest) -> Result<pb::ProposeResponse, Status> {
        Ok(DrafterCore::propose(self, request).await?)
    }

    async fn info(&self) -> Result<pb::InfoResponse, Status> {
        Ok(pb::InfoResponse {
            model: self.identity(),
            capabilities: self.capabilities(),
            version: env!("CARGO_PKG_VERSION").into(),
        })
    }
}

/// Prompt lookup answered in this process, other kinds by the drafter service when there is
/// one (`--ngram-in-process`). A lookup takes microseconds; a round trip to the drafter
/// service costs a sizeable share of a step (0.4–0.8 ms on loopback on a 2-core machine,
/// against a 7–9 ms pass), paid on every step that drafts. LM drafts, which need a model,
/// still cross the network.
pub struct NgramInProcess {
    local: DrafterCore,
    remote: Option<Arc<dyn DrafterBackend>>,
}

impl NgramInProcess {
    pub fn new(ngram: NgramConfig, remote: Option<Arc<dyn DrafterBackend>>) -> Self {
        Self {
            local: DrafterCore::new(ngram, None),
            remote,
        }
    }
}

#[tonic::async_trait]
impl DrafterBackend for NgramInProcess {
    async fn propose(&self, request: pb::ProposeRequest) -> Result<pb::ProposeResponse, Status> {
        let lookup = matches!(
            pb::DrafterKind::try_from(request.kind),
            Ok(pb::DrafterKind::Ngram | pb::DrafterKind::Unspecified)
        );
        match &self.remote {
            Some(remote) if !lookup => remote.propose(request).await,
            // Lookups, and (refused, with the local core's message) other kinds when no
            // drafter service is configured.
            _ => DrafterBackend::propose(&self.local, request).await,
        }
    }

    async fn info(&self) -> Result<pb::InfoResponse, Status> {
        match &self.remote {
            Some(remote) => remote.info().await,
            None => DrafterBackend::info(&self.local).await,
        }
    }

    fn breaker_state(&self) -> Option<BreakerState> {
        self.remote.as_ref().and_then(|remote| remote.breaker_state())
    }
}

/// A lazily connected channel. HTTP/2 keep-alive pings find a peer that vanished without
/// closing its connections (a killed container, a partition) within seconds, so calls on it
/// fail over instead of waiting out their deadline.
fn channel(url: &str, deadline: Duration, tls: Option<ClientTlsConfig>) -> Result<Channel, String> {
    let mut endpoint =
        Endpoint::from_shared(url.to_string()).map_err(|e| format!("bad endpoint {url:?}: {e}"))?;
    if let Some(tls) = tls {
        endpoint = endpoint
            .tls_config(tls)
            .map_err(|e| format!("bad TLS configuration for {url}: {e}"))?;
    }
    Ok(endpoint
        .connect_timeout(deadline.min(Duration::from_secs(2)))
        .http2_keep_alive_interval(Duration::from_secs(1))
        .keep_alive_timeout(Duration::from_secs(2))
        .keep_alive_while_idle(true)
        .tcp_nodelay(true)
        .connect_lazy())
}

/// An outgoing request with a deadline and the current span's trace context.
fn with_deadline<T>(message: T, deadline: Duration) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request.set_timeout(deadline);
    specd_common::telemetry::inject(&mut request);
    request
}

/// Runs a call under a local deadline too (the server may not honour grpc-timeout).
async fn bounded<T>(deadline: Duration, call: impl Future<Output = Result<T, Status>>) -> Result<T, Status> {
    let expired = || Status::deadline_exceeded(format!("no answer within {deadline:?}"));
    match tokio::time::timeout(deadline, call).await {
        Err(_) => Err(expired()),
        // tonic reports its own client-side timeout as Cancelled; it is a deadline.
        Ok(Err(status))
            if status.code() == tonic::Code::Cancelled && status.message().contains("Timeout expired") =>
        {
            Err(expired())
        }
        Ok(result) => result,
    }
}

/// One verifier replica reached over gRPC (the pool holds one per replica).
#[derive(Clone)]
pub struct GrpcVerifier {
    channel: Channel,
    client: VerifierClient<Channel>,
    deadline: Duration,
}

impl GrpcVerifier {
    pub fn new(url: &str, deadline: Duration, tls: Option<ClientTlsConfig>) -> Result<Self, String> {
        let channel = channel(url, deadline, tls)?;
        let client = VerifierClient::new(channel.clone())
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES);
        Ok(Self {
            channel,
            client,
            deadline,
        })
    }

    /// The connection, for other clients (health checks) to share.
    pub fn channel(&self) -> Channel {
        self.channel.clone()
    }

    pub async fn verify(&self, request: pb::VerifyRequest) -> Result<pb::VerifyResponse, Status> {
        let mut client = self.client.clone();
        bounded(self.deadline, async move {
            Ok(client
                .verify(with_deadline(request, self.deadline))
                .await?
                .into_inner())
        })
        .await
    }

    pub async fn info(&self) -> Result<pb::InfoResponse, Status> {
        let mut client = self.client.clone();
        bounded(self.deadline, async move {
            Ok(client
                .info(with_deadline(pb::InfoRequest {}, self.deadline))
                .await?
                .into_inner())
        })
        .await
    }

    pub async fn release(&self, session_id: &str) {
        let mut client = self.client.clone();
        let request = pb::ReleaseRequest {
            session_id: session_id.to_string(),
        };
        let _ = bounded(self.deadline, async move {
            client.release(with_deadline(request, self.deadline)).await
        })
        .await;
    }
}

type ProposeService = BoxCloneSyncService<pb::ProposeRequest, pb::ProposeResponse, Status>;

/// A drafter reached over gRPC, behind a circuit breaker.
#[derive(Clone)]
pub struct GrpcDrafter {
    client: DrafterClient<Channel>,
    propose: ProposeService,
    breaker: Breaker,
    deadline: Duration,
}

impl GrpcDrafter {
    pub fn new(
        url: &str,
        deadline: Duration,
        breaker: BreakerConfig,
        tls: Option<ClientTlsConfig>,
    ) -> Result<Self, String> {
        let client = DrafterClient::new(channel(url, deadline, tls)?)
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES);
        let breaker = Breaker::new(format!("drafter {url}"), breaker);
        let calls = client.clone();
        let propose = tower::ServiceBuilder::new()
            .layer(CircuitBreakerLayer::new(breaker.clone()))
            .service_fn(move |request: pb::ProposeRequest| {
                let mut client = calls.clone();
                async move {
                    bounded(deadline, async move {
                        Ok(client
                            .propose(with_deadline(request, deadline))
                            .await?
                            .into_inner())
                    })
                    .await
                }
            });
        Ok(Self {
            client,
            propose: BoxCloneSyncService::new(propose),
            breaker,
            deadline,
        })
    }
}

#[tonic::async_trait]
impl DrafterBackend for GrpcDrafter {
    async fn propose(&self, request: pb::ProposeRequest) -> Result<pb::ProposeResponse, Status> {
        self.propose.clone().oneshot(request).await
    }

    async fn info(&self) -> Result<pb::InfoResponse, Status> {
        let mut client = self.client.clone();
        bounded(self.deadline, async move {
            Ok(client
                .info(with_deadline(pb::InfoRequest {}, self.deadline))
                .await?
                .into_inner())
        })
        .await
    }

    fn breaker_state(&self) -> Option<BreakerState> {
        Some(self.breaker.state())
    }
}

/// Refuses a service whose tokenizer differs from ours: its drafts or scores would be
/// meaningless.
pub fn check_identity(
    role: &str,
    url: &str,
    model: Option<&pb::ModelIdentity>,
    ours: &str,
) -> Result<(), String> {
    let model = model.ok_or_else(|| format!("{role} {url} did not report its model"))?;
    if model.tokenizer_identity != ours {
        return Err(format!(
            "{role} {url} runs `{}` whose tokenizer ({}) differs from the orchestrator's ({ours}); \
             drafts and scores would be meaningless. Point both at models with the same tokenizer.",
            model.name, model.tokenizer_identity
        ));
    }
    Ok(())
}

/// The host part of a URL (`https://verifier:50052` → `verifier`): the name a server's
/// certificate must carry.
pub fn host_of(url: &str) -> &str {
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    let authority = rest.split('/').next().unwrap_or(rest);
    if let Some(v6) = authority.strip_prefix('[') {
        return v6.split(']').next().unwrap_or(v6);
    }
    authority.rsplit_once(':').map_or(authority, |(host, _)| host)
}

#[cfg(test)]
mod tests {
    use specd_drafter::LmDrafter;
    use specd_model::synthetic::{SyntheticSpec, write_tiny_llama};

    use super::*;

    fn request(kind: pb::DrafterKind) -> pb::ProposeRequest {
        pb::ProposeRequest {
            session_id: "s".into(),
            context: vec![5, 6, 7, 5, 6],
            max_tokens: 3,
            kind: kind as i32,
            ..Default::default()
        }
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn lookups_stay_in_process_and_lm_drafts_go_to_the_drafter_service() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("tiny.gguf");
        write_tiny_llama(&path, &SyntheticSpec::default()).unwrap();
        let loaded = specd_model::load(&path, specd_model::EngineOptions::default()).unwrap();
        // The drafter service: its own lookups never match (no suffix is 100 tokens long),
        // and it has an LM drafter.
        let never_matches = NgramConfig {
            min_n: 100,
            max_n: 100,
            ..NgramConfig::default()
        };
        let service: Arc<dyn DrafterBackend> = Arc::new(DrafterCore::new(
            never_matches,
            Some(LmDrafter::new(loaded.engine.clone())),
        ));
        assert!(
            service
                .propose(request(pb::DrafterKind::Ngram))
                .await
                .unwrap()
                .tokens
                .is_empty()
        );

        let routed = NgramInProcess::new(NgramConfig::default(), Some(service));
        let lookup = routed.propose(request(pb::DrafterKind::Ngram)).await.unwrap();
        assert_eq!(lookup.tokens, vec![7, 5, 6], "answered in process");
        assert_eq!(lookup.match_length, 2);
        let lm = routed.propose(request(pb::DrafterKind::Lm)).await.unwrap();
        assert_eq!(lm.tokens.len(), 3, "only the service has an LM drafter");
        assert_eq!(routed.info().await.unwrap().capabilities, vec!["ngram", "lm"]);

        // Without a drafter service, lookups still work and LM drafts are refused as a
        // drafter without one refuses them.
        let alone = NgramInProcess::new(NgramConfig::default(), None);
        assert_eq!(
            alone
                .propose(request(pb::DrafterKind::Ngram))
                .await
                .unwrap()
                .tokens,
            vec![7, 5, 6]
        );
        let refused = alone.propose(request(pb::DrafterKind::Lm)).await.unwrap_err();
        assert_eq!(refused.code(), tonic::Code::FailedPrecondition, "{refused:?}");
    }
}
