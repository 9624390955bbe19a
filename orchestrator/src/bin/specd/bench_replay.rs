//! `specd bench replay`: the end of `bench spec` again, offline, from the JSON a run wrote.
//! The run saved each workload's plain (greedy) outputs and the verifier's pass curve, so
//! a drafter setting or a change to the K policy can be priced on the same outputs and the
//! same curve in a second, without a model or a new (noisy) run: the oracle-K cap, the
//! policy's replay and its decisions with oracle lengths, as `bench spec` prints them. With
//! `--curve learned` they are priced on the curve the orchestrator's cost model had learned
//! from the run's own passes instead, the one that steered the live policy: a live figure
//! far from the replay on the measured curve but near this one was set by the pass costs of
//! the moment, not by the policy. `--curve live` prices them on the run's own passes.

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use serde::Deserialize;
use specd_drafter::NgramArgs;

use crate::bench_cap::{SAVED_PASS_SIZES, Trace, curve_ratios, replay_workloads};

#[derive(Debug, clap::Args)]
pub struct ReplayBenchArgs {
    /// A `bench spec` JSON file (with plain traces and the pass curve).
    #[arg(long, default_value = "bench-out/spec.json")]
    from: PathBuf,
    /// K ceiling for the replays (at most one less than the pass sizes the run saved).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=(SAVED_PASS_SIZES as i64 - 1)))]
    max_k: u32,
    /// Which of the run's pass curves prices the replays: `measured` (after the runs, by
    /// itself), `learned` (by the cost model, from the run's live passes) or `live` (the
    /// medians of the run's own passes).
    #[arg(long, value_enum, default_value_t = SavedCurve::Measured)]
    curve: SavedCurve,
    #[command(flatten)]
    ngram: NgramArgs,
}

/// The pass curves a `bench spec` JSON holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SavedCurve {
    Measured,
    Learned,
    Live,
}

impl SavedCurve {
    fn field(self) -> &'static str {
        match self {
            Self::Measured => "pass_seconds_1_to_9",
            Self::Learned => "learned_pass_seconds_1_to_9",
            Self::Live => "live_pass_seconds_1_to_9",
        }
    }

    fn name(self) -> &'static str {
        match self {
            Self::Measured => "measured",
            Self::Learned => "learned",
            Self::Live => "live",
        }
    }
}

#[derive(Debug, Deserialize)]
struct SavedWorkload {
    workload: String,
    pass_seconds_1_to_9: Vec<f64>,
    /// Absent from files written before these curves were saved (the live one also from a
    /// run too short to anchor it).
    #[serde(default)]
    learned_pass_seconds_1_to_9: Option<Vec<f64>>,
    #[serde(default)]
    live_pass_seconds_1_to_9: Option<Vec<f64>>,
    plain_traces: Vec<Trace>,
}

/// Each workload's traces and the pass curve (seconds for 1 to 9 tokens) of a saved run.
type Saved = (Vec<(String, Vec<Trace>)>, Vec<f64>);

fn load(path: &Path, which: SavedCurve) -> anyhow::Result<Saved> {
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let saved: Vec<SavedWorkload> = serde_json::from_str(&text)
        .with_context(|| format!("{} is not a bench spec JSON", path.display()))?;
    let Some(first) = saved.first() else {
        bail!("{} holds no workloads", path.display());
    };
    let curve = match which {
        SavedCurve::Measured => Some(first.pass_seconds_1_to_9.clone()),
        SavedCurve::Learned => first.learned_pass_seconds_1_to_9.clone(),
        SavedCurve::Live => first.live_pass_seconds_1_to_9.clone(),
    }
    .with_context(|| format!("{} holds no {} pass curve", path.display(), which.name()))?;
    if curve.len() != SAVED_PASS_SIZES || curve.iter().any(|s| !(s.is_finite() && *s > 0.0)) {
        bail!(
            "{}: the pass curve ({}) must hold {SAVED_PASS_SIZES} positive times",
            path.display(),
            which.field()
        );
    }
    let mut workloads = Vec::with_capacity(saved.len());
    for w in saved {
        if let Some(t) = w.plain_traces.iter().find(|t| t.prompt_len > t.context.len()) {
            bail!(
                "{}: a {} trace's prompt ({} tokens) is longer than the trace ({})",
                path.display(),
                w.workload,
                t.prompt_len,
                t.context.len()
            );
        }
        workloads.push((w.workload, w.plain_traces));
    }
    Ok((workloads, curve))
}

pub fn run(args: ReplayBenchArgs) -> anyhow::Result<()> {
    let (workloads, curve) = load(&args.from, args.curve)?;
    let pass_seconds = |n: usize| curve[n.clamp(1, SAVED_PASS_SIZES) - 1];
    println!(
        "replayed from {}, priced on its {} pass curve: n = 2..5 cost x{}",
        args.from.display(),
        args.curve.name(),
        curve_ratios(&pass_seconds)
    );
    replay_workloads(&workloads, args.max_k as usize, args.ngram.config(), pass_seconds);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use specd_drafter::NgramConfig;

    fn write(json: &serde_json::Value) -> tempfile::NamedTempFile {
        let file = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(file.path(), json.to_string()).unwrap();
        file
    }

    fn curve() -> Vec<f64> {
        (1..=9).map(|n| 1.0 + 0.1 * (n - 1) as f64).collect()
    }

    fn learned() -> Vec<f64> {
        (1..=9).map(|n| 1.0 + 0.3 * (n - 1) as f64).collect()
    }

    fn live() -> Vec<f64> {
        (1..=9).map(|n| 1.0 + 0.2 * (n - 1) as f64).collect()
    }

    #[test]
    fn a_saved_run_replays_as_the_run_priced_it() {
        // The shape `bench spec` writes: a verbatim copy, where drafting pays.
        let body: Vec<u32> = (10..90).collect();
        let tokens = [&body[..], &body[..60]].concat();
        let file = write(&serde_json::json!([{
            "workload": "copy",
            "results": [],
            "oracle_k_cap": 0.0,
            "pass_seconds_1_to_9": curve(),
            "learned_pass_seconds_1_to_9": learned(),
            "live_pass_seconds_1_to_9": live(),
            "plain_traces": [{ "prompt_len": body.len(), "tokens": tokens }],
        }]));
        let (_, learned_curve) = load(file.path(), SavedCurve::Learned).unwrap();
        assert_eq!(learned_curve, learned());
        let (_, live_curve) = load(file.path(), SavedCurve::Live).unwrap();
        assert_eq!(live_curve, live());
        let (workloads, saved_curve) = load(file.path(), SavedCurve::Measured).unwrap();
        assert_eq!(saved_curve, curve());
        assert_eq!(workloads[0].0, "copy");
        let trace = &workloads[0].1[0];
        assert_eq!((trace.prompt_len, trace.context.len()), (80, 140));
        let c = curve();
        let replays = replay_workloads(&workloads, 8, NgramConfig::default(), |n| c[n - 1]);
        let direct = crate::bench_cap::oracle_cap(&workloads[0].1, 8, NgramConfig::default(), |n| c[n - 1]);
        assert_eq!(replays[0].cap, direct);
        assert!(
            replays[0].cap > 2.0 && replays[0].policy > 1.5,
            "{:?}",
            replays[0]
        );
    }

    #[test]
    fn files_that_are_not_a_saved_run_are_refused_with_the_reason() {
        let missing = load(Path::new("/nonexistent/spec.json"), SavedCurve::Measured).unwrap_err();
        assert!(format!("{missing:#}").contains("cannot read"), "{missing:#}");
        let cases = [
            (serde_json::json!({ "workload": "x" }), "not a bench spec JSON"),
            (serde_json::json!([]), "holds no workloads"),
            (
                serde_json::json!([{ "workload": "x", "pass_seconds_1_to_9": [1.0, 2.0], "plain_traces": [] }]),
                "must hold 9 positive times",
            ),
            (
                serde_json::json!([{ "workload": "x", "pass_seconds_1_to_9": curve(),
                    "plain_traces": [{ "prompt_len": 5, "tokens": [1, 2] }] }]),
                "longer than the trace",
            ),
        ];
        for (json, reason) in cases {
            let err = load(write(&json).path(), SavedCurve::Measured).unwrap_err();
            assert!(format!("{err:#}").contains(reason), "{err:#}");
        }
        // A file without the cost model's curve replays on the measured one only.
        let old = write(
            &serde_json::json!([{ "workload": "x", "pass_seconds_1_to_9": curve(),
            "plain_traces": [] }]),
        );
        assert!(load(old.path(), SavedCurve::Measured).is_ok());
        for (which, name) in [(SavedCurve::Learned, "learned"), (SavedCurve::Live, "live")] {
            let err = load(old.path(), which).unwrap_err();
            assert!(
                format!("{err:#}").contains(&format!("holds no {name} pass curve")),
                "{err:#}"
            );
        }
        let short = write(
            &serde_json::json!([{ "workload": "x", "pass_seconds_1_to_9": curve(),
            "learned_pass_seconds_1_to_9": [1.0], "plain_traces": [] }]),
        );
        let err = load(short.path(), SavedCurve::Learned).unwrap_err();
        assert!(
            format!("{err:#}").contains("learned_pass_seconds_1_to_9")
                && format!("{err:#}").contains("9 positive"),
            "{err:#}"
        );
    }
}
