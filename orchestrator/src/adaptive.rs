//! Adaptive K: how many draft tokens a speculative step should verify. Under the usual
//! model each draft token is accepted with probability α (independently), so a step that
//! verifies k drafts emits E(k) = (1 − α^(k+1)) / (1 − α) tokens. What it costs — a drafter
//! call and k more tokens in the verifier's pass, alone or batched with other sessions — is
//! measured per process ([`crate::costs`]). The policy picks the k in [0, k_max] with the
//! most tokens per second of verifier time, from α measured per session; K = 0 (plain
//! decoding) whenever drafting does not pay. α learns from verified drafts and, for free,
//! from the first token of each proposal the policy declined.

use crate::costs::{CostModel, DraftPricing};

/// Prior acceptance counts (α starts at 0.5 and is pulled back to it slowly).
const PRIOR_ACCEPTED: f64 = 1.0;
const PRIOR_REJECTED: f64 = 1.0;
/// How quickly old acceptance evidence fades (per step).
const ACCEPTANCE_DECAY: f64 = 0.9;
/// After this many steps without drafting, a step with an available draft tries k = 1, so a
/// session whose text turns predictable is noticed; each failed try doubles the wait.
const EXPLORE_EVERY: u32 = 8;
const EXPLORE_MAX: u32 = 256;
/// A try is made only where a draft kept this often would pay at the current costs: on a
/// busy verifier, where only near-certain drafts pay, tries would waste rows.
const EXPLORE_ALPHA: f64 = 0.8;
/// Proposals are grouped by how long a context suffix they matched (prompt lookup); longer
/// matches are far more reliable, so each group keeps its own acceptance record.
pub const MATCH_BUCKETS: usize = 4;
/// How quickly old evidence of whether asking the drafter leads to a verified draft fades
/// (per ask), and its prior (one ask in two).
const ASK_DECAY: f64 = 0.95;
const PRIOR_ASKS: f64 = 2.0;
const PRIOR_ASKS_DRAFTED: f64 = 1.0;

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
    /// Drafter asks, and those whose proposal was then verified (decayed counts).
    asks: f64,
    asks_drafted: f64,
    /// How this session's drafter is priced (its requests name the drafter).
    pricing: DraftPricing,
}

impl Default for KPolicy {
    fn default() -> Self {
        Self {
            accepted: [PRIOR_ACCEPTED; MATCH_BUCKETS],
            rejected: [PRIOR_REJECTED; MATCH_BUCKETS],
            steps_without_draft: 0,
            explore_after: EXPLORE_EVERY,
            exploring: false,
            asks: PRIOR_ASKS,
            asks_drafted: PRIOR_ASKS_DRAFTED,
            pricing: DraftPricing::PerCall,
        }
    }
}

/// The acceptance group of a proposal that matched a `match_length`-token suffix (0: not a
/// lookup proposal, e.g. an LM drafter's).
pub fn bucket(match_length: usize) -> usize {
    match_length.min(MATCH_BUCKETS - 1)
}

impl KPolicy {
    /// Prices this session's next steps for its drafter (see [`DraftPricing`]).
    pub fn set_pricing(&mut self, pricing: DraftPricing) {
        self.pricing = pricing;
    }

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
        let (best, _) = best_k(available, self.alpha(bucket), costs, self.pricing);
        if best == 0 {
            self.steps_without_draft += 1;
            if self.steps_without_draft >= self.explore_after && tries_pay(costs, self.pricing) {
                self.steps_without_draft = 0;
                self.exploring = true;
                return 1;
            }
            return 0;
        }
        self.steps_without_draft = 0;
        best
    }

    /// Whether the drafter is worth asking this step: a try is due, or the most reliable
    /// acceptance group would draft at the current costs and what asks have gained so far
    /// beats the call's cost. Every ask costs a drafter round trip, but only the share of
    /// asks whose proposal is then verified gains anything: a session whose text rarely
    /// matches stops paying for lookups that come back unused. When not, the drafter need
    /// not be asked (see [`KPolicy::skip`]).
    pub fn worth_drafting(&self, available: usize, costs: &CostModel) -> bool {
        if available == 0 {
            return false;
        }
        if self.steps_without_draft + 1 >= self.explore_after && tries_pay(costs, self.pricing) {
            return true;
        }
        let alpha = (0..MATCH_BUCKETS).map(|b| self.alpha(b)).fold(0.0, f64::max);
        let (k, value) = best_k(available, alpha, costs, self.pricing);
        k > 0 && self.drafted_share() * (value - 1.0) > costs.draft_call_share()
    }

    /// Share of recent drafter asks whose proposal was verified.
    pub fn drafted_share(&self) -> f64 {
        self.asks_drafted / self.asks
    }

    /// Records a drafter ask, and whether its proposal was verified (k > 0).
    pub fn record_ask(&mut self, drafted: bool) {
        self.asks = self.asks * ASK_DECAY + 1.0;
        self.asks_drafted = self.asks_drafted * ASK_DECAY + f64::from(u8::from(drafted));
    }

    /// Records a step decoded without asking for drafts.
    pub fn skip(&mut self, costs: &CostModel) {
        self.choose(0, 0, costs);
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
        self.update(bucket, accepted as f64, accepted < k);
    }

    /// Records what a proposal the policy did not verify (k = 0) would have given: whether
    /// its first token is the one the step emitted. Free evidence: without it a group whose
    /// drafts failed for a while is judged by the few one-draft tries exploration makes, and
    /// drafts its copies late once its text turns predictable again (a quote's opening words).
    /// For a point-mass draft (prompt lookup) the target's own token equals it exactly as
    /// often as rejection sampling would accept it, so sampled steps count alike.
    pub fn record_unverified(&mut self, bucket: usize, first_kept: bool) {
        self.update(bucket, f64::from(u8::from(first_kept)), !first_kept);
    }

    fn update(&mut self, bucket: usize, accepted: f64, rejected: bool) {
        self.accepted[bucket] = self.accepted[bucket] * ACCEPTANCE_DECAY + accepted;
        self.rejected[bucket] = self.rejected[bucket] * ACCEPTANCE_DECAY + f64::from(u8::from(rejected));
    }
}

/// Whether a one-draft try would pay at the current costs if the draft were kept
/// `EXPLORE_ALPHA` of the time (a drafter price not measured for a while counts as free:
/// see [`CostModel::try_pays`]).
fn tries_pay(costs: &CostModel, pricing: DraftPricing) -> bool {
    costs.try_pays(EXPLORE_ALPHA, pricing)
}

/// The k in `[0, available]` with the most tokens per second of verifier time at `alpha`,
/// and its value relative to a plain step.
fn best_k(available: usize, alpha: f64, costs: &CostModel, pricing: DraftPricing) -> (usize, f64) {
    let expected: Vec<f64> = (0..=available).map(|k| expected_tokens(k, alpha)).collect();
    let value = costs.relative_values(&expected, pricing);
    (0..=available)
        .max_by(|&a, &b| value[a].total_cmp(&value[b]))
        .map_or((0, 1.0), |k| (k, value[k]))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A verifier whose pass over n tokens takes `base + per_token · (n − 1)`, and free
    /// drafting.
    fn costs(base: f64, per_token: f64) -> CostModel {
        CostModel::linear(base, per_token)
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
    fn no_tries_and_no_drafter_calls_where_no_draft_could_pay() {
        let mut policy = KPolicy::default();
        // A draft token costs a full pass: nothing is tried, however long the wait.
        let dear = costs(1.0, 1.05);
        assert!(!policy.worth_drafting(4, &dear));
        for _ in 0..4 * EXPLORE_EVERY {
            assert_eq!(policy.choose(4, 1, &dear), 0);
        }
        // Drafts nearly free: a session with no record yet (α = 0.5) asks for them.
        let cheap = costs(1.0, 0.05);
        assert!(policy.worth_drafting(4, &cheap));
        // Its one-token matches fail, but the groups without a record still make asking
        // worth it.
        for _ in 0..30 {
            policy.record(4, 0, 1);
        }
        assert!(policy.worth_drafting(4, &cheap));
        assert!(!policy.worth_drafting(0, &cheap));
    }

    #[test]
    fn a_slow_first_drafter_call_does_not_stop_a_session_drafting() {
        // A 10 ms pass, drafts nearly free, a drafter call of 0.2 ms: drafting pays.
        let c = costs(0.010, 0.0005).with_draft_call(0.0002);
        let mut policy = KPolicy::default();
        assert!(policy.worth_drafting(4, &c));
        // The first call also opens the connection and takes 50 ms.
        c.record_draft(4, 0.05, DraftPricing::PerCall, 0.0);
        assert!(
            policy.worth_drafting(4, &c),
            "one slow call priced asks out, so the drafter would never be asked again"
        );
        assert!(policy.choose(4, 1, &c) > 0);
    }

    #[test]
    fn a_session_whose_asks_come_back_unused_stops_asking() {
        // Drafts nearly free, but each drafter call costs 5% of a step.
        let c = costs(1.0, 0.05).with_draft_call(0.05);
        let mut policy = KPolicy::default();
        for _ in 0..30 {
            policy.record(4, 4, 3);
        }
        assert!(policy.worth_drafting(4, &c), "long matches are reliable");
        // Its asks mostly come back with proposals it does not verify.
        for _ in 0..60 {
            policy.record_ask(false);
        }
        assert!(policy.drafted_share() < 0.01);
        assert!(!policy.worth_drafting(4, &c));
        // A free call is always worth it while some group would draft.
        assert!(policy.worth_drafting(4, &costs(1.0, 0.05)));
        // Asks verified again: asking resumes.
        for _ in 0..60 {
            policy.record_ask(true);
        }
        assert!(policy.worth_drafting(4, &c));
    }

    #[test]
    fn unverified_proposals_that_would_have_been_kept_restart_drafting() {
        let c = costs(1.0, 0.1);
        let mut policy = KPolicy::default();
        for _ in 0..30 {
            policy.record(4, 0, 1);
        }
        assert_eq!(policy.choose(4, 1, &c), 0);
        // The group's proposals, not verified, turn out right: the group drafts again
        // without waiting for an exploration try.
        for _ in 0..10 {
            policy.record_unverified(1, true);
        }
        assert!(policy.alpha(1) > 0.5, "{}", policy.alpha(1));
        assert!(policy.choose(4, 1, &c) > 0);
        // And wrong ones pull it back down; other groups are untouched.
        let before = policy.alpha(2);
        for _ in 0..30 {
            policy.record_unverified(1, false);
        }
        assert_eq!(policy.choose(4, 1, &c), 0);
        assert_eq!(policy.alpha(2), before);
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
}
