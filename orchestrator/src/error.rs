//! The orchestrator's errors and their one mapping to gRPC status codes. Errors from a
//! downstream service keep their gRPC code.

use tonic::{Code, Status};

#[derive(Debug, thiserror::Error)]
pub enum OrchestratorError {
    #[error("{0}")]
    InvalidArgument(String),
    #[error("session `{0}` not found (it may have expired)")]
    SessionNotFound(String),
    #[error("session `{0}` is busy with another request")]
    SessionBusy(String),
    #[error("{0}")]
    ResourceExhausted(String),
    #[error("{service}: {status_message}")]
    Downstream {
        service: &'static str,
        code: Code,
        status_message: String,
    },
    #[error("internal error: {0}")]
    Internal(String),
}

impl OrchestratorError {
    pub fn downstream(service: &'static str, status: Status) -> Self {
        Self::Downstream {
            service,
            code: status.code(),
            status_message: status.message().to_string(),
        }
    }
}

impl From<OrchestratorError> for Status {
    fn from(e: OrchestratorError) -> Self {
        let code = match &e {
            OrchestratorError::InvalidArgument(_) => Code::InvalidArgument,
            OrchestratorError::SessionNotFound(_) => Code::NotFound,
            OrchestratorError::SessionBusy(_) => Code::Aborted,
            OrchestratorError::ResourceExhausted(_) => Code::ResourceExhausted,
            // A downstream InvalidArgument means we built a bad request: our fault.
            OrchestratorError::Downstream { code, .. } => match code {
                Code::InvalidArgument | Code::OutOfRange | Code::FailedPrecondition => Code::Internal,
                Code::Ok | Code::Unknown => Code::Unavailable,
                other => *other,
            },
            OrchestratorError::Internal(_) => Code::Internal,
        };
        Status::new(code, e.to_string())
    }
}
