//! The speed-up cap a `bench spec` run's own pass curve implies: prompt lookup replayed over
//! the plain (greedy) outputs with an oracle K — every step verifies exactly the drafts that
//! will be accepted, and none when the first would be rejected — priced on the verifier pass
//! times the run measured. No K policy beats it with this drafter on this machine; the gap
//! between it and a measured speed-up is what a better K choice could still win, and the gap
//! between it and a goal is what only a flatter pass curve or a better drafter can close.
//!
//! Between the two sits [`policy_replay`]: the same replay with the orchestrator's own K
//! policy choosing K, free drafting and no transport. The cap over the replay is what the
//! policy's choices cost; the replay over the measured speed-up is what drafting, transport
//! and the orchestrator cost. The policy's choices split in two: whether to draft at all,
//! and how many drafts to verify. The [`Lengths::Oracle`] replay keeps the first and takes
//! the second from the oracle (every draft the policy makes verifies exactly the tokens that
//! will be kept, at least one), so it says which of the two the policy loses on.

use serde::{Deserialize, Serialize};
use specd_drafter::NgramConfig;
use specd_drafter::ngram::propose;
use specd_orchestrator::adaptive::{KPolicy, bucket};
use specd_orchestrator::costs::{CostModel, DraftPricing, VerifyCall};

/// Pass sizes whose times a `bench spec` JSON records (1 to 9 tokens), beside its traces.
pub const SAVED_PASS_SIZES: usize = 9;

/// Passes of one size a run must hold for their median to stand for that size in
/// [`live_curve`].
pub const LIVE_MIN_PASSES: usize = 5;

/// The pass curve of a run's own decode and verify passes (one sequence, no prompt tokens):
/// for each size 1..=`sizes`, the median time of its passes and how many there were. A size
/// with fewer than [`LIVE_MIN_PASSES`] takes the nearest smaller size's median scaled by
/// `fallback`'s ratio between the two (the curve measured apart). `None` without enough
/// one-token passes to anchor it.
pub fn live_curve(
    passes: &[specd_model::PassRecord],
    sizes: usize,
    fallback: impl Fn(usize) -> f64,
) -> Option<(Vec<f64>, Vec<usize>)> {
    let mut by_size = vec![Vec::new(); sizes];
    for pass in passes {
        if pass.sequences == 1 && pass.prompt_tokens == 0 && (1..=sizes).contains(&pass.tokens) {
            by_size[pass.tokens - 1].push(pass.forward_seconds);
        }
    }
    let counts: Vec<usize> = by_size.iter().map(Vec::len).collect();
    let mut curve: Vec<f64> = Vec::with_capacity(sizes);
    let mut anchor: Option<(usize, f64)> = None;
    for (index, times) in by_size.into_iter().enumerate() {
        let n = index + 1;
        let seconds = if times.len() >= LIVE_MIN_PASSES {
            let median = crate::bench_engine::median(times);
            anchor = Some((n, median));
            median
        } else {
            let (m, at_m) = anchor?;
            at_m * fallback(n) / fallback(m)
        };
        curve.push(seconds);
    }
    Some((curve, counts))
}

/// One greedy generation: the prompt's tokens followed by the generated ones (as `bench
/// spec` saves it and `bench replay` reads it).
#[derive(Debug, Serialize, Deserialize)]
pub struct Trace {
    #[serde(rename = "tokens")]
    pub context: Vec<u32>,
    pub prompt_len: usize,
}

/// How many of `drafts` greedy verification keeps: the prefix that matches what followed.
fn kept(drafts: &[u32], actual: &[u32]) -> usize {
    drafts
        .iter()
        .zip(actual)
        .take_while(|(draft, actual)| draft == actual)
        .count()
}

/// Plain-decoding speed over oracle-K speculative speed (≥ 1 means speculation could pay), over
/// all `traces`' decode phases (after the first generated token, as the bench measures),
/// with drafts capped at `max_k`. `pass_seconds(n)` is the verifier's time for a pass of n
/// tokens.
pub fn oracle_cap(
    traces: &[Trace],
    max_k: usize,
    config: NgramConfig,
    pass_seconds: impl Fn(usize) -> f64,
) -> f64 {
    let (mut tokens, mut seconds) = (0usize, 0f64);
    for trace in traces {
        let end = trace.context.len();
        let mut at = trace.prompt_len + 1;
        while at < end {
            let proposal = propose(&trace.context[..at], max_k.min(end - at - 1), config);
            let accepted = kept(&proposal.tokens, &trace.context[at..]);
            seconds += pass_seconds(1 + accepted);
            tokens += accepted + 1;
            at += accepted + 1;
        }
    }
    if seconds <= 0.0 {
        return 1.0;
    }
    tokens as f64 * pass_seconds(1) / seconds
}

/// How a replayed step's number of drafts is chosen once the policy has chosen to draft.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lengths {
    /// The policy's k.
    Policy,
    /// The drafts that will be kept, at least one (what a perfect length estimate would pick).
    Oracle,
}

/// Plain-decoding speed over what the adaptive K policy reaches replaying `traces` (see the
/// module documentation): each trace a fresh session, the policy asking the drafter and
/// choosing K exactly as the generation loop does, against a cost model that has measured
/// every pass size up to `max_k + 1` at `pass_seconds` and a drafter that costs nothing.
/// With [`Lengths::Oracle`], a step the policy drafts verifies the drafts that will be kept.
pub fn policy_replay(
    traces: &[Trace],
    max_k: usize,
    config: NgramConfig,
    lengths: Lengths,
    pass_seconds: impl Fn(usize) -> f64,
) -> f64 {
    let costs = CostModel::default();
    for n in 1..=max_k + 1 {
        let seconds = pass_seconds(n);
        costs.record_verify(VerifyCall {
            batch_size: 1,
            batch_tokens: n as u32,
            forward_seconds: seconds,
            call_seconds: seconds,
            ..VerifyCall::default()
        });
    }
    // Free drafting: a call under half the estimate replaces it.
    costs.record_draft(0, 0.0, DraftPricing::PerCall, 0.0);
    let (mut tokens, mut seconds) = (0usize, 0f64);
    for trace in traces {
        let mut policy = KPolicy::default();
        let end = trace.context.len();
        let mut at = trace.prompt_len + 1;
        while at < end {
            let available = max_k.min(end - at - 1);
            let mut emitted = 1;
            let mut k = 0;
            if policy.worth_drafting(available, &costs) {
                let proposal = propose(&trace.context[..at], available, config);
                let group = bucket(proposal.match_length);
                k = policy.choose(proposal.tokens.len(), group, &costs);
                let keeps = kept(&proposal.tokens, &trace.context[at..]);
                if k > 0 && lengths == Lengths::Oracle {
                    k = keeps.max(1);
                }
                policy.record_ask(k > 0);
                let accepted = keeps.min(k);
                policy.record(k, accepted, group);
                if k == 0 && !proposal.tokens.is_empty() {
                    policy.record_unverified(group, keeps > 0);
                }
                emitted += accepted;
            } else {
                policy.skip(&costs);
            }
            seconds += pass_seconds(1 + k);
            tokens += emitted;
            at += emitted;
        }
    }
    if seconds <= 0.0 {
        return 1.0;
    }
    tokens as f64 * pass_seconds(1) / seconds
}

/// What passes of 2..5 tokens cost relative to one, as printed beside the replays.
pub fn curve_ratios(pass_seconds: &dyn Fn(usize) -> f64) -> String {
    (2..=5)
        .map(|n| format!("{:.2}", pass_seconds(n) / pass_seconds(1)))
        .collect::<Vec<_>>()
        .join("/")
}

/// One workload's three replays (see the module documentation), as ratios to plain speed.
#[derive(Debug, Clone, Copy)]
pub struct Replays {
    pub cap: f64,
    pub policy: f64,
    pub oracle_lengths: f64,
}

/// Replays every workload's traces and prints the table `bench spec` ends with.
pub fn replay_workloads(
    workloads: &[(String, Vec<Trace>)],
    max_k: usize,
    config: NgramConfig,
    pass_seconds: impl Fn(usize) -> f64 + Copy,
) -> Vec<Replays> {
    let replays: Vec<Replays> = workloads
        .iter()
        .map(|(_, traces)| Replays {
            cap: oracle_cap(traces, max_k, config, pass_seconds),
            policy: policy_replay(traces, max_k, config, Lengths::Policy, pass_seconds),
            oracle_lengths: policy_replay(traces, max_k, config, Lengths::Oracle, pass_seconds),
        })
        .collect();
    println!(
        "{:<15} {:>8} {:>14} {:>15}",
        "workload", "cap", "policy replay", "oracle lengths"
    );
    for ((name, _), r) in workloads.iter().zip(&replays) {
        println!(
            "{name:<15} {:>7.2}x {:>13.2}x {:>14.2}x",
            r.cap, r.policy, r.oracle_lengths
        );
    }
    replays
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trace(prompt: &[u32], output: &[u32]) -> Trace {
        Trace {
            context: [prompt, output].concat(),
            prompt_len: prompt.len(),
        }
    }

    fn pass(
        sequences: usize,
        tokens: usize,
        prompt_tokens: usize,
        forward_seconds: f64,
    ) -> specd_model::PassRecord {
        specd_model::PassRecord {
            sequences,
            tokens,
            prompt_tokens,
            forward_seconds,
            idle_seconds: 0.0,
        }
    }

    #[test]
    fn the_live_curve_takes_each_sizes_median_and_fills_thin_sizes_from_the_fallback() {
        let mut log = Vec::new();
        for i in 0..7 {
            log.push(pass(1, 1, 0, 1.0 + 0.01 * i as f64));
            log.push(pass(1, 3, 0, 1.5 + 0.01 * i as f64));
        }
        // Sizes 2 and 4 too thin to stand; prompts and batches are not this curve's passes.
        log.push(pass(1, 2, 0, 9.0));
        log.push(pass(1, 4, 0, 9.0));
        log.push(pass(1, 3, 2, 50.0));
        log.push(pass(2, 3, 0, 50.0));
        let fallback = |n: usize| 1.0 + 0.25 * (n - 1) as f64;
        let (curve, counts) = live_curve(&log, 4, fallback).unwrap();
        assert_eq!(counts, [7, 1, 7, 1]);
        let want = [1.03, 1.03 * 1.25, 1.53, 1.53 * 1.75 / 1.5];
        for (got, want) in curve.iter().zip(want) {
            assert!((got - want).abs() < 1e-12, "{curve:?}");
        }
        // No one-token passes to anchor it: no curve.
        let only_larger: Vec<_> = log.iter().copied().filter(|p| p.tokens != 1).collect();
        assert!(live_curve(&only_larger, 4, fallback).is_none());
    }

    #[test]
    fn nothing_to_copy_caps_at_plain_speed() {
        let t = trace(&[1, 2, 3], &[4, 5, 6, 7, 8, 9]);
        let cap = oracle_cap(&[t], 8, NgramConfig::default(), |n| 1.0 + 0.1 * n as f64);
        assert!((cap - 1.0).abs() < 1e-12, "{cap}");
    }

    #[test]
    fn a_verbatim_copy_with_free_drafts_emits_k_plus_one_per_pass() {
        let body: Vec<u32> = (10..60).collect();
        // The output repeats the prompt's body after its first token: after one generated
        // token every proposal is right, 4 drafts per pass plus the bonus token.
        let t = trace(&body, &body[..41]);
        let cap = oracle_cap(&[t], 4, NgramConfig::default(), |_| 1.0);
        assert!((cap - 5.0).abs() < 1e-12, "{cap}");
        // A pass that costs its tokens in full leaves nothing to win.
        let t = trace(&body, &body[..41]);
        let cap = oracle_cap(&[t], 4, NgramConfig::default(), |n| n as f64);
        assert!((cap - 1.0).abs() < 1e-12, "{cap}");
    }

    #[test]
    fn the_policy_replay_sits_between_plain_and_the_cap() {
        let body: Vec<u32> = (10..200).collect();
        let t = || trace(&body, &body[..150]);
        let curve = |n: usize| 1.0 + 0.2 * (n - 1) as f64;
        let (cap, replay) = (
            oracle_cap(&[t()], 4, NgramConfig::default(), curve),
            policy_replay(&[t()], 4, NgramConfig::default(), Lengths::Policy, curve),
        );
        // A verbatim copy: the policy learns that drafts hold and drafts deeply.
        assert!(replay > 2.0 && replay <= cap + 1e-9, "replay {replay}, cap {cap}");
        // Every proposal wrong ("1" was always followed by something else before): the
        // policy stops drafting after a few misses, so it stays near plain speed.
        let output: Vec<u32> = (5..40).flat_map(|t| [t, 1]).collect();
        let t = trace(&[1, 2, 3, 1, 4], &output);
        let replay = policy_replay(&[t], 4, NgramConfig::default(), Lengths::Policy, curve);
        assert!(replay > 0.7 && replay < 1.0, "{replay}");
    }

    #[test]
    fn oracle_lengths_keep_the_policys_decisions_to_draft_and_cut_its_overshoot() {
        // Copies of 6 tokens broken by a new token: a proposal runs past each copy's end,
        // so the policy's k overshoots where the oracle's length stops.
        let prompt: Vec<u32> = (10..16).collect();
        let output: Vec<u32> = (0..30u32)
            .flat_map(|i| [100 + i, 10, 11, 12, 13, 14, 15])
            .collect();
        let t = || trace(&prompt, &output);
        let curve = |n: usize| 1.0 + 0.3 * (n - 1) as f64;
        let policy = policy_replay(&[t()], 8, NgramConfig::default(), Lengths::Policy, curve);
        let lengths = policy_replay(&[t()], 8, NgramConfig::default(), Lengths::Oracle, curve);
        let cap = oracle_cap(&[t()], 8, NgramConfig::default(), curve);
        assert!(
            policy < lengths && lengths <= cap + 1e-9,
            "policy {policy}, lengths {lengths}, cap {cap}"
        );
        // Where every draft of a k > 0 step is kept, the two agree.
        let body: Vec<u32> = (10..200).collect();
        let copy = || trace(&body, &body[..150]);
        let a = policy_replay(&[copy()], 4, NgramConfig::default(), Lengths::Policy, curve);
        let b = policy_replay(&[copy()], 4, NgramConfig::default(), Lengths::Oracle, curve);
        assert!((a - b).abs() < 0.05 * a, "{a} vs {b}");
    }

    #[test]
    fn a_wrong_draft_costs_nothing_under_the_oracle() {
        // "7 8" recurs but is followed by something else: the oracle drafts nothing there.
        let t = trace(&[7, 8, 1, 2], &[7, 8, 3, 4]);
        let cap = oracle_cap(&[t], 4, NgramConfig::default(), |n| n as f64);
        assert!(cap >= 1.0, "{cap}");
    }
}
