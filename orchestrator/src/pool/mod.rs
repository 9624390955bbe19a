//! The verifier pool: every replica the orchestrator may score on, found by [`discovery`]
//! (static endpoints and DNS names re-resolved), watched by gRPC health checks, each behind
//! its own circuit breaker. A session sticks to one replica (rendezvous hashing with bounded
//! load, [`rendezvous`]) so its cache stays warm; a call that fails with a transient code is
//! retried with backoff under a budget ([`retry`]) on the next replica, which rebuilds the
//! session's cache from the context carried in the request — the output cannot change.
//!
//! A replica is routed to only after it reports SERVING and its tokenizer matches the
//! orchestrator's; one with a different tokenizer is rejected for good, and logged.

pub mod discovery;
pub mod rendezvous;
pub mod retry;

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, RwLock, Weak};
use std::time::Duration;

use specd_common::tls::TlsArgs;
use specd_proto::v1 as pb;
use tokio::task::AbortHandle;
use tokio::time::Instant;
use tonic::Status;
use tonic::transport::Channel;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tower::ServiceExt;
use tower::util::BoxCloneSyncService;
use tracing::Instrument;

use crate::backend::{GrpcVerifier, Verified, VerifierBackend, check_identity};
use crate::breaker::{Breaker, BreakerConfig, BreakerState, CircuitBreakerLayer, is_health_failure};
use discovery::{Resolver, Target};
use retry::{RetryBudget, RetryConfig, is_retryable};

/// Everything the pool needs to know.
#[derive(Debug, Clone)]
pub struct PoolConfig {
    pub targets: Vec<Target>,
    /// Deadline of each call to a replica.
    pub deadline: Duration,
    pub resolve_interval: Duration,
    pub health_interval: Duration,
    pub retry: RetryConfig,
    pub breaker: BreakerConfig,
    /// A new session skips replicas above this multiple of the mean calls in flight.
    pub load_factor: f64,
    /// Most session→replica assignments remembered (oldest dropped first).
    pub max_pins: usize,
    /// The orchestrator's tokenizer identity; replicas must match it.
    pub tokenizer_identity: String,
    /// TLS towards replicas (https endpoints, this process's certificate, the CA).
    pub tls: TlsArgs,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplicaHealth {
    /// Discovered, not yet checked.
    Unknown,
    Serving,
    NotServing,
    Unreachable,
    /// Runs a model with a different tokenizer: never used.
    Rejected,
}

type VerifyService = BoxCloneSyncService<pb::VerifyRequest, pb::VerifyResponse, Status>;

struct Replica {
    endpoint: String,
    client: GrpcVerifier,
    verify: VerifyService,
    breaker: Breaker,
    health: Mutex<(ReplicaHealth, String)>,
    identity_checked: AtomicBool,
    in_flight: AtomicUsize,
    requests: AtomicU64,
    failures: AtomicU64,
    watcher: Mutex<Option<AbortHandle>>,
}

impl Replica {
    fn health(&self) -> ReplicaHealth {
        self.health.lock().unwrap_or_else(|e| e.into_inner()).0
    }

    fn set_health(&self, health: ReplicaHealth, why: String) {
        let mut current = self.health.lock().unwrap_or_else(|e| e.into_inner());
        if current.0 != health {
            if health == ReplicaHealth::Serving {
                tracing::info!(replica = %self.endpoint, from = ?current.0, "verifier replica serving");
            } else {
                tracing::warn!(replica = %self.endpoint, from = ?current.0, to = ?health, %why, "verifier replica not serving");
            }
        }
        *current = (health, why);
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        if let Some(watcher) = self.watcher.get_mut().ok().and_then(Option::take) {
            watcher.abort();
        }
    }
}

/// Counts a call in flight on a replica for as long as it lives.
struct InFlight<'a>(&'a AtomicUsize);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

pub struct VerifierPool {
    config: PoolConfig,
    replicas: RwLock<BTreeMap<String, Arc<Replica>>>,
    pins: Mutex<HashMap<String, (String, Instant)>>,
    budget: RetryBudget,
    retries: AtomicU64,
    failovers: AtomicU64,
    discovery: Mutex<Option<AbortHandle>>,
}

impl Drop for VerifierPool {
    fn drop(&mut self) {
        if let Some(task) = self.discovery.get_mut().ok().and_then(Option::take) {
            task.abort();
        }
    }
}

impl VerifierPool {
    /// Resolves the targets once, starts health watching and periodic re-resolution.
    pub async fn start(config: PoolConfig) -> Result<Arc<Self>, String> {
        let pool = Arc::new(Self {
            budget: RetryBudget::new(&config.retry),
            config,
            replicas: RwLock::new(BTreeMap::new()),
            pins: Mutex::new(HashMap::new()),
            retries: AtomicU64::new(0),
            failovers: AtomicU64::new(0),
            discovery: Mutex::new(None),
        });
        let mut resolver = Resolver::new(pool.config.tls.scheme());
        let endpoints = resolver.resolve(&pool.config.targets).await;
        pool.sync(endpoints)?;
        let weak = Arc::downgrade(&pool);
        let task = tokio::spawn(async move {
            loop {
                let Some(interval) = weak.upgrade().map(|p| p.config.resolve_interval) else {
                    return;
                };
                tokio::time::sleep(interval).await;
                let Some(pool) = weak.upgrade() else { return };
                let endpoints = resolver.resolve(&pool.config.targets).await;
                if let Err(error) = pool.sync(endpoints) {
                    tracing::error!(%error, "cannot update the verifier pool");
                }
            }
        });
        *pool.discovery.lock().expect("pool lock") = Some(task.abort_handle());
        Ok(pool)
    }

    /// Adds replicas that appeared and drops those that went away.
    fn sync(self: &Arc<Self>, endpoints: BTreeMap<String, String>) -> Result<(), String> {
        let mut replicas = self.replicas.write().expect("pool lock");
        let gone: Vec<String> = replicas
            .keys()
            .filter(|k| !endpoints.contains_key(*k))
            .cloned()
            .collect();
        for endpoint in gone {
            tracing::info!(replica = %endpoint, "verifier replica left the pool");
            replicas.remove(&endpoint);
        }
        for (endpoint, domain) in endpoints {
            if replicas.contains_key(&endpoint) {
                continue;
            }
            let replica = self.new_replica(&endpoint, &domain)?;
            tracing::info!(replica = %endpoint, "verifier replica joined the pool");
            replicas.insert(endpoint, replica);
        }
        Ok(())
    }

    fn new_replica(self: &Arc<Self>, endpoint: &str, domain: &str) -> Result<Arc<Replica>, String> {
        let client = GrpcVerifier::new(endpoint, self.config.deadline, self.config.tls.client(domain)?)?;
        let breaker = Breaker::new(format!("verifier {endpoint}"), self.config.breaker);
        let calls = client.clone();
        let verify = tower::ServiceBuilder::new()
            .layer(CircuitBreakerLayer::new(breaker.clone()))
            .service_fn(move |request: pb::VerifyRequest| {
                let calls = calls.clone();
                async move { calls.verify(request).await }
            });
        let replica = Arc::new(Replica {
            endpoint: endpoint.to_string(),
            client,
            verify: BoxCloneSyncService::new(verify),
            breaker,
            health: Mutex::new((ReplicaHealth::Unknown, "not checked yet".into())),
            identity_checked: AtomicBool::new(false),
            in_flight: AtomicUsize::new(0),
            requests: AtomicU64::new(0),
            failures: AtomicU64::new(0),
            watcher: Mutex::new(None),
        });
        let watcher = tokio::spawn(watch_health(
            Arc::downgrade(&replica),
            self.config.health_interval,
            self.config.deadline.min(Duration::from_secs(2)),
            self.config.tokenizer_identity.clone(),
        ));
        *replica.watcher.lock().expect("replica lock") = Some(watcher.abort_handle());
        Ok(replica)
    }

    /// Waits until some replica is serving with the right tokenizer. Fails at once if every
    /// replica found so far runs a different tokenizer, and after `timeout` otherwise.
    pub async fn wait_ready(&self, timeout: Duration) -> Result<(), String> {
        let started = Instant::now();
        loop {
            let replicas: Vec<Arc<Replica>> = self
                .replicas
                .read()
                .expect("pool lock")
                .values()
                .cloned()
                .collect();
            if replicas.iter().any(|r| r.health() == ReplicaHealth::Serving) {
                return Ok(());
            }
            let rejected: Vec<String> = replicas
                .iter()
                .filter(|r| r.health() == ReplicaHealth::Rejected)
                .map(|r| r.health.lock().expect("replica lock").1.clone())
                .collect();
            if !replicas.is_empty() && rejected.len() == replicas.len() {
                return Err(rejected.join("; "));
            }
            if started.elapsed() >= timeout {
                let states: Vec<String> = replicas
                    .iter()
                    .map(|r| {
                        let (health, why) = r.health.lock().expect("replica lock").clone();
                        format!("{} {health:?} ({why})", r.endpoint)
                    })
                    .collect();
                return Err(format!(
                    "no verifier replica became ready within {timeout:?}: [{}]",
                    states.join(", ")
                ));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The replica for this session's next call, never one in `excluded` (replicas this
    /// call already failed on). Prefers replicas reported SERVING; if none is, tries any
    /// whose breaker allows, since health may lag behind a recovery.
    fn pick(&self, session: &str, excluded: &[String]) -> Option<Arc<Replica>> {
        let replicas = self.replicas.read().expect("pool lock");
        let allowed = |r: &&Arc<Replica>| {
            !excluded.contains(&r.endpoint) && r.health() != ReplicaHealth::Rejected && r.breaker.permits()
        };
        let mut candidates: Vec<&Arc<Replica>> = replicas
            .values()
            .filter(allowed)
            .filter(|r| r.health() == ReplicaHealth::Serving)
            .collect();
        if candidates.is_empty() {
            candidates = replicas.values().filter(allowed).collect();
        }
        if candidates.is_empty() {
            return None;
        }
        if let Some((pinned, _)) = self.pins.lock().expect("pins lock").get(session)
            && let Some(replica) = candidates.iter().find(|r| &r.endpoint == pinned)
        {
            return Some(Arc::clone(replica));
        }
        let loads: Vec<(&str, usize)> = candidates
            .iter()
            .map(|r| (r.endpoint.as_str(), r.in_flight.load(Ordering::Relaxed)))
            .collect();
        rendezvous::choose(session, &loads, self.config.load_factor).map(|i| Arc::clone(candidates[i]))
    }

    fn pin(&self, session: &str, endpoint: &str) {
        let mut pins = self.pins.lock().expect("pins lock");
        if pins.len() >= self.config.max_pins.max(1) && !pins.contains_key(session) {
            // Forget the least recently used half.
            let mut ages: Vec<Instant> = pins.values().map(|p| p.1).collect();
            ages.sort_unstable();
            let cutoff = ages[ages.len() / 2];
            pins.retain(|_, p| p.1 > cutoff);
        }
        pins.insert(session.to_string(), (endpoint.to_string(), Instant::now()));
    }

    fn no_replica(&self) -> Status {
        let replicas = self.replicas.read().expect("pool lock");
        let states: Vec<String> = replicas
            .values()
            .map(|r| {
                format!(
                    "{} health {:?}, breaker {}",
                    r.endpoint,
                    r.health(),
                    r.breaker.state()
                )
            })
            .collect();
        Status::unavailable(format!(
            "no verifier replica can take the call ({} known: [{}])",
            replicas.len(),
            states.join("; ")
        ))
    }

    /// Every replica's state, for the `Replicas` RPC.
    pub fn status(&self) -> Vec<pb::ReplicaStatus> {
        let pins = self.pins.lock().expect("pins lock");
        self.replicas
            .read()
            .expect("pool lock")
            .values()
            .map(|r| pb::ReplicaStatus {
                endpoint: r.endpoint.clone(),
                health: match r.health() {
                    ReplicaHealth::Unknown => pb::ReplicaHealth::Unknown,
                    ReplicaHealth::Serving => pb::ReplicaHealth::Serving,
                    ReplicaHealth::NotServing => pb::ReplicaHealth::NotServing,
                    ReplicaHealth::Unreachable => pb::ReplicaHealth::Unreachable,
                    ReplicaHealth::Rejected => pb::ReplicaHealth::Rejected,
                } as i32,
                breaker: breaker_to_proto(r.breaker.state()) as i32,
                in_flight: r.in_flight.load(Ordering::Relaxed) as u32,
                requests: r.requests.load(Ordering::Relaxed),
                failures: r.failures.load(Ordering::Relaxed),
                pinned_sessions: pins.values().filter(|p| p.0 == r.endpoint).count() as u32,
            })
            .collect()
    }

    /// Retries and failovers since start.
    pub fn totals(&self) -> (u64, u64) {
        (
            self.retries.load(Ordering::Relaxed),
            self.failovers.load(Ordering::Relaxed),
        )
    }
}

pub fn breaker_to_proto(state: BreakerState) -> pb::BreakerState {
    match state {
        BreakerState::Closed => pb::BreakerState::Closed,
        BreakerState::Open => pb::BreakerState::Open,
        BreakerState::HalfOpen => pb::BreakerState::HalfOpen,
    }
}

#[tonic::async_trait]
impl VerifierBackend for VerifierPool {
    async fn verify(&self, request: pb::VerifyRequest) -> Result<Verified, Status> {
        let session = request.session_id.clone();
        self.budget.deposit();
        let mut backoff = self.config.retry.backoff();
        let mut failed_on: Vec<String> = Vec::new();
        let mut previous: Option<String> = None;
        let mut last_failure: Option<Status> = None;
        let (mut attempts, mut failovers) = (0u32, 0u32);
        loop {
            // Every replica failed this call once: a lone replica gets retried. When none
            // can take it (breakers open), the caller learns what actually went wrong.
            let replica = match self
                .pick(&session, &failed_on)
                .or_else(|| self.pick(&session, &[]))
            {
                Some(r) => r,
                None => {
                    return Err(match last_failure {
                        Some(status) => Status::new(
                            status.code(),
                            format!(
                                "{} (after {attempts} attempts; no replica left to try)",
                                status.message()
                            ),
                        ),
                        None => self.no_replica(),
                    });
                }
            };
            if previous.as_ref().is_some_and(|p| *p != replica.endpoint) {
                failovers += 1;
                self.failovers.fetch_add(1, Ordering::Relaxed);
                crate::observe::failover();
                tracing::info!(%session, from = previous.as_deref(), to = %replica.endpoint, "verifier failover");
            }
            attempts += 1;
            replica.requests.fetch_add(1, Ordering::Relaxed);
            replica.in_flight.fetch_add(1, Ordering::Relaxed);
            let attempt = tracing::info_span!(
                "verify.attempt",
                otel.kind = "client",
                replica = %replica.endpoint,
                attempt = attempts
            );
            let result = {
                let _in_flight = InFlight(&replica.in_flight);
                replica
                    .verify
                    .clone()
                    .oneshot(request.clone())
                    .instrument(attempt)
                    .await
            };
            let status = match result {
                Ok(response) => {
                    self.pin(&session, &replica.endpoint);
                    return Ok(Verified {
                        response,
                        attempts,
                        failovers,
                        replica: replica.endpoint.clone(),
                    });
                }
                Err(status) => status,
            };
            if is_health_failure(&status) {
                replica.failures.fetch_add(1, Ordering::Relaxed);
            }
            if !is_retryable(status.code()) {
                return Err(status);
            }
            let Some(wait) = backoff.next() else {
                return Err(Status::new(
                    status.code(),
                    format!("{} (after {attempts} attempts)", status.message()),
                ));
            };
            if !self.budget.withdraw() {
                return Err(Status::new(
                    status.code(),
                    format!("{} (retry budget spent; not retried)", status.message()),
                ));
            }
            self.retries.fetch_add(1, Ordering::Relaxed);
            crate::observe::retry();
            tracing::info!(%session, replica = %replica.endpoint, code = ?status.code(), message = status.message(), wait_ms = wait.as_millis() as u64, "verifier call failed; retrying");
            failed_on.push(replica.endpoint.clone());
            previous = Some(replica.endpoint.clone());
            last_failure = Some(status);
            tokio::time::sleep(wait).await;
        }
    }

    async fn info(&self) -> Result<pb::InfoResponse, Status> {
        let replica = self.pick("", &[]).ok_or_else(|| self.no_replica())?;
        replica.client.info().await
    }

    async fn release(&self, session_id: &str) {
        let pinned = self.pins.lock().expect("pins lock").remove(session_id);
        let replica =
            pinned.and_then(|(endpoint, _)| self.replicas.read().expect("pool lock").get(&endpoint).cloned());
        if let Some(replica) = replica {
            replica.client.release(session_id).await;
        }
    }

    fn name(&self) -> String {
        format!("pool of {}", self.replicas.read().expect("pool lock").len())
    }
}

/// Checks a replica's health every `interval` until it leaves the pool. The first time it
/// reports SERVING, its tokenizer is compared with ours.
async fn watch_health(replica: Weak<Replica>, interval: Duration, timeout: Duration, ours: String) {
    let mut health: Option<HealthClient<Channel>> = None;
    loop {
        let Some(replica) = replica.upgrade() else { return };
        let client = health.get_or_insert_with(|| HealthClient::new(replica.client.channel()));
        let check = tokio::time::timeout(
            timeout,
            client.check(HealthCheckRequest {
                service: "specd.v1.Verifier".into(),
            }),
        )
        .await;
        let (state, why) = match check {
            Err(_) => (
                ReplicaHealth::Unreachable,
                format!("no health answer within {timeout:?}"),
            ),
            Ok(Err(status)) => (ReplicaHealth::Unreachable, status.message().to_string()),
            Ok(Ok(response)) if response.get_ref().status == ServingStatus::Serving as i32 => {
                (ReplicaHealth::Serving, String::new())
            }
            Ok(Ok(_)) => (ReplicaHealth::NotServing, "reports NOT_SERVING".into()),
        };
        if state == ReplicaHealth::Serving && !replica.identity_checked.load(Ordering::Relaxed) {
            match replica.client.info().await {
                Ok(info) => match check_identity("verifier", &replica.endpoint, info.model.as_ref(), &ours) {
                    Ok(()) => replica.identity_checked.store(true, Ordering::Relaxed),
                    Err(why) => {
                        tracing::error!(replica = %replica.endpoint, %why, "verifier replica rejected");
                        replica.set_health(ReplicaHealth::Rejected, why);
                        return;
                    }
                },
                Err(status) => {
                    replica.set_health(ReplicaHealth::Unreachable, status.message().to_string());
                    drop(replica);
                    tokio::time::sleep(interval).await;
                    continue;
                }
            }
        }
        replica.set_health(state, why);
        drop(replica);
        tokio::time::sleep(interval).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(max_pins: usize) -> PoolConfig {
        PoolConfig {
            // Nothing listens there: these tests never call a replica.
            targets: vec![Target::Static("http://127.0.0.1:9".into())],
            deadline: Duration::from_millis(200),
            resolve_interval: Duration::from_secs(60),
            health_interval: Duration::from_secs(60),
            retry: RetryConfig::default(),
            breaker: BreakerConfig::default(),
            load_factor: 1.25,
            max_pins,
            tokenizer_identity: "test".into(),
            tls: TlsArgs::default(),
        }
    }

    #[tokio::test]
    async fn session_pins_are_bounded_and_the_oldest_go_first() {
        let pool = VerifierPool::start(config(8)).await.unwrap();
        for i in 0..100 {
            pool.pin(&format!("s{i}"), "http://127.0.0.1:9");
        }
        let pins = pool.pins.lock().unwrap();
        assert!(pins.len() <= 8, "{} pins kept", pins.len());
        assert!(pins.contains_key("s99"), "the newest pin is kept");
        assert!(!pins.contains_key("s0"), "the oldest pins are dropped");
    }

    #[tokio::test]
    async fn with_every_replica_down_a_call_fails_fast_with_the_cause() {
        let pool = VerifierPool::start(config(8)).await.unwrap();
        let started = Instant::now();
        let status = pool
            .verify(pb::VerifyRequest {
                session_id: "s".into(),
                context: vec![1],
                ..Default::default()
            })
            .await
            .unwrap_err();
        assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
        assert!(status.message().contains("attempts"), "{status:?}");
        assert!(started.elapsed() < Duration::from_secs(10));
    }
}
