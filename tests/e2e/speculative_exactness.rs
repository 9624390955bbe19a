//! Greedy speculative decoding through the full stack — drafter, verifier and orchestrator as
//! three real processes on loopback, real SmolLM2 — produces exactly the tokens of plain
//! decoding, for every prompt, K in {1, 4, 8} and both drafters, and with prompt lookup
//! answered by the orchestrator (`--ngram-in-process`) while the drafter process is down.
//! Also: streaming delivers the same text as the unary call, and sessions continue.

use specd_e2e::{Stack, StackOptions, binaries};
use specd_proto::OrchestratorClient;
use specd_proto::v1 as pb;
use tonic::transport::Channel;

const PROMPTS: [&str; 5] = [
    "<|im_start|>user\nRewrite with clearer names:\ndef f(a, b):\n    c = a + b\n    return c * 2<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "<|im_start|>user\nConvert to JSON: name Ada, age 36, city London.<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a small village,",
];
const MAX_TOKENS: u32 = 24;

fn request(prompt: &str, speculation: pb::SpeculationOptions) -> pb::GenerateRequest {
    pb::GenerateRequest {
        input: Some(pb::generate_request::Input::Prompt(prompt.into())),
        max_tokens: MAX_TOKENS,
        speculation: Some(speculation),
        ..Default::default()
    }
}

async fn generate_plainly(client: &mut OrchestratorClient<Channel>, prompt: &str) -> pb::GenerateResponse {
    let plain = pb::SpeculationOptions {
        disable: true,
        ..Default::default()
    };
    client
        .generate(request(prompt, plain))
        .await
        .expect("plain generation")
        .into_inner()
}

#[tokio::test(flavor = "multi_thread")]
async fn greedy_speculation_is_token_identical_to_plain_decoding() {
    let stack = Stack::start(binaries!(), &[]).await;
    let mut client = stack.client().await;
    let mut checked = 0;
    for prompt in PROMPTS {
        let plain = generate_plainly(&mut client, prompt).await;
        assert!(!plain.token_ids.is_empty());
        assert_eq!(plain.stats.unwrap().proposed, 0);
        for drafter in [pb::DrafterKind::Ngram, pb::DrafterKind::Lm] {
            for k in [1u32, 4, 8] {
                let spec = client
                    .generate(request(
                        prompt,
                        pb::SpeculationOptions {
                            max_k: k,
                            drafter: drafter as i32,
                            fixed_k: true,
                            disable: false,
                        },
                    ))
                    .await
                    .expect("speculative generation")
                    .into_inner();
                assert_eq!(
                    spec.token_ids, plain.token_ids,
                    "prompt {prompt:?}, drafter {drafter:?}, K {k}: speculative output differs"
                );
                assert_eq!(spec.text, plain.text);
                let stats = spec.stats.unwrap();
                if drafter == pb::DrafterKind::Lm {
                    // The LM drafter always proposes, so speculation really ran.
                    assert!(stats.proposed > 0, "no drafts for {prompt:?} K {k}");
                }
                checked += 1;
            }
        }
    }
    assert_eq!(checked, PROMPTS.len() * 6);
}

#[tokio::test(flavor = "multi_thread")]
async fn lookups_answered_in_the_orchestrator_are_exact_and_need_no_drafter_service() {
    let mut stack = Stack::start_with(
        binaries!(),
        StackOptions {
            orchestrator_args: &["--ngram-in-process"],
            lm_drafter: false,
            ..StackOptions::default()
        },
    )
    .await;
    // With the drafter service gone, prompt lookup still runs: the orchestrator answers it.
    stack.drafter.signal("KILL");
    let _ = stack.drafter.child.wait();
    let mut client = stack.client().await;
    let mut proposed = 0;
    for prompt in PROMPTS {
        let plain = generate_plainly(&mut client, prompt).await;
        let spec = client
            .generate(request(
                prompt,
                pb::SpeculationOptions {
                    max_k: 4,
                    drafter: pb::DrafterKind::Ngram as i32,
                    fixed_k: true,
                    disable: false,
                },
            ))
            .await
            .expect("speculative generation")
            .into_inner();
        assert_eq!(spec.token_ids, plain.token_ids, "prompt {prompt:?}");
        proposed += spec.stats.unwrap().proposed;
    }
    assert!(proposed > 0, "no lookup proposed anything");
}

#[tokio::test(flavor = "multi_thread")]
async fn streaming_matches_unary_and_sessions_continue() {
    let stack = Stack::start(binaries!(), &[]).await;
    let mut client = stack.client().await;
    let chat = |text: &str| pb::GenerateRequest {
        input: Some(pb::generate_request::Input::Chat(pb::ChatMessages {
            messages: vec![pb::ChatMessage {
                role: "user".into(),
                content: text.into(),
            }],
        })),
        max_tokens: 20,
        ..Default::default()
    };
    let unary = client.generate(chat("Name a color.")).await.unwrap().into_inner();
    let mut stream = client
        .generate_stream(chat("Name a color."))
        .await
        .unwrap()
        .into_inner();
    let mut streamed = String::new();
    let mut ids = Vec::new();
    let mut done = None;
    while let Some(event) = stream.message().await.unwrap() {
        match event.event.unwrap() {
            pb::generate_stream_response::Event::Chunk(c) => {
                streamed.push_str(&c.text);
                ids.extend(c.token_ids);
            }
            pb::generate_stream_response::Event::Done(d) => done = Some(d),
        }
    }
    let done = done.expect("a final message");
    assert_eq!(streamed, done.text);
    assert_eq!(ids, done.token_ids);
    assert_eq!(done.token_ids, unary.token_ids);

    // Continue the unary call's session: the context grows by the reply and the new turn.
    let first_context = unary.usage.unwrap().context_tokens;
    let mut next = chat("And another one?");
    next.session_id = unary.session_id.clone();
    let second = client.generate(next).await.unwrap().into_inner();
    assert_eq!(second.session_id, unary.session_id);
    assert!(second.usage.unwrap().context_tokens > first_context + 5);
}
