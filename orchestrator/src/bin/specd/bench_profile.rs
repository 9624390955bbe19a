//! `specd bench engine --profile`: where a forward pass's time goes, by phase (matmuls by
//! kind, attention, LM head, element-wise ops, activation quantisation), for one-token
//! decode and for scoring n tokens at once (8 unless `--profile-rows` says), plus the thread pool's fixed cost per dispatch
//! times the dispatches a pass makes. The phases are timed inside the model's own pass, so
//! they add up to (nearly) the whole pass.

use specd_model::host::{ForwardProfile, Phase, pool_dispatch_seconds};
use specd_model::{Engine, ScoreRequest};

/// Passes profiled per shape.
const PASSES: usize = 40;

#[derive(Debug, serde::Serialize)]
pub struct PhaseRow {
    phase: &'static str,
    /// Milliseconds per pass, for n = 1 and n = `scored_rows`.
    decode_ms: f64,
    scored_ms: f64,
}

#[derive(Debug, serde::Serialize)]
pub struct Profile {
    rows: Vec<PhaseRow>,
    scored_rows: usize,
    decode_total_ms: f64,
    scored_total_ms: f64,
    dispatches_per_pass: f64,
    dispatch_us: f64,
}

fn profile_passes(engine: &Engine, n: usize, depth: usize, vocab: usize) -> anyhow::Result<ForwardProfile> {
    let base: Vec<u32> = (0..depth + n).map(|i| ((i * 7919 + 13) % vocab) as u32).collect();
    let sequence = format!("profile-{n}");
    engine.score_blocking(ScoreRequest {
        sequence: sequence.clone(),
        context: base[..depth].to_vec(),
        logits_from: depth - 1,
    })?;
    let mut profile = ForwardProfile::default();
    for _ in 0..PASSES {
        // Only the pass over the n tokens is profiled; rolling the cache back to depth
        // tokens (the second request re-scores the last cached token) is not.
        engine.start_profile();
        engine.score_blocking(ScoreRequest {
            sequence: sequence.clone(),
            context: base.clone(),
            logits_from: depth,
        })?;
        profile.add(&engine.take_profile().unwrap_or_default());
        engine.score_blocking(ScoreRequest {
            sequence: sequence.clone(),
            context: base[..depth].to_vec(),
            logits_from: depth - 1,
        })?;
    }
    engine.release(&sequence);
    Ok(profile)
}

pub fn measure(engine: &Engine, depth: usize, scored_rows: usize) -> anyhow::Result<Profile> {
    let vocab = engine.info().vocab_size;
    let decode = profile_passes(engine, 1, depth, vocab)?;
    let scored = profile_passes(engine, scored_rows.max(1), depth, vocab)?;
    anyhow::ensure!(decode.passes > 0 && scored.passes > 0, "no pass was profiled");
    let per = |p: &ForwardProfile, phase: Phase| p.phase(phase) * 1e3 / p.passes as f64;
    let rows = Phase::ALL
        .iter()
        .map(|&phase| PhaseRow {
            phase: phase.name(),
            decode_ms: per(&decode, phase),
            scored_ms: per(&scored, phase),
        })
        .collect();
    Ok(Profile {
        rows,
        scored_rows: scored_rows.max(1),
        decode_total_ms: decode.total_seconds * 1e3 / decode.passes as f64,
        scored_total_ms: scored.total_seconds * 1e3 / scored.passes as f64,
        dispatches_per_pass: decode.pool_dispatches as f64 / decode.passes as f64,
        dispatch_us: pool_dispatch_seconds() * 1e6,
    })
}

pub fn print(profile: &Profile) {
    println!();
    println!(
        "{:<26} {:>18} {:>18}",
        "phase (ms per pass)",
        "decode (n=1)",
        format!("score n={}", profile.scored_rows)
    );
    let pct = |v: f64, total: f64| format!("{v:.3} ({:>4.1}%)", 100.0 * v / total);
    for row in &profile.rows {
        println!(
            "{:<26} {:>18} {:>18}",
            row.phase,
            pct(row.decode_ms, profile.decode_total_ms),
            pct(row.scored_ms, profile.scored_total_ms)
        );
    }
    println!(
        "{:<26} {:>18.3} {:>18.3}",
        "whole pass", profile.decode_total_ms, profile.scored_total_ms
    );
    println!(
        "thread pool: {:.0} dispatches per pass × {:.1} µs empty dispatch = {:.3} ms per pass",
        profile.dispatches_per_pass,
        profile.dispatch_us,
        profile.dispatches_per_pass * profile.dispatch_us / 1e3
    );
}
