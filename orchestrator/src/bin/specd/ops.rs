//! Operations commands: `specd health` (a gRPC health probe for container health checks),
//! `specd replicas` (the orchestrator's view of its verifier pool), and `specd trace-sink`
//! (an OTLP/gRPC receiver that prints spans, for machines without Jaeger).

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context;
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
}

/// Exits 0 when the service reports SERVING, 1 otherwise.
pub async fn health(args: HealthArgs) -> anyhow::Result<()> {
    let timeout = Duration::from_millis(args.timeout_ms);
    let check = async {
        let channel = tonic::transport::Endpoint::from_shared(args.url.clone())?
            .connect_timeout(timeout)
            .connect()
            .await?;
        let response = HealthClient::new(channel)
            .check(HealthCheckRequest {
                service: args.service.clone(),
            })
            .await?;
        anyhow::Ok(response.into_inner().status)
    };
    let status = tokio::time::timeout(timeout, check)
        .await
        .with_context(|| format!("{} did not answer within {timeout:?}", args.url))??;
    let serving = status == ServingStatus::Serving as i32;
    println!(
        "{}: {}",
        args.url,
        ServingStatus::try_from(status).map_or("UNKNOWN", |s| s.as_str_name())
    );
    if !serving {
        std::process::exit(1);
    }
    Ok(())
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
    let mut client = specd_proto::OrchestratorClient::connect(args.orchestrator.clone())
        .await
        .with_context(|| format!("cannot reach the orchestrator at {}", args.orchestrator))?;
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
