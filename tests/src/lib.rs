//! Helpers for specd's end-to-end tests: start the real service binaries on loopback ports,
//! wait until their gRPC health says SERVING, and stop them (also on panic).

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

/// Paths of the service binaries cargo built for these tests (see this package's
/// Cargo.toml); `binaries!()` fills them in from the test's build environment.
#[derive(Debug, Clone, Copy)]
pub struct Binaries {
    pub verifier: &'static str,
    pub drafter: &'static str,
    pub orchestrator: &'static str,
}

#[macro_export]
macro_rules! binaries {
    () => {
        $crate::Binaries {
            verifier: env!("CARGO_BIN_EXE_e2e-verifier-svc"),
            drafter: env!("CARGO_BIN_EXE_e2e-drafter-svc"),
            orchestrator: env!("CARGO_BIN_EXE_e2e-orchestrator"),
        }
    };
}

/// A port nothing listens on right now.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The default model's path, fetched once into the cache if needed.
pub fn default_model() -> PathBuf {
    specd_model::fetch::ensure_default_model().expect("fetch the default model")
}

/// A running service process, killed when dropped.
pub struct Service {
    pub name: &'static str,
    pub url: String,
    pub child: Child,
}

impl Service {
    /// Starts the binary at `path` listening on a fresh loopback port with extra `args`.
    pub fn start(name: &'static str, path: &str, args: &[&str]) -> Self {
        let port = free_port();
        let child = Command::new(path)
            .arg("--listen")
            .arg(format!("127.0.0.1:{port}"))
            .args(args)
            .env("SPECD_THREADS", "1")
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name}: {e}"));
        Self {
            name,
            url: format!("http://127.0.0.1:{port}"),
            child,
        }
    }

    /// Waits until gRPC health reports SERVING.
    pub async fn wait_serving(&mut self, timeout: Duration) {
        let started = Instant::now();
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!("{} exited early with {status}", self.name);
            }
            if let Ok(channel) = tonic::transport::Endpoint::from_shared(self.url.clone())
                .unwrap()
                .connect()
                .await
                && let Ok(response) = HealthClient::new(channel)
                    .check(HealthCheckRequest {
                        service: String::new(),
                    })
                    .await
                && response.get_ref().status == ServingStatus::Serving as i32
            {
                return;
            }
            assert!(
                started.elapsed() < timeout,
                "{} not serving after {timeout:?}",
                self.name
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends a signal by name (STOP, CONT, KILL, TERM).
    pub fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(self.pid().to_string())
            .status()
            .expect("run kill");
        assert!(status.success());
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A drafter (with the LM drafter on the default model), a verifier and an orchestrator on
/// loopback, all SERVING.
pub struct Stack {
    pub drafter: Service,
    pub verifier: Service,
    pub orchestrator: Service,
}

impl Stack {
    pub async fn start(bins: Binaries, orchestrator_args: &[&str]) -> Self {
        let model = default_model();
        let model = model.to_str().expect("utf-8 path");
        let mut verifier = Service::start("verifier-svc", bins.verifier, &["--model", model]);
        let mut drafter = Service::start("drafter-svc", bins.drafter, &["--lm", "--model", model]);
        verifier.wait_serving(Duration::from_secs(120)).await;
        drafter.wait_serving(Duration::from_secs(120)).await;
        let mut args = vec![
            "--model",
            model,
            "--verifier",
            &verifier.url,
            "--drafter",
            &drafter.url,
        ];
        args.extend_from_slice(orchestrator_args);
        let mut orchestrator = Service::start("orchestrator", bins.orchestrator, &args);
        orchestrator.wait_serving(Duration::from_secs(120)).await;
        Self {
            drafter,
            verifier,
            orchestrator,
        }
    }

    pub async fn client(&self) -> specd_proto::OrchestratorClient<tonic::transport::Channel> {
        specd_proto::OrchestratorClient::connect(self.orchestrator.url.clone())
            .await
            .expect("connect to the orchestrator")
    }
}
