//! The `specd.v1.Verifier` gRPC service over [`VerifierCore`]. The service is mounted before
//! the model finishes loading (so health can say NOT_SERVING); until then calls get
//! `Unavailable`.

use std::sync::{Arc, OnceLock};

use prost::Message;
use specd_proto::v1 as pb;
use tonic::{Request, Response, Status};
use tracing::field::Empty;

use crate::core::VerifierCore;

#[derive(Clone, Default)]
pub struct VerifierService {
    core: Arc<OnceLock<Arc<VerifierCore>>>,
}

impl VerifierService {
    /// A service that answers at once.
    pub fn new(core: Arc<VerifierCore>) -> Self {
        let service = Self::default();
        service.set_core(core);
        service
    }

    /// Makes a service created with `default()` ready.
    pub fn set_core(&self, core: Arc<VerifierCore>) {
        let _ = self.core.set(core);
    }

    fn core(&self) -> Result<&Arc<VerifierCore>, Status> {
        self.core
            .get()
            .ok_or_else(|| Status::unavailable("the verifier is still loading its model"))
    }
}

#[tonic::async_trait]
impl specd_proto::Verifier for VerifierService {
    #[tracing::instrument(skip_all, fields(
        session = %request.get_ref().session_id,
        k = request.get_ref().draft.len(),
        context = request.get_ref().context.len(),
        bytes_received = request.get_ref().encoded_len(),
        bytes_sent = Empty,
        reused = Empty,
        computed = Empty,
        batch_size = Empty,
        queue_ms = Empty,
        forward_ms = Empty,
    ))]
    async fn verify(
        &self,
        request: Request<pb::VerifyRequest>,
    ) -> Result<Response<pb::VerifyResponse>, Status> {
        let core = self.core()?;
        core.admit(grpc_deadline(request.metadata()))?;
        let response = core.verify(request.into_inner()).await?;
        let span = tracing::Span::current();
        span.record("bytes_sent", response.encoded_len());
        span.record("reused", response.reused_tokens);
        span.record("computed", response.computed_tokens);
        span.record("batch_size", response.batch_size);
        span.record("queue_ms", response.queue_seconds * 1e3);
        span.record("forward_ms", response.forward_seconds * 1e3);
        observe(&response, core.queue_depth());
        Ok(Response::new(response))
    }

    async fn info(&self, _request: Request<pb::InfoRequest>) -> Result<Response<pb::InfoResponse>, Status> {
        Ok(Response::new(pb::InfoResponse {
            model: Some(self.core()?.identity()),
            capabilities: vec!["argmax".into(), "warped".into(), "logits".into()],
            version: env!("CARGO_PKG_VERSION").into(),
        }))
    }

    async fn release(
        &self,
        request: Request<pb::ReleaseRequest>,
    ) -> Result<Response<pb::ReleaseResponse>, Status> {
        self.core()?.release(&request.get_ref().session_id);
        Ok(Response::new(pb::ReleaseResponse {}))
    }
}

/// The verifier's Prometheus metrics for one answered call: batch size, queue wait, forward
/// pass, queue depth, and tokens served from the cache versus computed (prefix reuse).
fn observe(response: &pb::VerifyResponse, queue_depth: usize) {
    metrics::histogram!("specd_verifier_batch_size").record(f64::from(response.batch_size));
    metrics::histogram!("specd_verifier_queue_seconds").record(response.queue_seconds);
    metrics::histogram!("specd_verifier_forward_seconds").record(response.forward_seconds);
    metrics::gauge!("specd_verifier_queue_depth").set(queue_depth as f64);
    metrics::counter!("specd_verifier_reused_tokens_total").increment(u64::from(response.reused_tokens));
    metrics::counter!("specd_verifier_computed_tokens_total").increment(u64::from(response.computed_tokens));
    let context = response.reused_tokens + response.computed_tokens;
    if context > 0 {
        metrics::histogram!("specd_verifier_prefix_reuse_ratio")
            .record(f64::from(response.reused_tokens) / f64::from(context));
    }
}

/// The caller's deadline from the `grpc-timeout` header (e.g. `1500m`, `30S`).
pub fn grpc_deadline(metadata: &tonic::metadata::MetadataMap) -> Option<std::time::Duration> {
    let value = metadata.get("grpc-timeout")?.to_str().ok()?;
    let (amount, unit) = value.split_at(value.len().checked_sub(1)?);
    let amount: u64 = amount.parse().ok()?;
    use std::time::Duration;
    Some(match unit {
        "H" => Duration::from_secs(amount.saturating_mul(3600)),
        "M" => Duration::from_secs(amount.saturating_mul(60)),
        "S" => Duration::from_secs(amount),
        "m" => Duration::from_millis(amount),
        "u" => Duration::from_micros(amount),
        "n" => Duration::from_nanos(amount),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_timeouts_parse_in_every_unit() {
        let mut metadata = tonic::metadata::MetadataMap::new();
        assert_eq!(grpc_deadline(&metadata), None);
        for (text, millis) in [
            ("2H", 7_200_000),
            ("3M", 180_000),
            ("30S", 30_000),
            ("1500m", 1_500),
            ("2000u", 2),
        ] {
            metadata.insert("grpc-timeout", text.parse().unwrap());
            assert_eq!(
                grpc_deadline(&metadata).map(|d| d.as_millis()),
                Some(millis),
                "{text}"
            );
        }
        metadata.insert("grpc-timeout", "12x".parse().unwrap());
        assert_eq!(grpc_deadline(&metadata), None);
    }
}
