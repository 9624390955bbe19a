//! Helpers for specd's end-to-end tests: start the real service binaries on loopback ports,
//! wait until their gRPC health says SERVING, and stop them (also on panic).

pub mod otlp;

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
    pub specd: &'static str,
}

#[macro_export]
macro_rules! binaries {
    () => {
        $crate::Binaries {
            verifier: env!("CARGO_BIN_EXE_e2e-verifier-svc"),
            drafter: env!("CARGO_BIN_EXE_e2e-drafter-svc"),
            orchestrator: env!("CARGO_BIN_EXE_e2e-orchestrator"),
            specd: env!("CARGO_BIN_EXE_e2e-specd"),
        }
    };
}

/// A loopback port nothing listens on right now, outside the range outgoing connections
/// take their source ports from (see `specd_common::ports`).
pub fn free_port() -> u16 {
    specd_common::ports::free_local_port().expect("a free loopback port")
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
        Self::start_on(name, path, free_port(), args)
    }

    /// Starts the binary at `path` listening on loopback `port` (e.g. a restart).
    pub fn start_on(name: &'static str, path: &str, port: u16, args: &[&str]) -> Self {
        Self::start_with_env(name, path, port, args, &[])
    }

    /// As [`Service::start_on`], with extra environment variables.
    pub fn start_with_env(
        name: &'static str,
        path: &str,
        port: u16,
        args: &[&str],
        env: &[(&str, &str)],
    ) -> Self {
        let child = Command::new(path)
            .arg("--listen")
            .arg(format!("127.0.0.1:{port}"))
            .args(args)
            .envs(env.iter().copied())
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

    /// The port this service listens on.
    pub fn port(&self) -> u16 {
        self.url
            .rsplit(':')
            .next()
            .and_then(|p| p.parse().ok())
            .expect("a port in the url")
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

/// A drafter, one or more verifiers and an orchestrator on loopback, all SERVING.
pub struct Stack {
    pub drafter: Service,
    pub verifiers: Vec<Service>,
    pub orchestrator: Service,
}

/// What to start.
pub struct StackOptions<'a> {
    pub verifiers: usize,
    /// Offer the LM drafter (loads the model a further time) besides prompt lookup.
    pub lm_drafter: bool,
    pub verifier_args: &'a [&'a str],
    pub drafter_args: &'a [&'a str],
    pub orchestrator_args: &'a [&'a str],
    /// Environment for every service.
    pub env: &'a [(&'a str, &'a str)],
}

impl Default for StackOptions<'_> {
    fn default() -> Self {
        Self {
            verifiers: 1,
            lm_drafter: true,
            verifier_args: &[],
            drafter_args: &[],
            orchestrator_args: &[],
            env: &[],
        }
    }
}

impl Stack {
    /// One verifier and a drafter with the LM drafter.
    pub async fn start(bins: Binaries, orchestrator_args: &[&str]) -> Self {
        Self::start_with(
            bins,
            StackOptions {
                orchestrator_args,
                ..StackOptions::default()
            },
        )
        .await
    }

    pub async fn start_with(bins: Binaries, options: StackOptions<'_>) -> Self {
        let model = default_model();
        let model = model.to_str().expect("utf-8 path");
        let mut verifier_args = vec!["--model", model];
        verifier_args.extend_from_slice(options.verifier_args);
        let mut verifiers: Vec<Service> = (0..options.verifiers)
            .map(|_| {
                Service::start_with_env(
                    "verifier-svc",
                    bins.verifier,
                    free_port(),
                    &verifier_args,
                    options.env,
                )
            })
            .collect();
        let mut drafter_args = vec!["--model", model];
        if options.lm_drafter {
            drafter_args.push("--lm");
        }
        drafter_args.extend_from_slice(options.drafter_args);
        let mut drafter = Service::start_with_env(
            "drafter-svc",
            bins.drafter,
            free_port(),
            &drafter_args,
            options.env,
        );
        for verifier in &mut verifiers {
            verifier.wait_serving(Duration::from_secs(120)).await;
        }
        drafter.wait_serving(Duration::from_secs(120)).await;
        let endpoints = verifiers
            .iter()
            .map(|v| v.url.as_str())
            .collect::<Vec<_>>()
            .join(",");
        let mut args = vec![
            "--model",
            model,
            "--verifier",
            &endpoints,
            "--drafter",
            &drafter.url,
        ];
        // Authentication is off only where a test says nothing about keys.
        if !options.orchestrator_args.contains(&"--api-keys-file") {
            args.push("--no-auth");
        }
        args.extend_from_slice(options.orchestrator_args);
        let mut orchestrator =
            Service::start_with_env("orchestrator", bins.orchestrator, free_port(), &args, options.env);
        orchestrator.wait_serving(Duration::from_secs(120)).await;
        Self {
            drafter,
            verifiers,
            orchestrator,
        }
    }

    pub async fn client(&self) -> specd_proto::OrchestratorClient<tonic::transport::Channel> {
        specd_proto::OrchestratorClient::connect(self.orchestrator.url.clone())
            .await
            .expect("connect to the orchestrator")
    }

    /// The orchestrator's view of its verifier pool and drafter.
    pub async fn replicas(&self) -> specd_proto::v1::ReplicasResponse {
        self.client()
            .await
            .replicas(specd_proto::v1::ReplicasRequest {})
            .await
            .expect("Replicas")
            .into_inner()
    }

    /// The verifier process behind a pool endpoint.
    pub fn verifier_at(&self, endpoint: &str) -> &Service {
        self.verifiers
            .iter()
            .find(|v| v.url == endpoint)
            .unwrap_or_else(|| panic!("no verifier at {endpoint}"))
    }

    /// Waits until some verifier has a call in flight and returns its endpoint.
    pub async fn busy_verifier(&self, timeout: Duration) -> String {
        let started = Instant::now();
        loop {
            let replicas = self.replicas().await;
            if let Some(busy) = replicas.verifiers.iter().find(|r| r.in_flight > 0) {
                return busy.endpoint.clone();
            }
            assert!(started.elapsed() < timeout, "no verifier got busy: {replicas:?}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Waits until `check` holds for the replica at `endpoint`.
    pub async fn wait_replica(
        &self,
        endpoint: &str,
        timeout: Duration,
        what: &str,
        check: impl Fn(&specd_proto::v1::ReplicaStatus) -> bool,
    ) -> specd_proto::v1::ReplicaStatus {
        let started = Instant::now();
        loop {
            let replicas = self.replicas().await;
            let replica = replicas
                .verifiers
                .iter()
                .find(|r| r.endpoint == endpoint)
                .unwrap_or_else(|| panic!("{endpoint} not in the pool: {replicas:?}"));
            if check(replica) {
                return replica.clone();
            }
            assert!(
                started.elapsed() < timeout,
                "{endpoint} never became {what}: {replica:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}
