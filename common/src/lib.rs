//! Plumbing every specd service shares, so no binary copies it: logging set-up
//! ([`telemetry`]), gRPC health and reflection plus shutdown signals ([`serve`]), and the
//! conversions between the model crate's types and the wire types ([`convert`]), and the
//! model flags every model-serving binary takes ([`model_args`]), and a small OTLP trace
//! receiver ([`otlp_sink`]), and TLS set-up with a development CA ([`tls`]), and picking
//! loopback ports for child services ([`ports`]), and reading a Prometheus page back
//! ([`metrics_page`]).

pub mod convert;
pub mod metrics_page;
pub mod model_args;
pub mod otlp_sink;
pub mod ports;
pub mod serve;
pub mod telemetry;
pub mod tls;
