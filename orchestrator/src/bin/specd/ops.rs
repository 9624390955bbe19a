//! Operations commands: `specd health` (a gRPC health probe for container health checks),
//! `specd replicas` (the orchestrator's view of its verifier pool), and `specd trace-sink`
//! (an OTLP/gRPC receiver that prints spans, for machines without Jaeger).

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context;
use specd_common::tls::{DevCa, TlsArgs};
use specd_proto::v1 as pb;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

#[derive(Debug, clap::Args)]
pub struct HealthArgs {
    /// The service's address, e.g. http://127.0.0.1:50052.
    #[arg(env = "SPECD_HEALTH_URL")]
    url: String,
    /// The gRPC service to ask about (default: the server as a whole).
    #[arg(long, default_value = "")]
    service: String,
    /// Give up after this many milliseconds.
    #[arg(long, default_value_t = 3000)]
    timeout_ms: u64,
    #[command(flatten)]
    tls: TlsArgs,
}

/// A channel to `url`, over TLS when the flags say so (the server checked as the URL's host).
pub async fn connect(
    url: &str,
    tls: &TlsArgs,
    timeout: Duration,
) -> anyhow::Result<tonic::transport::Channel> {
    let mut endpoint = tonic::transport::Endpoint::from_shared(url.to_string())?.connect_timeout(timeout);
    if let Some(config) = tls
        .client(specd_orchestrator::backend::host_of(url))
        .map_err(anyhow::Error::msg)?
    {
        endpoint = endpoint.tls_config(config)?;
    }
    endpoint
        .connect()
        .await
        .with_context(|| format!("cannot reach {url}"))
}

/// Exits 0 when the service reports SERVING, 1 otherwise.
pub async fn health(args: HealthArgs) -> anyhow::Result<()> {
    let timeout = Duration::from_millis(args.timeout_ms);
    let status = health_status(&args.url, &args.service, &args.tls, timeout).await?;
    println!(
        "{}: {}",
        args.url,
        ServingStatus::try_from(status).map_or("UNKNOWN", |s| s.as_str_name())
    );
    if status != ServingStatus::Serving as i32 {
        std::process::exit(1);
    }
    Ok(())
}

/// The gRPC health status `url` reports for `service` ("" = the whole server), within
/// `timeout`.
pub async fn health_status(
    url: &str,
    service: &str,
    tls: &TlsArgs,
    timeout: Duration,
) -> anyhow::Result<i32> {
    let check = async {
        let channel = connect(url, tls, timeout).await?;
        let response = HealthClient::new(channel)
            .check(HealthCheckRequest {
                service: service.to_string(),
            })
            .await?;
        anyhow::Ok(response.into_inner().status)
    };
    tokio::time::timeout(timeout, check)
        .await
        .with_context(|| format!("{url} did not answer within {timeout:?}"))?
}

#[derive(Debug, clap::Args)]
pub struct ReplicasArgs {
    /// The orchestrator's address.
    #[arg(long, env = "SPECD_ORCHESTRATOR", default_value = "http://127.0.0.1:50050")]
    orchestrator: String,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
    /// API key for the orchestrator.
    #[arg(long, env = "SPECD_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    #[command(flatten)]
    tls: TlsArgs,
}

/// A request carrying `authorization: Bearer KEY` when a key is given.
pub fn authorized<T>(message: T, api_key: Option<&str>) -> anyhow::Result<tonic::Request<T>> {
    let mut request = tonic::Request::new(message);
    if let Some(key) = api_key {
        let value = format!("Bearer {key}")
            .parse()
            .map_err(|_| anyhow::anyhow!("the API key is not valid header text"))?;
        request.metadata_mut().insert("authorization", value);
    }
    Ok(request)
}

#[derive(Debug, clap::Args)]
pub struct HashKeyArgs {
    /// The key; read from stdin when absent (keeps it out of shell history).
    key: Option<String>,
}

/// Prints the SHA-256 of an API key, as the orchestrator's key file stores it.
pub fn hash_key(args: HashKeyArgs) -> anyhow::Result<()> {
    let key = match args.key {
        Some(key) => key,
        None => {
            let mut line = String::new();
            std::io::stdin().read_line(&mut line)?;
            line.trim_end_matches(['\r', '\n']).to_string()
        }
    };
    anyhow::ensure!(!key.is_empty(), "the key is empty");
    println!("{}", specd_orchestrator::auth::hash_key(&key));
    Ok(())
}

/// Prints the verifier pool: health, breaker, load and sessions per replica.
pub async fn replicas(args: ReplicasArgs) -> anyhow::Result<()> {
    let mut client = specd_proto::OrchestratorClient::new(
        connect(&args.orchestrator, &args.tls, Duration::from_secs(5)).await?,
    );
    let r = client
        .replicas(authorized(pb::ReplicasRequest {}, args.api_key.as_deref())?)
        .await?
        .into_inner();
    let health = |h: i32| {
        pb::ReplicaHealth::try_from(h).map_or("?".to_string(), |h| {
            h.as_str_name()
                .trim_start_matches("REPLICA_HEALTH_")
                .to_ascii_lowercase()
        })
    };
    let breaker = |b: i32| {
        pb::BreakerState::try_from(b).map_or("?".to_string(), |b| {
            b.as_str_name()
                .trim_start_matches("BREAKER_STATE_")
                .to_ascii_lowercase()
        })
    };
    if args.json {
        let verifiers: Vec<_> = r
            .verifiers
            .iter()
            .map(|v| {
                serde_json::json!({
                    "endpoint": v.endpoint, "health": health(v.health), "breaker": breaker(v.breaker),
                    "in_flight": v.in_flight, "requests": v.requests, "failures": v.failures,
                    "pinned_sessions": v.pinned_sessions,
                })
            })
            .collect();
        let json = serde_json::json!({
            "verifiers": verifiers,
            "drafter_breaker": breaker(r.drafter_breaker),
            "retries": r.retries,
            "failovers": r.failovers,
        });
        println!("{}", serde_json::to_string_pretty(&json)?);
        return Ok(());
    }
    println!(
        "{:<28} {:<12} {:<10} {:>9} {:>9} {:>9} {:>9}",
        "verifier", "health", "breaker", "in flight", "requests", "failures", "sessions"
    );
    for v in &r.verifiers {
        println!(
            "{:<28} {:<12} {:<10} {:>9} {:>9} {:>9} {:>9}",
            v.endpoint,
            health(v.health),
            breaker(v.breaker),
            v.in_flight,
            v.requests,
            v.failures,
            v.pinned_sessions
        );
    }
    println!(
        "drafter breaker: {}; retries {}, failovers {}",
        breaker(r.drafter_breaker),
        r.retries,
        r.failovers
    );
    Ok(())
}

#[derive(Debug, clap::Args)]
pub struct TraceSinkArgs {
    /// Address to receive OTLP/gRPC on.
    #[arg(long, env = "SPECD_LISTEN", default_value = "0.0.0.0:4317")]
    listen: SocketAddr,
}

/// Receives spans over OTLP/gRPC and prints one line per span until stopped.
pub async fn trace_sink(args: TraceSinkArgs) -> anyhow::Result<()> {
    let sink = specd_common::otlp_sink::OtlpReceiver::start(args.listen, true)
        .await
        .with_context(|| format!("cannot listen on {}", args.listen))?;
    eprintln!("trace-sink: receiving OTLP/gRPC at {}", sink.endpoint);
    specd_common::serve::shutdown_signal().await;
    Ok(())
}

#[derive(Debug, clap::Args)]
pub struct DevCertsArgs {
    /// Directory to write ca.pem, NAME.pem and NAME-key.pem into.
    #[arg(long, default_value = "certs")]
    out: std::path::PathBuf,
    /// One certificate per name (each valid for that DNS name), comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "orchestrator,verifier,drafter")]
    names: Vec<String>,
    /// Extra names every certificate is also valid for (DNS names or IP addresses).
    #[arg(long, value_delimiter = ',', default_value = "localhost,127.0.0.1")]
    san: Vec<String>,
    /// Make new ones even if `OUT/ca.pem` exists (otherwise existing ones are kept).
    #[arg(long)]
    force: bool,
}

/// Makes a development CA and a certificate per service. Keys are written readable, for
/// containers running as another user: development only; use your own PKI in production.
pub fn dev_certs(args: DevCertsArgs) -> anyhow::Result<()> {
    if args.out.join("ca.pem").exists() && !args.force {
        eprintln!(
            "{} already holds a CA; keeping it (--force to replace)",
            args.out.display()
        );
        return Ok(());
    }
    let ca = DevCa::new("specd development CA").map_err(anyhow::Error::msg)?;
    let names: Vec<&str> = args.names.iter().map(String::as_str).collect();
    let sans: Vec<&str> = args.san.iter().map(String::as_str).collect();
    ca.write(&args.out, &names, &sans).map_err(anyhow::Error::msg)?;
    eprintln!(
        "wrote {}/ca.pem and certificates for {} (also valid for {})",
        args.out.display(),
        names.join(", "),
        sans.join(", ")
    );
    Ok(())
}
