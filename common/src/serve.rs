//! gRPC serving for every service binary: a listener with health (NOT_SERVING until the
//! service says it is ready, e.g. its model is loaded and warm) and reflection over specd's
//! descriptor set already mounted, every call in a server span joined to the caller's trace,
//! served until SIGTERM or Ctrl-C.

use std::net::SocketAddr;

use tokio::net::TcpListener;

use crate::telemetry::TraceContextLayer;
use tonic::transport::server::{Router, TcpIncoming};
use tonic_health::ServingStatus;
use tonic_health::pb::health_server::HealthServer;
use tonic_health::server::{HealthReporter, HealthService};

/// Serving limits every service binary takes.
#[derive(Debug, Clone, clap::Args)]
pub struct ServeArgs {
    /// Largest request message accepted, in bytes; a larger one is refused (OutOfRange)
    /// and the service keeps serving.
    #[arg(long, env = "SPECD_MAX_REQUEST_BYTES", default_value_t = 4 << 20)]
    pub max_request_bytes: usize,
}

/// A router whose every call runs in a trace-context-aware server span.
pub type TracedRouter = Router<tower::layer::util::Stack<TraceContextLayer, tower::layer::util::Identity>>;

/// A bound gRPC listener with health and reflection ready to mount beside one service.
pub struct GrpcServer {
    pub health: Health,
    tls: Option<tonic::transport::ServerTlsConfig>,
    health_service: HealthServer<HealthService>,
    listener: TcpListener,
}

impl GrpcServer {
    /// Binds `addr`; health for `service` (e.g. `specd.v1.Verifier`) starts NOT_SERVING.
    pub async fn bind(service: &'static str, addr: SocketAddr) -> Result<Self, String> {
        let (health, health_service) = Health::new(service).await;
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|e| format!("cannot listen on {addr}: {e}"))?;
        Ok(Self {
            health,
            health_service,
            listener,
            tls: None,
        })
    }

    /// Serves TLS (mutual when the config names a client CA).
    pub fn with_tls(mut self, tls: Option<tonic::transport::ServerTlsConfig>) -> Self {
        self.tls = tls;
        self
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.listener
            .local_addr()
            .expect("a bound listener has an address")
    }

    /// Serves health, reflection and whatever `mount` adds, in a task, until a shutdown
    /// signal. On the signal, health turns NOT_SERVING (so callers route elsewhere), new
    /// connections are refused, and in-flight calls drain before the task ends.
    pub fn serve(
        self,
        mount: impl FnOnce(TracedRouter) -> TracedRouter,
    ) -> Result<tokio::task::JoinHandle<Result<(), tonic::transport::Error>>, String> {
        let mut builder = tonic::transport::Server::builder();
        if let Some(tls) = self.tls {
            builder = builder
                .tls_config(tls)
                .map_err(|e| format!("bad TLS configuration: {e}"))?;
        }
        let router = builder
            .layer(TraceContextLayer)
            .add_service(self.health_service)
            .add_service(reflection()?);
        let health = self.health.clone();
        let draining = async move {
            shutdown_signal().await;
            health.set(false).await;
        };
        // Accepted sockets get TCP_NODELAY, as tonic's own listener gives them (a listener
        // handed in keeps the system default, Nagle's algorithm): with Nagle, a reply's
        // last small frame can wait for the peer's delayed ACK, ~40 ms on Linux.
        let incoming = TcpIncoming::from(self.listener).with_nodelay(Some(true));
        let server = mount(router).serve_with_incoming_shutdown(incoming, draining);
        Ok(tokio::spawn(server))
    }
}

/// Health reporting for one gRPC service name (e.g. `specd.v1.Verifier`) and the server as a
/// whole (the empty name), kept in step.
#[derive(Clone)]
pub struct Health {
    reporter: HealthReporter,
    service: &'static str,
}

impl Health {
    /// The reporter and the health service to mount; both start NOT_SERVING.
    pub async fn new(service: &'static str) -> (Self, HealthServer<HealthService>) {
        let reporter = HealthReporter::new();
        let server = HealthServer::new(HealthService::from_health_reporter(reporter.clone()));
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

/// Runs a service binary's main future on a multi-threaded tokio runtime, with telemetry
/// installed inside it (the OTLP exporter needs the runtime) and the last spans flushed
/// when the future ends. Call it after whatever must happen before threads exist (setting
/// the model's compute threads). The outer error is the runtime's or telemetry's.
pub fn run_service<T>(
    name: &str,
    telemetry: &crate::telemetry::TelemetryArgs,
    main: impl std::future::Future<Output = T>,
) -> Result<T, String> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the async runtime: {e}"))?;
    runtime.block_on(async {
        let _flush_on_drop = crate::telemetry::init(name, telemetry)?;
        Ok(main.await)
    })
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

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;
    use std::os::fd::RawFd;
    use std::time::Duration;

    /// The TCP port of one side of socket `fd` (`peer`: the other side's), if it has one.
    fn port(fd: RawFd, peer: bool) -> Option<u16> {
        // SAFETY: the address buffer is a zeroed sockaddr_storage and its length is given;
        // the calls fail harmlessly on a descriptor that is not a connected socket.
        unsafe {
            let mut address: libc::sockaddr_storage = std::mem::zeroed();
            let mut len = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
            let pointer = &mut address as *mut _ as *mut libc::sockaddr;
            let status = if peer {
                libc::getpeername(fd, pointer, &mut len)
            } else {
                libc::getsockname(fd, pointer, &mut len)
            };
            if status != 0 || i32::from(address.ss_family) != libc::AF_INET {
                return None;
            }
            let ipv4 = &*(pointer as *const libc::sockaddr_in);
            Some(u16::from_be(ipv4.sin_port))
        }
    }

    /// This process's socket of the TCP connection from port `local` to port `peer`.
    fn connection(local: u16, peer: u16) -> Option<RawFd> {
        std::fs::read_dir("/proc/self/fd")
            .ok()?
            .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<RawFd>().ok())
            .find(|&fd| port(fd, false) == Some(local) && port(fd, true) == Some(peer))
    }

    fn nodelay(fd: RawFd) -> bool {
        let mut value: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: an int-sized option read into an int.
        let status = unsafe {
            libc::getsockopt(
                fd,
                libc::IPPROTO_TCP,
                libc::TCP_NODELAY,
                &mut value as *mut _ as *mut libc::c_void,
                &mut len,
            )
        };
        assert_eq!(status, 0, "getsockopt(TCP_NODELAY) on descriptor {fd}");
        value != 0
    }

    #[tokio::test]
    async fn accepted_connections_send_small_frames_at_once() {
        let server = GrpcServer::bind("specd.v1.Test", "127.0.0.1:0".parse().unwrap())
            .await
            .unwrap();
        let address = server.local_addr();
        let _serving = server.serve(|router| router).unwrap();
        let client = tokio::net::TcpStream::connect(address).await.unwrap();
        let client_port = client.local_addr().unwrap().port();
        // The server accepts on its task (and sets the option in the same poll), which runs
        // while this one sleeps.
        let mut accepted = None;
        for _ in 0..500 {
            accepted = connection(address.port(), client_port);
            if accepted.is_some() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let fd = accepted.expect("the server accepted the connection within 5 s");
        assert!(
            nodelay(fd),
            "an accepted connection must have Nagle's algorithm off (TCP_NODELAY), or a reply's last frame can wait for a delayed ACK"
        );
    }
}
