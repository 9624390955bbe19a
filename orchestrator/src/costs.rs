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

use drafter::DrafterEstimate;

mod drafter;

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
const PASS_WEIGHT_DOWN: f64 = 0.5;
/// A size last measured in a one-sequence pass and not since in this many passes drops out
/// of the curve, which its fresher neighbours then fill in. A size a lone session has
/// stopped running (because it looked dear) would otherwise keep its price forever: this
/// way the policy tries it again when its neighbours say it pays, and measures it anew.
/// Batched sizes keep theirs while the verifier stays busy: under load the sizes spread
/// widely, each is measured rarely, and the curve would be rebuilt from a few noisy
/// neighbours. Once no pass has held several sequences for as many passes, they go stale
/// like the others. A lone session would otherwise price its drafts by the passes of a
/// busier moment: two sessions' tokens in one pass (each reading its own cache, on a verifier
/// just started) cost far more than one session's two, and a size-2 estimate of 11 ms beside
/// one token's 3.5 ms kept a session from drafting, and so from measuring size 2 alone, for
/// good (`bench load`, three verifiers, one session: no step drafted in some runs of the cell).
const STALE_AFTER: u64 = 64;

/// How a drafter's time grows with the drafts a step asks of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DraftPricing {
    /// One call per step whatever k (prompt lookup).
    #[default]
    PerCall,
    /// A forward pass of the drafter's own model per drafted token (an LM drafter).
    PerToken,
}

#[derive(Debug)]
pub struct CostModel {
    inner: Mutex<Costs>,
}

#[derive(Debug)]
struct Costs {
    /// The pass-time estimate for n tokens (index n − 1), once seen.
    pass: Vec<Option<PassEstimate>>,
    /// Passes recorded so far, and the count when the last one holding several sequences
    /// was.
    passes: u64,
    last_batched_pass: u64,
    /// Before any pass is measured: `prior_base + prior_per_token · (n − 1)`.
    prior_base: f64,
    prior_per_token: f64,
    /// Seconds of a verifier call beyond its queue wait and forward pass (transport,
    /// serialisation, argmax or warping).
    round_trip: f64,
    /// Seconds of one prompt-lookup call, and per token an LM drafter drafts (its call less
    /// its catch-up on context, over its drafts).
    draft_call: DrafterEstimate,
    draft_per_token: DrafterEstimate,
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
                last_batched_pass: 0,
                prior_base: 0.02,
                prior_per_token: 0.0134,
                round_trip: 0.0,
                draft_call: DrafterEstimate::prior(0.0005),
                draft_per_token: DrafterEstimate::prior(0.0),
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
            let seconds = match c.pass[n - 1] {
                Some(old) => pass_estimate(old.seconds, forward_seconds, one_sequence),
                // A size's first pass, slower than its neighbours imply: it moves the
                // neighbours' estimate as a later pass would move its own. (A faster one is
                // taken as it is: noise does not make passes faster.) Only first passes
                // build the curve, so the call path of every other step stays as it was.
                None => match c.curve().predicted(n) {
                    Some(p) if forward_seconds > p => pass_estimate(p, forward_seconds, one_sequence),
                    _ => forward_seconds,
                },
            };
            c.passes += 1;
            if !one_sequence {
                c.last_batched_pass = c.passes;
            }
            c.pass[n - 1] = Some(PassEstimate {
                seconds,
                measured_at: c.passes,
                alone: one_sequence,
            });
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

    /// Records a drafter call that proposed `k` tokens in `seconds`, of which
    /// `catch_up_seconds` went to computing context the drafter's cache lacked (an LM
    /// drafter's, see [`DrafterEstimate`]). A call does the same work each time and noise
    /// only slows it, so its estimate follows faster calls quickly and slower ones slowly,
    /// as a lone sequence's pass does. With a plain average, one slow call (the first, which
    /// also opens the connection, or one that waited for a busy core) could price every
    /// later ask out: the drafter would then never be asked again, its estimate never come
    /// back down, and sessions whose drafts would pay decode plainly from then on.
    ///
    /// An LM drafter is priced by its calls less their catch-up: about one token's worth
    /// when its session asked at the previous step, the whole prompt on a session's first
    /// ask, the tokens since its last ask after a pause. A session drafting step after step
    /// does not pay for long catch-ups, and a first call that computed a prompt read 40 ms
    /// a drafted token against a 3 ms pass (SmolLM2 drafting for itself, `drafter-svc`).
    pub fn record_draft(&self, k: usize, seconds: f64, pricing: DraftPricing, catch_up_seconds: f64) {
        let mut c = self.lock();
        let passes = c.passes;
        if pricing == DraftPricing::PerCall {
            c.draft_call.record(seconds, passes);
        } else if k > 0 {
            let drafting = (seconds - catch_up_seconds).max(0.0);
            c.draft_per_token.record(drafting / k as f64, passes);
        }
    }

    /// What this session's next step is worth if it verifies k drafts and emits
    /// `expected[k]` tokens, relative to a plain step (1.0; see the module documentation),
    /// for every k in `0..expected.len()`, with its drafter priced as `pricing` says. (One
    /// process serves sessions of both drafter kinds: an LM drafter's price per token must
    /// not land on prompt lookup's drafts, nor the other way round.)
    pub fn relative_values(&self, expected: &[f64], pricing: DraftPricing) -> Vec<f64> {
        let c = self.lock();
        c.relative_values(expected, c.draft_price(pricing))
    }

    /// Whether a one-draft try kept with probability `alpha` would pay, as
    /// [`CostModel::relative_values`] prices it, except that a drafter price not measured for
    /// a while counts as free (see [`DrafterEstimate`]): a try is what measures it again.
    pub fn try_pays(&self, alpha: f64, pricing: DraftPricing) -> bool {
        let c = self.lock();
        let price = if c.drafter(pricing).trusted(c.passes) {
            c.draft_price(pricing)
        } else {
            DraftPrice::default()
        };
        let expected = [1.0, 1.0 + alpha];
        let values = c.relative_values(&expected, price);
        values[1] >= values[0]
    }

    /// What asking the drafter costs, relative to a plain step: its call's time over the
    /// step's (the call is paid whether or not its proposal is then verified).
    pub fn draft_call_share(&self) -> f64 {
        let c = self.lock();
        let curve = c.curve();
        let plain = c.step_seconds(&curve, 0, c.draft_price(DraftPricing::PerCall));
        c.draft_call.seconds / plain.max(1e-12)
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
            c.draft_call = DrafterEstimate::prior(0.0);
            c.draft_per_token = DrafterEstimate::prior(0.0);
        }
        model
    }

    /// The same model with a drafter call that takes `seconds` (for tests of the policy).
    #[cfg(test)]
    pub(crate) fn with_draft_call(self, seconds: f64) -> Self {
        self.lock().draft_call = DrafterEstimate::prior(seconds);
        self
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Costs> {
        self.inner.lock().expect("cost model lock")
    }
}

/// A drafter's price: seconds per call and per drafted token.
#[derive(Debug, Clone, Copy, Default)]
struct DraftPrice {
    per_call: f64,
    per_token: f64,
}

impl Costs {
    /// The estimate of the drafter `pricing` prices.
    fn drafter(&self, pricing: DraftPricing) -> DrafterEstimate {
        match pricing {
            DraftPricing::PerCall => self.draft_call,
            DraftPricing::PerToken => self.draft_per_token,
        }
    }

    /// The measured price of drafting as `pricing` says.
    fn draft_price(&self, pricing: DraftPricing) -> DraftPrice {
        let seconds = self.drafter(pricing).seconds;
        match pricing {
            DraftPricing::PerCall => DraftPrice {
                per_call: seconds,
                per_token: 0.0,
            },
            DraftPricing::PerToken => DraftPrice {
                per_call: 0.0,
                per_token: seconds,
            },
        }
    }

    /// See [`CostModel::relative_values`].
    fn relative_values(&self, expected: &[f64], price: DraftPrice) -> Vec<f64> {
        let curve = self.curve();
        let plain = self.step_seconds(&curve, 0, price);
        expected
            .iter()
            .enumerate()
            .map(|(k, e)| e * plain / self.step_seconds(&curve, k, price).max(1e-12))
            .collect()
    }

    /// A session's step verifying k drafts, in seconds: its share of the pass, the round
    /// trip, and for k > 0 the drafter's time.
    fn step_seconds(&self, curve: &PassCurve, k: usize, price: DraftPrice) -> f64 {
        // Sessions sharing the verifier: those in its passes, and as many again per pass
        // a call waits in its queue.
        let sessions = self.sessions.max(1.0) * (1.0 + self.queued_passes);
        let rows = sessions * (1 + k) as f64;
        let all = rows + self.others_prompt_tokens;
        let mut seconds = curve.seconds(all.round() as usize) * rows / all + self.round_trip;
        if k > 0 {
            seconds += price.per_call + price.per_token * k as f64;
        }
        seconds
    }

    /// The measured passes, smallest first, less sizes last measured more than
    /// [`STALE_AFTER`] passes ago, in a one-sequence pass or before the verifier's passes
    /// last held several sequences (unless fewer than two would be left).
    fn curve(&self) -> PassCurve {
        let busy = self.passes - self.last_batched_pass < STALE_AFTER;
        let measured = |fresh_only: bool| -> Vec<(usize, f64)> {
            self.pass
                .iter()
                .enumerate()
                .filter_map(|(i, estimate)| estimate.map(|e| (i + 1, e)))
                .filter(|(_, e)| {
                    !fresh_only || self.passes - e.measured_at < STALE_AFTER || (!e.alone && busy)
                })
                .map(|(size, e)| (size, e.seconds))
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

/// One pass size's time estimate: seconds, the pass count when last measured, and whether
/// that pass held one sequence (see [`STALE_AFTER`]).
#[derive(Debug, Clone, Copy)]
struct PassEstimate {
    seconds: f64,
    measured_at: u64,
    alone: bool,
}

/// Pass time by tokens, from the passes measured so far.
struct PassCurve {
    measured: Vec<(usize, f64)>,
    prior_base: f64,
    prior_per_token: f64,
}

impl PassCurve {
    /// Seconds of an `n`-token pass: measured where it was; between measured sizes a
    /// straight line; beyond the largest the slope from a much smaller size
    /// ([`PassCurve::baseline`]); never less than a smaller pass's (a noisy sample must not
    /// make more tokens look cheaper).
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

    /// Where the slope past the largest measured size is taken from: the largest measured
    /// size at most half of it, or else the smallest, so the slope spans a wide stretch of the
    /// curve. The last two sizes would do only on a quiet curve: under load the measured
    /// sizes are batches of every size, often neighbours (99 and 100 tokens) whose noise
    /// makes their slope anything, and a flat one priced drafts on a saturated verifier as
    /// nearly free (`bench load`, 64 sessions on one verifier: 0.76× plain). `None` with
    /// fewer than two sizes.
    fn baseline(measured: &[(usize, f64)]) -> Option<(usize, f64)> {
        let (&(largest, _), smaller) = measured.split_last()?;
        smaller
            .iter()
            .rev()
            .find(|&&(size, _)| 2 * size <= largest)
            .or(smaller.first())
            .copied()
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
                let slope = Self::baseline(&m[..split])
                    .map(|(r, tr)| ((t0 - tr) / (m0 - r) as f64).max(0.0))
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
    if one_sequence {
        undisturbed_estimate(old, seconds)
    } else {
        old + EMA_WEIGHT * (seconds.min(OUTLIER_FACTOR * old) - old)
    }
}

/// The estimate of something that does the same work each time (a lone sequence's pass of
/// one size, a drafter call), moved by one more measurement of it: towards a faster one
/// quickly, towards a slower one slowly and by at most [`OUTLIER_FACTOR`] of the estimate
/// (see [`PASS_WEIGHT_UP`]). With no estimate yet (0), the measurement is taken as it is.
fn undisturbed_estimate(old: f64, seconds: f64) -> f64 {
    if old <= 0.0 {
        return seconds;
    }
    let weight = if seconds < old {
        PASS_WEIGHT_DOWN
    } else {
        PASS_WEIGHT_UP
    };
    old + weight * (seconds.min(OUTLIER_FACTOR * old) - old)
}

#[cfg(test)]
mod tests;
