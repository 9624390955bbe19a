//! `specd bench engine`: plain decode tok/s, 64-token prompt processing tok/s, and the cost
//! of scoring n tokens in one pass (after `--depth` tokens of context, 64 by default) relative to n = 1 — the curve
//! that decides whether speculation pays, and how much a pass of several tokens slows the
//! one-token pass after it (`bench_aftermath`). With `--llama-cpp DIR` (llama.cpp's build/bin),
//! `llama-bench` runs on the same GGUF and thread count in the same run, and both print side
//! by side. Medians of repeated runs.

use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

use anyhow::Context;
use specd_common::model_args::ModelArgs;
use specd_model::{Engine, ScoreRequest, argmax};

#[derive(Debug, clap::Args)]
pub struct EngineBenchArgs {
    /// llama.cpp's bin folder (with llama-bench), to measure it in the same run.
    #[arg(long, env = "SPECD_LLAMA_CPP_BIN")]
    llama_cpp: Option<PathBuf>,
    /// Repetitions per measurement (the median is reported).
    #[arg(long, default_value_t = 5)]
    repetitions: usize,
    /// Tokens decoded for the decode measurement.
    #[arg(long, default_value_t = 64)]
    decode_tokens: usize,
    /// Write the results as JSON here too.
    #[arg(long)]
    json_out: Option<PathBuf>,
    /// Also print where a forward pass's time goes, by phase.
    #[arg(long)]
    profile: bool,
    /// Tokens scored in one pass for the profile's second column.
    #[arg(long, default_value_t = 8)]
    profile_rows: usize,
    /// Context already cached before the scored tokens of the pass-cost curve and the
    /// profile (speculative steps in real workloads run at a few hundred).
    #[arg(long, default_value_t = 64)]
    depth: usize,
    /// Also measure this many sessions decoding at once, batched against one job per
    /// forward pass, and with `--profile` profile their batched passes (0: skip).
    #[arg(long, default_value_t = 16)]
    sessions: usize,
    /// Also measure how much a pass of this many tokens slows the one-token pass after it
    /// (0: skip).
    #[arg(long, default_value_t = 8)]
    after_rows: usize,
    #[command(flatten)]
    pub model: ModelArgs,
}

const PASS_SIZES: [usize; 13] = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 14, 16];
const PROMPT: usize = 64;

#[derive(Debug, Default, serde::Serialize)]
struct Figures {
    decode_tok_s: f64,
    prompt64_tok_s: f64,
    /// Seconds of one pass over n tokens at `--depth`, for each n in PASS_SIZES.
    pass_seconds: Vec<(usize, f64)>,
}

/// One greedy decode step of `sequence`: scores `context` and appends the next token.
pub(crate) fn greedy_step(engine: &Engine, sequence: &str, context: &mut Vec<u32>) -> anyhow::Result<()> {
    let scores = engine.score_blocking(ScoreRequest {
        sequence: sequence.into(),
        logits_from: context.len() - 1,
        context: context.clone(),
    })?;
    context.push(argmax(scores.row(0)));
    Ok(())
}

pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// `n` arbitrary but fixed ids spread over the vocabulary, from a stream at `offset`: streams
/// at offsets far apart share no prefix, so the engine cannot copy one sequence's cache into
/// another instead of computing it.
pub(crate) fn tokens(offset: usize, n: usize, vocab: usize) -> Vec<u32> {
    (offset..offset + n)
        .map(|i| ((i * 7919 + 13) % vocab) as u32)
        .collect()
}

/// Session `session`'s stream of `n` tokens (see [`tokens`]): sessions' streams share no
/// prefix with each other or with the streams above.
pub(crate) fn session_tokens(session: usize, n: usize, vocab: usize) -> Vec<u32> {
    tokens(1_000_000 + 100_000 * session, n, vocab)
}

pub(crate) fn time_pass(
    engine: &Engine,
    sequence: &str,
    context: &[u32],
    logits_from: usize,
) -> anyhow::Result<f64> {
    let started = Instant::now();
    engine.score_blocking(ScoreRequest {
        sequence: sequence.into(),
        context: context.to_vec(),
        logits_from,
    })?;
    Ok(started.elapsed().as_secs_f64())
}

/// How long one-token passes run, untimed, after the pass that builds the curve's context,
/// and how many run before each timed pass. The pass after a heavy one runs slow: after the
/// context's prompt pass by up to 1.5× for tens of milliseconds, after a 16-token pass by
/// about 15% for a few passes (measured on this project's CPU machines, with and without
/// AMX: weights left unread, through an idle gap or a long pass, go cold in a shared L3;
/// `--after-rows` measures it, see `bench_aftermath` and docs/SCALING-RUNS.md). In a live stream most passes are one-token passes, so that is what each
/// timed pass follows.
const CURVE_SETTLE_SECONDS: f64 = 0.2;
const CURVE_LEAD_PASSES: usize = 3;

/// Seconds of a pass scoring n tokens after `depth` cached ones, logits at all n (as
/// verification needs), for each n in `sizes`: the median of `reps` passes, each after
/// [`CURVE_LEAD_PASSES`] one-token passes, the sizes taking turns ([`round_robin`]).
/// Measured one size after another, the slow passes after the context's prompt pass all
/// fell on the first size, the one-token pass every ratio is relative to, and the curve
/// read flatter than the passes of a live stream.
pub(crate) fn pass_curve(
    engine: &Engine,
    depth: usize,
    sizes: &[usize],
    reps: usize,
) -> anyhow::Result<Vec<(usize, f64)>> {
    let vocab = engine.info().vocab_size;
    let depth = depth.max(1);
    let most = sizes.iter().copied().max().unwrap_or(1);
    let base = tokens(100_000, depth + most, vocab);
    let pass = |n: usize| time_pass(engine, "depth", &base[..depth + n], depth);
    time_pass(engine, "depth", &base[..depth], depth - 1)?;
    let settle = Instant::now();
    while settle.elapsed().as_secs_f64() < CURVE_SETTLE_SECONDS {
        pass(1)?;
    }
    let mut times = vec![Vec::new(); sizes.len()];
    for index in round_robin(sizes.len(), reps.max(1)) {
        for _ in 0..CURVE_LEAD_PASSES {
            pass(1)?;
        }
        times[index].push(pass(sizes[index])?);
    }
    engine.release("depth");
    Ok(sizes.iter().copied().zip(times.into_iter().map(median)).collect())
}

/// The order of `rounds` rounds over `count` items: every item once per round, round r
/// starting at item r, so no item always follows the same one or always comes first.
fn round_robin(count: usize, rounds: usize) -> Vec<usize> {
    (0..rounds)
        .flat_map(|round| (0..count).map(move |i| (round + i) % count))
        .collect()
}

fn measure_ours(engine: &Engine, args: &EngineBenchArgs) -> anyhow::Result<Figures> {
    let vocab = engine.info().vocab_size;
    let reps = args.repetitions.max(1);
    // Warm-up.
    time_pass(engine, "warm", &tokens(0, 16, vocab), 0)?;
    // Prompt processing: a fresh sequence and prompt each time, logits for the last position.
    let pp: Vec<f64> = (0..reps)
        .map(|r| {
            time_pass(
                engine,
                &format!("pp-{r}"),
                &tokens(1000 * (r + 1), PROMPT, vocab),
                PROMPT - 1,
            )
        })
        .collect::<anyhow::Result<_>>()?;
    let pass_seconds = pass_curve(engine, args.depth, &PASS_SIZES, reps)?;
    // Decode: one token per pass, greedy, after a 16-token prompt.
    let mut decode = Vec::new();
    for r in 0..reps.min(3) {
        let sequence = format!("decode-{r}");
        let mut context = tokens(200_000 + 1000 * r, 16, vocab);
        let started = Instant::now();
        for _ in 0..args.decode_tokens {
            greedy_step(engine, &sequence, &mut context)?;
        }
        decode.push(args.decode_tokens as f64 / started.elapsed().as_secs_f64());
        engine.release(&sequence);
    }
    Ok(Figures {
        decode_tok_s: median(decode),
        prompt64_tok_s: PROMPT as f64 / median(pp),
        pass_seconds,
    })
}

#[derive(serde::Deserialize)]
struct LlamaBenchRow {
    n_prompt: usize,
    n_gen: usize,
    avg_ns: f64,
    avg_ts: f64,
}

fn measure_llama_cpp(
    bin: &std::path::Path,
    model: &std::path::Path,
    threads: usize,
    args: &EngineBenchArgs,
) -> anyhow::Result<Figures> {
    let sizes: Vec<String> = PASS_SIZES.iter().map(|n| n.to_string()).collect();
    let run = |prompts: &str, depth: usize, generate: usize| -> anyhow::Result<Vec<LlamaBenchRow>> {
        let rows = run_llama_bench(bin, model, threads, args, prompts, depth, generate, &[]);
        if rows.is_ok() || prompts == "0" {
            return rows;
        }
        // On some CPUs llama.cpp's repacked weight layout crashes on multi-token batches
        // (seen on an AVX-512 + AMX machine); measure those without it and say so.
        eprintln!("llama-bench failed on prompt sizes {prompts}; measuring them with --repack 0");
        run_llama_bench(bin, model, threads, args, prompts, depth, 0, &["--repack", "0"])
    };
    let passes = run(&sizes.join(","), args.depth, 0)?;
    let decode = run("0", 0, args.decode_tokens)?;
    let pp = run(&PROMPT.to_string(), 0, 0)?;
    Ok(Figures {
        decode_tok_s: decode.iter().find(|r| r.n_gen > 0).map_or(0.0, |r| r.avg_ts),
        prompt64_tok_s: pp.iter().find(|r| r.n_prompt == PROMPT).map_or(0.0, |r| r.avg_ts),
        pass_seconds: passes
            .iter()
            .filter(|r| r.n_prompt > 0)
            .map(|r| (r.n_prompt, r.avg_ns * 1e-9))
            .collect(),
    })
}

#[allow(clippy::too_many_arguments)]
fn run_llama_bench(
    bin: &std::path::Path,
    model: &std::path::Path,
    threads: usize,
    args: &EngineBenchArgs,
    prompts: &str,
    depth: usize,
    generate: usize,
    extra: &[&str],
) -> anyhow::Result<Vec<LlamaBenchRow>> {
    let output = Command::new(bin.join("llama-bench"))
        .env("LD_LIBRARY_PATH", bin)
        .args([
            "-m",
            &model.to_string_lossy(),
            "-t",
            &threads.to_string(),
            "-p",
            prompts,
        ])
        .args(["-n", &generate.to_string(), "-d", &depth.to_string()])
        .args(["-r", &args.repetitions.max(1).to_string(), "-o", "json"])
        .args(extra)
        .output()
        .with_context(|| format!("cannot run {}", bin.join("llama-bench").display()))?;
    anyhow::ensure!(
        output.status.success(),
        "llama-bench failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(serde_json::from_slice(&output.stdout)?)
}

pub fn run(args: EngineBenchArgs) -> anyhow::Result<()> {
    let path = args.model.resolve_path()?;
    let loaded = specd_model::load(&path, args.model.engine_options())?;
    let threads = if args.model.threads == 0 {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    } else {
        args.model.threads
    };
    eprintln!(
        "specd bench engine: {} on {} thread(s), {} repetitions",
        path.display(),
        threads,
        args.repetitions
    );
    let ours = measure_ours(&loaded.engine, &args)?;
    let theirs = match &args.llama_cpp {
        Some(bin) => Some(measure_llama_cpp(bin, &path, threads, &args)?),
        None => None,
    };
    let profile = if args.profile {
        Some(crate::bench_profile::measure(
            &loaded.engine,
            args.depth.max(1),
            args.profile_rows,
            args.sessions,
        )?)
    } else {
        None
    };
    let batching = if args.sessions > 0 {
        Some(crate::bench_batching::measure(&loaded.engine, args.sessions, 32)?)
    } else {
        None
    };
    let aftermath = if args.after_rows > 0 {
        Some(crate::bench_aftermath::measure(
            &loaded.engine,
            args.depth,
            args.after_rows,
            args.repetitions,
        )?)
    } else {
        None
    };
    print_table(&ours, theirs.as_ref(), args.depth);
    println!("kernels: {}", specd_model::kernels::Kernel::detect().name());
    if let Some(batching) = &batching {
        crate::bench_batching::print(batching);
    }
    if let Some(aftermath) = &aftermath {
        crate::bench_aftermath::print(aftermath);
    }
    if let Some(profile) = &profile {
        crate::bench_profile::print(profile);
    }
    if let Some(out) = &args.json_out {
        let json = serde_json::json!({
            "model": path, "threads": threads, "kernels": specd_model::kernels::Kernel::detect().name(),
            "specd": ours, "llama_cpp": theirs, "profile": profile, "batching": batching,
            "aftermath": aftermath,
        });
        std::fs::write(out, serde_json::to_string_pretty(&json)?)?;
    }
    Ok(())
}

fn print_table(ours: &Figures, theirs: Option<&Figures>, depth: usize) {
    let col = |f: Option<&Figures>, get: &dyn Fn(&Figures) -> f64| {
        f.map_or("-".to_string(), |f| format!("{:.1}", get(f)))
    };
    let ratio = |get: &dyn Fn(&Figures) -> f64| {
        theirs.map_or("-".to_string(), |t| format!("{:.2}", get(ours) / get(t)))
    };
    println!(
        "{:<34} {:>10} {:>10} {:>8}",
        "metric", "specd", "llama.cpp", "ratio"
    );
    type Getter<'a> = &'a dyn Fn(&Figures) -> f64;
    let rows: [(&str, Getter); 2] = [
        ("decode tok/s", &|f| f.decode_tok_s),
        ("prompt processing (64) tok/s", &|f| f.prompt64_tok_s),
    ];
    for (name, get) in rows {
        println!(
            "{name:<34} {:>10} {:>10} {:>8}",
            col(Some(ours), get),
            col(theirs, get),
            ratio(get)
        );
    }
    let one = |f: &Figures| f.pass_seconds.first().map_or(1.0, |p| p.1);
    for (i, &(n, seconds)) in ours.pass_seconds.iter().enumerate() {
        let theirs_rel = theirs.and_then(|t| t.pass_seconds.get(i).map(|p| p.1 / one(t)));
        println!(
            "{:<34} {:>10} {:>10} {:>8}",
            format!("pass of {n} at depth {depth}: ms (x n=1)"),
            format!("{:.2} (x{:.2})", seconds * 1e3, seconds / one(ours)),
            theirs_rel.map_or("-".into(), |r| format!("x{r:.2}")),
            "",
        );
    }
}

#[cfg(test)]
mod tests {
    use super::round_robin;

    #[test]
    fn round_robin_measures_every_size_each_round_and_rotates_the_start() {
        let order = round_robin(3, 4);
        assert_eq!(order, vec![0, 1, 2, 1, 2, 0, 2, 0, 1, 0, 1, 2]);
        for item in 0..3 {
            assert_eq!(order.iter().filter(|&&i| i == item).count(), 4);
        }
        assert!(round_robin(0, 3).is_empty());
    }
}
