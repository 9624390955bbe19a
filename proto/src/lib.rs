//! specd's gRPC API, package `specd.v1`, generated once here for every crate: messages,
//! clients (`*_client`) and servers (`*_server`) for the Orchestrator, Drafter and Verifier
//! services, plus the encoded descriptor set that services hand to gRPC reflection.

#[allow(clippy::all, missing_docs)]
pub mod v1 {
    tonic::include_proto!("specd.v1");
}

/// The encoded `FileDescriptorSet` of every specd.v1 proto, for gRPC reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("specd_v1_descriptor");

pub use v1::drafter_client::DrafterClient;
pub use v1::drafter_server::{Drafter, DrafterServer};
pub use v1::orchestrator_client::OrchestratorClient;
pub use v1::orchestrator_server::{Orchestrator, OrchestratorServer};
pub use v1::verifier_client::VerifierClient;
pub use v1::verifier_server::{Verifier, VerifierServer};
