//! Acceptance tests: greedy cases, and statistical tests that the emitted tokens follow the
//! target distribution exactly. Each statistical test uses a fixed seed (deterministic) and a
//! bound whose false-failure rate for a correct implementation is stated; each also runs a
//! deliberately wrong variant (the classic mistakes) and requires it to fail the same bound.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::*;

fn dist(pairs: &[(u32, f32)]) -> SparseDist {
    SparseDist {
        ids: pairs.iter().map(|p| p.0).collect(),
        probs: pairs.iter().map(|p| p.1).collect(),
    }
}

#[test]
fn greedy_accepts_the_agreeing_prefix_then_corrects() {
    assert_eq!(
        accept_greedy(&[5, 6, 7], &[5, 6, 9, 1]),
        StepOutcome { accepted: 2, next: 9 }
    );
    assert_eq!(accept_greedy(&[5], &[4, 1]), StepOutcome { accepted: 0, next: 4 });
}

#[test]
fn greedy_all_accepted_emits_the_bonus_token() {
    let out = accept_greedy(&[5, 6], &[5, 6, 8]);
    assert_eq!(out, StepOutcome { accepted: 2, next: 8 });
    assert_eq!(out.tokens(&[5, 6]), vec![5, 6, 8]);
    assert_eq!(accept_greedy(&[], &[3]), StepOutcome { accepted: 0, next: 3 });
}

#[test]
fn residual_is_the_normalised_positive_part() {
    let p = dist(&[(0, 0.5), (1, 0.3), (2, 0.2)]);
    let q = dist(&[(0, 0.7), (1, 0.1), (2, 0.2)]);
    let r = residual(&p, &q);
    assert_eq!(r.ids, vec![1]);
    assert!((r.probs[0] - 1.0).abs() < 1e-6);
}

const VOCAB: u32 = 4;

/// A target p and a draft q that disagree a lot, so every mistake shows.
fn p_and_q() -> (SparseDist, SparseDist) {
    (
        dist(&[(0, 0.1), (1, 0.2), (2, 0.3), (3, 0.4)]),
        dist(&[(0, 0.4), (1, 0.3), (2, 0.2), (3, 0.1)]),
    )
}

/// Total-variation distance between empirical counts and a distribution.
fn tv(counts: &[usize], expected: &dyn Fn(u32) -> f64) -> f64 {
    let n: usize = counts.iter().sum();
    0.5 * counts
        .iter()
        .enumerate()
        .map(|(i, &c)| (c as f64 / n as f64 - expected(i as u32)).abs())
        .sum::<f64>()
}

/// With N draws over 4 (or 16) outcomes, TV of the empirical distribution from the truth has
/// mean ≈ 0.5·Σ sqrt(2 p(1-p) / (π N)) ≈ 0.003 (4) / 0.006 (16) at N = 200k; 0.012 is more
/// than 5 standard deviations above, a false-failure rate below 1e-6. The wrong variants
/// below are off by 0.05–0.2.
const N: usize = 200_000;
const TV_BOUND: f64 = 0.012;

type Acceptor = fn(&[u32], &[SparseDist], &[SparseDist], &mut dyn FnMut() -> f64) -> StepOutcome;

/// The classic mistakes, to show the tests catch them.
mod wrong {
    use super::*;

    /// Accepts with probability p(x) instead of min(1, p(x)/q(x)).
    pub fn accept_with_p(
        draft: &[u32],
        q: &[SparseDist],
        p: &[SparseDist],
        u: &mut dyn FnMut() -> f64,
    ) -> StepOutcome {
        for (i, &x) in draft.iter().enumerate() {
            if u() >= p[i].prob(x) as f64 {
                return StepOutcome {
                    accepted: i,
                    next: residual(&p[i], &q[i]).sample_with(u()),
                };
            }
        }
        StepOutcome {
            accepted: draft.len(),
            next: p[draft.len()].sample_with(u()),
        }
    }

    /// Resamples from p instead of norm(max(0, p − q)) after a rejection.
    pub fn resample_from_p(
        draft: &[u32],
        q: &[SparseDist],
        p: &[SparseDist],
        u: &mut dyn FnMut() -> f64,
    ) -> StepOutcome {
        for (i, &x) in draft.iter().enumerate() {
            if u() >= (p[i].prob(x) as f64 / q[i].prob(x) as f64).min(1.0) {
                return StepOutcome {
                    accepted: i,
                    next: p[i].sample_with(u()),
                };
            }
        }
        StepOutcome {
            accepted: draft.len(),
            next: p[draft.len()].sample_with(u()),
        }
    }

    /// Emits nothing more when every draft is accepted (the missing bonus token is then
    /// taken as the next step's first draft position, i.e. drawn from q again).
    pub fn no_bonus(
        draft: &[u32],
        q: &[SparseDist],
        p: &[SparseDist],
        u: &mut dyn FnMut() -> f64,
    ) -> StepOutcome {
        let out = super::super::accept_sampled(draft, q, p, u);
        if out.accepted == draft.len() {
            // Without a bonus the caller re-drafts: model that as the next token from q.
            return StepOutcome {
                accepted: draft.len(),
                next: q[0].sample_with(u()),
            };
        }
        out
    }

    /// Weighs draft i against the target distribution of position i + 1 (off by one).
    pub fn off_by_one(
        draft: &[u32],
        q: &[SparseDist],
        p: &[SparseDist],
        u: &mut dyn FnMut() -> f64,
    ) -> StepOutcome {
        let shifted: Vec<SparseDist> = p[1..].iter().chain(std::iter::once(&p[0])).cloned().collect();
        super::super::accept_sampled(draft, q, &shifted, u)
    }
}

/// Runs one speculative step with K = 1 many times: the first emitted token must follow p0,
/// and the second (when two are emitted) must follow p1.
fn first_two_tokens_tv(acceptor: Acceptor, p: &[SparseDist; 2], q: &SparseDist, seed: u64) -> (f64, f64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut first = vec![0usize; VOCAB as usize];
    let mut second = vec![0usize; VOCAB as usize];
    for _ in 0..N {
        let x = q.sample_with(rng.random::<f64>());
        let mut u = || rng.random::<f64>();
        let out = acceptor(&[x], std::slice::from_ref(q), p, &mut u);
        let tokens = out.tokens(&[x]);
        first[tokens[0] as usize] += 1;
        if tokens.len() > 1 {
            second[tokens[1] as usize] += 1;
        }
    }
    let tv_first = tv(&first, &|id| p[0].prob(id) as f64);
    let tv_second = tv(&second, &|id| p[1].prob(id) as f64);
    (tv_first, tv_second)
}

#[test]
fn sampled_tokens_follow_the_target_distribution() {
    let (p0, q) = p_and_q();
    let p1 = dist(&[(0, 0.7), (1, 0.1), (2, 0.1), (3, 0.1)]);
    let (a, b) = first_two_tokens_tv(accept_sampled, &[p0, p1], &q, 1);
    assert!(a < TV_BOUND && b < TV_BOUND, "tv first {a}, second {b}");
}

#[test]
fn accepting_with_p_instead_of_the_ratio_is_caught() {
    let (p0, q) = p_and_q();
    let p1 = dist(&[(0, 0.7), (1, 0.1), (2, 0.1), (3, 0.1)]);
    let (a, _) = first_two_tokens_tv(wrong::accept_with_p, &[p0, p1], &q, 2);
    assert!(a > TV_BOUND, "the wrong acceptor passed: tv {a}");
}

#[test]
fn resampling_from_p_instead_of_the_residual_is_caught() {
    let (p0, q) = p_and_q();
    let p1 = dist(&[(0, 0.7), (1, 0.1), (2, 0.1), (3, 0.1)]);
    let (a, _) = first_two_tokens_tv(wrong::resample_from_p, &[p0, p1], &q, 3);
    assert!(a > TV_BOUND, "the wrong acceptor passed: tv {a}");
}

#[test]
fn a_missing_bonus_token_is_caught() {
    let (p0, q) = p_and_q();
    let p1 = dist(&[(0, 0.7), (1, 0.1), (2, 0.1), (3, 0.1)]);
    let (_, b) = first_two_tokens_tv(wrong::no_bonus, &[p0, p1], &q, 4);
    assert!(b > TV_BOUND, "the wrong acceptor passed: tv {b}");
}

#[test]
fn an_off_by_one_target_position_is_caught() {
    let (p0, q) = p_and_q();
    let p1 = dist(&[(0, 0.7), (1, 0.1), (2, 0.1), (3, 0.1)]);
    let (a, _) = first_two_tokens_tv(wrong::off_by_one, &[p0, p1], &q, 5);
    assert!(a > TV_BOUND, "the wrong acceptor passed: tv {a}");
}

#[test]
fn multi_token_drafts_keep_the_joint_distribution() {
    // A context-free target: position t has distribution p[t], the drafter q[t]. Generate
    // two tokens by speculative steps of K = 2 (re-drafting after a rejection); the pair
    // must follow p[0](a) · p[1](b).
    let (p0, q0) = p_and_q();
    let p = [
        p0,
        dist(&[(0, 0.25), (1, 0.05), (2, 0.6), (3, 0.1)]),
        dist(&[(0, 0.25), (1, 0.25), (2, 0.25), (3, 0.25)]),
    ];
    let q = [q0, dist(&[(0, 0.1), (1, 0.6), (2, 0.2), (3, 0.1)])];
    let mut rng = StdRng::seed_from_u64(6);
    let mut pairs = vec![0usize; 16];
    let mut accepted_all = 0;
    for _ in 0..N {
        let mut tokens: Vec<u32> = Vec::new();
        while tokens.len() < 2 {
            let pos = tokens.len();
            let k = 2 - pos;
            let draft: Vec<u32> = (0..k)
                .map(|i| q[pos + i].sample_with(rng.random::<f64>()))
                .collect();
            let mut u = || rng.random::<f64>();
            let out = accept_sampled(&draft, &q[pos..pos + k], &p[pos..pos + k + 1], &mut u);
            accepted_all += usize::from(out.accepted == 2);
            tokens.extend(out.tokens(&draft));
        }
        pairs[(tokens[0] * VOCAB + tokens[1]) as usize] += 1;
    }
    let expected = |i: u32| (p[0].prob(i / VOCAB) * p[1].prob(i % VOCAB)) as f64;
    let d = tv(&pairs, &expected);
    assert!(d < TV_BOUND, "tv of pairs {d}");
    assert!(accepted_all > 0);
}

#[test]
fn identical_draft_and_target_accept_everything() {
    let (p0, _) = p_and_q();
    let mut rng = StdRng::seed_from_u64(7);
    for _ in 0..1000 {
        let x = p0.sample_with(rng.random::<f64>());
        let mut u = || rng.random::<f64>();
        let out = accept_sampled(&[x], std::slice::from_ref(&p0), &[p0.clone(), p0.clone()], &mut u);
        assert_eq!(out.accepted, 1);
    }
}
