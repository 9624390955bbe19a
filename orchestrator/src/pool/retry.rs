//! When and how often a failed verifier call is tried again. Only codes that mean "this
//! replica could not answer now" are retried (Unavailable, DeadlineExceeded,
//! ResourceExhausted, Aborted, Unknown); a verify call is idempotent, since the request
//! carries the whole context. Waits grow exponentially, each stretched by a random jitter of up to
//! 100% (backon), and a
//! retry budget caps retries at a fraction of recent traffic, so a failing fleet is not
//! flooded with retries on top of its normal load.

use std::sync::Mutex;
use std::time::Duration;

use backon::{BackoffBuilder, ExponentialBuilder};
use tokio::time::Instant;
use tonic::Code;

/// Retry settings.
#[derive(Debug, Clone, Copy)]
pub struct RetryConfig {
    /// Most retries of one call (attempts = retries + 1).
    pub max_retries: usize,
    /// First backoff; later ones double, up to `max_delay`, each with jitter.
    pub base_delay: Duration,
    pub max_delay: Duration,
    /// Retries earned per call made (0.2: at most one retry per five calls, long-run).
    pub budget_ratio: f64,
    /// Retries always allowed per second, however little traffic there is.
    pub budget_floor_per_second: f64,
}

impl Default for RetryConfig {
    fn default() -> Self {
        Self {
            max_retries: 3,
            base_delay: Duration::from_millis(25),
            max_delay: Duration::from_secs(1),
            budget_ratio: 0.2,
            budget_floor_per_second: 5.0,
        }
    }
}

/// Whether a call that failed with `code` may be tried again (elsewhere).
pub fn is_retryable(code: Code) -> bool {
    matches!(
        code,
        Code::Unavailable | Code::DeadlineExceeded | Code::ResourceExhausted | Code::Aborted | Code::Unknown
    )
}

impl RetryConfig {
    /// The waits before each retry of one call.
    pub fn backoff(&self) -> impl Iterator<Item = Duration> + use<> {
        ExponentialBuilder::default()
            .with_min_delay(self.base_delay)
            .with_max_delay(self.max_delay)
            .with_factor(2.0)
            .with_jitter()
            .with_max_times(self.max_retries)
            .build()
    }
}

/// A token bucket of retries: each call deposits `ratio`, each retry withdraws one, and
/// `floor_per_second` trickles in with time. Holds at most ten seconds' floor plus 10 tokens.
pub struct RetryBudget {
    ratio: f64,
    floor_per_second: f64,
    state: Mutex<(f64, Instant)>,
}

impl RetryBudget {
    pub fn new(config: &RetryConfig) -> Self {
        let budget = Self {
            ratio: config.budget_ratio.max(0.0),
            floor_per_second: config.budget_floor_per_second.max(0.0),
            state: Mutex::new((0.0, Instant::now())),
        };
        budget.state.lock().expect("budget lock").0 = budget.cap();
        budget
    }

    fn cap(&self) -> f64 {
        10.0 + 10.0 * self.floor_per_second
    }

    fn refill(&self, state: &mut (f64, Instant)) {
        let now = Instant::now();
        let earned = now.duration_since(state.1).as_secs_f64() * self.floor_per_second;
        state.0 = (state.0 + earned).min(self.cap());
        state.1 = now;
    }

    /// Records a first attempt.
    pub fn deposit(&self) {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        self.refill(&mut state);
        state.0 = (state.0 + self.ratio).min(self.cap());
    }

    /// Takes one retry from the budget; false when it is spent.
    pub fn withdraw(&self) -> bool {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        self.refill(&mut state);
        if state.0 >= 1.0 {
            state.0 -= 1.0;
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_transient_codes_are_retried() {
        for code in [Code::Unavailable, Code::DeadlineExceeded, Code::ResourceExhausted] {
            assert!(is_retryable(code), "{code:?}");
        }
        for code in [
            Code::InvalidArgument,
            Code::NotFound,
            Code::FailedPrecondition,
            Code::Internal,
            Code::Cancelled,
            Code::Unauthenticated,
            Code::PermissionDenied,
        ] {
            assert!(!is_retryable(code), "{code:?}");
        }
    }

    #[test]
    fn backoff_is_bounded_jittered_and_finite() {
        let config = RetryConfig {
            max_retries: 6,
            base_delay: Duration::from_millis(10),
            max_delay: Duration::from_millis(200),
            ..RetryConfig::default()
        };
        let waits: Vec<Duration> = config.backoff().collect();
        assert_eq!(waits.len(), 6);
        // Jitter adds up to one more delay on top of the exponential one.
        for (i, w) in waits.iter().enumerate() {
            let nominal = Duration::from_millis(10 << i).min(Duration::from_millis(200));
            assert!(
                *w >= nominal.mul_f64(0.99) && *w <= nominal.mul_f64(2.01),
                "retry {i}: {w:?} vs {nominal:?}"
            );
        }
        let other: Vec<Duration> = config.backoff().collect();
        assert_ne!(waits, other, "two calls should not retry in lockstep");
    }

    #[tokio::test(start_paused = true)]
    async fn the_budget_caps_retries_at_a_share_of_traffic() {
        let config = RetryConfig {
            budget_ratio: 0.25,
            budget_floor_per_second: 0.0,
            ..RetryConfig::default()
        };
        let budget = RetryBudget::new(&config);
        // The initial reserve.
        let mut granted = 0;
        while budget.withdraw() {
            granted += 1;
        }
        assert_eq!(granted, 10);
        // Then one retry per four calls.
        for _ in 0..40 {
            budget.deposit();
        }
        let mut granted = 0;
        while budget.withdraw() {
            granted += 1;
        }
        assert_eq!(granted, 10);
    }

    #[tokio::test(start_paused = true)]
    async fn the_floor_refills_with_time() {
        let config = RetryConfig {
            budget_ratio: 0.0,
            budget_floor_per_second: 2.0,
            ..RetryConfig::default()
        };
        let budget = RetryBudget::new(&config);
        while budget.withdraw() {}
        assert!(!budget.withdraw());
        tokio::time::advance(Duration::from_millis(1500)).await;
        assert!(budget.withdraw());
        assert!(budget.withdraw());
        assert!(budget.withdraw());
        assert!(!budget.withdraw());
    }
}
