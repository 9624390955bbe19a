//! The verifier's errors and their one mapping to gRPC status codes.

use specd_model::ModelError;
use tonic::{Code, Status};

#[derive(Debug, thiserror::Error)]
pub enum VerifierError {
    #[error("{0}")]
    InvalidArgument(String),
    #[error("context of {requested} tokens exceeds the model's limit of {limit}")]
    ContextTooLong { requested: usize, limit: usize },
    #[error("the verifier is at capacity; retry later or on another replica")]
    Overloaded,
    #[error("the verifier is too busy for this deadline: {0}; retry later or on another replica")]
    Busy(String),
    #[error("the verifier is not ready: {0}")]
    Unavailable(String),
    #[error("internal error: {0}")]
    Internal(String),
}

impl From<ModelError> for VerifierError {
    fn from(e: ModelError) -> Self {
        match e {
            ModelError::InvalidRequest(m) => Self::InvalidArgument(m),
            ModelError::TokenOutOfRange { .. } => Self::InvalidArgument(e.to_string()),
            ModelError::ContextOverflow { requested, limit } => Self::ContextTooLong { requested, limit },
            ModelError::Overloaded => Self::Overloaded,
            ModelError::EngineStopped => Self::Unavailable(e.to_string()),
            other => Self::Internal(other.to_string()),
        }
    }
}

impl From<VerifierError> for Status {
    fn from(e: VerifierError) -> Self {
        let code = match &e {
            VerifierError::InvalidArgument(_) => Code::InvalidArgument,
            VerifierError::ContextTooLong { .. } => Code::OutOfRange,
            VerifierError::Overloaded | VerifierError::Busy(_) => Code::ResourceExhausted,
            VerifierError::Unavailable(_) => Code::Unavailable,
            VerifierError::Internal(_) => Code::Internal,
        };
        Status::new(code, e.to_string())
    }
}
