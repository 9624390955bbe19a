//! The `specd.v1.Verifier` gRPC service over [`VerifierCore`]. The service is mounted before
//! the model finishes loading (so health can say NOT_SERVING); until then calls get
//! `Unavailable`.

use std::sync::{Arc, OnceLock};

use specd_proto::v1 as pb;
use tonic::{Request, Response, Status};

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
    #[tracing::instrument(skip_all, fields(session = %request.get_ref().session_id, k = request.get_ref().draft.len()))]
    async fn verify(
        &self,
        request: Request<pb::VerifyRequest>,
    ) -> Result<Response<pb::VerifyResponse>, Status> {
        Ok(Response::new(self.core()?.verify(request.into_inner()).await?))
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
