//! The orchestrator's Prometheus metrics, recorded through the `metrics` facade (exported
//! when the binary serves `--metrics-listen`; free no-ops otherwise). Names are the
//! contract with dashboards: `specd_generated_tokens_total`, `specd_draft_tokens_proposed_total`,
//! `specd_draft_tokens_accepted_total`, `specd_accepted_length` (tokens a verify step
//! yields), `specd_request_acceptance_rate`, `specd_hop_seconds{hop}` (draft, verify,
//! accept), `specd_sessions_open`, plus the pool's retries, failovers and breaker states.

use std::time::Instant;

/// Time spent in one hop of a speculative step.
pub fn hop(hop: &'static str, started: Instant) {
    metrics::histogram!("specd_hop_seconds", "hop" => hop).record(started.elapsed().as_secs_f64());
}

/// One verify step: `k` drafts, `accepted` of them kept (plus one token from the target).
pub fn step(k: usize, accepted: usize) {
    metrics::histogram!("specd_accepted_length").record((accepted + 1) as f64);
    metrics::counter!("specd_draft_tokens_proposed_total").increment(k as u64);
    metrics::counter!("specd_draft_tokens_accepted_total").increment(accepted as u64);
}

/// One finished generation.
pub fn request(generated: usize, proposed: u32, accepted: u32) {
    metrics::counter!("specd_generated_tokens_total").increment(generated as u64);
    if proposed > 0 {
        metrics::histogram!("specd_request_acceptance_rate")
            .record(f64::from(accepted) / f64::from(proposed));
    }
}

/// Open sessions.
pub fn sessions(open: usize) {
    metrics::gauge!("specd_sessions_open").set(open as f64);
}

/// A verifier call tried again after a transient failure.
pub fn retry() {
    metrics::counter!("specd_verifier_retries_total").increment(1);
}

/// A verifier call moved to another replica.
pub fn failover() {
    metrics::counter!("specd_verifier_failovers_total").increment(1);
}

/// A breaker's state as a number: 0 closed, 1 half-open, 2 open.
pub fn breaker(name: &str, state: crate::breaker::BreakerState) {
    use crate::breaker::BreakerState;
    let value = match state {
        BreakerState::Closed => 0.0,
        BreakerState::HalfOpen => 1.0,
        BreakerState::Open => 2.0,
    };
    metrics::gauge!("specd_breaker_state", "breaker" => name.to_string()).set(value);
    metrics::counter!("specd_breaker_transitions_total", "breaker" => name.to_string()).increment(1);
}
