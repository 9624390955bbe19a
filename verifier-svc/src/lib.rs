//! specd's verifier: the target model behind a gRPC service. [`core`] scores a session's
//! context plus draft tokens in one forward pass (reusing the session's cached prefix) and
//! encodes the K + 1 next-token distributions; [`service`] is the thin gRPC layer over it;
//! the `verifier-svc` binary loads the model and serves it.

pub mod core;
pub mod error;
pub mod service;

pub use core::{MAX_DRAFT_TOKENS, VerifierCore};
pub use error::VerifierError;
pub use service::VerifierService;
