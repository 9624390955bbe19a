//! Which sequences a pass should wait for. Under closed-loop load (every session sends its
//! next step as soon as its last one is answered) sessions split into cohorts: while one
//! pass runs, the sessions it will answer are away, and the sessions answered by the pass
//! before come back and queue, so each pass holds about half of them. A pass that waits a
//! little for the sequences the previous pass answered — they are on their way back, after a
//! network hop and the orchestrator's acceptance step — scores them together: one pass over
//! the weights instead of two. The wait is bounded by the turnaround measured so far and by a
//! share of the previous pass's time, and a sequence that does not come back in time (its
//! session finished) is waited for once at most.

use std::collections::HashSet;
use std::time::{Duration, Instant};

/// A turnaround sample's weight in the running estimate.
const TURNAROUND_WEIGHT: f64 = 0.1;
/// How many estimated turnarounds a pass waits at most: the estimate is a mean, and the
/// returns of one pass's sequences spread around it.
const TURNAROUND_SLACK: f64 = 2.0;
/// The longest wait whatever the settings (a guard against absurd shares).
const MAX_WAIT_SECONDS: f64 = 0.25;

/// The sequences the last pass answered that have not come back, and how long they take.
#[derive(Debug)]
pub(super) struct Returns {
    /// Longest wait, as a share of the previous pass's time (0: never wait).
    share: f64,
    away: HashSet<String>,
    answered_at: Instant,
    last_pass_seconds: f64,
    /// Running mean of answer → next job, in seconds (None until the first sample).
    turnaround: Option<f64>,
}

impl Returns {
    pub(super) fn new(share: f64) -> Self {
        Self {
            share: share.max(0.0),
            away: HashSet::new(),
            answered_at: Instant::now(),
            last_pass_seconds: 0.0,
            turnaround: None,
        }
    }

    /// A pass that took `pass_seconds` answered `sequences` just now; those not back by the
    /// next pass's wait are no longer waited for.
    pub(super) fn answered(&mut self, sequences: impl IntoIterator<Item = String>, pass_seconds: f64) {
        self.away.clear();
        if self.share > 0.0 {
            self.away.extend(sequences);
        }
        self.answered_at = Instant::now();
        self.last_pass_seconds = pass_seconds;
    }

    /// A job for `sequence`, queued at `queued_at`, was taken: if the sequence was away, it
    /// is back, and its turnaround is a sample.
    pub(super) fn arrived(&mut self, sequence: &str, queued_at: Instant) {
        if !self.away.remove(sequence) {
            return;
        }
        let sample = queued_at
            .saturating_duration_since(self.answered_at)
            .as_secs_f64();
        self.turnaround = Some(match self.turnaround {
            None => sample,
            Some(mean) => mean + TURNAROUND_WEIGHT * (sample - mean),
        });
    }

    /// The sequence will not come back (released).
    pub(super) fn gone(&mut self, sequence: &str) {
        self.away.remove(sequence);
    }

    /// Until when the pass being formed should wait for sequences still away (None: start
    /// now: all are back, or their time is up). With no turnaround measured yet, the first
    /// wait is bounded by the pass share.
    pub(super) fn wait_until(&self) -> Option<Instant> {
        if self.away.is_empty() {
            return None;
        }
        let of_pass = self.share * self.last_pass_seconds;
        let bound = match self.turnaround {
            Some(mean) => of_pass.min(TURNAROUND_SLACK * mean),
            None => of_pass,
        };
        let deadline = self.answered_at + Duration::from_secs_f64(bound.clamp(0.0, MAX_WAIT_SECONDS));
        (deadline > Instant::now()).then_some(deadline)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(n: usize) -> Vec<String> {
        (0..n).map(|i| format!("s{i}")).collect()
    }

    #[test]
    fn waits_for_answered_sequences_up_to_a_share_of_the_pass() {
        let mut returns = Returns::new(0.5);
        returns.answered(names(2), 0.2);
        let deadline = returns.wait_until().expect("two sequences away");
        let wait = deadline - returns.answered_at;
        assert_eq!(wait, Duration::from_millis(100));
        returns.arrived("s0", Instant::now());
        assert!(!returns.away.is_empty(), "s1 is still away");
        returns.gone("s1");
        assert!(returns.wait_until().is_none());
    }

    #[test]
    fn the_measured_turnaround_bounds_the_wait() {
        let mut returns = Returns::new(0.5);
        returns.answered(names(1), 0.4);
        let back = returns.answered_at + Duration::from_millis(50);
        returns.arrived("s0", back);
        // Only the first arrival of an away sequence is a sample.
        returns.arrived("s0", back + Duration::from_secs(3));
        returns.answered(names(2), 0.4);
        let wait = returns.wait_until().unwrap() - returns.answered_at;
        assert_eq!(wait, Duration::from_millis(100));
        // However long the passes, a wait is bounded.
        let mut slow = Returns::new(0.5);
        slow.answered(names(1), 60.0);
        assert_eq!(
            slow.wait_until().unwrap() - slow.answered_at,
            Duration::from_millis(250)
        );
    }

    #[test]
    fn a_zero_share_never_waits_and_stragglers_are_dropped_at_the_next_pass() {
        let mut off = Returns::new(0.0);
        off.answered(names(4), 10.0);
        assert!(off.wait_until().is_none() && off.away.is_empty());

        let mut returns = Returns::new(0.5);
        returns.answered(names(3), 10.0);
        returns.answered(vec!["s9".to_string()], 10.0);
        returns.arrived("s0", Instant::now());
        assert_eq!(returns.turnaround, None, "s0 was no longer awaited");
        returns.arrived("s9", Instant::now());
        assert!(returns.away.is_empty());
    }
}
