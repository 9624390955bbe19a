//! Bad input and failing services get a precise gRPC status and a clear message, and the
//! orchestrator keeps serving: empty prompt, unknown session, K out of range, oversized
//! context, malformed sampling, a drafter that is down (requests still succeed, plainly), a
//! verifier that is down (Unavailable) or hangs (DeadlineExceeded).

use std::time::{Duration, Instant};

use specd_e2e::{Service, Stack, binaries, default_model, free_port};
use specd_proto::v1 as pb;
use tonic::Code;

fn prompt(text: &str) -> pb::GenerateRequest {
    pb::GenerateRequest {
        input: Some(pb::generate_request::Input::Prompt(text.into())),
        max_tokens: 8,
        ..Default::default()
    }
}

async fn expect_status(
    client: &mut specd_proto::OrchestratorClient<tonic::transport::Channel>,
    request: pb::GenerateRequest,
    code: Code,
    needle: &str,
) {
    let status = client.generate(request).await.expect_err("the request must fail");
    assert_eq!(status.code(), code, "{status:?}");
    assert!(
        status.message().contains(needle),
        "{:?} lacks {needle:?}",
        status.message()
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn invalid_requests_get_precise_codes_and_the_service_keeps_serving() {
    let stack = Stack::start(binaries!(), &[]).await;
    let mut client = stack.client().await;
    expect_status(&mut client, prompt(""), Code::InvalidArgument, "prompt is empty").await;
    expect_status(
        &mut client,
        pb::GenerateRequest::default(),
        Code::InvalidArgument,
        "neither a prompt",
    )
    .await;
    let mut unknown = prompt("hi");
    unknown.session_id = "no-such-session".into();
    expect_status(&mut client, unknown, Code::NotFound, "no-such-session").await;
    let mut big_k = prompt("hi");
    big_k.speculation = Some(pb::SpeculationOptions {
        max_k: 99,
        ..Default::default()
    });
    expect_status(&mut client, big_k, Code::InvalidArgument, "max_k is 99").await;
    let mut bad_sampling = prompt("hi");
    bad_sampling.sampling = Some(pb::SamplingParams {
        temperature: 1.0,
        top_k: 0,
        top_p: 2.0,
    });
    expect_status(&mut client, bad_sampling, Code::InvalidArgument, "top_p").await;
    // ~20k tokens: every digit is its own token in SmolLM2's tokenizer.
    expect_status(
        &mut client,
        prompt(&"1 ".repeat(10_000)),
        Code::InvalidArgument,
        "context holds 8192",
    )
    .await;
    let mut too_many = prompt("hi");
    too_many.max_tokens = 100_000;
    expect_status(
        &mut client,
        too_many,
        Code::InvalidArgument,
        "max_tokens is 100000",
    )
    .await;
    // Still serving.
    let ok = client
        .generate(prompt("Hello"))
        .await
        .expect("a valid request succeeds")
        .into_inner();
    assert_eq!(ok.token_ids.len(), 8);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_dead_drafter_costs_speculation_not_requests() {
    let model = default_model();
    let model = model.to_str().unwrap();
    let mut verifier = Service::start("verifier-svc", binaries!().verifier, &["--model", model]);
    verifier.wait_serving(Duration::from_secs(120)).await;
    let nobody = format!("http://127.0.0.1:{}", free_port());
    let mut orchestrator = Service::start(
        "orchestrator",
        binaries!().orchestrator,
        &[
            "--model",
            model,
            "--verifier",
            &verifier.url,
            "--drafter",
            &nobody,
            "--call-deadline-ms",
            "2000",
            "--no-auth",
        ],
    );
    orchestrator.wait_serving(Duration::from_secs(60)).await;
    let mut client = specd_proto::OrchestratorClient::connect(orchestrator.url.clone())
        .await
        .unwrap();
    let response = client
        .generate(prompt(
            "The quick brown fox jumps over the lazy dog. The quick brown fox",
        ))
        .await
        .expect("generation succeeds without a drafter")
        .into_inner();
    assert_eq!(response.token_ids.len(), 8);
    assert_eq!(response.stats.unwrap().proposed, 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_dead_or_hanging_lone_verifier_is_reported_precisely() {
    let stack = Stack::start(
        binaries!(),
        &["--call-deadline-ms", "1500", "--breaker-open-ms", "1000"],
    )
    .await;
    let mut client = stack.client().await;
    let verifier = &stack.verifiers[0];
    // Hanging: each attempt ends at the deadline; after the retries the call fails with
    // DeadlineExceeded (not a hang).
    verifier.signal("STOP");
    let started = Instant::now();
    let status = client
        .generate(prompt("Hello there"))
        .await
        .expect_err("a hung verifier fails the call");
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "{:?}",
        started.elapsed()
    );
    verifier.signal("CONT");
    // Its breaker opened; once it has been open a second, a probe gets through and closes it
    // (a probe may still time out while the resumed process catches up).
    let recovered = Instant::now();
    loop {
        match client.generate(prompt("Hello there")).await {
            Ok(_) => break,
            Err(status) => {
                assert!(
                    matches!(status.code(), Code::Unavailable | Code::DeadlineExceeded),
                    "{status:?}"
                );
                assert!(
                    recovered.elapsed() < Duration::from_secs(15),
                    "never recovered: {status:?}"
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }
    // Dead: Unavailable.
    verifier.signal("KILL");
    let status = client
        .generate(prompt("Hello there"))
        .await
        .expect_err("a dead verifier fails the call");
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
}
