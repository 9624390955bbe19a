//! The load benchmark's tables: one row per (verifiers, concurrency, mode), the
//! speculative/plain decode rate per workload, where the verifiers' time went, and
//! batching's gain; and the same rows as a plot.

use std::path::Path;

use serde::Serialize;

use super::verifier_time::Breakdown;
use crate::plot::{Panel, grouped_bars};

#[derive(Debug, Default, Serialize)]
pub struct Row {
    pub verifiers: usize,
    pub concurrency: usize,
    pub mode: &'static str,
    pub tokens: usize,
    pub seconds: f64,
    pub tokens_per_second: f64,
    /// Tokens after each session's first over the time after its first token, summed over
    /// sessions: the decode speed one session sees.
    pub session_decode_tokens_per_second: f64,
    pub ttft_p50_ms: f64,
    pub ttft_p99_ms: f64,
    pub itl_p50_ms: f64,
    pub itl_p99_ms: f64,
    pub failed: usize,
    /// Orchestrator CPU per speculative step (verifier call), drafter CPU per proposal,
    /// and bytes on the wire per step.
    pub orchestrator_cpu_ms_per_step: f64,
    pub drafter_cpu_ms_per_call: f64,
    pub bytes_per_step: f64,
    pub mean_k: f64,
    /// Draft tokens verified per step (all steps, those without drafts too), the share of
    /// them accepted, and tokens emitted per step.
    pub drafts_per_step: f64,
    pub acceptance: f64,
    pub tokens_per_step: f64,
    /// Mean sequences in the verifier passes that served the steps, and the time a step
    /// waited in the verifier's queue before its pass.
    pub sequences_per_pass: f64,
    pub verifier_queue_ms_per_step: f64,
    /// The verifiers' wall time in prompt passes, decode-only passes and idle, and the rows
    /// per second of their decode-only passes.
    pub verifier_time: Breakdown,
    /// Per workload, as `session_decode_tokens_per_second`.
    pub workload_decode_tokens_per_second: std::collections::BTreeMap<String, f64>,
}

pub fn print_table(rows: &[Row]) {
    println!(
        "{:>9} {:>5} {:<12} {:>8} {:>8} {:>9} {:>8} {:>9} {:>9} {:>8} {:>8} {:>6} {:>6} {:>9} {:>7} {:>8} {:>9} {:>9} {:>7} {:>8} {:>8}",
        "verifiers",
        "conc",
        "mode",
        "tok/s",
        "vs plain",
        "decode/s",
        "vs plain",
        "TTFT p50",
        "TTFT p99",
        "ITL p50",
        "ITL p99",
        "failed",
        "mean K",
        "drafts/st",
        "accept",
        "tok/step",
        "orch ms/st",
        "drft ms/c",
        "B/step",
        "seq/pass",
        "queue ms"
    );
    for row in rows {
        let plain = plain_row(rows, row);
        println!(
            "{:>9} {:>5} {:<12} {:>8.1} {:>7.2}x {:>9.1} {:>7.2}x {:>7.0}ms {:>7.0}ms {:>6.1}ms {:>6.1}ms {:>6} {:>6.2} {:>9.2} {:>6.0}% {:>8.2} {:>9.3} {:>9.3} {:>7.0} {:>8.1} {:>8.2}",
            row.verifiers,
            row.concurrency,
            row.mode,
            row.tokens_per_second,
            plain.map_or(f64::NAN, |p| row.tokens_per_second / p.tokens_per_second),
            row.session_decode_tokens_per_second,
            plain.map_or(f64::NAN, |p| row.session_decode_tokens_per_second
                / p.session_decode_tokens_per_second),
            row.ttft_p50_ms,
            row.ttft_p99_ms,
            row.itl_p50_ms,
            row.itl_p99_ms,
            row.failed,
            row.mean_k,
            row.drafts_per_step,
            100.0 * row.acceptance,
            row.tokens_per_step,
            row.orchestrator_cpu_ms_per_step,
            row.drafter_cpu_ms_per_call,
            row.bytes_per_step,
            row.sequences_per_pass,
            row.verifier_queue_ms_per_step
        );
    }
}

/// The plain row measured beside `row` (same verifiers and concurrency).
fn plain_row<'a>(rows: &'a [Row], row: &Row) -> Option<&'a Row> {
    rows.iter()
        .find(|r| r.verifiers == row.verifiers && r.concurrency == row.concurrency && r.mode == "plain")
}

/// Speculative (and, with `--control`, plain run again) over plain decode rate per
/// session, per workload.
pub fn print_workload_speedups(rows: &[Row]) {
    let Some(first) = rows.iter().find(|r| r.mode == "speculative") else {
        return;
    };
    let names: Vec<&String> = first.workload_decode_tokens_per_second.keys().collect();
    println!("\neach mode / plain, decode rate per session, by workload");
    print!("{:>9} {:>5} {:<12}", "verifiers", "conc", "mode");
    for name in &names {
        print!(" {name:>15}");
    }
    println!();
    for row in rows
        .iter()
        .filter(|r| r.mode == "speculative" || r.mode == "plain-again")
    {
        let Some(plain) = plain_row(rows, row) else {
            continue;
        };
        print!("{:>9} {:>5} {:<12}", row.verifiers, row.concurrency, row.mode);
        for name in &names {
            let ratio = row
                .workload_decode_tokens_per_second
                .get(*name)
                .copied()
                .unwrap_or(f64::NAN)
                / plain
                    .workload_decode_tokens_per_second
                    .get(*name)
                    .copied()
                    .unwrap_or(f64::NAN);
            print!(" {:>14.2}x", ratio);
        }
        println!();
    }
}

/// Where the verifiers' time went, per row: passes carrying prompt chunks, decode-only
/// passes, idle; and the decode-only passes' scored rows per second.
fn print_verifier_time(rows: &[Row]) {
    println!("\nverifier time (wall time x verifiers): in prompt passes, decode-only passes, idle");
    println!(
        "{:>9} {:>5} {:<15} {:>8} {:>8} {:>6} {:>13}",
        "verifiers", "conc", "mode", "prompt", "decode", "idle", "decode rows/s"
    );
    for row in rows {
        let t = &row.verifier_time;
        println!(
            "{:>9} {:>5} {:<15} {:>7.0}% {:>7.0}% {:>5.0}% {:>13.1}",
            row.verifiers,
            row.concurrency,
            row.mode,
            100.0 * t.prompt_pass_share,
            100.0 * t.decode_pass_share,
            100.0 * t.idle_share,
            t.decode_pass_rows_per_second
        );
    }
}

/// The verifier-time table, then batching's gain at each concurrency where the unbatched
/// baseline ran: end to end, per session's decode rate, and the decode-only passes' rows
/// per second; and the share of the batched verifier's time its prompt passes took, which
/// batching cannot shorten (they are 64-row passes either way).
pub fn print_batching(rows: &[Row]) {
    print_verifier_time(rows);
    for row in rows.iter().filter(|r| r.mode == "plain-unbatched") {
        let Some(batched) = plain_row(rows, row) else {
            continue;
        };
        println!(
            "batching, 1 verifier, {} sessions: {:.2}x the tok/s of one job per pass ({:.2}x each \
             session's decode rate, {:.2}x the decode-only passes' rows/s; prompt passes {:.0}% of \
             the batched verifier's time)",
            row.concurrency,
            batched.tokens_per_second / row.tokens_per_second,
            batched.session_decode_tokens_per_second / row.session_decode_tokens_per_second,
            batched.verifier_time.decode_pass_rows_per_second / row.verifier_time.decode_pass_rows_per_second,
            100.0 * batched.verifier_time.prompt_pass_share
        );
    }
}

/// The rows as grouped bars (SVG): one group per (verifiers, concurrency) cell, one bar per
/// mode; panels for aggregate tok/s, its ratio to plain in the same cell, and the p50 and
/// p99 inter-token latency and p50 time to first token. A mode that did not run in a cell
/// (the unbatched baseline beside three verifiers) has no bar there.
pub fn plot(path: &Path, rows: &[Row]) -> anyhow::Result<()> {
    let mut cells: Vec<(usize, usize)> = Vec::new();
    let mut modes: Vec<&str> = Vec::new();
    for row in rows {
        if !cells.contains(&(row.verifiers, row.concurrency)) {
            cells.push((row.verifiers, row.concurrency));
        }
        if !modes.contains(&row.mode) {
            modes.push(row.mode);
        }
    }
    let measure = |value: &dyn Fn(&Row) -> f64| -> Vec<Vec<f64>> {
        cells
            .iter()
            .map(|&(verifiers, concurrency)| {
                modes
                    .iter()
                    .map(|&mode| {
                        rows.iter()
                            .find(|r| {
                                r.verifiers == verifiers && r.concurrency == concurrency && r.mode == mode
                            })
                            .map_or(0.0, value)
                    })
                    .collect()
            })
            .collect()
    };
    let over_plain =
        |row: &Row| plain_row(rows, row).map_or(0.0, |plain| row.tokens_per_second / plain.tokens_per_second);
    let panels = [
        Panel {
            title: "aggregate tok/s",
            values: measure(&|r| r.tokens_per_second),
        },
        Panel {
            title: "aggregate tok/s over plain",
            values: measure(&over_plain),
        },
        Panel {
            title: "ITL p50 (ms)",
            values: measure(&|r| r.itl_p50_ms),
        },
        Panel {
            title: "ITL p99 (ms)",
            values: measure(&|r| r.itl_p99_ms),
        },
        Panel {
            title: "TTFT p50 (ms)",
            values: measure(&|r| r.ttft_p50_ms),
        },
    ];
    let groups: Vec<String> = cells
        .iter()
        .map(|&(verifiers, concurrency)| format!("{verifiers}v, {concurrency} sess."))
        .collect();
    let series: Vec<String> = modes.iter().map(|m| m.to_string()).collect();
    grouped_bars(path, &groups, &series, &panels)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(verifiers: usize, concurrency: usize, mode: &'static str, tokens_per_second: f64) -> Row {
        Row {
            verifiers,
            concurrency,
            mode,
            tokens_per_second,
            itl_p50_ms: 1000.0 / tokens_per_second,
            ..Row::default()
        }
    }

    #[test]
    fn the_plot_has_a_group_per_cell_and_a_bar_per_mode_that_ran_there() {
        let rows = [
            row(1, 4, "plain", 100.0),
            row(1, 4, "speculative", 150.0),
            row(1, 4, "plain-unbatched", 60.0),
            row(3, 4, "plain", 120.0),
            row(3, 4, "speculative", 130.0),
        ];
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out").join("load.svg");
        plot(&path, &rows).unwrap();
        let svg = std::fs::read_to_string(&path).unwrap();
        for text in [
            "1v, 4 sess.",
            "3v, 4 sess.",
            "plain-unbatched",
            "speculative",
            "aggregate tok/s over plain",
            "TTFT p50 (ms)",
        ] {
            assert!(svg.contains(text), "{text} missing");
        }
        // 5 panels x 2 cells x 3 modes bars (the missing one drawn empty), beside the
        // background, the legend boxes and their swatches.
        assert!(
            svg.matches("<rect").count() >= 30,
            "a bar per panel, cell and mode"
        );
    }
}
