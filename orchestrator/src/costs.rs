//! What a speculative step costs, measured per process and shared by sessions: the
//! verifier's forward-pass time as a function of the tokens in the pass (its cost curve),
//! the round trip around it, the drafter's time, and how full the verifier's passes are.
//!
//! The policy compares k by the tokens the *verifier* emits per second of its time. A lone
//! session's step verifying k drafts takes `T(1 + k)` plus the round trip and emits E(k)
//! tokens. On a batched verifier the same step joins a pass over the other sessions' tokens
//! `n`: it emits `S − 1 + E(k)` tokens for the pass's `S` sessions in `T(n + 1 + k)`. The
//! first pass tokens are nearly free on a CPU (one weight stream serves a tile of rows), the
//! later ones cost their compute, so a draft that pays alone may not pay in a full batch: K
//! shrinks as the verifier gets busy and grows back when it idles.

use std::sync::Mutex;

/// Weight of the newest sample in the moving averages.
const EMA_WEIGHT: f64 = 0.2;
/// Pass sizes (tokens) whose time is tracked one by one; larger passes extrapolate.
pub const PASS_TABLE: usize = 256;

#[derive(Debug)]
pub struct CostModel {
    inner: Mutex<Costs>,
}

#[derive(Debug, Clone)]
struct Costs {
    /// Forward-pass seconds for n tokens (index n − 1), once seen.
    pass: Vec<Option<f64>>,
    /// Before any pass is measured: `prior_base + prior_per_token · (n − 1)`.
    prior_base: f64,
    prior_per_token: f64,
    /// Seconds of a verifier call beyond its queue wait and forward pass (transport,
    /// serialisation, argmax or warping).
    round_trip: f64,
    /// Seconds of one drafter call, and per drafted token (LM drafters).
    draft_call: f64,
    draft_per_token: f64,
    /// Sessions and tokens in the verifier's recent passes.
    sessions: f64,
    tokens: f64,
}

impl Default for CostModel {
    fn default() -> Self {
        // Priors from candle's CPU curve (8 tokens ≈ 5.7× one): replaced by measurements
        // after a few steps.
        Self {
            inner: Mutex::new(Costs {
                pass: vec![None; PASS_TABLE],
                prior_base: 0.02,
                prior_per_token: 0.0134,
                round_trip: 0.0,
                draft_call: 0.0005,
                draft_per_token: 0.0,
                sessions: 1.0,
                tokens: 1.0,
            }),
        }
    }
}

impl CostModel {
    /// Records a verifier call: its forward pass scored `batch_tokens` tokens of
    /// `batch_size` sessions in `forward_seconds`, after `queue_seconds` of waiting, and the
    /// call took `call_seconds` in all.
    pub fn record_verify(
        &self,
        batch_size: u32,
        batch_tokens: u32,
        forward_seconds: f64,
        queue_seconds: f64,
        call_seconds: f64,
    ) {
        let mut c = self.lock();
        if let Some(slot) = (batch_tokens as usize)
            .checked_sub(1)
            .and_then(|i| c.pass.get_mut(i))
        {
            *slot = Some(slot.map_or(forward_seconds, |old| ema(old, forward_seconds)));
        }
        let round_trip = (call_seconds - forward_seconds - queue_seconds).max(0.0);
        c.round_trip = ema(c.round_trip, round_trip);
        c.sessions = ema(c.sessions, f64::from(batch_size.max(1)));
        c.tokens = ema(c.tokens, f64::from(batch_tokens.max(batch_size).max(1)));
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

    /// Verifier tokens emitted per second of verifier time if this session's next step
    /// verifies `k` drafts and emits `expected` tokens (see the module documentation).
    pub fn tokens_per_second(&self, k: usize, expected: f64) -> f64 {
        let c = self.lock();
        let sessions = c.sessions.max(1.0);
        // The other sessions' share of a pass, at their average tokens each.
        let others = ((sessions - 1.0) * c.tokens.max(sessions) / sessions).round() as usize;
        let mut seconds = c.pass_seconds(others + 1 + k) + c.round_trip;
        if k > 0 {
            seconds += c.draft_call + c.draft_per_token * k as f64;
        }
        (sessions - 1.0 + expected) / seconds.max(1e-9)
    }

    /// Forward-pass seconds for `n` tokens (as [`CostModel::tokens_per_second`] prices it).
    pub fn pass_seconds(&self, n: usize) -> f64 {
        self.lock().pass_seconds(n)
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

    fn lock(&self) -> std::sync::MutexGuard<'_, Costs> {
        self.inner.lock().expect("cost model lock")
    }
}

impl Costs {
    /// The measured time of an `n`-token pass; between measured sizes a straight line,
    /// beyond the largest the slope of the last two; never less than a smaller pass's (a
    /// noisy sample must not make more tokens look cheaper).
    fn pass_seconds(&self, n: usize) -> f64 {
        let n = n.max(1);
        let measured: Vec<(usize, f64)> = self
            .pass
            .iter()
            .enumerate()
            .filter_map(|(i, t)| t.map(|t| (i + 1, t)))
            .collect();
        let prior = |n: usize| self.prior_base + self.prior_per_token * (n - 1) as f64;
        let at = |n: usize| -> f64 {
            let below = measured.iter().rev().find(|(m, _)| *m <= n).copied();
            let above = measured.iter().find(|(m, _)| *m > n).copied();
            match (below, above) {
                (Some((m, t)), _) if m == n => t,
                (Some((m0, t0)), Some((m1, t1))) => t0 + (t1 - t0) * (n - m0) as f64 / (m1 - m0) as f64,
                (Some((m0, t0)), None) => {
                    let slope = measured
                        .iter()
                        .rev()
                        .nth(1)
                        .map(|&(m, t)| ((t0 - t) / (m0 - m) as f64).max(0.0))
                        .unwrap_or(self.prior_per_token * t0 / self.prior_base);
                    t0 + slope * (n - m0) as f64
                }
                // Only larger passes seen: scale the prior's shape to the first of them.
                (None, Some((m1, t1))) => t1 * prior(n) / prior(m1),
                (None, None) => prior(n),
            }
        };
        // Monotone: the largest of the estimates up to n.
        let mut best = 0f64;
        for size in 1..=n {
            best = best.max(at(size));
        }
        best
    }
}

fn ema(old: f64, sample: f64) -> f64 {
    old + EMA_WEIGHT * (sample - old)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::adaptive::expected_tokens;

    /// A CPU-like curve: tokens up to 4 nearly free, then 0.2 of a pass each.
    fn cpu_curve() -> CostModel {
        let model = CostModel::default();
        for _ in 0..50 {
            for (n, t) in [
                (1, 10.0),
                (2, 10.4),
                (3, 11.0),
                (4, 12.0),
                (8, 20.0),
                (16, 36.0),
                (24, 52.0),
            ] {
                model.record_verify(1, n, t * 1e-3, 0.0, t * 1e-3);
            }
        }
        model
    }

    fn best_k(model: &CostModel, alpha: f64) -> usize {
        (0..=8)
            .max_by(|&a, &b| {
                let rate = |k: usize| model.tokens_per_second(k, expected_tokens(k, alpha));
                rate(a).total_cmp(&rate(b))
            })
            .unwrap()
    }

    fn set_load(model: &CostModel, sessions: u32) {
        for _ in 0..60 {
            let mut c = model.lock();
            c.sessions = ema(c.sessions, f64::from(sessions));
            c.tokens = ema(c.tokens, f64::from(sessions));
        }
    }

    #[test]
    fn passes_cost_what_was_measured_and_interpolate_between() {
        let model = cpu_curve();
        assert!((model.pass_seconds(4) - 0.012).abs() < 1e-6);
        assert!(
            (model.pass_seconds(6) - 0.016).abs() < 1e-6,
            "{}",
            model.pass_seconds(6)
        );
        // Past the largest measured pass: the last slope (2 ms per token).
        assert!(
            (model.pass_seconds(30) - 0.064).abs() < 1e-6,
            "{}",
            model.pass_seconds(30)
        );
        // A noisy sample cannot make a larger pass cheaper than a smaller one.
        for _ in 0..50 {
            model.record_verify(1, 5, 0.005, 0.0, 0.005);
        }
        assert!(model.pass_seconds(5) >= model.pass_seconds(4));
    }

    #[test]
    fn k_shrinks_under_load_and_grows_back_when_idle() {
        let model = cpu_curve();
        let idle = best_k(&model, 0.7);
        assert!(idle >= 2, "alone, nearly free drafts pay: {idle}");
        set_load(&model, 16);
        let busy = best_k(&model, 0.7);
        assert!(busy < idle, "K under load {busy} vs idle {idle}");
        // In a full pass every draft costs 0.2 of a pass: only near-certain drafts pay.
        assert_eq!(best_k(&model, 0.5), 0);
        set_load(&model, 1);
        assert_eq!(best_k(&model, 0.7), idle);
    }

    #[test]
    fn a_lone_session_prices_k_by_the_pass_curve_and_round_trip() {
        let model = cpu_curve();
        let round_trip = model.lock().round_trip;
        assert!(round_trip.abs() < 1e-9);
        let draft = model.lock().draft_call;
        let rate = model.tokens_per_second(2, 2.0);
        assert!((rate - 2.0 / (0.011 + draft)).abs() < 1e-6, "{rate}");
        // Without drafts no drafter call is charged.
        assert!((model.tokens_per_second(0, 1.0) - 1.0 / 0.010).abs() < 1e-6);
    }

    #[test]
    fn the_round_trip_is_the_call_minus_queue_and_pass() {
        let model = CostModel::default();
        for _ in 0..80 {
            model.record_verify(1, 1, 0.010, 0.002, 0.0135);
        }
        assert!((model.lock().round_trip - 0.0015).abs() < 1e-6);
    }
}
