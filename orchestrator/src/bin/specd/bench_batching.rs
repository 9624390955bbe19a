//! `specd bench engine --sessions N`: the verifier engine's decode throughput with N
//! sessions decoding at once, batched (each session's next step joins whatever pass is
//! forming, as under load) against one job per pass (the same steps, one at a time), on the
//! same engine and threads, alternating, three times each: medians, and the median of the
//! pairs' ratios. This is the engine's own rate: no network, no orchestrator, no prompt
//! processing in the timed part.

use std::time::Instant;

use specd_model::Engine;

use crate::bench_engine::{greedy_step as step, median, session_tokens};

#[derive(Debug, serde::Serialize)]
pub struct Batching {
    pub sessions: usize,
    pub steps: usize,
    pub one_job_per_pass_tok_s: f64,
    pub batched_tok_s: f64,
    /// Median over the alternating pairs of batched / one job per pass.
    pub ratio: f64,
}

/// Alternating pairs measured.
const PAIRS: usize = 3;

/// Prompt tokens each session starts from (processed before timing).
const PROMPT: usize = 64;

/// Takes `steps` greedy decode steps in each of the sequences `names` (contexts beside them),
/// all at once, one thread each: each forward pass batches whichever steps are ready, as under
/// load.
pub(crate) fn decode_together(
    engine: &Engine,
    names: &[String],
    contexts: &mut [Vec<u32>],
    steps: usize,
) -> anyhow::Result<()> {
    std::thread::scope(|scope| -> anyhow::Result<()> {
        let workers: Vec<_> = names
            .iter()
            .zip(contexts.iter_mut())
            .map(|(name, context)| {
                scope.spawn(move || (0..steps).try_for_each(|_| step(engine, name, context)))
            })
            .collect();
        for worker in workers {
            worker.join().expect("a decoding thread panicked")?;
        }
        Ok(())
    })
}

pub fn measure(engine: &Engine, sessions: usize, steps: usize) -> anyhow::Result<Batching> {
    let vocab = engine.info().vocab_size;
    let run = |mode: &str, batched: bool| -> anyhow::Result<f64> {
        let names: Vec<String> = (0..sessions).map(|s| format!("{mode}-{s}")).collect();
        let mut contexts: Vec<Vec<u32>> = (0..sessions).map(|s| session_tokens(s, PROMPT, vocab)).collect();
        for (name, context) in names.iter().zip(&mut contexts) {
            step(engine, name, context)?; // the prompt, untimed
        }
        let started = Instant::now();
        if batched {
            decode_together(engine, &names, &mut contexts, steps)?;
        } else {
            for _ in 0..steps {
                for (name, context) in names.iter().zip(&mut contexts) {
                    step(engine, name, context)?;
                }
            }
        }
        let seconds = started.elapsed().as_secs_f64();
        for name in &names {
            engine.release(name);
        }
        Ok((sessions * steps) as f64 / seconds)
    };
    let (mut one, mut batched) = (Vec::new(), Vec::new());
    for _ in 0..PAIRS {
        one.push(run("sequential", false)?);
        batched.push(run("batched", true)?);
    }
    let ratio = median(batched.iter().zip(&one).map(|(b, o)| b / o).collect());
    Ok(Batching {
        sessions,
        steps,
        one_job_per_pass_tok_s: median(one),
        batched_tok_s: median(batched),
        ratio,
    })
}

pub fn print(b: &Batching) {
    println!();
    println!(
        "{} sessions decoding ({} steps each, after {PROMPT}-token prompts; medians of {PAIRS}):",
        b.sessions, b.steps
    );
    println!("  one job per pass   {:>8.1} tok/s", b.one_job_per_pass_tok_s);
    println!(
        "  batched            {:>8.1} tok/s  ({:.2}x, median of the pairs' ratios)",
        b.batched_tok_s, b.ratio
    );
}
