//! The orchestrator's view of drafters and verifiers: two small traits, each implemented by
//! the service core in-process (all-in-one mode) and by a gRPC client with a deadline. Both
//! run the same service code; only the transport differs. Errors are gRPC statuses either way.
//! Remote verifiers are used through a [`crate::pool::VerifierPool`]; the remote drafter sits
//! behind a circuit breaker, so a dead drafter costs one refused call per step, not a timeout.

use std::time::Duration;

use specd_drafter::DrafterCore;
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
