//! `orchestrator`: serves the public `specd.v1.Orchestrator` API against a remote verifier
//! and drafter, with health and reflection. Refuses to start when a service's tokenizer
//! differs from the model it was given.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use specd_common::serve::GrpcServer;
use specd_orchestrator::request::Limits;
use specd_orchestrator::service::OrchestratorService;
use specd_orchestrator::setup::{GeneratorSettings, remote};
use specd_proto::OrchestratorServer;

#[derive(Debug, Parser)]
#[command(
    name = "orchestrator",
    version,
    about = "specd orchestrator: speculative decoding over gRPC"
)]
struct Config {
    /// Address to listen on.
    #[arg(long, env = "SPECD_LISTEN", default_value = "0.0.0.0:50050")]
    listen: SocketAddr,
    /// Verifier endpoint, e.g. http://127.0.0.1:50052.
    #[arg(long, env = "SPECD_VERIFIER", default_value = "http://127.0.0.1:50052")]
    verifier: String,
    /// Drafter endpoint, e.g. http://127.0.0.1:50051; without one, decoding is plain.
    #[arg(long, env = "SPECD_DRAFTER")]
    drafter: Option<String>,
    /// GGUF whose tokenizer and chat template the orchestrator uses (weights are not
    /// loaded); default: the default model, fetched once.
    #[arg(long, env = "SPECD_MODEL")]
    model: Option<std::path::PathBuf>,
    /// Deadline of every drafter and verifier call, in milliseconds.
    #[arg(long, env = "SPECD_CALL_DEADLINE_MS", default_value_t = 30_000)]
    call_deadline_ms: u64,
    /// How long to wait at start-up for the verifier to answer, in seconds.
    #[arg(long, env = "SPECD_READY_TIMEOUT_S", default_value_t = 300)]
    ready_timeout_s: u64,
    /// Seconds an idle session is kept.
    #[arg(long, env = "SPECD_SESSION_TTL_S", default_value_t = 600)]
    session_ttl_s: u64,
    /// Most open sessions; more are refused with ResourceExhausted.
    #[arg(long, env = "SPECD_MAX_SESSIONS", default_value_t = 1024)]
    max_sessions: usize,
    /// Most tokens one request may generate.
    #[arg(long, env = "SPECD_MAX_NEW_TOKENS", default_value_t = 4096)]
    max_new_tokens: usize,
    /// Largest K (draft tokens per step) a request may ask for.
    #[arg(long, env = "SPECD_MAX_K", default_value_t = 16)]
    max_k: usize,
    /// K ceiling when a request does not set one.
    #[arg(long, env = "SPECD_DEFAULT_K", default_value_t = 8)]
    default_k: usize,
    /// Log one JSON object per line instead of text.
    #[arg(long, env = "SPECD_LOG_JSON")]
    log_json: bool,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let config = Config::parse();
    specd_common::telemetry::init_telemetry("orchestrator", config.log_json);
    let grpc = GrpcServer::bind("specd.v1.Orchestrator", config.listen)
        .await
        .map_err(anyhow::Error::msg)?;
    let health = grpc.health.clone();
    let local = grpc.local_addr();
    let model_path = match &config.model {
        Some(p) => p.clone(),
        None => tokio::task::spawn_blocking(specd_model::fetch::ensure_default_model).await??,
    };
    let text = specd_model::load_text_model(&model_path).context("cannot read the model's tokenizer")?;
    let settings = GeneratorSettings {
        limits: Limits {
            max_new_tokens: config.max_new_tokens,
            max_k: config.max_k,
            default_k: config.default_k.min(config.max_k),
            ..Limits::default()
        },
        session_ttl: Duration::from_secs(config.session_ttl_s),
        max_sessions: config.max_sessions,
        ..GeneratorSettings::default()
    };
    let generator = remote(
        text,
        &config.verifier,
        config.drafter.as_deref(),
        Duration::from_millis(config.call_deadline_ms),
        Duration::from_secs(config.ready_timeout_s),
        settings,
    )
    .await
    .map_err(anyhow::Error::msg)?;
    let service = OrchestratorService::new(Arc::new(generator));
    health.set(true).await;
    tracing::info!(listen = %local, verifier = %config.verifier, drafter = ?config.drafter, "orchestrator serving");
    grpc.serve(|router| router.add_service(OrchestratorServer::new(service)))
        .map_err(anyhow::Error::msg)?
        .await??;
    tracing::info!("orchestrator stopped");
    Ok(())
}
