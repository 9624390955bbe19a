//! A drafter's price as the cost model keeps it: seconds (a call's, or a drafted token's),
//! when last measured, and for how many passes after that a one-draft try trusts it.
//!
//! A try is what measures a drafter whose price rules drafting out. Priced by a call that
//! was slow once (the first, on a cold model or a new connection), no try would ever pay,
//! so no call would bring the price back down. So a price not measured for a while counts
//! as free for a try ([`DrafterEstimate::trusted`]). A drafter that really is dear would
//! then be tried, and an LM drafter caught up on the context since its last call, every
//! [`STALE_AFTER`] passes for good: each try that finds the price no lower trusts it twice
//! as long, up to [`MAX_TRUSTED_FOR`] passes.

use super::{OUTLIER_FACTOR, STALE_AFTER, undisturbed_estimate};

/// Longest a price is trusted without a measurement (passes).
const MAX_TRUSTED_FOR: u64 = STALE_AFTER << 6;

#[derive(Debug, Clone, Copy)]
pub(super) struct DrafterEstimate {
    pub seconds: f64,
    /// The pass count when last measured (none: a prior), and for how many passes after that
    /// it is trusted.
    measured_at: Option<u64>,
    trusted_for: u64,
}

impl DrafterEstimate {
    /// A price assumed before any measurement.
    pub fn prior(seconds: f64) -> Self {
        Self {
            seconds,
            measured_at: None,
            trusted_for: STALE_AFTER,
        }
    }

    /// Whether the price was measured recently enough to rule a try out, `passes` into
    /// the process.
    pub fn trusted(&self, passes: u64) -> bool {
        self.measured_at.is_some_and(|at| passes - at < self.trusted_for)
    }

    /// Moves the estimate by one measurement, `passes` into the process: towards a faster
    /// call quickly and a slower one slowly, since noise only slows calls
    /// ([`undisturbed_estimate`]); a call under `1 / OUTLIER_FACTOR` of the estimate replaces
    /// it, since it shows that the estimate came from disturbed calls and a drafter priced
    /// out is measured too rarely (once per try) to wait for the estimate to halve its way
    /// down.
    pub fn record(&mut self, seconds: f64, passes: u64) {
        let old = self.seconds;
        self.seconds = if seconds * OUTLIER_FACTOR < old {
            seconds
        } else {
            undisturbed_estimate(old, seconds)
        };
        if self.measured_at.is_some() && !self.trusted(passes) {
            self.trusted_for = if seconds < old {
                STALE_AFTER
            } else {
                (self.trusted_for * 2).min(MAX_TRUSTED_FOR)
            };
        }
        self.measured_at = Some(passes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_try_that_finds_the_price_no_lower_trusts_it_twice_as_long() {
        let mut price = DrafterEstimate::prior(0.0);
        price.record(0.01, 1);
        assert!(price.trusted(1 + STALE_AFTER - 1));
        assert!(!price.trusted(1 + STALE_AFTER));
        // The try's call is as dear: the next try comes twice as late.
        price.record(0.01, 1 + STALE_AFTER);
        assert!(price.trusted(1 + 3 * STALE_AFTER - 1));
        assert!(!price.trusted(1 + 3 * STALE_AFTER));
        // Many more such tries: capped.
        let mut at = 1 + 3 * STALE_AFTER;
        for _ in 0..20 {
            price.record(0.01, at);
            at += MAX_TRUSTED_FOR;
        }
        assert!(!price.trusted(at));
        // One finds it cheaper: tries come at the usual interval again.
        price.record(0.009, at);
        assert!(!price.trusted(at + STALE_AFTER));
        // A measurement while trusted (a session drafting) changes no interval.
        price.record(0.02, at + 1);
        assert!(!price.trusted(at + 1 + STALE_AFTER));
    }

    #[test]
    fn a_call_under_half_the_estimate_replaces_it() {
        let mut price = DrafterEstimate::prior(0.0);
        price.record(0.2, 1);
        price.record(0.001, 2);
        assert_eq!(price.seconds, 0.001);
        price.record(0.0015, 3);
        assert!(price.seconds > 0.001 && price.seconds < 0.0015);
    }
}
