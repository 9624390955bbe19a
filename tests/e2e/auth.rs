//! API keys on the real orchestrator: no key, a wrong key, a revoked key (the key file is
//! rewritten while it serves), another key's session, and a key over its token quota — each
//! gets its exact gRPC code, and the service keeps serving everyone else.

use std::time::Duration;

use specd_e2e::{Stack, StackOptions, binaries};
use specd_orchestrator::auth::hash_key;
use specd_proto::v1 as pb;
use tonic::Code;

fn keys_file(entries: &[(&str, &str, &str)]) -> String {
    entries
        .iter()
        .map(|(id, key, limits)| format!("{id} {} {limits}\n", hash_key(key)))
        .collect()
}

fn request(key: Option<&str>, session: &str) -> tonic::Request<pb::GenerateRequest> {
    let mut request = tonic::Request::new(pb::GenerateRequest {
        input: Some(pb::generate_request::Input::Prompt("Once upon a time".into())),
        max_tokens: 8,
        session_id: session.into(),
        ..Default::default()
    });
    if let Some(key) = key {
        request
            .metadata_mut()
            .insert("authorization", format!("Bearer {key}").parse().unwrap());
    }
    request
}

#[tokio::test(flavor = "multi_thread")]
async fn keys_are_required_scoped_limited_and_revocable() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("api-keys");
    let all = [
        ("alice", "alice-key", "tokens_per_minute=60"),
        ("bob", "bob-key", ""),
        ("carol", "carol-key", ""),
    ];
    std::fs::write(&path, keys_file(&all)).unwrap();
    let path_arg = path.to_str().unwrap().to_string();
    let stack = Stack::start_with(
        binaries!(),
        StackOptions {
            lm_drafter: false,
            orchestrator_args: &["--api-keys-file", &path_arg],
            ..StackOptions::default()
        },
    )
    .await;
    let mut client = stack.client().await;
    let status = client.generate(request(None, "")).await.unwrap_err();
    assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");
    assert!(status.message().contains("missing API key"), "{status:?}");
    let status = client.generate(request(Some("guess"), "")).await.unwrap_err();
    assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");
    assert!(status.message().contains("invalid API key"), "{status:?}");

    // Sessions belong to their key: bob cannot see alice's.
    let alice = client
        .generate(request(Some("alice-key"), ""))
        .await
        .unwrap()
        .into_inner();
    let status = client
        .generate(request(Some("bob-key"), &alice.session_id))
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::NotFound, "{status:?}");
    client
        .generate(request(Some("alice-key"), &alice.session_id))
        .await
        .expect("alice continues her own session");

    // Alice's 60 tokens per minute run out; she is told when to come back. Bob is not.
    let mut exhausted = None;
    for _ in 0..10 {
        match client.generate(request(Some("alice-key"), "")).await {
            Ok(_) => {}
            Err(status) => {
                exhausted = Some(status);
                break;
            }
        }
    }
    let status = exhausted.expect("alice's quota never ran out");
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(status.message().contains("tokens per minute"), "{status:?}");
    let hint: u64 = status
        .metadata()
        .get("retry-after-ms")
        .expect("a retry hint")
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!(hint > 0);
    client
        .generate(request(Some("bob-key"), ""))
        .await
        .expect("bob is unaffected");

    // Revoking carol: rewrite the file; it is re-read without a restart.
    client.generate(request(Some("carol-key"), "")).await.unwrap();
    std::fs::write(&path, keys_file(&all[..2])).unwrap();
    let later = std::time::SystemTime::now() + Duration::from_secs(5);
    std::fs::File::options()
        .write(true)
        .open(&path)
        .unwrap()
        .set_modified(later)
        .unwrap();
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let status = client.generate(request(Some("carol-key"), "")).await.unwrap_err();
    assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");
    client
        .generate(request(Some("bob-key"), ""))
        .await
        .expect("the service keeps serving other keys");
}
