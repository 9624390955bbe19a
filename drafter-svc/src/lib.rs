//! specd's drafter: cheap draft tokens for speculative decoding. [`ngram`] is prompt lookup
//! (continue the most recent earlier match of the context's suffix); [`lm`] drafts with a
//! small language model sharing the target's tokenizer. Every proposal carries its q
//! distribution so the orchestrator's acceptance is exact. [`core`] is the transport-free
//! logic, [`service`] the gRPC layer, and the `drafter-svc` binary serves it.

pub mod core;
pub mod error;
pub mod lm;
pub mod ngram;
pub mod service;

pub use core::{DrafterCore, MAX_PROPOSAL_TOKENS};
pub use error::DrafterError;
pub use lm::LmDrafter;
pub use ngram::{NgramArgs, NgramConfig};
pub use service::DrafterService;
