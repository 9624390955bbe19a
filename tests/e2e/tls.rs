//! TLS with certificates made in the test: the three services over mutual TLS, a client of
//! the orchestrator's public TLS port, and the verifier refusing callers without a
//! certificate of our CA — no certificate, an expired one, another CA's, plain text — while
//! it keeps serving the orchestrator.

use std::path::Path;
use std::time::{Duration, Instant};

use specd_common::tls::DevCa;
use specd_e2e::{Service, binaries, default_model};
use specd_proto::v1 as pb;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

fn tls_args(dir: &Path, name: &str) -> Vec<String> {
    vec![
        "--tls-cert".into(),
        dir.join(format!("{name}.pem")).display().to_string(),
        "--tls-key".into(),
        dir.join(format!("{name}-key.pem")).display().to_string(),
        "--tls-ca".into(),
        dir.join("ca.pem").display().to_string(),
    ]
}

fn start(name: &'static str, path: &str, args: Vec<String>) -> (Service, String) {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let service = Service::start(name, path, &args);
    let url = format!("https://127.0.0.1:{}", service.port());
    (service, url)
}

/// Connects and makes one Info call; the error if either fails.
async fn info(url: &str, tls: Option<ClientTlsConfig>) -> Result<pb::InfoResponse, String> {
    let mut endpoint = Endpoint::from_shared(url.to_string())
        .unwrap()
        .connect_timeout(Duration::from_secs(3));
    if let Some(tls) = tls {
        endpoint = endpoint.tls_config(tls).map_err(|e| e.to_string())?;
    }
    let channel: Channel = endpoint.connect().await.map_err(|e| format!("connect: {e:?}"))?;
    specd_proto::VerifierClient::new(channel)
        .info(pb::InfoRequest {})
        .await
        .map(|r| r.into_inner())
        .map_err(|s| format!("{:?}: {}", s.code(), s.message()))
}

fn client_tls(ca: &str, identity: Option<(&str, &str)>) -> ClientTlsConfig {
    let mut config = ClientTlsConfig::new()
        .domain_name("127.0.0.1")
        .ca_certificate(Certificate::from_pem(ca));
    if let Some((cert, key)) = identity {
        config = config.identity(Identity::from_pem(cert, key));
    }
    config
}

async fn wait_until_ok(url: &str, tls: ClientTlsConfig) {
    let started = Instant::now();
    while let Err(e) = info(url, Some(tls.clone())).await {
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "{url} never answered: {e}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn mutual_tls_between_services_and_strangers_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let ca = DevCa::new("specd test CA").unwrap();
    ca.write(
        dir.path(),
        &["verifier", "drafter", "orchestrator"],
        &["localhost", "127.0.0.1"],
    )
    .unwrap();
    let ca_pem = ca.cert_pem().to_string();
    let read = |f: &str| std::fs::read_to_string(dir.path().join(f)).unwrap();
    let (good_cert, good_key) = (read("orchestrator.pem"), read("orchestrator-key.pem"));
    let expired = ca.issue(&["orchestrator", "127.0.0.1"], true).unwrap();
    let stranger = DevCa::new("someone else")
        .unwrap()
        .issue(&["orchestrator", "127.0.0.1"], false)
        .unwrap();

    let model = default_model().display().to_string();
    let bins = binaries!();
    let mut args = vec!["--model".to_string(), model.clone()];
    args.extend(tls_args(dir.path(), "verifier"));
    let (_verifier, verifier_url) = start("verifier-svc", bins.verifier, args);
    let mut args = vec!["--model".to_string(), model.clone()];
    args.extend(tls_args(dir.path(), "drafter"));
    let (_drafter, drafter_url) = start("drafter-svc", bins.drafter, args);
    let trusted = client_tls(&ca_pem, Some((&good_cert, &good_key)));
    wait_until_ok(&verifier_url, trusted.clone()).await;

    // Strangers are refused by the verifier.
    let refusals = [
        ("no client certificate", Some(client_tls(&ca_pem, None))),
        (
            "an expired certificate",
            Some(client_tls(&ca_pem, Some((&expired.cert_pem, &expired.key_pem)))),
        ),
        (
            "another CA's certificate",
            Some(client_tls(&ca_pem, Some((&stranger.cert_pem, &stranger.key_pem)))),
        ),
    ];
    for (what, tls) in refusals {
        let result = info(&verifier_url, tls).await;
        assert!(
            result.is_err(),
            "the verifier accepted a client with {what}: {result:?}"
        );
        eprintln!("{what}: refused ({})", result.unwrap_err());
    }
    let plain = info(&verifier_url.replace("https://", "http://"), None).await;
    assert!(plain.is_err(), "plain text accepted: {plain:?}");

    // The orchestrator: public TLS port, mutual TLS to the drafter and verifier.
    let mut args = vec![
        "--model".to_string(),
        model,
        "--verifier".into(),
        verifier_url.clone(),
        "--drafter".into(),
        drafter_url,
        "--no-auth".into(),
    ];
    args.extend(tls_args(dir.path(), "orchestrator"));
    let (_orchestrator, orchestrator_url) = start("orchestrator", bins.orchestrator, args);
    let public = ClientTlsConfig::new()
        .domain_name("127.0.0.1")
        .ca_certificate(Certificate::from_pem(&ca_pem));
    let started = Instant::now();
    let channel = loop {
        match Endpoint::from_shared(orchestrator_url.clone())
            .unwrap()
            .tls_config(public.clone())
            .unwrap()
            .connect()
            .await
        {
            Ok(channel) => break channel,
            Err(e) => {
                assert!(
                    started.elapsed() < Duration::from_secs(120),
                    "orchestrator: {e:?}"
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    };
    let mut client = specd_proto::OrchestratorClient::new(channel);
    let generate = || pb::GenerateRequest {
        input: Some(pb::generate_request::Input::Prompt(
            "def add(a, b):\n    return a + b\n\ndef sub(a, b):".into(),
        )),
        max_tokens: 12,
        ..Default::default()
    };
    let started = Instant::now();
    let response = loop {
        match client.generate(generate()).await {
            Ok(r) => break r.into_inner(),
            Err(status) => {
                assert!(started.elapsed() < Duration::from_secs(60), "{status:?}");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    };
    assert_eq!(response.token_ids.len(), 12);
    assert!(
        response.stats.unwrap().drafter_calls > 0,
        "the drafter answered over mTLS"
    );
    // A plain-text client of the TLS port is refused; the trusted path still works.
    let plain =
        specd_proto::OrchestratorClient::connect(orchestrator_url.replace("https://", "http://")).await;
    if let Ok(mut plain) = plain {
        assert!(plain.generate(generate()).await.is_err());
    }
    assert!(info(&verifier_url, Some(trusted)).await.is_ok());
    client.generate(generate()).await.expect("still serving");
}
