//! Traces and metrics from the three real services: spans exported over OTLP/gRPC to a real
//! receiver in this process form ONE trace across orchestrator, drafter and verifier with
//! correct parent links and the documented attributes; each service's Prometheus endpoint
//! is scraped and its counters agree with what the responses reported.

use std::collections::HashSet;
use std::time::Duration;

use specd_e2e::otlp::{ReceivedSpan, receiver, render_tree, scrape, wait_for};
use specd_e2e::{Stack, StackOptions, binaries, free_port};
use specd_proto::v1 as pb;

const PROMPT: &str = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):";

fn find<'a>(spans: &'a [ReceivedSpan], service: &str, name: &str) -> Vec<&'a ReceivedSpan> {
    spans
        .iter()
        .filter(|s| s.service == service && s.name == name)
        .collect()
}

fn parent_of<'a>(spans: &'a [ReceivedSpan], span: &ReceivedSpan) -> &'a ReceivedSpan {
    spans
        .iter()
        .find(|s| s.span_id == span.parent_span_id)
        .unwrap_or_else(|| panic!("{} ({}) has no parent in the trace", span.name, span.service))
}

fn sample(samples: &[(String, f64)], name: &str) -> f64 {
    samples
        .iter()
        .find(|(n, _)| n == name)
        .unwrap_or_else(|| {
            panic!(
                "{name} not scraped; have {:?}",
                samples.iter().map(|s| &s.0).collect::<Vec<_>>()
            )
        })
        .1
}

#[tokio::test(flavor = "multi_thread")]
async fn one_trace_spans_all_three_services_and_metrics_match_the_responses() {
    let receiver = receiver().await;
    let metrics_ports = [free_port(), free_port(), free_port()];
    let listen = metrics_ports.map(|p| format!("127.0.0.1:{p}"));
    let env = [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint.as_str()),
        // Export promptly; the default batch delay is 5 s.
        ("OTEL_BSP_SCHEDULE_DELAY", "100"),
    ];
    let stack = Stack::start_with(
        binaries!(),
        StackOptions {
            lm_drafter: false,
            env: &env,
            orchestrator_args: &["--metrics-listen", &listen[0]],
            verifier_args: &["--metrics-listen", &listen[1]],
            drafter_args: &["--metrics-listen", &listen[2]],
            ..StackOptions::default()
        },
    )
    .await;
    let mut client = stack.client().await;
    let mut responses = Vec::new();
    for max_tokens in [24, 16] {
        responses.push(
            client
                .generate(pb::GenerateRequest {
                    input: Some(pb::generate_request::Input::Prompt(PROMPT.into())),
                    max_tokens,
                    ..Default::default()
                })
                .await
                .expect("generation")
                .into_inner(),
        );
    }

    // Traces: wait until the first request's whole trace has arrived.
    let spans = wait_for(&receiver, Duration::from_secs(30), |spans| {
        let services: HashSet<&str> = spans.iter().map(|s| s.service.as_str()).collect();
        ["orchestrator", "verifier-svc", "drafter-svc"]
            .iter()
            .all(|s| services.contains(s))
            && spans.iter().filter(|s| s.name == "generate").count() >= 2
    })
    .await;
    let generates = find(&spans, "orchestrator", "generate");
    let first = generates.iter().min_by_key(|s| s.start_ns).unwrap();
    let trace: Vec<ReceivedSpan> = spans
        .iter()
        .filter(|s| s.trace_id == first.trace_id)
        .cloned()
        .collect();
    let services: HashSet<&str> = trace.iter().map(|s| s.service.as_str()).collect();
    assert_eq!(
        services,
        HashSet::from(["orchestrator", "verifier-svc", "drafter-svc"]),
        "one trace id across all three processes"
    );
    // Orchestrator: Generate server span → generate → step → draft / verify / accept.
    let server = parent_of(&trace, first);
    assert_eq!(server.name, "specd.v1.Orchestrator/Generate");
    let steps = find(&trace, "orchestrator", "step");
    let stats = responses[0].stats.unwrap();
    assert_eq!(
        steps.len() as u32,
        stats.verifier_calls,
        "one step span per verifier call"
    );
    let mut accepted = 0u64;
    for step in &steps {
        assert_eq!(parent_of(&trace, step).span_id, first.span_id);
        for key in ["session", "step", "k", "accepted", "bonus"] {
            assert!(step.attribute(key).is_some(), "step lacks {key}: {step:?}");
        }
        accepted += step.attribute("accepted").unwrap().parse::<u64>().unwrap();
    }
    assert_eq!(accepted, u64::from(stats.accepted));
    for name in ["draft", "verify", "accept"] {
        for span in find(&trace, "orchestrator", name) {
            assert_eq!(parent_of(&trace, span).name, "step", "{name}");
        }
    }
    for verify in find(&trace, "orchestrator", "verify") {
        for key in ["replica", "attempts", "bytes_sent", "bytes_received", "computed"] {
            assert!(verify.attribute(key).is_some(), "verify lacks {key}: {verify:?}");
        }
    }
    // Across the process boundary: the verifier's server span is a child of the
    // orchestrator's attempt span; the drafter's of the draft span.
    let verifier_servers = find(&trace, "verifier-svc", "specd.v1.Verifier/Verify");
    assert_eq!(verifier_servers.len() as u32, stats.verifier_calls);
    for server in &verifier_servers {
        let parent = parent_of(&trace, server);
        assert_eq!(
            (parent.service.as_str(), parent.name.as_str()),
            ("orchestrator", "verify.attempt")
        );
        assert_eq!(parent.attribute("replica"), Some(stack.verifiers[0].url.as_str()));
    }
    for verify in find(&trace, "verifier-svc", "verify") {
        for key in ["batch_size", "queue_ms", "forward_ms", "computed", "reused"] {
            assert!(
                verify.attribute(key).is_some(),
                "verifier span lacks {key}: {verify:?}"
            );
        }
        assert_eq!(parent_of(&trace, verify).name, "specd.v1.Verifier/Verify");
    }
    assert!(!find(&trace, "verifier-svc", "engine.score").is_empty());
    let drafter_servers = find(&trace, "drafter-svc", "specd.v1.Drafter/Propose");
    assert_eq!(drafter_servers.len() as u32, stats.drafter_calls);
    for server in drafter_servers {
        assert_eq!(parent_of(&trace, server).name, "draft");
    }
    let keys = [
        "step",
        "k",
        "accepted",
        "bonus",
        "replica",
        "attempt",
        "bytes_sent",
        "bytes_received",
        "batch_size",
        "queue_ms",
        "forward_ms",
        "proposed",
    ];
    eprintln!(
        "one trace ({} spans):\n{}",
        trace.len(),
        render_tree(&trace, &keys)
    );

    // Metrics agree with the responses.
    let generated: usize = responses.iter().map(|r| r.token_ids.len()).sum();
    let accepted: u32 = responses.iter().map(|r| r.stats.as_ref().unwrap().accepted).sum();
    let proposed: u32 = responses.iter().map(|r| r.stats.as_ref().unwrap().proposed).sum();
    let calls: u32 = responses
        .iter()
        .map(|r| r.stats.as_ref().unwrap().verifier_calls)
        .sum();
    let orchestrator = scrape(&listen[0]).await;
    assert_eq!(
        sample(&orchestrator, "specd_generated_tokens_total"),
        generated as f64
    );
    assert_eq!(
        sample(&orchestrator, "specd_draft_tokens_accepted_total"),
        f64::from(accepted)
    );
    assert_eq!(
        sample(&orchestrator, "specd_draft_tokens_proposed_total"),
        f64::from(proposed)
    );
    assert_eq!(
        sample(&orchestrator, "specd_accepted_length_count"),
        f64::from(calls)
    );
    assert_eq!(
        sample(
            &orchestrator,
            "specd_grpc_requests_total{method=\"specd.v1.Orchestrator/Generate\",status=\"Ok\"}"
        ),
        2.0
    );
    assert_eq!(
        sample(&orchestrator, "specd_hop_seconds_count{hop=\"verify\"}"),
        f64::from(calls)
    );
    let verifier = scrape(&listen[1]).await;
    assert_eq!(
        sample(
            &verifier,
            "specd_grpc_requests_total{method=\"specd.v1.Verifier/Verify\",status=\"Ok\"}"
        ),
        f64::from(calls)
    );
    assert_eq!(
        sample(&verifier, "specd_verifier_batch_size_count"),
        f64::from(calls)
    );
    assert!(sample(&verifier, "specd_verifier_computed_tokens_total") > 0.0);
    // The engine's own accounting covers every token the calls computed (and its warm-up).
    let engine_tokens: f64 = verifier
        .iter()
        .filter(|(name, _)| {
            name == "specd_engine_prompt_tokens_total"
                || name.starts_with("specd_engine_scored_tokens_total{")
        })
        .map(|(_, value)| value)
        .sum();
    assert!(engine_tokens >= sample(&verifier, "specd_verifier_computed_tokens_total"));
    assert!(sample(&verifier, "specd_engine_pass_seconds_count{kind=\"prompt\"}") >= 1.0);
    assert!(sample(&verifier, "specd_engine_pass_seconds_sum{kind=\"decode\"}") > 0.0);
    let drafter = scrape(&listen[2]).await;
    let drafter_calls: u32 = responses
        .iter()
        .map(|r| r.stats.as_ref().unwrap().drafter_calls)
        .sum();
    assert_eq!(
        sample(&drafter, "specd_drafter_proposed_tokens_count"),
        f64::from(drafter_calls)
    );
    let excerpt: Vec<String> = orchestrator
        .iter()
        .chain(verifier.iter())
        .filter(|(n, _)| {
            !n.contains("_bucket")
                && (n.starts_with("specd_generated")
                    || n.starts_with("specd_draft_tokens")
                    || n.starts_with("specd_accepted_length")
                    || n.starts_with("specd_grpc_requests_total")
                    || n.starts_with("specd_verifier_"))
        })
        .map(|(n, v)| format!("{n} {v}"))
        .collect();
    eprintln!("scrape excerpt:\n{}", excerpt.join("\n"));
}
