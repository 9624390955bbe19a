//! The orchestrator's view of drafters and verifiers: two small traits, each implemented by
//! the service core in-process (all-in-one mode) and by a gRPC client with a deadline. Both
//! run the same service code; only the transport differs. Errors are gRPC statuses either way.

use std::time::Duration;

use specd_drafter::DrafterCore;
use specd_proto::v1 as pb;
use specd_proto::{DrafterClient, VerifierClient};
use specd_verifier::VerifierCore;
use tonic::Status;
use tonic::transport::{Channel, Endpoint};

/// Largest message the orchestrator accepts from a service (dense distributions are large).
const MAX_MESSAGE_BYTES: usize = 64 << 20;

#[tonic::async_trait]
pub trait VerifierBackend: Send + Sync {
    async fn verify(&self, request: pb::VerifyRequest) -> Result<pb::VerifyResponse, Status>;
    async fn info(&self) -> Result<pb::InfoResponse, Status>;
    async fn release(&self, session_id: &str);
    /// A name for logs and stats (an address, or "in-process").
    fn name(&self) -> String;
}

#[tonic::async_trait]
pub trait DrafterBackend: Send + Sync {
    async fn propose(&self, request: pb::ProposeRequest) -> Result<pb::ProposeResponse, Status>;
    async fn info(&self) -> Result<pb::InfoResponse, Status>;
}

#[tonic::async_trait]
impl VerifierBackend for VerifierCore {
    async fn verify(&self, request: pb::VerifyRequest) -> Result<pb::VerifyResponse, Status> {
        Ok(VerifierCore::verify(self, request).await?)
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

fn channel(url: &str, connect_timeout: Duration) -> Result<Channel, String> {
    Ok(Endpoint::from_shared(url.to_string())
        .map_err(|e| format!("bad endpoint {url:?}: {e}"))?
        .connect_timeout(connect_timeout)
        .tcp_nodelay(true)
        .connect_lazy())
}

fn with_deadline<T>(message: T, deadline: Duration) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request.set_timeout(deadline);
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

/// A verifier reached over gRPC.
#[derive(Clone)]
pub struct GrpcVerifier {
    client: VerifierClient<Channel>,
    url: String,
    deadline: Duration,
}

impl GrpcVerifier {
    pub fn new(url: &str, deadline: Duration) -> Result<Self, String> {
        let client = VerifierClient::new(channel(url, deadline)?)
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES);
        Ok(Self {
            client,
            url: url.to_string(),
            deadline,
        })
    }
}

#[tonic::async_trait]
impl VerifierBackend for GrpcVerifier {
    async fn verify(&self, request: pb::VerifyRequest) -> Result<pb::VerifyResponse, Status> {
        let mut client = self.client.clone();
        bounded(self.deadline, async move {
            Ok(client
                .verify(with_deadline(request, self.deadline))
                .await?
                .into_inner())
        })
        .await
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

    async fn release(&self, session_id: &str) {
        let mut client = self.client.clone();
        let request = pb::ReleaseRequest {
            session_id: session_id.to_string(),
        };
        let _ = bounded(self.deadline, async move {
            client.release(with_deadline(request, self.deadline)).await
        })
        .await;
    }

    fn name(&self) -> String {
        self.url.clone()
    }
}

/// A drafter reached over gRPC.
#[derive(Clone)]
pub struct GrpcDrafter {
    client: DrafterClient<Channel>,
    deadline: Duration,
}

impl GrpcDrafter {
    pub fn new(url: &str, deadline: Duration) -> Result<Self, String> {
        let client = DrafterClient::new(channel(url, deadline)?)
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES);
        Ok(Self { client, deadline })
    }
}

#[tonic::async_trait]
impl DrafterBackend for GrpcDrafter {
    async fn propose(&self, request: pb::ProposeRequest) -> Result<pb::ProposeResponse, Status> {
        let mut client = self.client.clone();
        bounded(self.deadline, async move {
            Ok(client
                .propose(with_deadline(request, self.deadline))
                .await?
                .into_inner())
        })
        .await
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
}
