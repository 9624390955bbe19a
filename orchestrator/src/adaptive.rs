//! Adaptive K: how many draft tokens a speculative step should verify. Under the usual
//! model each draft token is accepted with probability α (independently), so a step that
//! verifies k drafts emits E(k) = (1 − α^(k+1)) / (1 − α) tokens. It costs one drafter call
//! (when k > 0) plus a verifier pass over k + 1 tokens, whose time grows with k — on a CPU
//! steeply, and not linearly (one weight stream serves a tile of rows, then a second
//! stream starts), so the time of each k is measured on its own. The policy picks the k in
//! [0, k_max] with the most tokens per second, from α measured per session and costs
//! measured per process; K = 0 (plain decoding) whenever drafting does not pay.

use std::sync::Mutex;

/// Weight of the newest sample in the moving averages.
const EMA_WEIGHT: f64 = 0.2;
/// Prior acceptance counts (α starts at 0.5 and is pulled back to it slowly).
const PRIOR_ACCEPTED: f64 = 1.0;
const PRIOR_REJECTED: f64 = 1.0;
/// How quickly old acceptance evidence fades (per step).
const ACCEPTANCE_DECAY: f64 = 0.9;
/// After this many steps without drafting, a step with an available draft tries k = 1, so a
/// session whose text turns predictable is noticed; each failed try doubles the wait.
const EXPLORE_EVERY: u32 = 8;
const EXPLORE_MAX: u32 = 256;
/// Proposals are grouped by how long a context suffix they matched (prompt lookup); longer
/// matches are far more reliable, so each group keeps its own acceptance record.
pub const MATCH_BUCKETS: usize = 4;

/// Draft counts whose verifier time is measured one by one; beyond, the time is
/// extrapolated with the measured seconds per draft token.
pub const MEASURED_K: usize = 16;

/// Process-wide costs, shared by sessions: the verifier's time for a pass over k + 1
/// tokens (measured per k, `base + per_token · k` where k was never measured), and the
/// drafter's round trip.
#[derive(Debug)]
pub struct CostModel {
    inner: Mutex<Costs>,
}

#[derive(Debug, Clone, Copy)]
struct Costs {
    /// Seconds of one verifier call with no drafts (round trip included).
    base: f64,
    /// Extra verifier seconds per draft token, averaged over every k measured.
    per_token: f64,
    /// Seconds of a verifier call with k drafts, for k in 1..=MEASURED_K (index k − 1),
    /// once measured.
    by_k: [Option<f64>; MEASURED_K],
    /// Seconds of one drafter call, and per drafted token (LM drafters).
    draft_call: f64,
    draft_per_token: f64,
    /// Sessions sharing the verifier's forward passes lately (its reported batch size).
    load: f64,
}

impl Default for CostModel {
    fn default() -> Self {
        // Priors from candle's CPU curve (8 tokens ≈ 5.7× one): replaced by measurements
        // after a few steps.
        Self {
            inner: Mutex::new(Costs {
                base: 0.02,
                per_token: 0.0134,
                by_k: [None; MEASURED_K],
                draft_call: 0.0005,
                draft_per_token: 0.0,
                load: 1.0,
            }),
        }
    }
}

impl CostModel {
    /// Records a verifier call that scored `k` drafts in `seconds` (wall time).
    pub fn record_verify(&self, k: usize, seconds: f64) {
        let mut c = self.inner.lock().expect("cost model lock");
        if k == 0 {
            c.base = ema(c.base, seconds);
        } else {
            let per_token = ((seconds - c.base) / k as f64).max(0.0);
            c.per_token = ema(c.per_token, per_token);
            if let Some(slot) = c.by_k.get_mut(k - 1) {
                *slot = Some(slot.map_or(seconds, |old| ema(old, seconds)));
            }
        }
    }

    /// Records how many sessions shared the verifier pass that served a step.
    pub fn record_load(&self, batch_size: u32) {
        let mut c = self.inner.lock().expect("cost model lock");
        c.load = ema(c.load, f64::from(batch_size.max(1)));
    }

    /// Sessions sharing each verifier pass lately (1 when idle).
    pub fn load(&self) -> f64 {
        self.inner.lock().expect("cost model lock").load
    }

    /// Records a drafter call that proposed `k` tokens in `seconds`.
    pub fn record_draft(&self, k: usize, seconds: f64, per_token_drafter: bool) {
        let mut c = self.inner.lock().expect("cost model lock");
        if per_token_drafter && k > 0 {
            c.draft_per_token = ema(c.draft_per_token, seconds / k as f64);
        } else {
            c.draft_call = ema(c.draft_call, seconds);
        }
    }

    /// Expected cost, in seconds, of a step verifying `k` drafts. Under load the verifier's
    /// passes are shared by `load` sessions: a draft token then delays every one of them, so
    /// it is charged `load` times (the system's cost, not this session's wall time). K
    /// therefore shrinks as the verifier gets busy and grows back when it idles.
    pub fn step_seconds(&self, k: usize) -> f64 {
        let c = *self.inner.lock().expect("cost model lock");
        let verify = c.base + c.extra_verify_seconds(k) * c.load.max(1.0);
        if k == 0 {
            verify
        } else {
            verify + c.draft_call + c.draft_per_token * k as f64
        }
    }

    /// Verifier cost of one extra draft token relative to a plain step.
    pub fn relative_token_cost(&self) -> f64 {
        let c = *self.inner.lock().expect("cost model lock");
        c.per_token / c.base.max(1e-9)
    }
}

impl Costs {
    /// Verifier seconds that k drafts add to a plain step: measured where k was, else
    /// extrapolated from the largest measured k below it; never less than for fewer drafts
    /// (a noisy sample must not make more drafts look cheaper).
    fn extra_verify_seconds(&self, k: usize) -> f64 {
        let mut extra = 0.0f64;
        let mut known = (0, 0.0);
        for j in 1..=k {
            let measured = self.by_k.get(j - 1).copied().flatten();
            let value = match measured {
                Some(seconds) => {
                    known = (j, (seconds - self.base).max(0.0));
                    known.1
                }
                None => known.1 + self.per_token * (j - known.0) as f64,
            };
            extra = extra.max(value);
        }
        extra
    }
}

fn ema(old: f64, sample: f64) -> f64 {
    old + EMA_WEIGHT * (sample - old)
}

/// Expected tokens emitted by a step verifying `k` drafts at per-token acceptance `alpha`.
pub fn expected_tokens(k: usize, alpha: f64) -> f64 {
    if alpha >= 1.0 {
        return (k + 1) as f64;
    }
    (1.0 - alpha.powi(k as i32 + 1)) / (1.0 - alpha)
}

/// One session's acceptance record and K choice.
#[derive(Debug, Clone)]
pub struct KPolicy {
    accepted: [f64; MATCH_BUCKETS],
    rejected: [f64; MATCH_BUCKETS],
    steps_without_draft: u32,
    explore_after: u32,
    exploring: bool,
}

impl Default for KPolicy {
    fn default() -> Self {
        Self {
            accepted: [PRIOR_ACCEPTED; MATCH_BUCKETS],
            rejected: [PRIOR_REJECTED; MATCH_BUCKETS],
            steps_without_draft: 0,
            explore_after: EXPLORE_EVERY,
            exploring: false,
        }
    }
}

/// The acceptance group of a proposal that matched a `match_length`-token suffix (0: not a
/// lookup proposal, e.g. an LM drafter's).
pub fn bucket(match_length: usize) -> usize {
    match_length.min(MATCH_BUCKETS - 1)
}

impl KPolicy {
    /// Estimated probability that a draft token of group `bucket` is accepted.
    pub fn alpha(&self, bucket: usize) -> f64 {
        self.accepted[bucket] / (self.accepted[bucket] + self.rejected[bucket])
    }

    /// Chooses k in `[0, available]` (available: drafts on offer, capped by K max and the
    /// tokens still wanted) for a proposal of group `bucket`.
    pub fn choose(&mut self, available: usize, bucket: usize, costs: &CostModel) -> usize {
        self.exploring = false;
        if available == 0 {
            self.steps_without_draft += 1;
            return 0;
        }
        let alpha = self.alpha(bucket);
        let rate = |k: usize| expected_tokens(k, alpha) / costs.step_seconds(k);
        let best = (0..=available)
            .max_by(|&a, &b| rate(a).total_cmp(&rate(b)))
            .unwrap_or(0);
        if best == 0 {
            self.steps_without_draft += 1;
            if self.steps_without_draft >= self.explore_after {
                self.steps_without_draft = 0;
                self.exploring = true;
                return 1;
            }
            return 0;
        }
        self.steps_without_draft = 0;
        best
    }

    /// Records a step that verified `k` drafts of group `bucket` and accepted `accepted`.
    pub fn record(&mut self, k: usize, accepted: usize, bucket: usize) {
        if k == 0 {
            return;
        }
        if self.exploring {
            self.explore_after = if accepted == k {
                EXPLORE_EVERY
            } else {
                (self.explore_after * 2).min(EXPLORE_MAX)
            };
        }
        self.accepted[bucket] = self.accepted[bucket] * ACCEPTANCE_DECAY + accepted as f64;
        self.rejected[bucket] = self.rejected[bucket] * ACCEPTANCE_DECAY + f64::from(u8::from(accepted < k));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn k_shrinks_under_load_and_grows_back_when_idle() {
        let costs = costs(0.02, 0.003);
        let mut policy = KPolicy::default();
        for _ in 0..30 {
            policy.record(4, 3, 0); // α ≈ 0.75
        }
        let idle = policy.choose(8, 0, &costs);
        for _ in 0..40 {
            costs.record_load(16);
        }
        let busy = policy.choose(8, 0, &costs);
        assert!(busy < idle, "K under load {busy} vs idle {idle}");
        for _ in 0..40 {
            costs.record_load(1);
        }
        assert_eq!(policy.choose(8, 0, &costs), idle);
    }

    fn costs(base: f64, per_token: f64) -> CostModel {
        let model = CostModel::default();
        {
            let mut c = model.inner.lock().unwrap();
            c.base = base;
            c.per_token = per_token;
            c.draft_call = 0.0;
        }
        model
    }

    #[test]
    fn expected_tokens_matches_the_geometric_series() {
        assert!((expected_tokens(0, 0.7) - 1.0).abs() < 1e-12);
        assert!((expected_tokens(2, 0.5) - 1.75).abs() < 1e-12);
        assert_eq!(expected_tokens(4, 1.0), 5.0);
    }

    #[test]
    fn high_acceptance_and_cheap_tokens_draft_deeply() {
        let mut policy = KPolicy::default();
        for _ in 0..30 {
            policy.record(4, 4, 1);
        }
        assert!(policy.alpha(1) > 0.9);
        assert_eq!(policy.choose(8, 1, &costs(1.0, 0.1)), 8);
    }

    #[test]
    fn low_acceptance_or_expensive_tokens_decode_plainly() {
        let mut policy = KPolicy::default();
        for _ in 0..30 {
            policy.record(4, 0, 1);
        }
        assert!(policy.alpha(1) < 0.1);
        assert_eq!(policy.choose(8, 1, &costs(1.0, 0.1)), 0);
        // Even perfect acceptance does not pay when a draft token costs a full pass.
        let mut perfect = KPolicy::default();
        for _ in 0..30 {
            perfect.record(2, 2, 1);
        }
        assert_eq!(perfect.choose(8, 1, &costs(1.0, 1.05)), 0);
    }

    #[test]
    fn k_never_exceeds_what_is_available() {
        let mut policy = KPolicy::default();
        for _ in 0..30 {
            policy.record(4, 4, 1);
        }
        assert_eq!(policy.choose(2, 1, &costs(1.0, 0.01)), 2);
        assert_eq!(policy.choose(0, 1, &costs(1.0, 0.01)), 0);
    }

    #[test]
    fn a_session_that_stopped_drafting_explores_again() {
        let mut policy = KPolicy::default();
        for _ in 0..30 {
            policy.record(4, 0, 1);
        }
        let c = costs(1.0, 0.5);
        let picks: Vec<usize> = (0..EXPLORE_EVERY).map(|_| policy.choose(4, 1, &c)).collect();
        assert_eq!(picks.iter().filter(|&&k| k == 1).count(), 1, "{picks:?}");
    }

    #[test]
    fn failed_exploration_backs_off_and_groups_are_separate() {
        let mut policy = KPolicy::default();
        for _ in 0..30 {
            policy.record(4, 0, 1);
            policy.record(4, 4, 3);
        }
        let c = costs(1.0, 0.5);
        // Long matches draft deeply while one-token matches do not.
        assert!(policy.choose(4, 3, &c) > 1);
        let mut picks = Vec::new();
        for _ in 0..3 * EXPLORE_EVERY {
            let k = policy.choose(4, 1, &c);
            picks.push(k);
            policy.record(k, 0, 1);
        }
        // The first try comes after EXPLORE_EVERY steps, the next only after twice as many.
        let tries: Vec<usize> = picks
            .iter()
            .enumerate()
            .filter(|(_, k)| **k == 1)
            .map(|(i, _)| i)
            .collect();
        let first = EXPLORE_EVERY as usize - 1;
        assert_eq!(
            tries,
            vec![first, first + 2 * EXPLORE_EVERY as usize],
            "{picks:?}"
        );
    }

    #[test]
    fn each_k_costs_what_was_measured_for_it() {
        let model = CostModel::default();
        // A convex curve: 1 and 2 drafts nearly free, 4 expensive.
        for _ in 0..60 {
            model.record_verify(0, 0.010);
            model.record_verify(1, 0.0105);
            model.record_verify(2, 0.011);
            model.record_verify(4, 0.020);
        }
        let extra = |k| model.step_seconds(k) - model.step_seconds(0);
        let draft_call = model.inner.lock().unwrap().draft_call;
        assert!((extra(2) - draft_call - 0.001).abs() < 1e-4, "{}", extra(2));
        assert!((extra(4) - draft_call - 0.010).abs() < 1e-4, "{}", extra(4));
        // Unmeasured k: at least the measured k below it, plus the average per-token cost.
        assert!(extra(3) >= extra(2) && extra(3) < extra(4), "{}", extra(3));
        assert!(extra(5) > extra(4));
        // With k = 3 measured too, a fairly confident policy (α = 0.75) takes k = 2, the
        // most tokens per second on this curve.
        for _ in 0..60 {
            model.record_verify(3, 0.016);
        }
        let mut policy = KPolicy::default();
        for _ in 0..30 {
            policy.record(2, 2, 1);
        }
        policy.accepted[1] = 3.0;
        policy.rejected[1] = 1.0; // α = 0.75
        assert_eq!(policy.choose(8, 1, &model), 2);
    }

    #[test]
    fn measured_costs_move_the_model() {
        let model = CostModel::default();
        for _ in 0..50 {
            model.record_verify(0, 0.010);
            model.record_verify(4, 0.030);
        }
        assert!(
            (model.relative_token_cost() - 0.5).abs() < 0.05,
            "{}",
            model.relative_token_cost()
        );
    }
}
