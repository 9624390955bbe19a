//! What a speculative step costs, measured per process and shared by sessions: the
//! verifier's forward-pass time as a function of the tokens in the pass (its cost curve),
//! the round trip around it, the drafter's time, and how full the verifier's passes are.
//!
//! The policy compares k by the tokens the verifier emits per second of its time. A lone
//! session's step verifying k drafts takes `T(1 + k)` plus the round trip and emits E(k)
//! tokens. On a batched verifier the pass is shared by `S` sessions, which run this same
//! policy: if each verifies k drafts, the pass scores `S · (1 + k)` tokens and emits
//! `S · E(k)`, so k is worth `E(k) · T(S) / T(S · (1 + k))` plain steps. The first tokens of a
//! pass are nearly free on a CPU (one weight stream serves a tile of rows) and later ones
//! cost their compute, so drafts that pay alone stop paying in a full pass: K shrinks as the
//! verifier gets busy and grows back when it idles. Other sequences' prompt chunks in the
//! pass (P tokens) take their share of its time: the sessions' share is
//! `T(P + S · (1 + k)) · S · (1 + k) / (P + S · (1 + k))`. Without prompts this is the whole
//! pass; in passes that run for prompts anyway, drafts save no pass and only add rows, so
//! they pay only when nearly every one is kept.
//!
//! A saturated verifier has more sessions than its passes take: calls wait in its queue.
//! There a draft row takes the place of another session's token, not of idle time, so `S`
//! counts the sessions sharing the verifier, not only those in a pass: in a closed loop
//! where each call waits q in the queue and f in its pass, `S · (1 + q / f)` (Little's law).

use std::sync::Mutex;

/// Weight of the newest sample in the moving averages.
const EMA_WEIGHT: f64 = 0.2;
/// Most that one call's queue wait counts, in passes (a long stall says little about how
/// many sessions share the verifier).
const QUEUED_PASSES_CAP: f64 = 4.0;
/// Pass sizes (tokens) whose time is tracked one by one; larger passes extrapolate.
pub const PASS_TABLE: usize = 256;
/// A pass counts for at most this many times the estimate it updates. Noise on a shared
/// machine only ever slows a pass (preemption, interrupts), and an estimate pushed up
/// corrects itself only if the policy runs that size again, which it avoids once the size
/// looks dear: so one slow pass moves an estimate by at most `EMA_WEIGHT` of this.
const OUTLIER_FACTOR: f64 = 2.0;
/// Weights of a one-sequence pass's time in its size's estimate, when slower and when
/// faster than it. Passes of one sequence and a given size do the same work, and noise only
/// slows them, so the estimate follows faster passes quickly and slower ones slowly: it sits
/// near the machine's undisturbed time for that size rather than at the mean of the
/// disturbed ones. A plain average let the sizes the policy runs less often keep whatever
/// burst of noise they were last measured in (on a 2-core machine, the learned price of 3
/// tokens read 1.75 passes of one where undisturbed passes take 1.07), pricing drafts out. A
/// real slowdown (deeper context) is still followed within a few dozen passes. Batched
/// passes of one size differ in what they hold (a prompt chunk's rows share one cache,
/// sessions' rows each read their own), so their times are averaged (`EMA_WEIGHT`): a low
/// estimate there would price the dear kind of row at the cheap kind's time.
const PASS_WEIGHT_UP: f64 = 0.1;
/// A size last measured in a one-sequence pass and not since in this many passes drops out
/// of the curve, which its fresher neighbours then fill in. A size a lone session has
/// stopped running (because it looked dear) would otherwise keep its price forever: this
/// way the policy tries it again when its neighbours say it pays, and measures it anew.
/// Batched sizes keep theirs: under load the sizes spread widely, each is measured rarely,
/// and the curve would be rebuilt from a few noisy neighbours.
const STALE_AFTER: u64 = 64;
const PASS_WEIGHT_DOWN: f64 = 0.5;

#[derive(Debug)]
pub struct CostModel {
    inner: Mutex<Costs>,
}

#[derive(Debug)]
struct Costs {
    /// Forward-pass seconds for n tokens (index n − 1), once seen.
    pass: Vec<Option<f64>>,
    /// Passes recorded so far; the count when each size was last measured, and whether
    /// that pass held one sequence.
    passes: u64,
    pass_measured_at: Vec<u64>,
    pass_alone: Vec<bool>,
    /// Before any pass is measured: `prior_base + prior_per_token · (n − 1)`.
    prior_base: f64,
    prior_per_token: f64,
    /// Seconds of a verifier call beyond its queue wait and forward pass (transport,
    /// serialisation, argmax or warping).
    round_trip: f64,
    /// Seconds of one drafter call, and per drafted token (LM drafters).
    draft_call: f64,
    draft_per_token: f64,
    /// Sessions in the verifier's recent passes, and other sequences' prompt tokens there.
    sessions: f64,
    others_prompt_tokens: f64,
    /// A call's wait in the verifier's queue over its pass's time (see the module
    /// documentation).
    queued_passes: f64,
}

impl Default for CostModel {
    fn default() -> Self {
        // Priors from candle's CPU curve (8 tokens ≈ 5.7× one): replaced by measurements
        // after a few steps.
        Self {
            inner: Mutex::new(Costs {
                pass: vec![None; PASS_TABLE],
                passes: 0,
                pass_measured_at: vec![0; PASS_TABLE],
                pass_alone: vec![false; PASS_TABLE],
                prior_base: 0.02,
                prior_per_token: 0.0134,
                round_trip: 0.0,
                draft_call: 0.0005,
                draft_per_token: 0.0,
                sessions: 1.0,
                others_prompt_tokens: 0.0,
                queued_passes: 0.0,
            }),
        }
    }
}

impl CostModel {
    /// Records a verifier call (see [`VerifyCall`]).
    pub fn record_verify(&self, call: VerifyCall) {
        let VerifyCall {
            batch_size,
            batch_tokens,
            others_prompt_tokens,
            forward_seconds,
            queue_seconds,
            call_seconds,
            computed_context,
        } = call;
        let mut c = self.lock();
        let n = batch_tokens as usize;
        if (1..=PASS_TABLE).contains(&n) {
            let one_sequence = batch_size <= 1;
            let estimate = match c.pass[n - 1] {
                Some(old) => pass_estimate(old, forward_seconds, one_sequence),
                // A size's first pass, slower than its neighbours imply: it moves the
                // neighbours' estimate as a later pass would move its own. (A faster one is
                // taken as it is: noise does not make passes faster.) Only first passes
                // build the curve, so the call path of every other step stays as it was.
                None => match c.curve().predicted(n) {
                    Some(p) if forward_seconds > p => pass_estimate(p, forward_seconds, one_sequence),
                    _ => forward_seconds,
                },
            };
            c.pass[n - 1] = Some(estimate);
            c.passes += 1;
            c.pass_measured_at[n - 1] = c.passes;
            c.pass_alone[n - 1] = one_sequence;
        }
        let round_trip = (call_seconds - forward_seconds - queue_seconds).max(0.0);
        c.round_trip = ema(c.round_trip, round_trip);
        c.sessions = ema(c.sessions, f64::from(batch_size.max(1)));
        c.others_prompt_tokens = ema(c.others_prompt_tokens, f64::from(others_prompt_tokens));
        // A call that computed context (a prompt) waited for its earlier chunks' passes too.
        if forward_seconds > 0.0 && computed_context == 0 {
            let queued = (queue_seconds / forward_seconds).clamp(0.0, QUEUED_PASSES_CAP);
            c.queued_passes = ema(c.queued_passes, queued);
        }
    }

    /// Records a drafter call that proposed `k` tokens in `seconds`.
    pub fn record_draft(&self, k: usize, seconds: f64, per_token_drafter: bool) {
        let mut c = self.lock();
        if per_token_drafter && k > 0 {
            c.draft_per_token = ema(c.draft_per_token, seconds / k as f64);
        } else {
            c.draft_call = ema(c.draft_call, seconds);
        }
    }

    /// What this session's next step is worth if it verifies k drafts and emits
    /// `expected[k]` tokens, relative to a plain step (1.0; see the module documentation),
    /// for every k in `0..expected.len()`.
    pub fn relative_values(&self, expected: &[f64]) -> Vec<f64> {
        let c = self.lock();
        let curve = c.curve();
        let plain = c.step_seconds(&curve, 0);
        expected
            .iter()
            .enumerate()
            .map(|(k, e)| e * plain / c.step_seconds(&curve, k).max(1e-12))
            .collect()
    }

    /// What asking the drafter costs, relative to a plain step: its call's time over the
    /// step's (the call is paid whether or not its proposal is then verified).
    pub fn draft_call_share(&self) -> f64 {
        let c = self.lock();
        let curve = c.curve();
        c.draft_call / c.step_seconds(&curve, 0).max(1e-12)
    }

    /// Forward-pass seconds for `n` tokens (as [`CostModel::relative_values`] prices it).
    pub fn pass_seconds(&self, n: usize) -> f64 {
        self.lock().curve().seconds(n)
    }

    /// A model whose pass over n tokens takes `base + per_token · (n − 1)` and whose
    /// drafter and round trip are free (for tests of the policy).
    #[cfg(test)]
    pub(crate) fn linear(base: f64, per_token: f64) -> Self {
        let model = Self::default();
        {
            let mut c = model.lock();
            c.prior_base = base;
            c.prior_per_token = per_token;
            c.draft_call = 0.0;
        }
        model
    }

    /// The same model with a drafter call that takes `seconds` (for tests of the policy).
    #[cfg(test)]
    pub(crate) fn with_draft_call(self, seconds: f64) -> Self {
        self.lock().draft_call = seconds;
        self
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Costs> {
        self.inner.lock().expect("cost model lock")
    }
}

impl Costs {
    /// A session's step verifying k drafts, in seconds: its share of the pass, the round
    /// trip, and for k > 0 the drafter call.
    fn step_seconds(&self, curve: &PassCurve, k: usize) -> f64 {
        // Sessions sharing the verifier: those in its passes, and as many again per pass
        // a call waits in its queue.
        let sessions = self.sessions.max(1.0) * (1.0 + self.queued_passes);
        let rows = sessions * (1 + k) as f64;
        let all = rows + self.others_prompt_tokens;
        let mut seconds = curve.seconds(all.round() as usize) * rows / all + self.round_trip;
        if k > 0 {
            seconds += self.draft_call + self.draft_per_token * k as f64;
        }
        seconds
    }

    /// The measured passes, smallest first, less sizes last measured in a one-sequence
    /// pass more than [`STALE_AFTER`] passes ago (unless fewer than two would be left).
    fn curve(&self) -> PassCurve {
        let measured = |fresh_only: bool| -> Vec<(usize, f64)> {
            self.pass
                .iter()
                .enumerate()
                .filter(|&(i, _)| {
                    !fresh_only || !self.pass_alone[i] || self.passes - self.pass_measured_at[i] < STALE_AFTER
                })
                .filter_map(|(i, t)| t.map(|t| (i + 1, t)))
                .collect()
        };
        let fresh = measured(true);
        PassCurve {
            measured: if fresh.len() >= 2 { fresh } else { measured(false) },
            prior_base: self.prior_base,
            prior_per_token: self.prior_per_token,
        }
    }
}

/// Pass time by tokens, from the passes measured so far.
struct PassCurve {
    measured: Vec<(usize, f64)>,
    prior_base: f64,
    prior_per_token: f64,
}

impl PassCurve {
    /// Seconds of an `n`-token pass: measured where it was; between measured sizes a
    /// straight line; beyond the largest the slope of the last two; never less than a
    /// smaller pass's (a noisy sample must not make more tokens look cheaper).
    fn seconds(&self, n: usize) -> f64 {
        // Estimates are straight lines between measured sizes and rise outside them, so
        // the largest over sizes 1..=n is at n or at a measured size below it.
        let n = n.max(1);
        self.measured
            .iter()
            .take_while(|&&(size, _)| size <= n)
            .fold(self.estimate(n), |max, &(_, t)| max.max(t))
    }

    /// What the measured passes of other sizes imply for an unmeasured size `n`: between two
    /// measured sizes, or past at least two smaller ones; `None` where they do not pin it.
    fn predicted(&self, n: usize) -> Option<f64> {
        let split = self.measured.partition_point(|&(size, _)| size <= n);
        let between = split > 0 && split < self.measured.len();
        (between || split >= 2).then(|| self.seconds(n))
    }

    fn prior(&self, n: usize) -> f64 {
        self.prior_base + self.prior_per_token * (n - 1) as f64
    }

    fn estimate(&self, n: usize) -> f64 {
        let m = &self.measured;
        let split = m.partition_point(|&(size, _)| size <= n);
        let below = split.checked_sub(1).map(|i| m[i]);
        let above = m.get(split).copied();
        match (below, above) {
            (Some((m0, t0)), _) if m0 == n => t0,
            (Some((m0, t0)), Some((m1, t1))) => t0 + (t1 - t0) * (n - m0) as f64 / (m1 - m0) as f64,
            (Some((m0, t0)), None) => {
                let slope = split
                    .checked_sub(2)
                    .map(|i| ((t0 - m[i].1) / (m0 - m[i].0) as f64).max(0.0))
                    .unwrap_or(self.prior_per_token * t0 / self.prior_base);
                t0 + slope * (n - m0) as f64
            }
            // Only larger passes seen: the prior's shape, scaled to the first of them.
            (None, Some((m1, t1))) => t1 * self.prior(n) / self.prior(m1),
            (None, None) => self.prior(n),
        }
    }
}

/// What one verifier call reports about the pass that served it.
#[derive(Debug, Clone, Copy, Default)]
pub struct VerifyCall {
    /// Sessions and tokens (all sessions') in the forward pass.
    pub batch_size: u32,
    pub batch_tokens: u32,
    /// Of `batch_tokens`, other sequences' prompt tokens.
    pub others_prompt_tokens: u32,
    pub forward_seconds: f64,
    /// Time the call waited for the engine, and the whole call as the caller saw it.
    pub queue_seconds: f64,
    pub call_seconds: f64,
    /// Tokens the call computed beyond its drafts and last accepted token (a prompt, or
    /// context the replica had not cached).
    pub computed_context: u32,
}

fn ema(old: f64, sample: f64) -> f64 {
    old + EMA_WEIGHT * (sample - old)
}

/// A pass-time estimate moved by one pass (see [`PASS_WEIGHT_UP`]).
fn pass_estimate(old: f64, seconds: f64, one_sequence: bool) -> f64 {
    let weight = match (one_sequence, seconds < old) {
        (false, _) => EMA_WEIGHT,
        (true, true) => PASS_WEIGHT_DOWN,
        (true, false) => PASS_WEIGHT_UP,
    };
    old + weight * (seconds.min(OUTLIER_FACTOR * old) - old)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::adaptive::expected_tokens;

    fn pass(n: u32, milliseconds: f64) -> VerifyCall {
        VerifyCall {
            batch_size: 1,
            batch_tokens: n,
            forward_seconds: milliseconds * 1e-3,
            call_seconds: milliseconds * 1e-3,
            ..VerifyCall::default()
        }
    }

    /// A CPU-like curve: tokens up to 4 nearly free, then 0.2 of a pass each.
    fn cpu_curve() -> CostModel {
        let model = CostModel::default();
        for _ in 0..120 {
            for (n, t) in [
                (1, 10.0),
                (2, 10.4),
                (3, 11.0),
                (4, 12.0),
                (8, 20.0),
                (16, 36.0),
                (24, 52.0),
            ] {
                model.record_verify(pass(n, t));
            }
        }
        // Those passes were one session's steps, not a batch: start from a lone session.
        set_load(&model, 1);
        model
    }

    fn best_k(model: &CostModel, alpha: f64) -> usize {
        let expected: Vec<f64> = (0..=8).map(|k| expected_tokens(k, alpha)).collect();
        let values = model.relative_values(&expected);
        (0..=8).max_by(|&a, &b| values[a].total_cmp(&values[b])).unwrap()
    }

    /// Moves one of the model's moving averages to `value`, as 60 passes reporting it would.
    fn settle(model: &CostModel, average: fn(&mut Costs) -> &mut f64, value: u32) {
        for _ in 0..60 {
            let mut c = model.lock();
            let field = average(&mut c);
            *field = ema(*field, f64::from(value));
        }
    }

    fn set_load(model: &CostModel, sessions: u32) {
        settle(model, |c| &mut c.sessions, sessions);
    }

    fn set_others_prompt_tokens(model: &CostModel, tokens: u32) {
        settle(model, |c| &mut c.others_prompt_tokens, tokens);
    }

    #[test]
    fn passes_cost_what_was_measured_and_interpolate_between() {
        let model = cpu_curve();
        assert!((model.pass_seconds(4) - 0.012).abs() < 1e-6);
        let six = model.pass_seconds(6);
        assert!((six - 0.016).abs() < 1e-6, "{six}");
        // Past the largest measured pass: the last slope (2 ms per token).
        let thirty = model.pass_seconds(30);
        assert!((thirty - 0.064).abs() < 1e-6, "{thirty}");
        // A noisy sample cannot make a larger pass cheaper than a smaller one.
        for _ in 0..50 {
            model.record_verify(pass(5, 5.0));
        }
        assert!(model.pass_seconds(5) >= model.pass_seconds(4));
    }

    #[test]
    fn one_slow_pass_does_not_price_deeper_drafts_out() {
        let model = CostModel::default();
        for _ in 0..50 {
            for (n, t) in [(1, 10.0), (2, 10.4), (3, 11.0)] {
                model.record_verify(pass(n, t));
            }
        }
        // The first pass of 4, slowed twofold: sizes 2 and 3 imply 11.6 ms.
        model.record_verify(pass(4, 24.0));
        let four = model.pass_seconds(4);
        assert!((four - 0.01276).abs() < 1e-5, "{four}");
        // Drafting 3 at 90% acceptance still pays, as it would at 11.6 ms.
        assert!(best_k(&model, 0.9) >= 3);
        // A size measured often: one preempted pass moves it by a tenth at most.
        for _ in 0..50 {
            model.record_verify(pass(4, 12.0));
        }
        model.record_verify(pass(4, 60.0));
        let four = model.pass_seconds(4);
        assert!((four - 0.0132).abs() < 1e-4, "{four}");
        // A real slowdown is followed within a few dozen passes.
        for _ in 0..30 {
            model.record_verify(pass(4, 20.0));
        }
        let four = model.pass_seconds(4);
        assert!((four - 0.020).abs() < 0.0005, "{four}");
        // A first pass faster than the neighbours imply is taken as it is.
        model.record_verify(pass(5, 12.5));
        assert_eq!(model.lock().pass[4], Some(0.0125));
        assert_eq!(
            model.pass_seconds(5),
            model.pass_seconds(4),
            "never cheaper than a smaller pass"
        );
    }

    #[test]
    fn a_size_not_run_for_a_while_is_priced_by_its_fresher_neighbours() {
        let model = CostModel::default();
        for _ in 0..20 {
            for (n, t) in [(1, 10.0), (2, 10.4), (3, 10.8), (4, 11.2)] {
                model.record_verify(pass(n, t));
            }
        }
        // A burst of noise while passes of 4 ran: they now look dear.
        for _ in 0..10 {
            model.record_verify(pass(4, 19.0));
        }
        assert!(model.pass_seconds(4) > 0.015, "{}", model.pass_seconds(4));
        // Then only smaller passes run, at the slope they had.
        for _ in 0..(STALE_AFTER / 3 + 1) {
            for (n, t) in [(1, 10.0), (2, 10.4), (3, 10.8)] {
                model.record_verify(pass(n, t));
            }
        }
        let four = model.pass_seconds(4);
        assert!(
            (four - 0.0112).abs() < 1e-6,
            "priced by its neighbours again: {four}"
        );
        // Measured again, it counts again.
        model.record_verify(pass(4, 12.0));
        assert!(model.pass_seconds(4) > 0.0112);
    }

    #[test]
    fn one_sequences_passes_are_priced_undisturbed_and_batched_ones_on_average() {
        let (alone, batched) = (CostModel::default(), CostModel::default());
        // The same size, alternately 10 and 14 ms: noise on one sequence's passes, but
        // different mixes of rows in batched ones.
        for i in 0..200 {
            let t = if i % 2 == 0 { 10.0 } else { 14.0 };
            alone.record_verify(pass(8, t));
            batched.record_verify(VerifyCall {
                batch_size: 4,
                ..pass(8, t)
            });
        }
        let (alone, batched) = (alone.pass_seconds(8), batched.pass_seconds(8));
        assert!(alone < 0.0115, "near the undisturbed 10 ms: {alone}");
        assert!((batched - 0.012).abs() < 0.0006, "near the mean: {batched}");
    }

    #[test]
    fn k_shrinks_in_full_passes_and_grows_back_when_the_verifier_idles() {
        let model = cpu_curve();
        let alone = best_k(&model, 0.7);
        assert!(alone >= 2, "alone, nearly free drafts pay: {alone}");
        // Two sessions: their passes are still in the cheap part of the curve.
        set_load(&model, 2);
        assert!(best_k(&model, 0.7) > 0);
        // Sixteen sessions: every draft token costs 2 ms of compute, like a plain one; only
        // the pass's small fixed part is shared, so only near-certain drafts pay.
        set_load(&model, 16);
        assert_eq!(best_k(&model, 0.7), 0);
        assert_eq!(best_k(&model, 0.8), 0);
        assert!(best_k(&model, 0.97) > 0);
        set_load(&model, 1);
        assert_eq!(best_k(&model, 0.7), alone);
    }

    #[test]
    fn a_saturated_verifier_counts_the_sessions_waiting_in_its_queue() {
        let model = cpu_curve();
        set_load(&model, 2);
        assert!(best_k(&model, 0.8) >= 2, "two sessions alone share cheap passes");
        // The same two-session passes, but every call waits three passes in the queue:
        // eight sessions share the verifier, and a draft row displaces another's token.
        for _ in 0..60 {
            model.record_verify(VerifyCall {
                batch_size: 2,
                batch_tokens: 2,
                forward_seconds: 0.0104,
                queue_seconds: 3.0 * 0.0104,
                call_seconds: 4.0 * 0.0104,
                ..VerifyCall::default()
            });
        }
        assert!((model.lock().queued_passes - 3.0).abs() < 1e-3);
        assert_eq!(best_k(&model, 0.8), 0);
        // A prompt's wait (behind its own earlier chunks) does not count, and a long stall
        // counts as QUEUED_PASSES_CAP passes at most.
        let stall = VerifyCall {
            batch_size: 2,
            batch_tokens: 66,
            forward_seconds: 0.0104,
            queue_seconds: 10.0,
            call_seconds: 10.02,
            computed_context: 64,
            ..VerifyCall::default()
        };
        model.record_verify(stall);
        assert!((model.lock().queued_passes - 3.0).abs() < 1e-3);
        model.record_verify(VerifyCall {
            computed_context: 0,
            ..stall
        });
        assert!(model.lock().queued_passes <= QUEUED_PASSES_CAP);
        // The queue drained: the passes' own sessions again.
        for _ in 0..60 {
            model.record_verify(VerifyCall {
                batch_size: 2,
                batch_tokens: 2,
                forward_seconds: 0.0104,
                call_seconds: 0.0104,
                ..VerifyCall::default()
            });
        }
        assert!(best_k(&model, 0.8) >= 2);
    }

    #[test]
    fn drafts_beside_other_sequences_prompts_do_not_pay() {
        let model = cpu_curve();
        set_load(&model, 2);
        let decoding_only = best_k(&model, 0.8);
        assert!(decoding_only >= 2, "{decoding_only}");
        // Passes that also compute others' prompt chunks run anyway: a draft saves none of
        // them and adds a row, so even 95% acceptance does not pay.
        for prompt in [16, 64] {
            set_others_prompt_tokens(&model, prompt);
            assert_eq!(best_k(&model, 0.95), 0, "beside {prompt} prompt tokens");
        }
        // Not even perfect acceptance pays: a kept draft row costs about what a plain row
        // does, and the drafter call comes on top.
        let values = model.relative_values(&[1.0, 2.0, 3.0]);
        assert!(values[1] <= 1.0 + 1e-9 && values[2] <= 1.0 + 1e-9, "{values:?}");
        // The prompts done, the cheap part of the curve is back.
        set_others_prompt_tokens(&model, 0);
        assert_eq!(best_k(&model, 0.8), decoding_only);
    }

    #[test]
    fn a_lone_session_prices_k_by_the_pass_curve_and_round_trip() {
        let model = cpu_curve();
        assert!(model.lock().round_trip.abs() < 1e-9);
        let draft = model.lock().draft_call;
        // Two drafts, both accepted (3 tokens) in an 11 ms pass plus the drafter call,
        // against 1 token in 10 ms.
        let values = model.relative_values(&[1.0, 2.0, 3.0]);
        let want = 3.0 / (0.011 + draft) * 0.010;
        // (Each size's first pass starts from what its neighbours imply: 120 passes later the
        // estimates sit within a few nanoseconds of the passes' time.)
        assert!((values[2] - want).abs() < 1e-5, "{} vs {want}", values[2]);
        assert!((values[0] - 1.0).abs() < 1e-12);
    }

    #[test]
    fn the_round_trip_is_the_call_minus_queue_and_pass() {
        let model = CostModel::default();
        for _ in 0..80 {
            model.record_verify(VerifyCall {
                batch_size: 1,
                batch_tokens: 3,
                forward_seconds: 0.010,
                queue_seconds: 0.002,
                call_seconds: 0.0135,
                ..VerifyCall::default()
            });
        }
        assert!((model.lock().round_trip - 0.0015).abs() < 1e-6);
    }
}
