//! `specd bench load`: throughput and latency under concurrent sessions, through the real
//! services. For each verifier count it starts that many `verifier-svc` processes, one
//! `drafter-svc` and an `orchestrator` on loopback, then, mode by mode (plain, speculative),
//! keeps C streaming sessions in flight (closed loop) until every prompt of the `specd bench
//! spec` workloads has run at least once and each slot has run `--rounds` sessions
//! (max(C × rounds, prompts)). Reports aggregate tok/s, each session's decode rate (after its
//! first token), time to first token and inter-token latency (p50/p99) per (verifiers,
//! concurrency, mode), and the decode speed-up per workload, as tables, a plot ([`report`])
//! and a JSON file; with `--repetitions N` the modes run N times, alternating (in reverse on
//! odd repetitions), pooled per row; with `--control`, plain decoding runs a second time
//! among them, so each cell shows its own run-to-run noise. With `--unbatched-baseline`, a
//! second single-verifier stack runs with batching off (`--max-batch-tokens 1`: one job per
//! forward pass), plainly, its runs alternating with the batched verifier's, so batching's
//! gain is measured directly.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use specd_proto::v1 as pb;
use tonic_health::pb::health_check_response::ServingStatus;

mod report;
mod verifier_time;

use crate::bench_spec::{DEFAULT_WORKLOADS, Workloads, mode_order};

use report::{Row, plot, print_batching, print_table, print_workload_speedups};
use verifier_time::EngineTime;

#[derive(Debug, clap::Args)]
pub struct LoadBenchArgs {
    /// Concurrent sessions, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,4,16,64")]
    concurrency: Vec<usize>,
    /// Verifier process counts, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,3")]
    verifiers: Vec<usize>,
    /// Workloads whose prompts the sessions run, comma-separated (default: all of them).
    #[arg(long, value_delimiter = ',')]
    workloads: Vec<String>,
    /// Tokens generated per session.
    #[arg(long, default_value_t = 32)]
    max_tokens: u32,
    /// CPU threads per verifier process.
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// GGUF model (default: the default model, fetched once).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Directory holding verifier-svc, drafter-svc and orchestrator (default: this
    /// executable's).
    #[arg(long)]
    bin_dir: Option<PathBuf>,
    /// Where to write the JSON results.
    #[arg(long, default_value = "bench-out/load.json")]
    json_out: PathBuf,
    /// Where to write the plot (SVG): aggregate tok/s, its ratio to plain, ITL and TTFT per
    /// (verifiers, concurrency) cell and mode.
    #[arg(long, default_value = "bench-out/load.svg")]
    plot_out: PathBuf,
    /// The orchestrator's call deadline. Saturation is the point here: 64 prompts queued on
    /// one single-threaded verifier take longer than the production default of 30 s.
    #[arg(long, default_value_t = 300_000)]
    call_deadline_ms: u64,
    /// Also run plain decoding against one verifier with batching off (one job per forward
    /// pass), the baseline of the batching gain.
    #[arg(long)]
    unbatched_baseline: bool,
    /// Also run plain decoding a second time on the same stack (mode `plain-again`),
    /// alternating with the others: its ratio to plain is the run-to-run noise of each cell
    /// on this machine, to read speculation's ratio against.
    #[arg(long)]
    control: bool,
    /// The orchestrator answers prompt-lookup drafts itself (its --ngram-in-process) rather
    /// than calling the drafter process: measures what the drafter's round trip costs.
    #[arg(long)]
    ngram_in_process: bool,
    /// Runs of each (concurrency, mode), the modes alternating (reversed on odd
    /// repetitions), pooled into one row each: the machine's speed drifts less between
    /// neighbouring runs than across a whole table.
    #[arg(long, default_value_t = 1)]
    repetitions: usize,
    /// Sessions each concurrent slot runs, one after another: above 1 a run weighs the
    /// steady state more than its start (every session waiting for its prompt) and its tail
    /// (few sessions left).
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=100))]
    rounds: u32,
    /// Run the verifiers with --share-prefixes false: every session computes its whole
    /// prompt, as when each user's prompt is new, and no mode reuses another's prefill.
    /// Without it the workloads' prompts recur and mostly come from the verifiers' caches.
    #[arg(long)]
    no_prefix_sharing: bool,
}

/// A child process killed when dropped.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn free_port() -> anyhow::Result<u16> {
    Ok(specd_common::ports::free_local_port()?)
}

fn spawn(bin_dir: &Path, name: &str, port: u16, args: &[String], threads: usize) -> anyhow::Result<Proc> {
    let child = Command::new(bin_dir.join(name))
        .arg("--listen")
        .arg(format!("127.0.0.1:{port}"))
        .args(args)
        .env("SPECD_THREADS", threads.to_string())
        .env(
            "RUST_LOG",
            std::env::var("SPECD_BENCH_CHILD_LOG").unwrap_or_else(|_| "error".into()),
        )
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .with_context(|| format!("cannot start {}", bin_dir.join(name).display()))?;
    Ok(Proc(child))
}

async fn wait_serving(url: &str) -> anyhow::Result<()> {
    let started = Instant::now();
    let plain = specd_common::tls::TlsArgs::default();
    loop {
        let status = crate::ops::health_status(url, "", &plain, Duration::from_secs(2)).await;
        if status.is_ok_and(|s| s == ServingStatus::Serving as i32) {
            return Ok(());
        }
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(180),
            "{url} never became ready"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// One session's measurements.
struct Session {
    tokens: usize,
    ttft: Duration,
    /// From the first token to the last.
    decode: Duration,
    gaps: Vec<Duration>,
    stats: pb::SpeculationStats,
}

/// CPU seconds (user + system) a process has used, from /proc (Linux).
fn cpu_seconds(pid: u32) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return f64::NAN;
    };
    // Fields after the command name (which may hold spaces) start after the last ')'.
    let fields: Vec<&str> = stat.rsplit(')').next().unwrap_or("").split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<f64>().ok())
            .unwrap_or(f64::NAN)
    };
    // utime and stime are fields 14 and 15 of the line, 12 and 13 after the name.
    (ticks(11) + ticks(12)) / 100.0
}

async fn session(url: String, prompt: String, max_tokens: u32, speculate: bool) -> anyhow::Result<Session> {
    let mut client = specd_proto::OrchestratorClient::connect(url).await?;
    let request = pb::GenerateRequest {
        input: Some(pb::generate_request::Input::Chat(pb::ChatMessages {
            messages: vec![pb::ChatMessage {
                role: "user".into(),
                content: prompt,
            }],
        })),
        max_tokens,
        speculation: Some(pb::SpeculationOptions {
            disable: !speculate,
            ..Default::default()
        }),
        ..Default::default()
    };
    let started = Instant::now();
    let mut stream = client.generate_stream(request).await?.into_inner();
    let (mut tokens, mut ttft, mut last) = (0usize, None::<Duration>, started);
    let mut gaps = Vec::new();
    let mut stats = pb::SpeculationStats::default();
    while let Some(event) = stream.message().await? {
        if let Some(pb::generate_stream_response::Event::Done(done)) = &event.event {
            stats = done.stats.unwrap_or_default();
        }
        if let Some(pb::generate_stream_response::Event::Chunk(chunk)) = event.event {
            let n = chunk.token_ids.len();
            if n == 0 {
                continue;
            }
            let now = Instant::now();
            if ttft.is_none() {
                ttft = Some(now - started);
            } else {
                // Tokens of one chunk arrive together: each counts an equal share of the gap.
                let gap = (now - last) / n as u32;
                gaps.extend(std::iter::repeat_n(gap, n));
            }
            last = now;
            tokens += n;
        }
    }
    let ttft = ttft.unwrap_or_else(|| started.elapsed());
    Ok(Session {
        tokens,
        decode: (last - started).saturating_sub(ttft),
        ttft,
        gaps,
        stats,
    })
}

/// The benchmark's orchestrator and drafter processes, whose CPU time is read.
#[derive(Clone, Copy)]
struct Pids {
    orchestrator: u32,
    drafter: u32,
}

/// The services of one benchmark setup on loopback: `verifiers` verifier processes
/// (batching on or off), a drafter and an orchestrator, all killed when dropped.
struct Stack {
    url: String,
    pids: Pids,
    /// The verifiers' metrics pages (host:port), for their engine time.
    verifier_metrics: Vec<String>,
    _procs: Vec<Proc>,
}

impl Stack {
    async fn start(
        bin_dir: &Path,
        model: &str,
        verifiers: usize,
        batched: bool,
        args: &LoadBenchArgs,
        prompts: &[Prompt],
    ) -> anyhow::Result<Self> {
        let mut procs = Vec::new();
        let mut urls = Vec::new();
        let mut verifier_metrics = Vec::new();
        for _ in 0..verifiers {
            let port = free_port()?;
            let metrics = format!("127.0.0.1:{}", free_port()?);
            let mut verifier_args = vec![
                "--model".to_string(),
                model.to_string(),
                "--metrics-listen".into(),
                metrics.clone(),
            ];
            verifier_metrics.push(metrics);
            if !batched {
                verifier_args.extend(["--max-batch-tokens".to_string(), "1".to_string()]);
            }
            if args.no_prefix_sharing {
                verifier_args.extend(["--share-prefixes".to_string(), "false".to_string()]);
            }
            procs.push(spawn(
                bin_dir,
                "verifier-svc",
                port,
                &verifier_args,
                args.threads,
            )?);
            urls.push(format!("http://127.0.0.1:{port}"));
        }
        let drafter_port = free_port()?;
        procs.push(spawn(
            bin_dir,
            "drafter-svc",
            drafter_port,
            &["--model".into(), model.to_string()],
            1,
        )?);
        let drafter_url = format!("http://127.0.0.1:{drafter_port}");
        for url in urls.iter().chain([&drafter_url]) {
            wait_serving(url).await?;
        }
        let orchestrator_port = free_port()?;
        let mut orchestrator_args = vec![
            "--model".to_string(),
            model.to_string(),
            "--verifier".into(),
            urls.join(","),
            "--drafter".into(),
            drafter_url,
            "--no-auth".into(),
            "--max-concurrent-requests".into(),
            "1024".into(),
            "--call-deadline-ms".into(),
            args.call_deadline_ms.to_string(),
        ];
        if args.ngram_in_process {
            orchestrator_args.push("--ngram-in-process".into());
        }
        procs.push(spawn(
            bin_dir,
            "orchestrator",
            orchestrator_port,
            &orchestrator_args,
            1,
        )?);
        let url = format!("http://127.0.0.1:{orchestrator_port}");
        wait_serving(&url).await?;
        // Warm-up: page in weights on every replica.
        let warm: Vec<_> = (0..verifiers * 2)
            .map(|i| {
                let prompt = prompts[i % prompts.len()].text.clone();
                tokio::spawn(session(url.clone(), prompt, 4, true))
            })
            .collect();
        for w in warm {
            w.await??;
        }
        let pids = Pids {
            orchestrator: procs.last().expect("the orchestrator").0.id(),
            drafter: procs[verifiers].0.id(),
        };
        Ok(Self {
            url,
            pids,
            verifier_metrics,
            _procs: procs,
        })
    }
}

/// A bench prompt and the workload it belongs to.
#[derive(Clone)]
struct Prompt {
    workload: String,
    text: String,
}

/// One run: `concurrency` sessions in flight against the orchestrator at `url`, each
/// starting the next prompt when it ends, until max(concurrency × rounds, prompts) have run.
struct Load<'a> {
    url: &'a str,
    prompts: &'a [Prompt],
    concurrency: usize,
    rounds: usize,
    max_tokens: u32,
    speculate: bool,
}

impl Load<'_> {
    async fn run(&self, pids: Pids, verifier_metrics: &[String]) -> anyhow::Result<Tally> {
        let engine_before = EngineTime::read(verifier_metrics).await?;
        let cpu_before = (cpu_seconds(pids.orchestrator), cpu_seconds(pids.drafter));
        let started = Instant::now();
        let sessions = (self.concurrency * self.rounds).max(self.prompts.len());
        let next = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let workers: Vec<_> = (0..self.concurrency)
            .map(|_| {
                let (next, url, prompts) = (next.clone(), self.url.to_string(), self.prompts.to_vec());
                let (max_tokens, speculate) = (self.max_tokens, self.speculate);
                tokio::spawn(async move {
                    let mut done = Vec::new();
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        if i >= sessions {
                            return done;
                        }
                        let prompt = &prompts[i % prompts.len()];
                        let result = session(url.clone(), prompt.text.clone(), max_tokens, speculate).await;
                        done.push((prompt.workload.clone(), result));
                    }
                })
            })
            .collect();
        let mut tally = Tally::default();
        let mut results = Vec::new();
        for worker in workers {
            results.extend(worker.await?);
        }
        for (workload, result) in results {
            match result {
                Ok(s) => {
                    tally.tokens += s.tokens;
                    let per_workload = tally.workloads.entry(workload).or_default();
                    per_workload.0 += s.tokens.saturating_sub(1);
                    per_workload.1 += s.decode.as_secs_f64();
                    tally.ttfts.push(s.ttft);
                    tally.gaps.extend(s.gaps);
                    tally.steps += u64::from(s.stats.verifier_calls);
                    tally.drafter_calls += u64::from(s.stats.drafter_calls);
                    tally.bytes += s.stats.bytes_sent + s.stats.bytes_received;
                    tally.k_sum += s.stats.mean_k;
                    tally.proposed += u64::from(s.stats.proposed);
                    tally.accepted += u64::from(s.stats.accepted);
                    tally.batch_size_sum += s.stats.mean_batch_size * f64::from(s.stats.verifier_calls);
                    tally.verifier_queue_seconds += s.stats.verifier_queue_seconds;
                    tally.sessions += 1;
                }
                Err(error) => {
                    eprintln!("bench load: a session failed: {error:#}");
                    tally.failed += 1;
                }
            }
        }
        tally.seconds = started.elapsed().as_secs_f64();
        tally.orchestrator_cpu = cpu_seconds(pids.orchestrator) - cpu_before.0;
        tally.drafter_cpu = cpu_seconds(pids.drafter) - cpu_before.1;
        tally.engine = EngineTime::read(verifier_metrics).await?.since(engine_before);
        Ok(tally)
    }
}

/// Measurements of one or more runs of one (verifiers, concurrency, mode).
#[derive(Default)]
struct Tally {
    tokens: usize,
    seconds: f64,
    ttfts: Vec<Duration>,
    gaps: Vec<Duration>,
    /// Per workload: tokens after each session's first, and seconds after its first token.
    workloads: std::collections::BTreeMap<String, (usize, f64)>,
    failed: usize,
    sessions: usize,
    steps: u64,
    drafter_calls: u64,
    bytes: u64,
    k_sum: f64,
    proposed: u64,
    accepted: u64,
    orchestrator_cpu: f64,
    drafter_cpu: f64,
    batch_size_sum: f64,
    verifier_queue_seconds: f64,
    engine: EngineTime,
}

impl Tally {
    fn add(&mut self, run: Tally) {
        self.tokens += run.tokens;
        self.seconds += run.seconds;
        self.ttfts.extend(run.ttfts);
        self.gaps.extend(run.gaps);
        for (workload, (tokens, seconds)) in run.workloads {
            let mine = self.workloads.entry(workload).or_default();
            mine.0 += tokens;
            mine.1 += seconds;
        }
        self.failed += run.failed;
        self.sessions += run.sessions;
        self.steps += run.steps;
        self.drafter_calls += run.drafter_calls;
        self.bytes += run.bytes;
        self.k_sum += run.k_sum;
        self.proposed += run.proposed;
        self.accepted += run.accepted;
        self.orchestrator_cpu += run.orchestrator_cpu;
        self.drafter_cpu += run.drafter_cpu;
        self.batch_size_sum += run.batch_size_sum;
        self.verifier_queue_seconds += run.verifier_queue_seconds;
        self.engine.add(run.engine);
    }

    fn row(mut self, verifiers: usize, concurrency: usize, mode: &'static str) -> Row {
        let per = |total: f64, n: u64| if n == 0 { 0.0 } else { total / n as f64 };
        let (decode_tokens, decode_seconds) = self
            .workloads
            .values()
            .fold((0, 0.0), |(t, s), &(tokens, seconds)| (t + tokens, s + seconds));
        Row {
            session_decode_tokens_per_second: decode_tokens as f64 / decode_seconds,
            workload_decode_tokens_per_second: self
                .workloads
                .iter()
                .map(|(name, &(tokens, seconds))| (name.clone(), tokens as f64 / seconds))
                .collect(),
            orchestrator_cpu_ms_per_step: per(self.orchestrator_cpu * 1e3, self.steps),
            drafter_cpu_ms_per_call: per(self.drafter_cpu * 1e3, self.drafter_calls),
            bytes_per_step: per(self.bytes as f64, self.steps),
            mean_k: per(self.k_sum, self.sessions as u64),
            drafts_per_step: per(self.proposed as f64, self.steps),
            acceptance: per(self.accepted as f64, self.proposed),
            tokens_per_step: per(self.tokens as f64, self.steps),
            sequences_per_pass: per(self.batch_size_sum, self.steps),
            verifier_queue_ms_per_step: per(self.verifier_queue_seconds * 1e3, self.steps),
            verifier_time: self.engine.breakdown(self.seconds * verifiers as f64),
            verifiers,
            concurrency,
            mode,
            tokens: self.tokens,
            seconds: self.seconds,
            tokens_per_second: self.tokens as f64 / self.seconds,
            ttft_p50_ms: percentile_ms(&mut self.ttfts, 0.5),
            ttft_p99_ms: percentile_ms(&mut self.ttfts, 0.99),
            itl_p50_ms: percentile_ms(&mut self.gaps, 0.5),
            itl_p99_ms: percentile_ms(&mut self.gaps, 0.99),
            failed: self.failed,
        }
    }
}

fn percentile_ms(values: &mut [Duration], p: f64) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    values.sort();
    values[((values.len() - 1) as f64 * p).round() as usize].as_secs_f64() * 1e3
}

pub async fn run(args: LoadBenchArgs) -> anyhow::Result<()> {
    let bin_dir = match &args.bin_dir {
        Some(dir) => dir.clone(),
        None => std::env::current_exe()?
            .parent()
            .context("no executable directory")?
            .to_path_buf(),
    };
    let model = match &args.model {
        Some(path) => path.clone(),
        None => tokio::task::spawn_blocking(specd_model::fetch::ensure_default_model).await??,
    };
    let model = model.display().to_string();
    let workloads: Workloads = serde_json::from_str(DEFAULT_WORKLOADS)?;
    let mut prompts: Vec<Prompt> = Vec::new();
    let mut names = Vec::new();
    for workload in &workloads.workloads {
        let name = workload.name.as_str();
        names.push(name);
        if !args.workloads.is_empty() && !args.workloads.iter().any(|w| w == name) {
            continue;
        }
        prompts.extend(workload.prompts.iter().map(|text| Prompt {
            workload: name.to_string(),
            text: text.clone(),
        }));
    }
    if let Some(unknown) = args.workloads.iter().find(|w| !names.contains(&w.as_str())) {
        anyhow::bail!(
            "no workload is named {unknown:?}; the workloads are {}",
            names.join(", ")
        );
    }
    anyhow::ensure!(
        !args.unbatched_baseline || args.verifiers.contains(&1),
        "--unbatched-baseline is measured beside one batched verifier: include 1 in --verifiers"
    );
    let mut rows = Vec::new();
    for &verifier_count in &args.verifiers {
        // The modes share one stack: processes started at different times have run at
        // different speeds on the development VMs (by up to 25%, the later ones faster),
        // which would land in the ratios.
        // The baseline runs beside the batched verifier, its runs alternating with the
        // others', so the machine's drift weighs on both alike; the two stacks start together
        // so that neither is the older.
        let (batched, unbatched) = tokio::try_join!(
            Stack::start(&bin_dir, &model, verifier_count, true, &args, &prompts),
            async {
                if args.unbatched_baseline && verifier_count == 1 {
                    Stack::start(&bin_dir, &model, 1, false, &args, &prompts)
                        .await
                        .map(Some)
                } else {
                    Ok(None)
                }
            }
        )?;
        let mut modes: Vec<(&'static str, bool, &Stack)> =
            vec![("plain", false, &batched), ("speculative", true, &batched)];
        if args.control {
            modes.push(("plain-again", false, &batched));
        }
        if let Some(stack) = &unbatched {
            modes.push(("plain-unbatched", false, stack));
        }
        for &concurrency in &args.concurrency {
            let mut tallies: Vec<Tally> = modes.iter().map(|_| Tally::default()).collect();
            for repetition in 0..args.repetitions.max(1) {
                for i in mode_order(modes.len(), repetition) {
                    let ((mode, speculate, stack), tally) = (modes[i], &mut tallies[i]);
                    eprintln!(
                        "bench load: {verifier_count} verifier(s), {concurrency} sessions, {mode} ({}/{})",
                        repetition + 1,
                        args.repetitions.max(1)
                    );
                    let load = Load {
                        url: &stack.url,
                        prompts: &prompts,
                        concurrency,
                        rounds: args.rounds as usize,
                        max_tokens: args.max_tokens,
                        speculate,
                    };
                    tally.add(load.run(stack.pids, &stack.verifier_metrics).await?);
                }
            }
            for (&(mode, _, _), tally) in modes.iter().zip(tallies) {
                rows.push(tally.row(verifier_count, concurrency, mode));
            }
        }
    }
    print_table(&rows);
    print_workload_speedups(&rows);
    print_batching(&rows);
    if let Some(parent) = args.json_out.parent() {
        std::fs::create_dir_all(parent)?;
    }
    std::fs::write(&args.json_out, serde_json::to_string_pretty(&rows)?)?;
    eprintln!("wrote {}", args.json_out.display());
    plot(&args.plot_out, &rows)?;
    eprintln!("wrote {}", args.plot_out.display());
    Ok(())
}
