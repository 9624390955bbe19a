//! Tests of the cost model: the pass curve, its estimates, and the prices it gives k.

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
    let values = model.relative_values(&expected, DraftPricing::PerCall);
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
    // Past the largest measured pass: the slope from the largest size at most half of it
    // (8 to 24 tokens, 2 ms per token).
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
    // The first pass of 4, slowed twofold: the slope from size 1 to 3 (the largest size at
    // most half of 3, else the smallest) implies 11.5 ms.
    model.record_verify(pass(4, 24.0));
    let four = model.pass_seconds(4);
    assert!((four - 0.01265).abs() < 1e-5, "{four}");
    // Drafting 3 at 90% acceptance still pays, as it would at 11.5 ms.
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
    assert_eq!(model.lock().pass[4].map(|p| p.seconds), Some(0.0125));
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

fn batched(sequences: u32, n: u32, milliseconds: f64) -> VerifyCall {
    VerifyCall {
        batch_size: sequences,
        ..pass(n, milliseconds)
    }
}

#[test]
fn a_busy_moments_batched_passes_stop_pricing_a_lone_sessions_drafts_once_it_has_passed() {
    let model = CostModel::default();
    // A verifier just started, two sessions at once: two tokens cost three passes of one.
    for _ in 0..3 {
        model.record_verify(batched(2, 2, 12.0));
    }
    // Then one session at a time: one-token passes and prompt chunks, never a pass of 2
    // (the policy will not draft at that price, so nothing measures it alone).
    for round in 0..3 {
        for _ in 0..STALE_AFTER / 2 {
            model.record_verify(pass(1, 4.0));
        }
        model.record_verify(pass(40 + round, 24.0));
    }
    set_load(&model, 1);
    let two = model.pass_seconds(2);
    assert!(two < 0.0046, "priced by its one-sequence neighbours: {two}");
    assert!(best_k(&model, 0.7) > 0, "drafts pay again");
}

#[test]
fn under_load_batched_sizes_keep_their_price() {
    let model = CostModel::default();
    model.record_verify(batched(8, 8, 20.0));
    // Busy: batched passes of other sizes keep coming, size 8 is not run again.
    for _ in 0..2 * STALE_AFTER {
        model.record_verify(batched(4, 4, 12.0));
        model.record_verify(batched(12, 12, 28.0));
    }
    let eight = model.pass_seconds(8);
    assert!((eight - 0.020).abs() < 1e-9, "{eight}");
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
fn past_the_largest_batch_the_curve_keeps_its_wide_slope_whatever_the_last_two_say() {
    // Batched passes of many sizes, about 1 ms a token past a 10 ms weight stream; the two
    // largest are neighbours, and noise has the larger one faster.
    let model = CostModel::default();
    for _ in 0..60 {
        for (n, t) in [
            (10, 20.0),
            (20, 30.0),
            (40, 50.0),
            (60, 70.0),
            (99, 110.0),
            (100, 108.0),
        ] {
            model.record_verify(VerifyCall {
                batch_size: n / 2,
                ..pass(n, t)
            });
        }
    }
    // The slope from 40 to 100 tokens (58 ms over 60), not a flat one from 99 to 100.
    let two_hundred = model.pass_seconds(200);
    assert!(
        (two_hundred - (0.108 + 100.0 * 0.058 / 60.0)).abs() < 1e-3,
        "{two_hundred}"
    );
    // So 64 sessions sharing those passes do not draft at 70% acceptance: a draft row costs
    // about as much as another session's token.
    set_load(&model, 64);
    assert_eq!(best_k(&model, 0.7), 0);
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
    let values = model.relative_values(&[1.0, 2.0, 3.0], DraftPricing::PerCall);
    assert!(values[1] <= 1.0 + 1e-9 && values[2] <= 1.0 + 1e-9, "{values:?}");
    // The prompts done, the cheap part of the curve is back.
    set_others_prompt_tokens(&model, 0);
    assert_eq!(best_k(&model, 0.8), decoding_only);
}

#[test]
fn a_lone_session_prices_k_by_the_pass_curve_and_round_trip() {
    let model = cpu_curve();
    assert!(model.lock().round_trip.abs() < 1e-9);
    let draft = model.lock().draft_call.seconds;
    // Two drafts, both accepted (3 tokens) in an 11 ms pass plus the drafter call,
    // against 1 token in 10 ms.
    let values = model.relative_values(&[1.0, 2.0, 3.0], DraftPricing::PerCall);
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

#[test]
fn one_slow_drafter_call_moves_its_estimate_little_and_faster_calls_bring_it_back() {
    let model = cpu_curve();
    for _ in 0..40 {
        model.record_draft(0, 0.0002, DraftPricing::PerCall, 0.0);
    }
    let settled = model.lock().draft_call.seconds;
    assert!((settled - 0.0002).abs() < 1e-6, "{settled}");
    // The connection's first call, or one that waited for a busy core: 100 times as long.
    model.record_draft(0, 0.02, DraftPricing::PerCall, 0.0);
    let after = model.lock().draft_call.seconds;
    assert!(after <= settled * (1.0 + PASS_WEIGHT_UP) + 1e-12, "{after}");
    model.record_draft(0, 0.0002, DraftPricing::PerCall, 0.0);
    assert!(
        model.lock().draft_call.seconds < after,
        "a normal call brings it down again"
    );
    // A drafter that really is slower is followed within a few dozen calls.
    for _ in 0..40 {
        model.record_draft(0, 0.001, DraftPricing::PerCall, 0.0);
    }
    assert!(
        (model.lock().draft_call.seconds - 0.001).abs() < 5e-5,
        "{}",
        model.lock().draft_call.seconds
    );
}

#[test]
fn an_lm_drafters_price_per_token_does_not_land_on_prompt_lookups_drafts() {
    let model = cpu_curve();
    let expected = [1.0, 1.9, 2.7];
    let before = model.relative_values(&expected, DraftPricing::PerCall);
    // Sessions with an LM drafter in the same process: 2 ms a drafted token.
    for _ in 0..60 {
        model.record_draft(2, 0.004, DraftPricing::PerToken, 0.0);
    }
    let lookup = model.relative_values(&expected, DraftPricing::PerCall);
    let lm = model.relative_values(&expected, DraftPricing::PerToken);
    for k in 0..expected.len() {
        assert!(
            (lookup[k] - before[k]).abs() < 1e-12,
            "k = {k}: {} vs {}",
            lookup[k],
            before[k]
        );
    }
    // Two drafts at 2 ms each on a 11 ms pass against one token in 10 ms.
    let want = 2.7 * 0.010 / (0.011 + 0.004);
    assert!((lm[2] - want).abs() < 1e-3, "{} vs {want}", lm[2]);
}

#[test]
fn a_dear_drafter_price_is_measured_again_by_a_try_less_and_less_often() {
    let model = cpu_curve();
    // The first call found the drafter's model cold: 200 ms for one token.
    model.record_draft(1, 0.2, DraftPricing::PerToken, 0.0);
    assert!(
        !model.try_pays(0.8, DraftPricing::PerToken),
        "fresh, that price rules tries out"
    );
    // Prompt lookup's price is its own.
    assert!(model.try_pays(0.8, DraftPricing::PerCall));
    // Plain steps go by; nothing measures the drafter.
    let plain_steps = |model: &CostModel, n: u64| {
        for _ in 0..n {
            model.record_verify(pass(1, 10.0));
        }
    };
    plain_steps(&model, STALE_AFTER);
    assert!(
        model.try_pays(0.8, DraftPricing::PerToken),
        "a stale price does not block a try"
    );
    // The try's call is fast: it replaces the estimate, and drafts pay again.
    model.record_draft(1, 0.0005, DraftPricing::PerToken, 0.0);
    let expected = [1.0, 1.8];
    let values = model.relative_values(&expected, DraftPricing::PerToken);
    assert!(values[1] > values[0], "{values:?}");
    // A drafter that really is dear: the try's call finds it as dear, and the next try
    // comes twice as late.
    let dear = cpu_curve();
    dear.record_draft(1, 0.2, DraftPricing::PerToken, 0.0);
    plain_steps(&dear, STALE_AFTER);
    assert!(dear.try_pays(0.8, DraftPricing::PerToken));
    dear.record_draft(1, 0.2, DraftPricing::PerToken, 0.0);
    assert!(!dear.try_pays(0.8, DraftPricing::PerToken));
    plain_steps(&dear, STALE_AFTER);
    assert!(!dear.try_pays(0.8, DraftPricing::PerToken));
    plain_steps(&dear, STALE_AFTER);
    assert!(dear.try_pays(0.8, DraftPricing::PerToken));
}

#[test]
fn an_lm_drafters_catch_up_on_context_is_not_priced_as_drafting() {
    let model = cpu_curve();
    let expected = [1.0, 1.9, 2.7];
    // A session's first ask: 80 ms computing its prompt, then two drafts at 2 ms each.
    model.record_draft(2, 0.084, DraftPricing::PerToken, 0.080);
    let priced = model.relative_values(&expected, DraftPricing::PerToken);
    let want = 2.7 * 0.010 / (0.011 + 0.004);
    assert!((priced[2] - want).abs() < 1e-3, "{} vs {want}", priced[2]);
    assert!(priced[2] > 1.0, "drafting pays");
}
