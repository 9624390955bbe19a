//! Acceptance of draft tokens, as pure functions. Greedy: accept while the draft equals the
//! target's argmax, then emit the target's token. Sampling: exact speculative rejection
//! sampling (Leviathan et al. 2023; Chen et al. 2023): accept draft x with probability
//! min(1, p(x)/q(x)); on the first rejection emit a token from norm(max(0, p − q)); if every
//! draft passes, emit a bonus token from the target's distribution after the last draft.
//! Either way the output is distributed exactly as the target's own.

use specd_model::SparseDist;

/// The result of one speculative step: the first `accepted` draft tokens are kept, then
/// `next` (a correction, or the bonus token when every draft was accepted).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepOutcome {
    pub accepted: usize,
    pub next: u32,
}

impl StepOutcome {
    /// The tokens this step adds to the context.
    pub fn tokens(&self, draft: &[u32]) -> Vec<u32> {
        let mut tokens = draft[..self.accepted].to_vec();
        tokens.push(self.next);
        tokens
    }
}

/// Greedy acceptance. `target[i]` is the target's argmax after `context + draft[..i]`;
/// `target.len() == draft.len() + 1`.
pub fn accept_greedy(draft: &[u32], target: &[u32]) -> StepOutcome {
    assert_eq!(
        target.len(),
        draft.len() + 1,
        "one target token per draft position plus one"
    );
    let accepted = draft.iter().zip(target).take_while(|(d, t)| d == t).count();
    StepOutcome {
        accepted,
        next: target[accepted],
    }
}

/// Rejection-sampling acceptance. `q[i]` is the distribution draft token `i` was drawn
/// from, `p[i]` the target's distribution at the same position (`p.len() == draft.len() + 1`),
/// both warped with the same parameters. `uniform` yields draws in [0, 1).
pub fn accept_sampled(
    draft: &[u32],
    q: &[SparseDist],
    p: &[SparseDist],
    uniform: &mut dyn FnMut() -> f64,
) -> StepOutcome {
    assert_eq!(q.len(), draft.len(), "one q per draft token");
    assert_eq!(p.len(), draft.len() + 1, "one p per draft position plus one");
    for (i, &x) in draft.iter().enumerate() {
        let px = p[i].prob(x) as f64;
        let qx = q[i].prob(x) as f64;
        // A draft its own q gives no mass cannot be weighed: treat it as rejected.
        let accept = qx > 0.0 && uniform() < (px / qx).min(1.0);
        if !accept {
            return StepOutcome {
                accepted: i,
                next: residual(&p[i], &q[i]).sample_with(uniform()),
            };
        }
    }
    StepOutcome {
        accepted: draft.len(),
        next: p[draft.len()].sample_with(uniform()),
    }
}

/// norm(max(0, p − q)): where the target wants more mass than the draft gave.
pub fn residual(p: &SparseDist, q: &SparseDist) -> SparseDist {
    let mut ids = Vec::new();
    let mut probs = Vec::new();
    for (&id, &pp) in p.ids.iter().zip(&p.probs) {
        let r = pp - q.prob(id);
        if r > 0.0 {
            ids.push(id);
            probs.push(r);
        }
    }
    let total: f32 = probs.iter().sum();
    if ids.is_empty() || total <= 0.0 {
        // p <= q everywhere means p == q (both sum to 1): a rejection had probability 0,
        // so only rounding gets here; p itself is the right distribution then.
        return p.clone();
    }
    probs.iter_mut().for_each(|r| *r /= total);
    SparseDist { ids, probs }
}

#[cfg(test)]
mod tests;
