//! The order in which carried jobs ask for a pass's prompt budget (`--prefill-chunk`): least
//! prompt left first. A short prompt is not stuck behind a long one, and a prompt that has
//! started finishes before the next one starts, so when many sessions arrive together they
//! reach decoding one after another and their decode steps ride in the passes that compute
//! the others' prompts. (Taking turns, every prompt finished at about the same time, and
//! until then the passes held prompt tokens only.) So that a long prompt is not starved by a
//! stream of shorter ones, each pass a job sits out for want of budget counts its prompt
//! down by a quarter of the budget: it waits at most about four times its own passes.
//! (`PrefillOrder::Turns` skips this sort: carried jobs then take the budget in turns.)

use std::collections::VecDeque;
use std::time::Instant;

use super::Job;

/// Share of a pass's prompt budget a job's priority gains for each pass it sat out.
const AGING_DIVISOR: usize = 4;

/// Sorts `jobs` (stable) into the order they should ask for prompt budget, with
/// `chunk` prompt tokens per pass (0: no bound, every prompt runs whole and order does not
/// matter).
pub(super) fn sort(jobs: &mut VecDeque<Job>, chunk: usize) {
    if chunk == 0 || jobs.len() < 2 {
        return;
    }
    jobs.make_contiguous().sort_by_key(|job| key(job, chunk));
}

fn key(job: &Job, chunk: usize) -> (i64, Option<Instant>) {
    match job {
        // Releases free memory and take no budget: first.
        Job::Release { .. } => (i64::MIN, None),
        Job::Score {
            request,
            queued_at,
            prefilled,
            waited,
            partial,
            ..
        } => {
            // A job planned before knows its cache; one that never was (a second job for a
            // sequence already in a pass) is counted from what earlier passes computed.
            let done = partial.as_ref().map_or(*prefilled, |cache| cache.len());
            let left = request.logits_from.saturating_sub(done);
            (priority(left, *waited, chunk), Some(*queued_at))
        }
    }
}

/// Lower runs first: prompt tokens left, less a quarter of `chunk` per pass waited.
fn priority(left: usize, waited: usize, chunk: usize) -> i64 {
    let credit = waited.saturating_mul(chunk / AGING_DIVISOR);
    i64::try_from(left).unwrap_or(i64::MAX) - i64::try_from(credit).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::ScoreRequest;
    use std::time::Duration;

    fn job(name: &str, prompt: usize, prefilled: usize, waited: usize, queued_at: Instant) -> Job {
        let (reply, _) = tokio::sync::oneshot::channel();
        Job::Score {
            request: ScoreRequest {
                sequence: name.into(),
                context: vec![1; prompt + 1],
                logits_from: prompt,
            },
            reply,
            queued_at,
            prefilled,
            waited,
            partial: None,
        }
    }

    fn names(jobs: &VecDeque<Job>) -> Vec<String> {
        jobs.iter()
            .map(|job| match job {
                Job::Score { request, .. } => request.sequence.clone(),
                Job::Release { sequence } => format!("release {sequence}"),
            })
            .collect()
    }

    #[test]
    fn least_prompt_left_goes_first_and_a_started_prompt_before_equal_newcomers() {
        let t0 = Instant::now();
        let later = t0 + Duration::from_millis(1);
        // Three 48-token prompts arrived together; "a" has had one 16-token chunk, "b" and
        // "c" sat out that pass. "d" is a 4-token prompt that just arrived.
        let mut jobs: VecDeque<Job> = [
            job("b", 48, 0, 1, t0),
            job("c", 48, 0, 1, t0),
            job("a", 48, 16, 0, t0),
            job("d", 4, 0, 0, later),
        ]
        .into();
        jobs.push_back(Job::Release {
            sequence: "gone".into(),
        });
        sort(&mut jobs, 16);
        assert_eq!(names(&jobs), ["release gone", "d", "a", "b", "c"]);
        // Without a prompt bound the order is left as it was.
        let mut unbounded: VecDeque<Job> = [job("x", 40, 0, 0, t0), job("y", 2, 0, 0, t0)].into();
        sort(&mut unbounded, 0);
        assert_eq!(names(&unbounded), ["x", "y"]);
    }

    #[test]
    fn a_long_prompt_waiting_long_enough_overtakes_new_short_ones() {
        // 64 tokens per pass: each pass sat out is worth 16 tokens.
        assert_eq!(priority(100, 0, 64), 100);
        assert_eq!(priority(100, 3, 64), 52);
        let t0 = Instant::now();
        // 1000 − 60 · 16 = 40 tokens still count for more than a new 30-token prompt; after
        // two more passes (1000 − 62 · 16 = 8), the long prompt goes first.
        let mut jobs: VecDeque<Job> = [job("short", 30, 0, 0, t0), job("long", 1000, 0, 60, t0)].into();
        sort(&mut jobs, 64);
        assert_eq!(names(&jobs), ["short", "long"]);
        let mut jobs: VecDeque<Job> = [job("short", 30, 0, 0, t0), job("long", 1000, 0, 62, t0)].into();
        sort(&mut jobs, 64);
        assert_eq!(names(&jobs), ["long", "short"]);
    }
}
