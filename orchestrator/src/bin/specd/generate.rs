//! `specd generate`: builds a `GenerateRequest` from flags, runs it all-in-one or against an
//! orchestrator, streams text to stdout and prints a summary to stderr (or one JSON object
//! with `--json`).

use std::io::Write;

use anyhow::Context;
use specd_common::model_args::ModelArgs;
use specd_orchestrator::setup::{GeneratorSettings, in_process};
use specd_proto::OrchestratorClient;
use specd_proto::v1 as pb;

#[derive(Debug, clap::Args)]
pub struct GenerateArgs {
    /// Raw prompt text; special tokens such as <|im_start|> are recognised.
    #[arg(long, conflicts_with_all = ["user", "system"])]
    prompt: Option<String>,
    /// A user message, formatted with the model's chat template.
    #[arg(long)]
    user: Option<String>,
    /// A system message before the user message.
    #[arg(long, requires = "user")]
    system: Option<String>,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 128)]
    max_tokens: u32,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Keep the k most likely tokens (0: off).
    #[arg(long, default_value_t = 0)]
    top_k: u32,
    /// Nucleus sampling mass (1: off).
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Random seed for sampling.
    #[arg(long)]
    seed: Option<u64>,
    /// Stop when this text appears (repeatable).
    #[arg(long)]
    stop: Vec<String>,
    /// Decode plainly, without speculation.
    #[arg(long)]
    no_speculation: bool,
    /// Most draft tokens per step (K adapts within it).
    #[arg(long, default_value_t = 8)]
    max_k: u32,
    /// Verify exactly max-k drafts whenever the drafter has them, instead of adapting K.
    #[arg(long)]
    fixed_k: bool,
    /// Drafter: ngram (prompt lookup) or lm (a language model drafter).
    #[arg(long, default_value = "ngram", value_parser = ["ngram", "lm"])]
    drafter: String,
    /// Prompt lookup's settings when running all-in-one.
    #[command(flatten)]
    ngram: specd_drafter::NgramArgs,
    /// Continue this session (its id is printed in the summary and the JSON).
    #[arg(long)]
    session: Option<String>,
    /// Print one JSON object (text, token_ids, finish_reason, usage, stats) instead of text.
    #[arg(long)]
    json: bool,
    /// Use a running orchestrator (e.g. http://127.0.0.1:50050) instead of running all-in-one.
    #[arg(long, env = "SPECD_ORCHESTRATOR")]
    orchestrator: Option<String>,
    /// API key for the orchestrator (sent as `authorization: Bearer KEY`).
    #[arg(long, env = "SPECD_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// TLS towards the orchestrator (an https:// URL): the CA to trust, and optionally a
    /// client certificate.
    #[command(flatten)]
    tls: specd_common::tls::TlsArgs,
    #[command(flatten)]
    pub model: ModelArgs,
}

impl GenerateArgs {
    fn request(&self) -> anyhow::Result<pb::GenerateRequest> {
        let input = match (&self.prompt, &self.user) {
            (Some(p), _) => pb::generate_request::Input::Prompt(p.clone()),
            (None, Some(user)) => {
                let mut messages = Vec::new();
                if let Some(system) = &self.system {
                    messages.push(pb::ChatMessage {
                        role: "system".into(),
                        content: system.clone(),
                    });
                }
                messages.push(pb::ChatMessage {
                    role: "user".into(),
                    content: user.clone(),
                });
                pb::generate_request::Input::Chat(pb::ChatMessages { messages })
            }
            (None, None) => anyhow::bail!("give --prompt TEXT or --user TEXT"),
        };
        Ok(pb::GenerateRequest {
            input: Some(input),
            max_tokens: self.max_tokens,
            stop: self.stop.clone(),
            sampling: Some(pb::SamplingParams {
                temperature: self.temperature,
                top_k: self.top_k,
                top_p: self.top_p,
            }),
            seed: self.seed,
            speculation: Some(pb::SpeculationOptions {
                disable: self.no_speculation,
                max_k: self.max_k,
                drafter: if self.drafter == "lm" {
                    pb::DrafterKind::Lm
                } else {
                    pb::DrafterKind::Ngram
                } as i32,
                fixed_k: self.fixed_k,
            }),
            session_id: self.session.clone().unwrap_or_default(),
        })
    }
}

pub async fn run(args: GenerateArgs) -> anyhow::Result<()> {
    let request = args.request()?;
    let (chunks_tx, mut chunks_rx) = tokio::sync::mpsc::channel::<pb::TokenChunk>(64);
    let print = !args.json;
    let printer = tokio::spawn(async move {
        let mut stdout = std::io::stdout();
        while let Some(chunk) = chunks_rx.recv().await {
            if print {
                let _ = stdout.write_all(chunk.text.as_bytes());
                let _ = stdout.flush();
            }
        }
    });
    let response = match &args.orchestrator {
        Some(url) => remote_generate(url, args.api_key.as_deref(), &args.tls, request, chunks_tx).await?,
        None => {
            let model = args.model.clone();
            let loaded = tokio::task::spawn_blocking(move || model.load())
                .await?
                .context("cannot load the model")?;
            let settings = GeneratorSettings {
                ngram: args.ngram.config(),
                ..GeneratorSettings::default()
            };
            let generator = in_process(loaded, settings);
            let result = generator.generate(&request, Some(&chunks_tx)).await;
            drop(chunks_tx);
            result.map_err(|e| anyhow::anyhow!(tonic::Status::from(e).message().to_string()))?
        }
    };
    printer.await?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&response_json(&response))?);
    } else {
        println!();
        eprintln!("{}", summary(&response));
    }
    Ok(())
}

async fn remote_generate(
    url: &str,
    api_key: Option<&str>,
    tls: &specd_common::tls::TlsArgs,
    request: pb::GenerateRequest,
    chunks: tokio::sync::mpsc::Sender<pb::TokenChunk>,
) -> anyhow::Result<pb::GenerateResponse> {
    let mut client = OrchestratorClient::new(
        crate::ops::connect(url, tls, std::time::Duration::from_secs(10))
            .await
            .with_context(|| format!("cannot reach the orchestrator at {url}"))?,
    );
    let mut stream = client
        .generate_stream(crate::ops::authorized(request, api_key)?)
        .await?
        .into_inner();
    while let Some(event) = stream.message().await? {
        match event.event {
            Some(pb::generate_stream_response::Event::Chunk(chunk)) => {
                let _ = chunks.send(chunk).await;
            }
            Some(pb::generate_stream_response::Event::Done(done)) => return Ok(done),
            None => {}
        }
    }
    anyhow::bail!("the orchestrator closed the stream without a result")
}

fn finish_reason(code: i32) -> &'static str {
    match pb::FinishReason::try_from(code) {
        Ok(pb::FinishReason::Length) => "length",
        Ok(pb::FinishReason::Eos) => "eos",
        Ok(pb::FinishReason::Stop) => "stop",
        _ => "cancelled",
    }
}

fn summary(r: &pb::GenerateResponse) -> String {
    let s = r.stats.unwrap_or_default();
    format!(
        "[{} tokens, {:.1} tok/s, finish: {}; verifier calls {}, drafted {} accepted {} ({:.0}%), {:.2} tokens/call; session {}]",
        r.token_ids.len(),
        s.tokens_per_second,
        finish_reason(r.finish_reason),
        s.verifier_calls,
        s.proposed,
        s.accepted,
        100.0 * s.acceptance_rate,
        s.mean_accepted_length,
        r.session_id
    )
}

fn response_json(r: &pb::GenerateResponse) -> serde_json::Value {
    let s = r.stats.unwrap_or_default();
    let u = r.usage.unwrap_or_default();
    serde_json::json!({
        "text": r.text,
        "token_ids": r.token_ids,
        "finish_reason": finish_reason(r.finish_reason),
        "session_id": r.session_id,
        "usage": {
            "prompt_tokens": u.prompt_tokens,
            "completion_tokens": u.completion_tokens,
            "context_tokens": u.context_tokens,
        },
        "stats": {
            "tokens_per_second": s.tokens_per_second,
            "decode_seconds": s.decode_seconds,
            "time_to_first_token_seconds": s.time_to_first_token_seconds,
            "proposed": s.proposed,
            "accepted": s.accepted,
            "acceptance_rate": s.acceptance_rate,
            "verifier_calls": s.verifier_calls,
            "drafter_calls": s.drafter_calls,
            "mean_accepted_length": s.mean_accepted_length,
            "mean_k": s.mean_k,
            "bytes_sent": s.bytes_sent,
            "bytes_received": s.bytes_received,
            "draft_seconds": s.draft_seconds,
            "verify_seconds": s.verify_seconds,
            "mean_batch_size": s.mean_batch_size,
            "verifier_queue_seconds": s.verifier_queue_seconds,
            "verifier_forward_seconds": s.verifier_forward_seconds,
            "decode_forward_seconds": s.decode_forward_seconds,
            "decode_draft_seconds": s.decode_draft_seconds,
            "decode_verify_seconds": s.decode_verify_seconds,
            "retries": s.retries,
            "failovers": s.failovers,
        },
    })
}
