//! `specd bench engine --profile`: where a forward pass's time goes, by phase (matmuls by
//! kind, attention, LM head, element-wise ops, activation quantisation), for one-token
//! decode, for scoring n tokens of one sequence at once (8 unless `--profile-rows` says) and,
//! with `--sessions N`, for N sequences decoding together (each pass batching whichever of
//! their steps are ready, as under load: N rows over N caches instead of n rows over one),
//! plus the thread pool's fixed cost per dispatch times the dispatches a pass makes. The
//! phases are timed inside the model's own pass, so they add up to (nearly) the whole pass.

use specd_model::host::{ForwardProfile, Phase, pool_dispatch_seconds};
use specd_model::{Engine, ScoreRequest};

use crate::bench_batching::decode_together;
use crate::bench_engine::{greedy_step, session_tokens, tokens};

/// Passes profiled per shape.
const PASSES: usize = 40;
/// Decode steps each session takes in the profile of sessions decoding together.
const SESSION_STEPS: usize = 16;

#[derive(Debug, serde::Serialize)]
pub struct PhaseRow {
    phase: &'static str,
    /// Milliseconds per pass, for n = 1, n = `scored_rows` and (if profiled) the sessions.
    decode_ms: f64,
    scored_ms: f64,
    sessions_ms: Option<f64>,
}

#[derive(Debug, serde::Serialize)]
pub struct Profile {
    rows: Vec<PhaseRow>,
    scored_rows: usize,
    decode_total_ms: f64,
    scored_total_ms: f64,
    /// Sessions decoding together, their passes' mean rows and milliseconds per pass.
    sessions: usize,
    sessions_rows_per_pass: f64,
    sessions_total_ms: f64,
    dispatches_per_pass: f64,
    dispatch_us: f64,
}

fn profile_passes(engine: &Engine, n: usize, depth: usize, vocab: usize) -> anyhow::Result<ForwardProfile> {
    let base = tokens(0, depth + n, vocab);
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

/// Passes of `sessions` sequences (streams of their own, `depth` tokens cached each) taking
/// [`SESSION_STEPS`] greedy steps together ([`decode_together`]), after a first step together
/// that is not profiled.
fn profile_sessions(
    engine: &Engine,
    sessions: usize,
    depth: usize,
    vocab: usize,
) -> anyhow::Result<ForwardProfile> {
    let names: Vec<String> = (0..sessions).map(|s| format!("profile-session-{s}")).collect();
    let mut contexts: Vec<Vec<u32>> = (0..sessions).map(|s| session_tokens(s, depth, vocab)).collect();
    for (name, context) in names.iter().zip(&mut contexts) {
        greedy_step(engine, name, context)?; // the prompt, not profiled
    }
    // One step together, not profiled either: the first step after a prompt grows every
    // layer's cache buffers (a copy and fresh pages, ~2 ms per layer for 16 sessions at depth
    // 256), a cost each session pays once that would otherwise be 1/16 of the profile.
    decode_together(engine, &names, &mut contexts, 1)?;
    engine.start_profile();
    let stepped = decode_together(engine, &names, &mut contexts, SESSION_STEPS);
    let profile = engine.take_profile().unwrap_or_default();
    for name in &names {
        engine.release(name);
    }
    stepped?;
    Ok(profile)
}

/// Profiles one-token decode and n-token scoring at `depth`, and `sessions` sequences
/// decoding together (0: not).
pub fn measure(
    engine: &Engine,
    depth: usize,
    scored_rows: usize,
    sessions: usize,
) -> anyhow::Result<Profile> {
    let vocab = engine.info().vocab_size;
    let decode = profile_passes(engine, 1, depth, vocab)?;
    let scored = profile_passes(engine, scored_rows.max(1), depth, vocab)?;
    let together = if sessions > 0 {
        Some(profile_sessions(engine, sessions, depth, vocab)?)
    } else {
        None
    };
    anyhow::ensure!(decode.passes > 0 && scored.passes > 0, "no pass was profiled");
    let per = |p: &ForwardProfile, phase: Phase| p.phase(phase) * 1e3 / p.passes.max(1) as f64;
    let rows = Phase::ALL
        .iter()
        .map(|&phase| PhaseRow {
            phase: phase.name(),
            decode_ms: per(&decode, phase),
            scored_ms: per(&scored, phase),
            sessions_ms: together.as_ref().map(|p| per(p, phase)),
        })
        .collect();
    let together = together.unwrap_or_default();
    let passes = together.passes.max(1) as f64;
    Ok(Profile {
        rows,
        scored_rows: scored_rows.max(1),
        decode_total_ms: decode.total_seconds * 1e3 / decode.passes as f64,
        scored_total_ms: scored.total_seconds * 1e3 / scored.passes as f64,
        sessions,
        sessions_rows_per_pass: together.tokens as f64 / passes,
        sessions_total_ms: together.total_seconds * 1e3 / passes,
        dispatches_per_pass: decode.pool_dispatches as f64 / decode.passes as f64,
        dispatch_us: pool_dispatch_seconds() * 1e6,
    })
}

pub fn print(profile: &Profile) {
    println!();
    let sessions = profile.sessions > 0;
    let sessions_header = format!(
        "{} sessions ({:.1}/pass)",
        profile.sessions, profile.sessions_rows_per_pass
    );
    println!(
        "{:<26} {:>18} {:>18} {:>22}",
        "phase (ms per pass)",
        "decode (n=1)",
        format!("score n={}", profile.scored_rows),
        if sessions { sessions_header.as_str() } else { "" }
    );
    let pct = |v: f64, total: f64| format!("{v:.3} ({:>4.1}%)", 100.0 * v / total);
    for row in &profile.rows {
        println!(
            "{:<26} {:>18} {:>18} {:>22}",
            row.phase,
            pct(row.decode_ms, profile.decode_total_ms),
            pct(row.scored_ms, profile.scored_total_ms),
            row.sessions_ms
                .map_or(String::new(), |v| pct(v, profile.sessions_total_ms))
        );
    }
    println!(
        "{:<26} {:>18.3} {:>18.3} {:>22}",
        "whole pass",
        profile.decode_total_ms,
        profile.scored_total_ms,
        if sessions {
            format!("{:.3}", profile.sessions_total_ms)
        } else {
            String::new()
        }
    );
    println!(
        "thread pool: {:.0} dispatches per pass × {:.1} µs empty dispatch = {:.3} ms per pass",
        profile.dispatches_per_pass,
        profile.dispatch_us,
        profile.dispatches_per_pass * profile.dispatch_us / 1e3
    );
}
