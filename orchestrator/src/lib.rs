//! specd's orchestrator. It owns every session's token context, runs the speculative
//! decoding loop ([`generate`]) against a drafter and a verifier ([`backend`]: in-process or
//! gRPC, the same service code either way), accepts drafts exactly ([`acceptance`]), picks K
//! per session from measured acceptance and costs ([`adaptive`]), spreads sessions over a
//! pool of verifier replicas with retries, failover and circuit breakers ([`pool`],
//! [`breaker`]), and serves the public
//! `Generate` API ([`service`]) to callers with an API key ([`auth`]). The `orchestrator`
//! binary serves it; the `specd` binary is
//! the CLI (all-in-one generation, a client, and benchmarks).

pub mod acceptance;
pub mod adaptive;
pub mod auth;
pub mod backend;
pub mod breaker;
pub mod costs;
pub mod error;
pub mod generate;
pub mod observe;
pub mod pool;
pub mod request;
pub mod service;
pub mod session;
pub mod setup;
pub mod stop;

pub use error::OrchestratorError;
pub use generate::Generator;
