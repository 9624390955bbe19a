//! `orchestrator`: serves the public `specd.v1.Orchestrator` API against a pool of remote
//! verifier replicas (static endpoints and/or DNS names) and a drafter, with health and
//! reflection. Refuses to start when no verifier replica's tokenizer matches the model it
//! was given.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use specd_common::serve::{GrpcServer, ServeArgs};
use specd_common::telemetry::TelemetryArgs;
use specd_common::tls::TlsArgs;
use specd_orchestrator::auth::{ApiKeyAuth, KeyStore};
use specd_orchestrator::breaker::BreakerConfig;
use specd_orchestrator::pool::PoolConfig;
use specd_orchestrator::pool::discovery::parse_targets;
use specd_orchestrator::pool::retry::RetryConfig;
use specd_orchestrator::request::Limits;
use specd_orchestrator::service::OrchestratorService;
use specd_orchestrator::setup::{GeneratorSettings, RemoteSettings, remote};
use specd_proto::OrchestratorServer;
use tonic::service::interceptor::InterceptedService;

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
    /// Verifier replica endpoints, comma-separated, e.g. http://10.0.0.5:50052. Default:
    /// http://127.0.0.1:50052 when no --verifier-dns is given either.
    #[arg(long, env = "SPECD_VERIFIER", value_delimiter = ',')]
    verifier: Vec<String>,
    /// DNS names (host:port), comma-separated, re-resolved periodically; every address is
    /// a replica (a compose service scaled to N, a Kubernetes headless Service).
    #[arg(long, env = "SPECD_VERIFIER_DNS", value_delimiter = ',')]
    verifier_dns: Vec<String>,
    /// How often DNS names are re-resolved, in milliseconds.
    #[arg(long, env = "SPECD_RESOLVE_INTERVAL_MS", default_value_t = 5_000)]
    resolve_interval_ms: u64,
    /// How often each replica's gRPC health is checked, in milliseconds.
    #[arg(long, env = "SPECD_HEALTH_INTERVAL_MS", default_value_t = 1_000)]
    health_interval_ms: u64,
    /// Most retries of one verifier call (on another replica when there is one).
    #[arg(long, env = "SPECD_MAX_RETRIES", default_value_t = 3)]
    max_retries: usize,
    /// First retry backoff in milliseconds; later ones double (up to 1 s), with jitter.
    #[arg(long, env = "SPECD_RETRY_BASE_MS", default_value_t = 25)]
    retry_base_ms: u64,
    /// Retries earned per verifier call (the retry budget), e.g. 0.2 = one per five calls.
    #[arg(long, env = "SPECD_RETRY_BUDGET_RATIO", default_value_t = 0.2)]
    retry_budget_ratio: f64,
    /// Consecutive failures that open a replica's (or the drafter's) circuit breaker.
    #[arg(long, env = "SPECD_BREAKER_FAILURES", default_value_t = 3)]
    breaker_failures: u32,
    /// How long an open breaker refuses calls before a probe, in milliseconds.
    #[arg(long, env = "SPECD_BREAKER_OPEN_MS", default_value_t = 5_000)]
    breaker_open_ms: u64,
    /// A new session skips replicas carrying more than this multiple of the mean load.
    #[arg(long, env = "SPECD_LOAD_FACTOR", default_value_t = 1.25)]
    load_factor: f64,
    /// Most requests served at once; more are refused with ResourceExhausted.
    #[arg(long, env = "SPECD_MAX_CONCURRENT_REQUESTS", default_value_t = 256)]
    max_concurrent_requests: usize,
    /// File of API keys (id, SHA-256 of the key, optional limits per line; re-read when it
    /// changes). Clients send `authorization: Bearer KEY`.
    #[arg(long, env = "SPECD_API_KEYS_FILE")]
    api_keys_file: Option<std::path::PathBuf>,
    /// Serve without authentication (local use only); required when no key file is given.
    #[arg(long, env = "SPECD_NO_AUTH", conflicts_with = "api_keys_file")]
    no_auth: bool,
    #[command(flatten)]
    serve: ServeArgs,
    /// TLS: the public port serves it (clients authenticate with API keys), and calls to
    /// the drafter and verifiers use mutual TLS with this certificate and CA.
    #[command(flatten)]
    tls: TlsArgs,
    /// Drafter endpoint, e.g. http://127.0.0.1:50051; without one (and without
    /// --ngram-in-process), decoding is plain.
    #[arg(long, env = "SPECD_DRAFTER")]
    drafter: Option<String>,
    /// Answer prompt-lookup (n-gram) drafts in this process instead of calling the drafter
    /// service, saving a network round trip on every step that drafts; LM drafts still go to
    /// --drafter.
    #[arg(long, env = "SPECD_NGRAM_IN_PROCESS")]
    ngram_in_process: bool,
    /// Prompt lookup's settings when --ngram-in-process answers it here.
    #[command(flatten)]
    ngram: specd_drafter::NgramArgs,
    /// GGUF whose tokenizer and chat template the orchestrator uses (weights are not
    /// loaded); default: the default model, fetched once into $SPECD_MODEL_DIR (or
    /// ~/.cache/specd/models).
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
    #[command(flatten)]
    telemetry: TelemetryArgs,
}

fn main() -> anyhow::Result<()> {
    let config = Config::parse();
    let telemetry = config.telemetry.clone();
    specd_common::serve::run_service("orchestrator", &telemetry, run(config)).map_err(anyhow::Error::msg)?
}

async fn run(config: Config) -> anyhow::Result<()> {
    let keys = match (&config.api_keys_file, config.no_auth) {
        (Some(path), _) => Some(Arc::new(KeyStore::open(path).map_err(anyhow::Error::msg)?)),
        (None, true) => None,
        (None, false) => anyhow::bail!(
            "no API keys configured: pass --api-keys-file FILE (see `specd hash-key`), or --no-auth to \
             serve without authentication"
        ),
    };
    let grpc = GrpcServer::bind("specd.v1.Orchestrator", config.listen)
        .await
        .map_err(anyhow::Error::msg)?
        .with_tls(config.tls.server(false).map_err(anyhow::Error::msg)?);
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
        max_concurrent_requests: config.max_concurrent_requests,
        ngram: config.ngram.config(),
    };
    let mut urls = config.verifier.clone();
    if urls.is_empty() && config.verifier_dns.is_empty() {
        urls.push("http://127.0.0.1:50052".into());
    }
    let breaker = BreakerConfig {
        failure_threshold: config.breaker_failures.max(1),
        open_for: Duration::from_millis(config.breaker_open_ms),
    };
    let pool = PoolConfig {
        targets: parse_targets(&urls, &config.verifier_dns).map_err(anyhow::Error::msg)?,
        deadline: Duration::from_millis(config.call_deadline_ms),
        resolve_interval: Duration::from_millis(config.resolve_interval_ms.max(100)),
        health_interval: Duration::from_millis(config.health_interval_ms.max(50)),
        retry: RetryConfig {
            max_retries: config.max_retries,
            base_delay: Duration::from_millis(config.retry_base_ms),
            budget_ratio: config.retry_budget_ratio,
            ..RetryConfig::default()
        },
        breaker,
        load_factor: config.load_factor,
        max_pins: config.max_sessions.saturating_mul(2).max(1024),
        tokenizer_identity: String::new(),
        tls: config.tls.clone(),
    };
    let generator = remote(
        text,
        RemoteSettings {
            pool,
            drafter_url: config.drafter.clone(),
            drafter_breaker: breaker,
            ready_timeout: Duration::from_secs(config.ready_timeout_s),
            ngram_in_process: config.ngram_in_process,
        },
        settings,
    )
    .await
    .map_err(anyhow::Error::msg)?;
    let service = OrchestratorService::new(Arc::new(generator));
    health.set(true).await;
    tracing::info!(listen = %local, verifier = ?urls, verifier_dns = ?config.verifier_dns, drafter = ?config.drafter, "orchestrator serving");
    let max_request_bytes = config.serve.max_request_bytes;
    if keys.is_none() {
        tracing::warn!("serving WITHOUT authentication (--no-auth)");
    }
    grpc.serve(|router| {
        let server = OrchestratorServer::new(service).max_decoding_message_size(max_request_bytes);
        match keys {
            Some(store) => router.add_service(InterceptedService::new(server, ApiKeyAuth { store })),
            None => router.add_service(server),
        }
    })
    .map_err(anyhow::Error::msg)?
    .await??;
    tracing::info!("orchestrator stopped");
    Ok(())
}
