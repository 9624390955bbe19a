//! The drafter's errors and their one mapping to gRPC status codes.

use specd_model::ModelError;
use tonic::{Code, Status};

#[derive(Debug, thiserror::Error)]
pub enum DrafterError {
    #[error("{0}")]
    InvalidArgument(String),
    #[error("drafter kind `{0}` is not enabled on this drafter")]
    KindUnavailable(&'static str),
    #[error("the drafter is at capacity")]
    Overloaded,
    #[error("internal error: {0}")]
    Internal(String),
}

impl From<ModelError> for DrafterError {
    fn from(e: ModelError) -> Self {
        match e {
            ModelError::InvalidRequest(m) => Self::InvalidArgument(m),
            ModelError::TokenOutOfRange { .. } | ModelError::ContextOverflow { .. } => {
                Self::InvalidArgument(e.to_string())
            }
            ModelError::Overloaded => Self::Overloaded,
            other => Self::Internal(other.to_string()),
        }
    }
}

impl From<DrafterError> for Status {
    fn from(e: DrafterError) -> Self {
        let code = match &e {
            DrafterError::InvalidArgument(_) => Code::InvalidArgument,
            DrafterError::KindUnavailable(_) => Code::FailedPrecondition,
            DrafterError::Overloaded => Code::ResourceExhausted,
            DrafterError::Internal(_) => Code::Internal,
        };
        Status::new(code, e.to_string())
    }
}
