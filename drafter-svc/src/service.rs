//! The `specd.v1.Drafter` gRPC service over [`DrafterCore`]. Mounted before an LM drafter's
//! model finishes loading; until then calls get `Unavailable`.

use std::sync::{Arc, OnceLock};

use specd_proto::v1 as pb;
use tonic::{Request, Response, Status};
use tracing::field::Empty;

use crate::core::DrafterCore;

#[derive(Clone, Default)]
pub struct DrafterService {
    core: Arc<OnceLock<Arc<DrafterCore>>>,
}

impl DrafterService {
    pub fn new(core: Arc<DrafterCore>) -> Self {
        let service = Self::default();
        service.set_core(core);
        service
    }

    pub fn set_core(&self, core: Arc<DrafterCore>) {
        let _ = self.core.set(core);
    }

    fn core(&self) -> Result<&Arc<DrafterCore>, Status> {
        self.core
            .get()
            .ok_or_else(|| Status::unavailable("the drafter is still loading"))
    }
}

#[tonic::async_trait]
impl specd_proto::Drafter for DrafterService {
    #[tracing::instrument(skip_all, fields(
        session = %request.get_ref().session_id,
        k = request.get_ref().max_tokens,
        kind = request.get_ref().kind,
        context = request.get_ref().context.len(),
        proposed = Empty,
        match_length = Empty,
    ))]
    async fn propose(
        &self,
        request: Request<pb::ProposeRequest>,
    ) -> Result<Response<pb::ProposeResponse>, Status> {
        let response = self.core()?.propose(request.into_inner()).await?;
        let span = tracing::Span::current();
        span.record("proposed", response.tokens.len());
        span.record("match_length", response.match_length);
        metrics::histogram!("specd_drafter_proposed_tokens").record(response.tokens.len() as f64);
        metrics::histogram!("specd_drafter_seconds").record(response.draft_seconds);
        Ok(Response::new(response))
    }

    async fn info(&self, _request: Request<pb::InfoRequest>) -> Result<Response<pb::InfoResponse>, Status> {
        let core = self.core()?;
        Ok(Response::new(pb::InfoResponse {
            model: core.identity(),
            capabilities: core.capabilities(),
            version: env!("CARGO_PKG_VERSION").into(),
        }))
    }
}
