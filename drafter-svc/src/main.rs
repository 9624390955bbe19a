//! `drafter-svc`: serves `specd.v1.Drafter` (prompt lookup always; an LM drafter with
//! `--lm`) with health and reflection. Health is NOT_SERVING until any model is loaded.

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context;
use clap::Parser;
use specd_common::model_args::ModelArgs;
use specd_common::serve::{GrpcServer, ServeArgs};
use specd_common::telemetry::TelemetryArgs;
use specd_common::tls::TlsArgs;
use specd_drafter::{DrafterCore, DrafterService, LmDrafter, NgramArgs};
use specd_proto::DrafterServer;

#[derive(Debug, Parser)]
#[command(
    name = "drafter-svc",
    version,
    about = "specd drafter: draft tokens over gRPC"
)]
struct Config {
    /// Address to listen on.
    #[arg(long, env = "SPECD_LISTEN", default_value = "0.0.0.0:50051")]
    listen: SocketAddr,
    #[command(flatten)]
    ngram: NgramArgs,
    /// Also serve an LM drafter, running the model given by --model (same tokenizer as the
    /// target's).
    #[arg(long, env = "SPECD_LM_DRAFTER")]
    lm: bool,
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
    specd_common::serve::run_service("drafter-svc", &telemetry, run(config)).map_err(anyhow::Error::msg)?
}

async fn run(config: Config) -> anyhow::Result<()> {
    let grpc = GrpcServer::bind("specd.v1.Drafter", config.listen)
        .await
        .map_err(anyhow::Error::msg)?
        .with_tls(config.tls.server(true).map_err(anyhow::Error::msg)?);
    let local = grpc.local_addr();
    let health = grpc.health.clone();
    let service = DrafterService::default();
    let mounted = service.clone();
    let max_request_bytes = config.serve.max_request_bytes;
    let server = grpc
        .serve(|router| {
            router.add_service(DrafterServer::new(mounted).max_decoding_message_size(max_request_bytes))
        })
        .map_err(anyhow::Error::msg)?;
    tracing::info!(%local, lm = config.lm, "drafter listening");
    let lm = if config.lm {
        let model_args = config.model.clone();
        let loaded = tokio::task::spawn_blocking(move || model_args.load())
            .await?
            .context("cannot load the LM drafter's model")?;
        Some(LmDrafter::new(loaded.engine))
    } else {
        None
    };
    service.set_core(Arc::new(DrafterCore::new(config.ngram.config(), lm)));
    health.set(true).await;
    tracing::info!("drafter serving");
    server.await??;
    tracing::info!("drafter stopped");
    Ok(())
}
