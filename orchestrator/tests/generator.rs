//! The generator on a tiny random model, in-process: sessions survive failures unchanged,
//! failed requests leave no session behind, continuations extend the context, stop strings
//! and max_tokens end generation, and greedy speculation equals plain decoding.

use std::sync::Arc;

use specd_model::synthetic::{SyntheticSpec, write_tiny_llama};
use specd_model::{EngineOptions, LoadedModel};
use specd_orchestrator::setup::{GeneratorSettings, in_process};
use specd_orchestrator::{Generator, OrchestratorError};
use specd_proto::v1 as pb;

fn generator(context_length: usize) -> (tempfile::TempDir, Arc<Generator>) {
    generator_with(context_length, GeneratorSettings::default())
}

fn generator_with(context_length: usize, settings: GeneratorSettings) -> (tempfile::TempDir, Arc<Generator>) {
    generator_on(context_length, settings, EngineOptions::default())
}

fn generator_on(
    context_length: usize,
    settings: GeneratorSettings,
    options: EngineOptions,
) -> (tempfile::TempDir, Arc<Generator>) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.gguf");
    write_tiny_llama(
        &path,
        &SyntheticSpec {
            context_length,
            ..SyntheticSpec::default()
        },
    )
    .unwrap();
    let loaded: LoadedModel = specd_model::load(&path, options).unwrap();
    (dir, Arc::new(in_process(loaded, settings)))
}

fn prompt(text: &str, max_tokens: u32) -> pb::GenerateRequest {
    pb::GenerateRequest {
        input: Some(pb::generate_request::Input::Prompt(text.into())),
        max_tokens,
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn failed_requests_leave_no_session_and_keep_existing_ones_intact() {
    let (_dir, generator) = generator(64);
    let too_long = prompt(&"the ".repeat(100), 4);
    assert!(matches!(
        generator.generate(&too_long, None).await,
        Err(OrchestratorError::InvalidArgument(_))
    ));
    assert!(generator.sessions.is_empty());

    let first = generator.generate(&prompt("the", 4), None).await.unwrap();
    let context = first.usage.unwrap().context_tokens;
    let mut overflow = prompt(&"the ".repeat(100), 4);
    overflow.session_id = first.session_id.clone();
    assert!(generator.generate(&overflow, None).await.is_err());
    assert_eq!(generator.sessions.len(), 1, "the existing session stays");
    let mut next = prompt(" in", 4);
    next.session_id = first.session_id.clone();
    let second = generator.generate(&next, None).await.unwrap();
    assert!(
        second.usage.unwrap().context_tokens > context,
        "the failed request changed nothing"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn max_tokens_and_stop_strings_end_generation() {
    let (_dir, generator) = generator(512);
    // A random model may end at once; take the first prompt it continues for 7 tokens.
    let mut found = None;
    for text in ["the", "in", "a", "er", "x", "q", "7"] {
        let out = generator.generate(&prompt(text, 7), None).await.unwrap();
        if out.finish_reason == pb::FinishReason::Length as i32 && !out.text.is_empty() {
            found = Some((text, out));
            break;
        }
    }
    let (text, out) = found.expect("some prompt runs to max_tokens");
    assert_eq!(out.token_ids.len(), 7);
    // Stop at the first character the model produced: the text before it is empty.
    let first_char = out.text.chars().next().unwrap().to_string();
    let mut stopped = prompt(text, 7);
    stopped.stop = vec![first_char];
    let out = generator.generate(&stopped, None).await.unwrap();
    assert_eq!(out.finish_reason, pb::FinishReason::Stop as i32);
    assert_eq!(out.text, "");
}

#[tokio::test(flavor = "multi_thread")]
async fn greedy_speculation_equals_plain_on_a_tiny_model() {
    let (_dir, generator) = generator(512);
    let plain = pb::GenerateRequest {
        speculation: Some(pb::SpeculationOptions {
            disable: true,
            ..Default::default()
        }),
        ..prompt("the the in the in", 24)
    };
    let expected = generator.generate(&plain, None).await.unwrap().token_ids;
    for drafter in [pb::DrafterKind::Ngram, pb::DrafterKind::Lm] {
        for k in [1, 3, 8] {
            let spec = pb::GenerateRequest {
                speculation: Some(pb::SpeculationOptions {
                    max_k: k,
                    drafter: drafter as i32,
                    fixed_k: true,
                    disable: false,
                }),
                ..prompt("the the in the in", 24)
            };
            assert_eq!(
                generator.generate(&spec, None).await.unwrap().token_ids,
                expected,
                "{drafter:?} K {k}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn requests_over_the_concurrency_limit_are_refused_at_once() {
    let (_dir, generator) = generator_with(
        256,
        GeneratorSettings {
            max_concurrent_requests: 1,
            ..GeneratorSettings::default()
        },
    );
    // A random model may end at once; take a prompt it continues for 64 tokens.
    let mut long = None;
    for text in ["the", "in", "a", "er", "x", "q", "7"] {
        let out = generator.generate(&prompt(text, 64), None).await.unwrap();
        if out.token_ids.len() == 64 {
            long = Some(text);
            break;
        }
    }
    let long = long.expect("some prompt runs to max_tokens");
    // A streaming request whose client does not read holds the only slot.
    let (tx, mut rx) = tokio::sync::mpsc::channel(1);
    let holder = {
        let generator = generator.clone();
        tokio::spawn(async move { generator.generate(&prompt(long, 64), Some(&tx)).await })
    };
    let Some(first_chunk) = rx.recv().await else {
        panic!("the first request ended: {:?}", holder.await);
    };
    assert!(!first_chunk.token_ids.is_empty());
    let started = std::time::Instant::now();
    let refused = generator.generate(&prompt("the", 4), None).await;
    assert!(
        matches!(&refused, Err(OrchestratorError::ResourceExhausted(m)) if m.contains("limit of 1 requests")),
        "{refused:?}"
    );
    assert!(
        started.elapsed() < std::time::Duration::from_secs(1),
        "refused by a timeout"
    );
    // Once the first finishes, the slot is free again.
    while rx.recv().await.is_some() {}
    holder.await.unwrap().unwrap();
    generator.generate(&prompt("the", 4), None).await.unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn stats_report_the_verifier_passes_a_request_shared() {
    // Each pass waits up to 100 ms for company, so two identical requests (same steps)
    // share every pass; a lone request has every pass to itself.
    let options = EngineOptions {
        batch_wait: std::time::Duration::from_millis(100),
        ..EngineOptions::default()
    };
    let (_dir, generator) = generator_on(256, GeneratorSettings::default(), options);
    let request = pb::GenerateRequest {
        speculation: Some(pb::SpeculationOptions {
            disable: true,
            ..Default::default()
        }),
        ..prompt("the in the", 6)
    };
    let alone = generator.generate(&request, None).await.unwrap().stats.unwrap();
    assert_eq!(alone.mean_batch_size, 1.0);
    assert!(alone.verifier_forward_seconds > 0.0);
    assert!(alone.verifier_forward_seconds <= alone.verify_seconds);
    // The decode phase's passes: every step's but the first (which computed the prompt).
    assert!(alone.decode_forward_seconds > 0.0);
    assert!(alone.decode_forward_seconds < alone.verifier_forward_seconds);
    assert!(alone.decode_forward_seconds <= alone.decode_verify_seconds);
    assert!(alone.decode_verify_seconds < alone.verify_seconds);
    assert_eq!(alone.decode_draft_seconds, 0.0, "plain decoding never drafts");
    // Each of its steps waited the 100 ms for company that never came.
    let waited = alone.verifier_queue_seconds / f64::from(alone.verifier_calls);
    assert!(waited >= 0.09, "{waited}");
    let (a, b) = tokio::join!(
        generator.generate(&request, None),
        generator.generate(&request, None)
    );
    let (a, b) = (a.unwrap().stats.unwrap(), b.unwrap().stats.unwrap());
    assert_eq!(a.verifier_calls, b.verifier_calls);
    for stats in [a, b] {
        assert!(stats.mean_batch_size > 1.5, "{stats:?}");
        assert!(stats.mean_batch_size <= 2.0, "{stats:?}");
    }
}
