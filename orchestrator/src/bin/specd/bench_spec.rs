//! `specd bench spec`: speculative vs plain decoding through the same stack in one run, per
//! workload kind (copy-heavy code edits, summaries with quotes, JSON rewrites, open-ended
//! chat; prompts in `workloads.json`). Reports decode tok/s of each, the speed-up, acceptance
//! rate, tokens per verifier call, mean K and bytes per step, as a table, a JSON file and an
//! SVG plot of tok/s and acceptance per workload and mode.

use std::path::PathBuf;

use anyhow::Context;
use serde::{Deserialize, Serialize};
use specd_common::model_args::ModelArgs;
use specd_orchestrator::Generator;
use specd_orchestrator::setup::{GeneratorSettings, in_process};
use specd_proto::v1 as pb;

use crate::bench_cap::{
    Lengths, SAVED_PASS_SIZES, Trace, curve_ratios, live_curve, policy_replay, replay_workloads,
};
use crate::bench_engine::pass_curve;
use crate::plot::{Panel, grouped_bars};

/// Passes per size when measuring the verifier's pass curve (the median is used).
const PASS_CURVE_REPS: usize = 7;

/// The built-in workloads (`specd bench load` runs them too).
pub(crate) const DEFAULT_WORKLOADS: &str = include_str!("workloads.json");

#[derive(Debug, clap::Args)]
pub struct SpecBenchArgs {
    /// Workloads file (default: the built-in workloads.json).
    #[arg(long)]
    workloads: Option<PathBuf>,
    /// Tokens generated per prompt.
    #[arg(long, default_value_t = 128)]
    max_tokens: u32,
    /// K ceiling for speculation.
    #[arg(long, default_value_t = 8)]
    max_k: u32,
    /// Times each prompt is run in every mode, the modes alternating (plain, adaptive, …,
    /// then in reverse, …), so a drifting machine weighs on every mode alike; figures are
    /// totals.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=20))]
    repetitions: u32,
    /// Also run fixed-K speculation at these K (comma separated), beside adaptive K.
    #[arg(long, value_delimiter = ',')]
    fixed_k: Vec<u32>,
    /// Where to write the JSON results.
    #[arg(long, default_value = "bench-out/spec.json")]
    json_out: PathBuf,
    /// Where to write the plot (SVG).
    #[arg(long, default_value = "bench-out/spec.svg")]
    plot_out: PathBuf,
    #[command(flatten)]
    pub model: ModelArgs,
}

#[derive(Debug, Deserialize)]
pub(crate) struct Workloads {
    pub workloads: Vec<Workload>,
}

#[derive(Debug, Deserialize)]
pub(crate) struct Workload {
    pub name: String,
    pub prompts: Vec<String>,
}

/// The order in which repetition `repetition` runs `modes` modes (indices): as listed, and
/// in reverse on odd repetitions (plain, speculative, speculative, plain, …), so drift over a
/// run, or an order effect such as following another mode, weighs on every mode alike.
pub(crate) fn mode_order(modes: usize, repetition: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..modes).collect();
    if repetition % 2 == 1 {
        order.reverse();
    }
    order
}

/// Totals of one mode over one workload's prompts.
#[derive(Debug, Default, Clone, Serialize)]
struct ModeResult {
    mode: String,
    tokens: u64,
    decode_tokens: f64,
    decode_seconds: f64,
    proposed: u64,
    accepted: u64,
    verifier_calls: u64,
    drafted_k_sum: f64,
    drafted_steps: f64,
    bytes: u64,
    identical_to_plain: bool,
    /// Of `decode_seconds`, the verifier's forward passes, its calls (passes included) and
    /// the drafter's calls.
    forward_seconds: f64,
    verify_seconds: f64,
    draft_seconds: f64,
    /// Each repetition's decode phase (over the workload's prompts), for the spread of the
    /// speed-up from one repetition to the next.
    repetitions: Vec<DecodePhase>,
}

/// Tokens decoded after the first step, and the seconds they took.
#[derive(Debug, Default, Clone, Copy, PartialEq, Serialize)]
struct DecodePhase {
    decode_tokens: f64,
    decode_seconds: f64,
}

impl DecodePhase {
    fn tok_s(&self) -> f64 {
        self.decode_tokens / self.decode_seconds.max(1e-9)
    }
}

impl ModeResult {
    fn tok_s(&self) -> f64 {
        self.decode_tokens / self.decode_seconds.max(1e-9)
    }

    /// This mode's tok/s over `baseline`'s in each repetition: the modes of one repetition
    /// run back to back, so each ratio is measured under one state of the machine, and their
    /// spread shows how far one figure may be from the total's.
    fn repetition_speedups(&self, baseline: &ModeResult) -> Vec<f64> {
        self.repetitions
            .iter()
            .zip(&baseline.repetitions)
            .map(|(own, base)| own.tok_s() / base.tok_s())
            .collect()
    }

    /// Where a decode-phase token's time goes, in microseconds: the verifier's forward
    /// passes, the rest of its calls (the hand-off to the engine and back, or transport and
    /// queue), drafting, and the orchestrator's own work (acceptance, detokenising, stop
    /// strings).
    fn time_per_token_us(&self) -> [f64; 4] {
        let per_token = 1e6 / self.decode_tokens.max(1.0);
        let call = (self.verify_seconds - self.forward_seconds).max(0.0);
        let own = (self.decode_seconds - self.verify_seconds - self.draft_seconds).max(0.0);
        [self.forward_seconds, call, self.draft_seconds, own].map(|seconds| seconds * per_token)
    }
}

async fn run_one(
    generator: &Generator,
    prompt: &str,
    args: &SpecBenchArgs,
    mode: &str,
) -> anyhow::Result<pb::GenerateResponse> {
    let (disable, fixed_k, max_k) = match mode {
        "plain" => (true, false, args.max_k),
        "adaptive" => (false, false, args.max_k),
        k => (false, true, k.trim_start_matches("k=").parse()?),
    };
    let request = pb::GenerateRequest {
        input: Some(pb::generate_request::Input::Chat(pb::ChatMessages {
            messages: vec![pb::ChatMessage {
                role: "user".into(),
                content: prompt.into(),
            }],
        })),
        max_tokens: args.max_tokens,
        speculation: Some(pb::SpeculationOptions {
            disable,
            max_k,
            drafter: pb::DrafterKind::Ngram as i32,
            fixed_k,
        }),
        ..Default::default()
    };
    generator
        .generate(&request, None)
        .await
        .map_err(|e| anyhow::anyhow!(tonic::Status::from(e).message().to_string()))
}

pub async fn run(args: SpecBenchArgs) -> anyhow::Result<()> {
    let text = match &args.workloads {
        Some(path) => {
            std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?
        }
        None => DEFAULT_WORKLOADS.to_string(),
    };
    let workloads: Workloads = serde_json::from_str(&text)?;
    let model = args.model.clone();
    let loaded = tokio::task::spawn_blocking(move || model.load()).await??;
    let (tokenizer, template) = (loaded.tokenizer.clone(), loaded.chat_template.clone());
    let settings = GeneratorSettings::default();
    let ngram = settings.ngram;
    let engine = loaded.engine.clone();
    let generator = in_process(loaded, settings);
    // The prompt's tokens as the generator builds them (one user message, chat template).
    let prompt_tokens = |prompt: &str| -> anyhow::Result<Vec<u32>> {
        let template = template.as_ref().context("the model has no chat template")?;
        let text = template.render(&[specd_model::ChatMessage::new("user", prompt)], true)?;
        Ok(tokenizer.encode(&text)?)
    };
    let mut modes = vec!["plain".to_string(), "adaptive".to_string()];
    modes.extend(args.fixed_k.iter().map(|k| format!("k={k}")));
    // Warm-up (page in weights, settle the cost model).
    run_one(&generator, "Hello", &args, "plain").await?;
    run_one(&generator, "Hello", &args, "adaptive").await?;
    // Every pass of the runs, to price the replays on what they cost live too.
    engine.start_pass_log();
    let mut all = Vec::new();
    let mut traces: Vec<Vec<Trace>> = Vec::new();
    let runs = args.repetitions as usize
        * modes.len()
        * workloads.workloads.iter().map(|w| w.prompts.len()).sum::<usize>();
    let mut run = 0;
    for workload in &workloads.workloads {
        let mut results: Vec<ModeResult> = modes
            .iter()
            .map(|m| ModeResult {
                mode: m.clone(),
                identical_to_plain: true,
                ..ModeResult::default()
            })
            .collect();
        let mut workload_traces = Vec::new();
        for (i, prompt) in workload.prompts.iter().enumerate() {
            let mut plain_ids = Vec::new();
            // The first repetition runs plain first: the reference for the others.
            let order = (0..args.repetitions as usize).flat_map(|repetition| {
                mode_order(modes.len(), repetition)
                    .into_iter()
                    .map(move |m| (repetition, m))
            });
            for (repetition, index) in order {
                let (mode, result) = (&modes[index], &mut results[index]);
                run += 1;
                eprintln!(
                    "bench spec [{run}/{runs}]: {} prompt {} {mode}",
                    workload.name,
                    i + 1
                );
                let r = run_one(&generator, prompt, &args, mode).await?;
                let s = r.stats.unwrap_or_default();
                if mode == "plain" {
                    plain_ids = r.token_ids.clone();
                    if workload_traces.len() == i {
                        let prompt = prompt_tokens(prompt)?;
                        workload_traces.push(Trace {
                            prompt_len: prompt.len(),
                            context: [prompt, r.token_ids.clone()].concat(),
                        });
                    }
                } else {
                    result.identical_to_plain &= r.token_ids == plain_ids;
                }
                let n = r.token_ids.len() as f64;
                let ttft = s.time_to_first_token_seconds;
                // Decode phase: everything after the first step (which processes the prompt).
                let decode_tokens = if s.tokens_per_second > 0.0 {
                    s.tokens_per_second * (s.decode_seconds - ttft)
                } else {
                    0.0
                };
                let decode_seconds = s.decode_seconds - ttft;
                result.decode_tokens += decode_tokens;
                result.decode_seconds += decode_seconds;
                let reps = &mut result.repetitions;
                reps.resize(reps.len().max(repetition + 1), DecodePhase::default());
                reps[repetition].decode_tokens += decode_tokens;
                reps[repetition].decode_seconds += decode_seconds;
                result.tokens += n as u64;
                result.proposed += u64::from(s.proposed);
                result.accepted += u64::from(s.accepted);
                result.verifier_calls += u64::from(s.verifier_calls);
                result.bytes += s.bytes_sent + s.bytes_received;
                result.forward_seconds += s.decode_forward_seconds;
                result.verify_seconds += s.decode_verify_seconds;
                result.draft_seconds += s.decode_draft_seconds;
                if s.mean_k > 0.0 {
                    let drafted_steps = f64::from(s.proposed) / s.mean_k;
                    result.drafted_k_sum += f64::from(s.proposed);
                    result.drafted_steps += drafted_steps;
                }
            }
        }
        all.push((workload.name.clone(), results));
        traces.push(workload_traces);
    }
    let live_passes = engine.take_pass_log();
    print_table(&all);
    // Priced on the verifier's pass curve, measured after the runs at the traces' mean
    // decode depth (the cost model's learned curve, which steered the live policy, can
    // drift far on a noisy machine: it is printed beside).
    let all_traces: Vec<&Trace> = traces.iter().flatten().collect();
    let depth = all_traces
        .iter()
        .map(|t| (t.prompt_len + t.context.len()) / 2)
        .sum::<usize>()
        / all_traces.len().max(1);
    // Sizes up to K + 1, and at least those the JSON records.
    let sizes: Vec<usize> = (1..=(args.max_k as usize + 1).max(SAVED_PASS_SIZES)).collect();
    let measured =
        tokio::task::spawn_blocking(move || pass_curve(&engine, depth, &sizes, PASS_CURVE_REPS)).await??;
    let pass_seconds = |n: usize| measured[n.clamp(1, measured.len()) - 1].1;
    println!(
        "\noracle-K cap (prompt lookup replayed on the plain outputs, each step verifying exactly the drafts that will be accepted), policy replay (the orchestrator's K policy on the same outputs, free drafting, no transport) and the policy's decisions to draft with oracle lengths (each drafting step verifying the drafts that will be kept, at least one), priced on the pass curve measured at depth {depth}: n = 2..5 cost x{} (the cost model had learned x{})",
        curve_ratios(&pass_seconds),
        curve_ratios(&|n| generator.costs.pass_seconds(n)),
    );
    let workloads: Vec<(String, Vec<Trace>)> = all.iter().map(|(name, _)| name.clone()).zip(traces).collect();
    let replays = replay_workloads(&workloads, args.max_k as usize, ngram, pass_seconds);
    // The same policy replay on what this run's own passes cost (the curve measured after
    // the runs is a few passes per size on a machine that drifts; the live passes are
    // thousands, at the depths and in the order the workloads ran them).
    let live = live_curve(&live_passes, measured.len(), pass_seconds);
    let live_replays: Option<Vec<f64>> = live.as_ref().map(|(curve, counts)| {
        let live_seconds = |n: usize| curve[n.clamp(1, curve.len()) - 1];
        println!(
            "the policy replayed on this run's own passes ({} of one token; n = 2..5: {} passes, cost x{}):",
            counts[0],
            counts[1..5]
                .iter()
                .map(usize::to_string)
                .collect::<Vec<_>>()
                .join("/"),
            curve_ratios(&live_seconds)
        );
        workloads
            .iter()
            .map(|(name, traces)| {
                let replay = policy_replay(traces, args.max_k as usize, ngram, Lengths::Policy, live_seconds);
                println!("{name:<15} {replay:>7.2}x");
                replay
            })
            .collect()
    });
    if let Some(parent) = args.json_out.parent() {
        std::fs::create_dir_all(parent)?;
    }
    let pass_curve: Vec<f64> = (1..=SAVED_PASS_SIZES).map(pass_seconds).collect();
    let learned_curve: Vec<f64> = (1..=SAVED_PASS_SIZES)
        .map(|n| generator.costs.pass_seconds(n))
        .collect();
    let (live_curve, live_counts) = match &live {
        Some((curve, counts)) => (
            Some(curve[..SAVED_PASS_SIZES].to_vec()),
            Some(counts[..SAVED_PASS_SIZES].to_vec()),
        ),
        None => (None, None),
    };
    let json: Vec<_> = all
        .iter()
        .zip(&replays)
        .zip(&workloads)
        .enumerate()
        .map(|(i, (((name, results), replay), (_, traces)))| {
            serde_json::json!({
                "workload": name,
                "results": results,
                "oracle_k_cap": replay.cap,
                "policy_replay": replay.policy,
                "policy_replay_oracle_lengths": replay.oracle_lengths,
                "pass_seconds_1_to_9": pass_curve,
                "learned_pass_seconds_1_to_9": learned_curve,
                // This run's own one-sequence decode and verify passes (thin sizes filled
                // from the curve above), how many of each, and the policy replayed on them.
                "live_pass_seconds_1_to_9": live_curve,
                "live_pass_counts_1_to_9": live_counts,
                "policy_replay_live": live_replays.as_ref().map(|r| r[i]),
                // The plain outputs, so drafting strategies can be replayed offline
                // (`specd bench replay`).
                "plain_traces": traces,
            })
        })
        .collect();
    std::fs::write(&args.json_out, serde_json::to_string_pretty(&json)?)?;
    eprintln!("wrote {}", args.json_out.display());
    let groups: Vec<String> = all.iter().map(|(name, _)| name.clone()).collect();
    let panels = [
        Panel {
            title: "decode tok/s",
            values: all
                .iter()
                .map(|(_, rs)| rs.iter().map(ModeResult::tok_s).collect())
                .collect(),
        },
        Panel {
            title: "acceptance rate",
            values: all
                .iter()
                .map(|(_, rs)| {
                    rs.iter()
                        .map(|r| r.accepted as f64 / r.proposed.max(1) as f64)
                        .collect()
                })
                .collect(),
        },
    ];
    grouped_bars(&args.plot_out, &groups, &modes, &panels)?;
    eprintln!("wrote {}", args.plot_out.display());
    Ok(())
}

fn print_table(all: &[(String, Vec<ModeResult>)]) {
    println!(
        "{:<15} {:<9} {:>8} {:>8} {:>11} {:>8} {:>10} {:>7} {:>10} {:>9} {:>9} {:>9} {:>9} {:>9}",
        "workload",
        "mode",
        "tok/s",
        "speedup",
        "per rep",
        "accept",
        "tok/call",
        "mean K",
        "B/step",
        "= plain",
        "pass us",
        "call us",
        "draft us",
        "own us"
    );
    for (name, results) in all {
        let plain = results[0].tok_s();
        for r in results {
            let per_repetition = if r.mode == "plain" {
                "-".to_string()
            } else {
                spread(&r.repetition_speedups(&results[0]))
            };
            let accept = if r.proposed == 0 {
                "-".to_string()
            } else {
                format!("{:.0}%", 100.0 * r.accepted as f64 / r.proposed as f64)
            };
            let mean_k = if r.drafted_steps > 0.0 {
                format!("{:.1}", r.drafted_k_sum / r.drafted_steps)
            } else {
                "-".into()
            };
            let [pass_us, call_us, draft_us, own_us] = r.time_per_token_us();
            println!(
                "{:<15} {:<9} {:>8.1} {:>7.2}x {:>11} {:>8} {:>10.2} {:>7} {:>10.0} {:>9} {:>9.0} {:>9.0} {:>9.0} {:>9.0}",
                name,
                r.mode,
                r.tok_s(),
                r.tok_s() / plain,
                per_repetition,
                accept,
                r.tokens as f64 / r.verifier_calls.max(1) as f64,
                mean_k,
                r.bytes as f64 / r.verifier_calls.max(1) as f64,
                if r.mode == "plain" {
                    "-"
                } else if r.identical_to_plain {
                    "yes"
                } else {
                    "NO"
                },
                pass_us,
                call_us,
                draft_us,
                own_us,
            );
        }
    }
}

/// The lowest and highest of some ratios, as `1.41-1.58` (or the one value).
fn spread(ratios: &[f64]) -> String {
    let low = ratios.iter().copied().fold(f64::INFINITY, f64::min);
    let high = ratios.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    match ratios.len() {
        0 => "-".into(),
        1 => format!("{low:.2}"),
        _ => format!("{low:.2}-{high:.2}"),
    }
}

#[cfg(test)]
mod tests {
    use super::{DecodePhase, ModeResult, mode_order, spread};

    #[test]
    fn a_decode_tokens_time_splits_into_passes_calls_drafting_and_the_rest() {
        let r = ModeResult {
            decode_tokens: 100.0,
            decode_seconds: 0.5,
            forward_seconds: 0.4,
            verify_seconds: 0.43,
            draft_seconds: 0.01,
            ..ModeResult::default()
        };
        let us = r.time_per_token_us();
        for (got, want) in us.iter().zip([4000.0, 300.0, 100.0, 600.0]) {
            assert!((got - want).abs() < 1e-6, "{us:?}");
        }
        // Clock skew between the verifier's and the orchestrator's timings leaves no negative
        // remainder.
        let skewed = ModeResult {
            forward_seconds: 0.6,
            verify_seconds: 0.55,
            ..r
        };
        let [_, call, _, own] = skewed.time_per_token_us();
        assert_eq!((call, own), (0.0, 0.0));
    }

    #[test]
    fn each_repetition_is_compared_with_the_baselines_same_repetition() {
        let phases = |pairs: &[(f64, f64)]| -> Vec<DecodePhase> {
            pairs
                .iter()
                .map(|&(decode_tokens, decode_seconds)| DecodePhase {
                    decode_tokens,
                    decode_seconds,
                })
                .collect()
        };
        let plain = ModeResult {
            repetitions: phases(&[(100.0, 1.0), (100.0, 2.0), (100.0, 1.0)]),
            ..ModeResult::default()
        };
        let adaptive = ModeResult {
            repetitions: phases(&[(100.0, 0.5), (100.0, 1.6), (50.0, 0.5)]),
            ..ModeResult::default()
        };
        let speedups = adaptive.repetition_speedups(&plain);
        for (got, want) in speedups.iter().zip([2.0, 1.25, 1.0]) {
            assert!((got - want).abs() < 1e-12, "{speedups:?}");
        }
        assert_eq!(spread(&speedups), "1.00-2.00");
        assert_eq!(spread(&speedups[..1]), "2.00");
        assert_eq!(spread(&[]), "-");
        // A baseline with fewer repetitions recorded bounds the comparison.
        let short = ModeResult {
            repetitions: phases(&[(100.0, 1.0)]),
            ..ModeResult::default()
        };
        assert_eq!(adaptive.repetition_speedups(&short).len(), 1);
    }

    #[test]
    fn odd_repetitions_run_the_modes_in_reverse() {
        assert_eq!(mode_order(3, 0), vec![0, 1, 2]);
        assert_eq!(mode_order(3, 1), vec![2, 1, 0]);
        assert_eq!(mode_order(3, 2), vec![0, 1, 2]);
        assert!(mode_order(0, 1).is_empty());
    }
}
