//! `verifier-svc`: loads the target model and serves `specd.v1.Verifier` with health and
//! reflection. Health stays NOT_SERVING until the model is loaded and has run a warm-up pass.

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context;
use clap::Parser;
use specd_common::model_args::ModelArgs;
use specd_common::serve::{GrpcServer, ServeArgs};
use specd_common::telemetry::TelemetryArgs;
use specd_common::tls::TlsArgs;
use specd_model::ScoreRequest;
use specd_proto::VerifierServer;
use specd_verifier::{VerifierCore, VerifierService};

#[derive(Debug, Parser)]
#[command(
    name = "verifier-svc",
    version,
    about = "specd verifier: target-model scoring over gRPC"
)]
struct Config {
    /// Address to listen on.
    #[arg(long, env = "SPECD_LISTEN", default_value = "0.0.0.0:50052")]
    listen: SocketAddr,
    /// Name this replica reports in responses (default: the listen address).
    #[arg(long, env = "SPECD_REPLICA_NAME")]
    replica_name: Option<String>,
    #[command(flatten)]
    telemetry: TelemetryArgs,
    #[command(flatten)]
    serve: ServeArgs,
    #[command(flatten)]
    tls: TlsArgs,
    #[command(flatten)]
    model: ModelArgs,
}

fn main() -> anyhow::Result<()> {
    let config = Config::parse();
    config.model.apply_threads();
    let telemetry = config.telemetry.clone();
    specd_common::serve::run_service("verifier-svc", &telemetry, run(config)).map_err(anyhow::Error::msg)?
}

async fn run(config: Config) -> anyhow::Result<()> {
    let grpc = GrpcServer::bind("specd.v1.Verifier", config.listen)
        .await
        .map_err(anyhow::Error::msg)?
        .with_tls(config.tls.server(true).map_err(anyhow::Error::msg)?);
    let local = grpc.local_addr();
    let health = grpc.health.clone();
    let replica = config.replica_name.clone().unwrap_or_else(|| local.to_string());
    // Serve health while the model loads, so orchestrators see NOT_SERVING, not a refusal.
    let model_args = config.model.clone();
    let loading = tokio::task::spawn_blocking(move || model_args.load());
    let service = VerifierService::default();
    let mounted = service.clone();
    let max_request_bytes = config.serve.max_request_bytes;
    let server = grpc
        .serve(|router| {
            router.add_service(VerifierServer::new(mounted).max_decoding_message_size(max_request_bytes))
        })
        .map_err(anyhow::Error::msg)?;
    tracing::info!(%local, "verifier listening; loading model");
    let loaded = loading.await?.context("cannot load the model")?;
    warm_up(&loaded.engine).await?;
    let core = Arc::new(VerifierCore::new(loaded.engine.clone(), replica));
    service.set_core(core.clone());
    health.set(true).await;
    tracing::info!(model = %core.model().name, "verifier serving");
    server.await??;
    tracing::info!("verifier stopped");
    Ok(())
}

async fn warm_up(engine: &specd_model::Engine) -> anyhow::Result<()> {
    let sequence = "__warmup__".to_string();
    engine
        .score(ScoreRequest {
            sequence: sequence.clone(),
            context: vec![0; 8],
            logits_from: 0,
        })
        .await
        .context("warm-up pass failed")?;
    engine.release(&sequence);
    Ok(())
}
