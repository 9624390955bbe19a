//! `specd`: the command line. `specd generate` runs speculative generation — all-in-one in
//! this process by default (the same drafter, verifier and orchestrator code the services
//! run), or against a running orchestrator with `--orchestrator URL`. `specd bench` measures
//! the engine and speculation; `specd fetch-model` fetches the default model; `specd health`,
//! `specd replicas` and `specd trace-sink` help operate a deployment.

mod bench_aftermath;
mod bench_batching;
mod bench_cap;
mod bench_engine;
mod bench_load;
mod bench_profile;
mod bench_replay;
mod bench_spec;
mod generate;
mod ops;
mod plot;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "specd",
    version,
    about = "Distributed speculative decoding for llama-family GGUF models"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Generate text (speculative by default).
    Generate(Box<generate::GenerateArgs>),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Fetch the default model into the model cache and print its path.
    FetchModel,
    /// Ask a service's gRPC health; exit 0 when SERVING (for container health checks).
    Health(ops::HealthArgs),
    /// Show the orchestrator's verifier pool: health, breakers, load, sessions.
    Replicas(ops::ReplicasArgs),
    /// Receive OTLP/gRPC spans and print them (a stand-in for Jaeger).
    TraceSink(ops::TraceSinkArgs),
    /// Print an API key's SHA-256, the form the orchestrator's key file stores.
    HashKey(ops::HashKeyArgs),
    /// Make a development CA and TLS certificates for the services.
    DevCerts(ops::DevCertsArgs),
}

#[derive(Debug, Subcommand)]
enum BenchCommand {
    /// Engine speed: decode, prompt processing and the cost of scoring n tokens in one pass,
    /// beside llama.cpp on the same model when its tools are given.
    Engine(bench_engine::EngineBenchArgs),
    /// Speculative vs plain decoding through the same stack, per workload.
    Spec(bench_spec::SpecBenchArgs),
    /// Throughput and latency under concurrent sessions, through real service processes.
    Load(bench_load::LoadBenchArgs),
    /// `bench spec`'s cap and K-policy replays again, offline, from the JSON a run wrote
    /// (to price a drafter setting or a policy change on the same outputs and pass curve).
    Replay(bench_replay::ReplayBenchArgs),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Command::Generate(args) => {
            args.model.apply_threads();
            specd_common::telemetry::init_logging();
            runtime()?.block_on(generate::run(*args))
        }
        Command::Bench(BenchCommand::Engine(args)) => {
            args.model.apply_threads();
            bench_engine::run(args)
        }
        Command::Bench(BenchCommand::Load(args)) => {
            specd_common::telemetry::init_logging();
            runtime()?.block_on(bench_load::run(args))
        }
        Command::Bench(BenchCommand::Spec(args)) => {
            args.model.apply_threads();
            specd_common::telemetry::init_logging();
            runtime()?.block_on(bench_spec::run(args))
        }
        Command::Bench(BenchCommand::Replay(args)) => bench_replay::run(args),
        Command::Health(args) => runtime()?.block_on(ops::health(args)),
        Command::Replicas(args) => runtime()?.block_on(ops::replicas(args)),
        Command::TraceSink(args) => runtime()?.block_on(ops::trace_sink(args)),
        Command::HashKey(args) => ops::hash_key(args),
        Command::DevCerts(args) => ops::dev_certs(args),
        Command::FetchModel => {
            println!("{}", specd_model::fetch::ensure_default_model()?.display());
            Ok(())
        }
    }
}

fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread().enable_all().build()
}
