//! Fault tolerance with real processes on loopback and the real model: a verifier killed
//! mid-generation (failover, identical greedy output), a hung verifier (deadline, breaker
//! opens, traffic moves, breaker closes after it resumes), a killed and restarted drafter
//! (K = 0, then speculation again), 50 concurrent sessions over 3 verifiers with one killed,
//! garbage and oversized messages on every port, and SIGTERM draining in-flight requests.

use std::io::Write;
use std::time::{Duration, Instant};

use specd_e2e::{Service, Stack, StackOptions, binaries, default_model};
use specd_proto::v1 as pb;
use tokio_stream::StreamExt;
use tonic::Code;

const PROMPTS: [&str; 5] = [
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):",
    "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is",
    "List the days of the week: Monday, Tuesday, Wednesday,",
    "Once upon a time, in a small village by the sea, there lived",
    "{\"name\": \"Ada\", \"age\": 36, \"city\": \"London\"}\nRewrite the JSON with the age doubled:",
];

fn request(prompt: &str, max_tokens: u32, speculate: bool) -> pb::GenerateRequest {
    pb::GenerateRequest {
        input: Some(pb::generate_request::Input::Prompt(prompt.into())),
        max_tokens,
        speculation: Some(pb::SpeculationOptions {
            disable: !speculate,
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// Plain greedy decoding of each prompt through the same stack: the reference.
async fn references(stack: &Stack, max_tokens: u32) -> Vec<Vec<u32>> {
    let mut client = stack.client().await;
    let mut out = Vec::new();
    for prompt in PROMPTS {
        let response = client
            .generate(request(prompt, max_tokens, false))
            .await
            .expect("plain generation")
            .into_inner();
        out.push(response.token_ids);
    }
    out
}

/// Streams one generation; returns the final response.
async fn stream_to_end(
    mut stream: tonic::Streaming<pb::GenerateStreamResponse>,
) -> Result<pb::GenerateResponse, tonic::Status> {
    while let Some(event) = stream.next().await {
        if let Some(pb::generate_stream_response::Event::Done(done)) = event?.event {
            return Ok(done);
        }
    }
    Err(tonic::Status::internal("the stream ended without a summary"))
}

#[tokio::test(flavor = "multi_thread")]
async fn a_verifier_killed_mid_generation_costs_a_failover_not_the_request() {
    let stack = Stack::start_with(
        binaries!(),
        StackOptions {
            verifiers: 2,
            lm_drafter: false,
            orchestrator_args: &["--call-deadline-ms", "5000"],
            ..StackOptions::default()
        },
    )
    .await;
    let reference = &references(&stack, 96).await[0];
    let mut client = stack.client().await;
    let stream = client
        .generate_stream(request(PROMPTS[0], 96, true))
        .await
        .expect("stream starts")
        .into_inner();
    let generation = tokio::spawn(stream_to_end(stream));
    let victim = stack.busy_verifier(Duration::from_secs(30)).await;
    stack.verifier_at(&victim).signal("KILL");
    let done = generation.await.unwrap().expect("the request survives the kill");
    let stats = done.stats.unwrap();
    assert_eq!(
        &done.token_ids, reference,
        "greedy output changed across the failover"
    );
    assert!(stats.failovers >= 1, "no failover counted: {stats:?}");
    let replicas = stack.replicas().await;
    assert!(replicas.failovers >= 1, "{replicas:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_hung_verifier_opens_its_breaker_traffic_moves_and_it_closes_after_resuming() {
    let stack = Stack::start_with(
        binaries!(),
        StackOptions {
            verifiers: 2,
            lm_drafter: false,
            orchestrator_args: &[
                "--call-deadline-ms",
                "1500",
                "--breaker-failures",
                "1",
                "--breaker-open-ms",
                "1000",
                "--health-interval-ms",
                "300",
            ],
            ..StackOptions::default()
        },
    )
    .await;
    let reference = &references(&stack, 64).await[1];
    let mut client = stack.client().await;
    let stream = client
        .generate_stream(request(PROMPTS[1], 64, true))
        .await
        .unwrap()
        .into_inner();
    let generation = tokio::spawn(stream_to_end(stream));
    let victim = stack.busy_verifier(Duration::from_secs(30)).await;
    stack.verifier_at(&victim).signal("STOP");
    let done = generation.await.unwrap().expect("the request survives the hang");
    assert_eq!(&done.token_ids, reference);
    assert!(done.stats.unwrap().failovers >= 1);
    // The deadline tripped the breaker; health checks time out too.
    let stopped = stack
        .wait_replica(&victim, Duration::from_secs(10), "unreachable", |r| {
            r.health == pb::ReplicaHealth::Unreachable as i32
        })
        .await;
    assert_ne!(stopped.breaker, pb::BreakerState::Closed as i32, "{stopped:?}");
    assert!(stopped.failures >= 1);
    // Traffic moves: new sessions all go to the healthy replica, without retries.
    for prompt in PROMPTS {
        let response = client
            .generate(request(prompt, 8, true))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(response.stats.unwrap().retries, 0);
    }
    let after = stack
        .wait_replica(&victim, Duration::from_secs(1), "unchanged", |_| true)
        .await;
    assert_eq!(after.requests, stopped.requests, "the hung replica got traffic");
    // Resumed: health recovers, and a probe closes the breaker.
    stack.verifier_at(&victim).signal("CONT");
    stack
        .wait_replica(&victim, Duration::from_secs(10), "serving", |r| {
            r.health == pb::ReplicaHealth::Serving as i32
        })
        .await;
    let started = Instant::now();
    loop {
        let replica = stack
            .wait_replica(&victim, Duration::from_secs(1), "listed", |_| true)
            .await;
        if replica.breaker == pb::BreakerState::Closed as i32 && replica.requests > stopped.requests {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "breaker never closed: {replica:?}"
        );
        client.generate(request(PROMPTS[2], 4, true)).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_killed_drafter_costs_speculation_and_rejoins_when_restarted() {
    let mut stack = Stack::start_with(
        binaries!(),
        StackOptions {
            lm_drafter: false,
            orchestrator_args: &["--breaker-open-ms", "1000", "--call-deadline-ms", "3000"],
            ..StackOptions::default()
        },
    )
    .await;
    let mut client = stack.client().await;
    // Every step asks the drafter (fixed K): the adaptive policy may not ask at all where
    // the verifier's cost curve says drafts do not pay (a slow machine, or one shared with
    // the other tests' stacks), and then the dead drafter would never be noticed.
    let copy_heavy = || {
        let mut r = request(PROMPTS[0], 32, true);
        r.speculation = Some(pb::SpeculationOptions {
            max_k: 4,
            fixed_k: true,
            ..Default::default()
        });
        r
    };
    let before = client.generate(copy_heavy()).await.unwrap().into_inner();
    assert!(
        before.stats.unwrap().proposed > 0,
        "prompt lookup should draft here"
    );
    let port = stack.drafter.port();
    stack.drafter.signal("KILL");
    let _ = stack.drafter.child.wait();
    for _ in 0..3 {
        let response = client
            .generate(copy_heavy())
            .await
            .expect("requests succeed without a drafter")
            .into_inner();
        assert_eq!(response.token_ids, before.token_ids);
    }
    // Tripped: open, or half-open when those requests outlasted the open period (a slow
    // machine); either way no proposal reaches the dead drafter but a lone probe.
    let replicas = stack.replicas().await;
    assert!(
        [pb::BreakerState::Open as i32, pb::BreakerState::HalfOpen as i32]
            .contains(&replicas.drafter_breaker),
        "{replicas:?}"
    );
    let response = client.generate(copy_heavy()).await.unwrap().into_inner();
    let stats = response.stats.unwrap();
    assert_eq!(
        (stats.proposed, stats.mean_k),
        (0, 0.0),
        "K = 0 while the drafter is down"
    );
    // Restarted on the same address: after the open period a probe succeeds.
    let model = default_model();
    stack.drafter = Service::start_on(
        "drafter-svc",
        binaries!().drafter,
        port,
        &["--model", model.to_str().unwrap()],
    );
    stack.drafter.wait_serving(Duration::from_secs(60)).await;
    let started = Instant::now();
    loop {
        let response = client.generate(copy_heavy()).await.unwrap().into_inner();
        assert_eq!(response.token_ids, before.token_ids);
        if response.stats.unwrap().proposed > 0 {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the drafter never rejoined"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(
        stack.replicas().await.drafter_breaker,
        pb::BreakerState::Closed as i32
    );
}

/// Runs `n` concurrent greedy sessions; returns (latency, tokens) per request, in order.
async fn concurrent_sessions(
    stack: &Stack,
    n: usize,
    max_tokens: u32,
) -> Vec<(Duration, Result<Vec<u32>, tonic::Status>)> {
    let mut tasks = Vec::new();
    for i in 0..n {
        let mut client = stack.client().await;
        tasks.push(tokio::spawn(async move {
            let started = Instant::now();
            let result = client
                .generate(request(PROMPTS[i % PROMPTS.len()], max_tokens, true))
                .await
                .map(|r| r.into_inner().token_ids);
            (started.elapsed(), result)
        }));
    }
    let mut out = Vec::new();
    for task in tasks {
        out.push(task.await.unwrap());
    }
    out
}

fn percentile(latencies: &mut [Duration], p: f64) -> Duration {
    latencies.sort();
    latencies[((latencies.len() - 1) as f64 * p).round() as usize]
}

/// (completed, failed, wrong, p50, p99) of a run against the reference outputs.
fn summarise(
    run: Vec<(Duration, Result<Vec<u32>, tonic::Status>)>,
    reference: &[Vec<u32>],
) -> (usize, usize, usize, Duration, Duration) {
    let (mut completed, mut failed, mut wrong) = (0, 0, 0);
    let mut latencies = Vec::new();
    for (i, (latency, result)) in run.into_iter().enumerate() {
        latencies.push(latency);
        match result {
            Ok(tokens) if tokens == reference[i % PROMPTS.len()] => completed += 1,
            Ok(_) => wrong += 1,
            Err(status) => {
                eprintln!("session {i} failed: {status:?}");
                failed += 1;
            }
        }
    }
    let p50 = percentile(&mut latencies, 0.5);
    let p99 = percentile(&mut latencies, 0.99);
    (completed, failed, wrong, p50, p99)
}

#[tokio::test(flavor = "multi_thread")]
async fn fifty_sessions_over_three_verifiers_survive_losing_one() {
    const SESSIONS: usize = 50;
    const TOKENS: u32 = 24;
    let stack = Stack::start_with(
        binaries!(),
        StackOptions {
            verifiers: 3,
            lm_drafter: false,
            orchestrator_args: &["--call-deadline-ms", "20000"],
            ..StackOptions::default()
        },
    )
    .await;
    let reference = references(&stack, TOKENS).await;
    // Warm-up (first passes, the cost model), so both measured runs start alike.
    concurrent_sessions(&stack, 10, 4).await;
    let calm = summarise(concurrent_sessions(&stack, SESSIONS, TOKENS).await, &reference);
    let spread = stack.replicas().await;
    for replica in &spread.verifiers {
        assert!(replica.requests > 0, "affinity left a replica idle: {spread:?}");
    }
    // Same load; one verifier is killed while the sessions run.
    let run = {
        let stack = &stack;
        let killer = async move {
            let victim = stack.busy_verifier(Duration::from_secs(30)).await;
            tokio::time::sleep(Duration::from_millis(500)).await;
            stack.verifier_at(&victim).signal("KILL");
            victim
        };
        let (run, victim) = tokio::join!(concurrent_sessions(stack, SESSIONS, TOKENS), killer);
        eprintln!("killed {victim}");
        run
    };
    let faulty = summarise(run, &reference);
    let totals = stack.replicas().await;
    eprintln!(
        "50 sessions over 3 verifiers\n\
         run        completed failed wrong   p50      p99\n\
         no fault   {:>9} {:>6} {:>5} {:>7.2}s {:>7.2}s\n\
         one killed {:>9} {:>6} {:>5} {:>7.2}s {:>7.2}s\n\
         retries {}, failovers {}",
        calm.0,
        calm.1,
        calm.2,
        calm.3.as_secs_f64(),
        calm.4.as_secs_f64(),
        faulty.0,
        faulty.1,
        faulty.2,
        faulty.3.as_secs_f64(),
        faulty.4.as_secs_f64(),
        totals.retries,
        totals.failovers
    );
    assert_eq!((calm.0, calm.1, calm.2), (SESSIONS, 0, 0));
    assert_eq!((faulty.0, faulty.1, faulty.2), (SESSIONS, 0, 0));
    assert!(totals.failovers >= 1, "{totals:?}");
}

/// Writes bytes that are not HTTP/2 to a service's port.
fn send_garbage(url: &str) {
    let address = url.trim_start_matches("http://");
    let mut socket = std::net::TcpStream::connect(address).expect("connect");
    socket.set_write_timeout(Some(Duration::from_secs(2))).unwrap();
    let mut garbage = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec();
    garbage.extend((0..4096u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8));
    let _ = socket.write_all(&garbage);
}

#[tokio::test(flavor = "multi_thread")]
async fn garbage_and_oversized_messages_are_refused_and_every_service_keeps_serving() {
    let limit = ["--max-request-bytes", "65536"];
    let mut stack = Stack::start_with(
        binaries!(),
        StackOptions {
            lm_drafter: false,
            verifier_args: &limit,
            drafter_args: &limit,
            orchestrator_args: &limit,
            ..StackOptions::default()
        },
    )
    .await;
    for url in [
        &stack.orchestrator.url,
        &stack.drafter.url,
        &stack.verifiers[0].url,
    ] {
        send_garbage(url);
    }
    let huge: Vec<u32> = vec![300; 100_000]; // ~200 KB encoded, over the 64 KiB limit
    let status = specd_proto::VerifierClient::connect(stack.verifiers[0].url.clone())
        .await
        .unwrap()
        .verify(pb::VerifyRequest {
            session_id: "x".into(),
            context: huge.clone(),
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::OutOfRange, "{status:?}");
    let status = specd_proto::DrafterClient::connect(stack.drafter.url.clone())
        .await
        .unwrap()
        .propose(pb::ProposeRequest {
            session_id: "x".into(),
            context: huge,
            max_tokens: 4,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::OutOfRange, "{status:?}");
    let mut client = stack.client().await;
    let status = client
        .generate(request(&"word ".repeat(20_000), 4, true))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::OutOfRange, "{status:?}");
    // Everyone still serves, end to end.
    for service in [
        &mut stack.orchestrator,
        &mut stack.drafter,
        &mut stack.verifiers[0],
    ] {
        service.wait_serving(Duration::from_secs(5)).await;
    }
    let ok = client
        .generate(request(PROMPTS[0], 8, true))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(ok.token_ids.len(), 8);
}

#[tokio::test(flavor = "multi_thread")]
async fn sigterm_drains_in_flight_requests_then_exits() {
    let mut stack = Stack::start_with(
        binaries!(),
        StackOptions {
            lm_drafter: false,
            ..StackOptions::default()
        },
    )
    .await;
    let reference = references(&stack, 48).await;
    let mut client = stack.client().await;
    let stream = client
        .generate_stream(request(PROMPTS[3], 48, true))
        .await
        .unwrap()
        .into_inner();
    let generation = tokio::spawn(stream_to_end(stream));
    stack.busy_verifier(Duration::from_secs(30)).await;
    stack.orchestrator.signal("TERM");
    let done = generation
        .await
        .unwrap()
        .expect("the in-flight request completes");
    assert_eq!(done.token_ids, reference[3]);
    let started = Instant::now();
    let status = loop {
        if let Some(status) = stack.orchestrator.child.try_wait().unwrap() {
            break status;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the orchestrator did not exit"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "{status}");
}
