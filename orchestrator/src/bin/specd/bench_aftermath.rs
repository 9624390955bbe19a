//! `specd bench engine`'s aftermath measurement: how much longer a one-token pass takes right
//! after a pass of several tokens than right after another one-token pass. A verifier's
//! live passes read steeper than the pass curve measured alone, and part of the difference
//! is this: a speculative step's pass slows the step after it. Three kinds of heavy pass are
//! compared with the one-token baseline: one whose tokens the next pass keeps (every draft
//! accepted), one the next pass rolls back into (drafts rejected after two), and one with
//! logits at its last row only (a prompt chunk's shape), so the cause can be told apart from
//! rollback and from the LM head's extra rows; and an idle gap as long as the heavy pass's
//! extra time, which tells whether what slows the next pass is the time since the weights
//! were last read (on the shared-cache machines measured so far, it is: see
//! docs/SCALING-RUNS.md).

use specd_model::Engine;

use crate::bench_engine::{median, time_pass, tokens};

/// One-token passes before each measured pair, so every pair starts from the same state.
const LEAD_PASSES: usize = 3;
/// Measured pairs per kind and repetition.
const PAIRS_PER_REPETITION: usize = 15;

/// What precedes the timed one-token pass.
#[derive(Debug, Clone, Copy)]
enum Before {
    OneToken,
    HeavyKept,
    HeavyRolledBack,
    HeavyOneLogitsRow,
    IdleAsLong,
}

impl Before {
    const ALL: [Before; 5] = [
        Before::OneToken,
        Before::HeavyKept,
        Before::HeavyRolledBack,
        Before::HeavyOneLogitsRow,
        Before::IdleAsLong,
    ];

    fn label(self, rows: usize) -> String {
        match self {
            Before::OneToken => "after a one-token pass".into(),
            Before::HeavyKept => format!("after a pass of {rows} tokens, all kept"),
            Before::HeavyRolledBack => format!("after a pass of {rows}, rolled back to 2"),
            Before::HeavyOneLogitsRow => format!("after a pass of {rows}, logits at 1 row"),
            Before::IdleAsLong => format!("after a one-token pass and {rows}'s extra time idle"),
        }
    }
}

#[derive(Debug, serde::Serialize)]
pub struct Aftermath {
    heavy_rows: usize,
    depth: usize,
    /// Milliseconds the idle gap lasted.
    gap_ms: f64,
    /// Median milliseconds of the one-token pass after each kind of pass, in `Before::ALL`
    /// order, with its label.
    passes: Vec<(String, f64)>,
}

/// Times one-token passes at `depth` after each kind of pass ([`Before`]), the kinds taking
/// turns.
pub fn measure(
    engine: &Engine,
    depth: usize,
    heavy_rows: usize,
    repetitions: usize,
) -> anyhow::Result<Aftermath> {
    let vocab = engine.info().vocab_size;
    let depth = depth.max(1);
    let heavy_rows = heavy_rows.max(2);
    let sequence = "aftermath";
    let base = tokens(300_000, depth + LEAD_PASSES + heavy_rows + 1, vocab);
    let other_token = tokens(400_000, 1, vocab)[0];
    let pass = |context: &[u32], logits_from: usize| time_pass(engine, sequence, context, logits_from);
    // The idle gap: how much longer the heavy pass takes than a one-token pass.
    let mut one = Vec::new();
    let mut heavy = Vec::new();
    for _ in 0..5 {
        pass(&base[..depth], depth - 1)?;
        one.push(pass(&base[..depth + 1], depth)?);
        heavy.push(pass(&base[..depth + heavy_rows], depth)?);
    }
    let gap = std::time::Duration::from_secs_f64((median(heavy) - median(one)).max(0.0));
    let mut times = vec![Vec::new(); Before::ALL.len()];
    for round in 0..PAIRS_PER_REPETITION * repetitions.max(1) {
        // Back to `depth` cached tokens (the pass re-scores the last one), then one-token
        // passes up to `d`.
        pass(&base[..depth], depth - 1)?;
        for i in 1..=LEAD_PASSES {
            pass(&base[..depth + i], depth + i - 1)?;
        }
        let d = depth + LEAD_PASSES;
        let index = round % Before::ALL.len();
        let timed = match Before::ALL[index] {
            Before::OneToken => {
                pass(&base[..d + 1], d)?;
                pass(&base[..d + 2], d + 1)?
            }
            Before::HeavyKept => {
                pass(&base[..d + heavy_rows], d)?;
                pass(&base[..d + heavy_rows + 1], d + heavy_rows)?
            }
            Before::HeavyRolledBack => {
                pass(&base[..d + heavy_rows], d)?;
                let mut context = base[..d + 2].to_vec();
                context.push(other_token);
                pass(&context, d + 2)?
            }
            Before::HeavyOneLogitsRow => {
                pass(&base[..d + heavy_rows], d + heavy_rows - 1)?;
                pass(&base[..d + heavy_rows + 1], d + heavy_rows)?
            }
            Before::IdleAsLong => {
                pass(&base[..d + 1], d)?;
                std::thread::sleep(gap);
                pass(&base[..d + 2], d + 1)?
            }
        };
        times[index].push(timed);
    }
    engine.release(sequence);
    Ok(Aftermath {
        heavy_rows,
        depth,
        gap_ms: gap.as_secs_f64() * 1e3,
        passes: Before::ALL
            .iter()
            .zip(times)
            .map(|(kind, t)| (kind.label(heavy_rows), median(t) * 1e3))
            .collect(),
    })
}

pub fn print(aftermath: &Aftermath) {
    println!(
        "\none-token pass at depth ~{} by what came before it (medians; idle gap {:.2} ms):",
        aftermath.depth + LEAD_PASSES,
        aftermath.gap_ms
    );
    let baseline = aftermath.passes.first().map_or(1.0, |p| p.1);
    for (label, ms) in &aftermath.passes {
        println!("  {label:<52} {ms:>7.3} ms  (x{:.3})", ms / baseline);
    }
}
