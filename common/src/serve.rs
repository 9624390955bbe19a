//! gRPC serving helpers: health that reports NOT_SERVING until the model is loaded and warm,
//! reflection over specd's descriptor set, and a future that resolves on SIGTERM or Ctrl-C.

use tonic_health::ServingStatus;
use tonic_health::server::HealthReporter;

/// Health reporting for one gRPC service name (e.g. `specd.v1.Verifier`) and the server as a
/// whole (the empty name), kept in step.
#[derive(Clone)]
pub struct Health {
    reporter: HealthReporter,
    service: &'static str,
}

impl Health {
    /// The reporter and the health service to mount; both start NOT_SERVING.
    pub async fn new(
        service: &'static str,
    ) -> (
        Self,
        tonic_health::pb::health_server::HealthServer<impl tonic_health::pb::health_server::Health>,
    ) {
        let (reporter, server) = tonic_health::server::health_reporter();
        let health = Self { reporter, service };
        health.set(false).await;
        (health, server)
    }

    pub async fn set(&self, serving: bool) {
        let status = if serving {
            ServingStatus::Serving
        } else {
            ServingStatus::NotServing
        };
        self.reporter.set_service_status(self.service, status).await;
        self.reporter.set_service_status("", status).await;
    }
}

/// gRPC reflection (v1) over every specd.v1 service.
pub fn reflection() -> Result<
    tonic_reflection::server::v1::ServerReflectionServer<impl tonic_reflection::server::v1::ServerReflection>,
    String,
> {
    tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(specd_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()
        .map_err(|e| e.to_string())
}

/// Resolves when the process is asked to stop (SIGTERM or Ctrl-C).
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = terminate => {}
    }
    tracing::info!("shutdown requested; draining in-flight requests");
}
