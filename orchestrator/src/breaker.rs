//! Circuit breaking for calls to a downstream service (one breaker per verifier replica, one
//! for the drafter), as a tower layer. Closed: calls pass and consecutive failures are
//! counted. Open (after `failure_threshold` failures in a row): calls are refused at once
//! with Unavailable, costing nothing. Half-open (once `open_for` has passed): one probe call
//! is let through; its success closes the breaker, its failure opens it again.
//!
//! Only failures that say something about the service's health count: Unavailable,
//! DeadlineExceeded, Unknown, Internal, DataLoss. An overloaded service (ResourceExhausted)
//! or a bad request is alive and answering, so it does not trip the breaker. Nor does a
//! call that ran out of time while the service kept answering other calls (one succeeded
//! in the second half of its wait): it waited in a busy service's queue. Counted, such
//! deadlines opened the breaker of a saturated but healthy verifier, and every session on
//! it failed (`specd bench load --concurrency 64 --verifiers 1 --call-deadline-ms 3000`:
//! all 64 sessions, mostly with Unavailable). A hung service answers no one, so its
//! deadlines still count.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::time::Instant;
use tonic::{Code, Status};

/// When a breaker opens and for how long.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BreakerConfig {
    /// Consecutive failures that open the breaker.
    pub failure_threshold: u32,
    /// How long an open breaker refuses calls before letting a probe through.
    pub open_for: Duration,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        Self {
            failure_threshold: 3,
            open_for: Duration::from_secs(5),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BreakerState {
    Closed,
    Open,
    HalfOpen,
}

impl fmt::Display for BreakerState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Closed => "closed",
            Self::Open => "open",
            Self::HalfOpen => "half-open",
        })
    }
}

/// Whether a failed call says the service is unhealthy (and so counts against the breaker).
pub fn is_health_failure(status: &Status) -> bool {
    matches!(
        status.code(),
        Code::Unavailable | Code::DeadlineExceeded | Code::Unknown | Code::Internal | Code::DataLoss
    )
}

#[derive(Debug)]
struct Inner {
    state: BreakerState,
    consecutive_failures: u32,
    opened_at: Instant,
    probe_in_flight: bool,
    transitions: u64,
    /// When a call last succeeded: the service's latest sign of life.
    last_success: Option<Instant>,
}

/// A breaker's shared state; clones share it.
#[derive(Clone)]
pub struct Breaker {
    name: Arc<str>,
    config: BreakerConfig,
    inner: Arc<Mutex<Inner>>,
}

impl fmt::Debug for Breaker {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Breaker")
            .field("name", &self.name)
            .field("state", &self.state())
            .finish()
    }
}

impl Breaker {
    pub fn new(name: impl Into<Arc<str>>, config: BreakerConfig) -> Self {
        Self {
            name: name.into(),
            config,
            inner: Arc::new(Mutex::new(Inner {
                state: BreakerState::Closed,
                consecutive_failures: 0,
                opened_at: Instant::now(),
                probe_in_flight: false,
                transitions: 0,
                last_success: None,
            })),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The state as a caller would see it now (an open breaker whose time is up reads as
    /// half-open).
    pub fn state(&self) -> BreakerState {
        let inner = self.lock();
        match inner.state {
            BreakerState::Open if inner.opened_at.elapsed() >= self.config.open_for => BreakerState::HalfOpen,
            state => state,
        }
    }

    /// How many times the state has changed.
    pub fn transitions(&self) -> u64 {
        self.lock().transitions
    }

    /// Whether a call would be admitted now (without admitting it).
    pub fn permits(&self) -> bool {
        let inner = self.lock();
        match inner.state {
            BreakerState::Closed => true,
            BreakerState::Open => inner.opened_at.elapsed() >= self.config.open_for,
            BreakerState::HalfOpen => !inner.probe_in_flight,
        }
    }

    /// Admits one call, or refuses it with Unavailable while the breaker is open (or its one
    /// half-open probe is already out). Record the call's outcome on the permit.
    pub fn try_acquire(&self) -> Result<Permit, Status> {
        let mut inner = self.lock();
        match inner.state {
            BreakerState::Closed => Ok(Permit::new(self.clone(), false)),
            BreakerState::Open if inner.opened_at.elapsed() >= self.config.open_for => {
                self.transition(&mut inner, BreakerState::HalfOpen);
                inner.probe_in_flight = true;
                Ok(Permit::new(self.clone(), true))
            }
            BreakerState::HalfOpen if !inner.probe_in_flight => {
                inner.probe_in_flight = true;
                Ok(Permit::new(self.clone(), true))
            }
            state => {
                let wait = self.config.open_for.saturating_sub(inner.opened_at.elapsed());
                Err(Status::unavailable(format!(
                    "{}: circuit {state} after {} failures in a row; next probe in {} ms",
                    self.name,
                    inner.consecutive_failures,
                    wait.as_millis()
                )))
            }
        }
    }

    fn record(&self, probe: bool, success: bool) {
        let mut inner = self.lock();
        if probe {
            inner.probe_in_flight = false;
        }
        if success {
            inner.last_success = Some(Instant::now());
            inner.consecutive_failures = 0;
            if inner.state != BreakerState::Closed && (probe || inner.state == BreakerState::HalfOpen) {
                self.transition(&mut inner, BreakerState::Closed);
            }
            return;
        }
        inner.consecutive_failures = inner.consecutive_failures.saturating_add(1);
        let trips = match inner.state {
            BreakerState::Closed => inner.consecutive_failures >= self.config.failure_threshold,
            BreakerState::HalfOpen => probe,
            BreakerState::Open => false,
        };
        if trips {
            inner.opened_at = Instant::now();
            self.transition(&mut inner, BreakerState::Open);
        }
    }

    /// Whether a call succeeded in the second half of a wait that started at `started`: the
    /// service was answering others while this call waited (see the module documentation).
    fn answered_others_since(&self, started: Instant) -> bool {
        let midpoint = started + started.elapsed() / 2;
        self.lock().last_success.is_some_and(|at| at > midpoint)
    }

    fn transition(&self, inner: &mut Inner, to: BreakerState) {
        if inner.state == to {
            return;
        }
        let from = inner.state;
        inner.state = to;
        inner.transitions += 1;
        crate::observe::breaker(&self.name, to);
        if to == BreakerState::Open {
            tracing::warn!(breaker = %self.name, %from, %to, failures = inner.consecutive_failures, "circuit breaker opened");
        } else {
            tracing::info!(breaker = %self.name, %from, %to, "circuit breaker changed state");
        }
    }
}

/// One admitted call. Dropping it without an outcome (the caller gave up) counts as neither
/// success nor failure; a probe slot is freed either way.
pub struct Permit {
    breaker: Breaker,
    probe: bool,
    recorded: bool,
}

impl Permit {
    fn new(breaker: Breaker, probe: bool) -> Self {
        Self {
            breaker,
            probe,
            recorded: false,
        }
    }

    pub fn is_probe(&self) -> bool {
        self.probe
    }

    pub fn record(mut self, success: bool) {
        self.recorded = true;
        self.breaker.record(self.probe, success);
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        if !self.recorded && self.probe {
            self.breaker.lock().probe_in_flight = false;
        }
    }
}

/// A tower layer that puts a [`Breaker`] in front of a service whose errors are statuses.
#[derive(Clone)]
pub struct CircuitBreakerLayer {
    breaker: Breaker,
}

impl CircuitBreakerLayer {
    pub fn new(breaker: Breaker) -> Self {
        Self { breaker }
    }
}

impl<S> tower::Layer<S> for CircuitBreakerLayer {
    type Service = CircuitBreakerService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        CircuitBreakerService {
            inner,
            breaker: self.breaker.clone(),
        }
    }
}

#[derive(Clone)]
pub struct CircuitBreakerService<S> {
    inner: S,
    breaker: Breaker,
}

impl<S, Request> tower::Service<Request> for CircuitBreakerService<S>
where
    S: tower::Service<Request, Error = Status>,
    S::Future: Send + 'static,
    S::Response: Send + 'static,
{
    type Response = S::Response;
    type Error = Status;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, Status>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Status>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request) -> Self::Future {
        let permit = match self.breaker.try_acquire() {
            Ok(permit) => permit,
            Err(status) => return Box::pin(std::future::ready(Err(status))),
        };
        let call = self.inner.call(request);
        let breaker = self.breaker.clone();
        let started = Instant::now();
        Box::pin(async move {
            let result = call.await;
            match &result {
                Ok(_) => permit.record(true),
                // Queued behind other calls of a live service: no verdict on its health.
                Err(status)
                    if status.code() == Code::DeadlineExceeded && breaker.answered_others_since(started) => {}
                Err(status) => permit.record(!is_health_failure(status)),
            }
            result
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tower::{Layer, ServiceExt};

    fn config() -> BreakerConfig {
        BreakerConfig {
            failure_threshold: 3,
            open_for: Duration::from_secs(10),
        }
    }

    /// A service that answers with the outcome it is asked for.
    fn echo() -> impl tower::Service<Result<u32, Code>, Response = u32, Error = Status, Future: Send> + Clone
    {
        tower::service_fn(|outcome: Result<u32, Code>| async move {
            outcome.map_err(|c| Status::new(c, "failed"))
        })
    }

    async fn call(
        service: &CircuitBreakerService<
            impl tower::Service<Result<u32, Code>, Response = u32, Error = Status, Future: Send + 'static> + Clone,
        >,
        outcome: Result<u32, Code>,
    ) -> Result<u32, Status> {
        service.clone().oneshot(outcome).await
    }

    #[tokio::test(start_paused = true)]
    async fn opens_after_consecutive_failures_then_probes_and_closes() {
        let breaker = Breaker::new("test", config());
        let service = CircuitBreakerLayer::new(breaker.clone()).layer(echo());
        assert_eq!(call(&service, Ok(1)).await.unwrap(), 1);
        for _ in 0..2 {
            call(&service, Err(Code::Unavailable)).await.unwrap_err();
        }
        assert_eq!(
            breaker.state(),
            BreakerState::Closed,
            "two failures are under the threshold"
        );
        call(&service, Err(Code::DeadlineExceeded)).await.unwrap_err();
        assert_eq!(breaker.state(), BreakerState::Open);
        // Open: refused without reaching the service (which would have succeeded).
        let refused = call(&service, Ok(2)).await.unwrap_err();
        assert_eq!(refused.code(), Code::Unavailable);
        assert!(refused.message().contains("circuit open"), "{refused:?}");
        assert!(!breaker.permits());
        tokio::time::advance(Duration::from_secs(10)).await;
        assert_eq!(breaker.state(), BreakerState::HalfOpen);
        assert!(breaker.permits());
        assert_eq!(call(&service, Ok(3)).await.unwrap(), 3, "the probe goes through");
        assert_eq!(breaker.state(), BreakerState::Closed);
        assert_eq!(breaker.transitions(), 3);
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_probe_reopens_for_another_period() {
        let breaker = Breaker::new("test", config());
        let service = CircuitBreakerLayer::new(breaker.clone()).layer(echo());
        for _ in 0..3 {
            call(&service, Err(Code::Unavailable)).await.unwrap_err();
        }
        tokio::time::advance(Duration::from_secs(10)).await;
        call(&service, Err(Code::Unavailable)).await.unwrap_err();
        assert_eq!(breaker.state(), BreakerState::Open);
        tokio::time::advance(Duration::from_secs(9)).await;
        assert_eq!(breaker.state(), BreakerState::Open, "a new full period started");
        tokio::time::advance(Duration::from_secs(1)).await;
        assert_eq!(breaker.state(), BreakerState::HalfOpen);
    }

    #[tokio::test(start_paused = true)]
    async fn half_open_admits_one_probe_at_a_time() {
        let breaker = Breaker::new("test", config());
        for _ in 0..3 {
            breaker.try_acquire().unwrap().record(false);
        }
        tokio::time::advance(Duration::from_secs(10)).await;
        let probe = breaker.try_acquire().expect("one probe");
        assert!(probe.is_probe());
        assert!(
            breaker.try_acquire().is_err(),
            "a second concurrent probe is refused"
        );
        drop(probe); // the caller gave up: no verdict, but the slot is free again
        assert_eq!(breaker.state(), BreakerState::HalfOpen);
        breaker.try_acquire().expect("probe again").record(true);
        assert_eq!(breaker.state(), BreakerState::Closed);
    }

    /// A service whose calls take `delay` and then give `outcome`.
    fn slow()
    -> impl tower::Service<(Duration, Result<u32, Code>), Response = u32, Error = Status, Future: Send> + Clone
    {
        tower::service_fn(|(delay, outcome): (Duration, Result<u32, Code>)| async move {
            tokio::time::sleep(delay).await;
            outcome.map_err(|c| Status::new(c, "failed"))
        })
    }

    /// Calls `outcome` five times at once, each taking 3 s, while one call succeeds after
    /// `answer_after`; returns the breaker's state once all are done.
    async fn five_slow_failures_and_one_answer(outcome: Code, answer_after: Duration) -> BreakerState {
        let breaker = Breaker::new("test", config());
        let service = CircuitBreakerLayer::new(breaker.clone()).layer(slow());
        let failing: Vec<_> = (0..5)
            .map(|_| tokio::spawn(service.clone().oneshot((Duration::from_secs(3), Err(outcome)))))
            .collect();
        assert_eq!(service.clone().oneshot((answer_after, Ok(1))).await.unwrap(), 1);
        for call in failing {
            assert_eq!(call.await.unwrap().unwrap_err().code(), outcome);
        }
        breaker.state()
    }

    #[tokio::test(start_paused = true)]
    async fn deadlines_in_a_busy_services_queue_do_not_trip_but_a_silent_services_do() {
        // Busy: another call succeeded in the second half of their wait.
        let busy = five_slow_failures_and_one_answer(Code::DeadlineExceeded, Duration::from_secs(2)).await;
        assert_eq!(busy, BreakerState::Closed);
        // Silent for the second half of their wait (an answer early on is no sign of life).
        let fell_silent =
            five_slow_failures_and_one_answer(Code::DeadlineExceeded, Duration::from_secs(1)).await;
        assert_eq!(fell_silent, BreakerState::Open);
        // Other health failures count whatever else the service answered.
        let unavailable = five_slow_failures_and_one_answer(Code::Unavailable, Duration::from_secs(2)).await;
        assert_eq!(unavailable, BreakerState::Open);
    }

    #[tokio::test(start_paused = true)]
    async fn successes_reset_the_count_and_live_errors_do_not_trip() {
        let breaker = Breaker::new("test", config());
        let service = CircuitBreakerLayer::new(breaker.clone()).layer(echo());
        for _ in 0..5 {
            call(&service, Err(Code::Unavailable)).await.unwrap_err();
            call(&service, Err(Code::Unavailable)).await.unwrap_err();
            call(&service, Ok(0)).await.unwrap();
        }
        for code in [
            Code::ResourceExhausted,
            Code::InvalidArgument,
            Code::NotFound,
            Code::Cancelled,
        ] {
            for _ in 0..5 {
                call(&service, Err(code)).await.unwrap_err();
            }
        }
        assert_eq!(breaker.state(), BreakerState::Closed);
        assert_eq!(breaker.transitions(), 0);
    }
}
