//! Engine tests on a tiny random model: queue bounds, chunked prefill, batching.

use super::*;
use std::time::Duration;

use crate::synthetic::{SyntheticSpec, write_tiny_llama};

fn tiny_engine(options: EngineOptions) -> (tempfile::NamedTempFile, LoadedModel) {
    engine_of(&SyntheticSpec::default(), options)
}

fn engine_of(spec: &SyntheticSpec, options: EngineOptions) -> (tempfile::NamedTempFile, LoadedModel) {
    let file = tempfile::NamedTempFile::new().unwrap();
    write_tiny_llama(file.path(), spec).unwrap();
    let loaded = load(file.path(), options).unwrap();
    (file, loaded)
}

#[test]
fn a_full_queue_refuses_at_once_and_the_admitted_jobs_complete() {
    let (_file, loaded) = tiny_engine(EngineOptions {
        max_queue: 1,
        max_batch_tokens: 1,
        ..EngineOptions::default()
    });
    let engine = loaded.engine;
    let context: Vec<u32> = (0..200).map(|i| 3 + (i % 250)).collect();
    let mut admitted = Vec::new();
    let mut refused = 0;
    let started = Instant::now();
    for i in 0..8 {
        match engine.submit(ScoreRequest {
            sequence: format!("s{i}"),
            context: context.clone(),
            logits_from: context.len() - 1,
        }) {
            Ok(receiver) => admitted.push(receiver),
            Err(ModelError::Overloaded) => refused += 1,
            Err(other) => panic!("{other}"),
        }
    }
    // Refusals are immediate: eight submissions take no forward pass's time.
    assert!(
        started.elapsed() < Duration::from_millis(50),
        "{:?}",
        started.elapsed()
    );
    // One job runs and one waits (a third may slip in as the first is taken): the
    // others are refused.
    assert!(refused >= 5, "refused {refused} of 8 with a queue of 1");
    for receiver in admitted {
        let scores = receiver.blocking_recv().unwrap().unwrap();
        assert_eq!(scores.logits.len(), scores.vocab);
    }
}

fn request(sequence: &str, context: &[u32]) -> ScoreRequest {
    ScoreRequest {
        sequence: sequence.into(),
        context: context.to_vec(),
        logits_from: context.len() - 1,
    }
}

#[test]
fn a_chunked_prompt_gives_the_same_logits_and_shares_its_passes() {
    let prompt: Vec<u32> = (0..200).map(|i| 3 + (i * 7 % 250)).collect();
    let (_whole_file, whole) = tiny_engine(EngineOptions {
        prefill_chunk: 0,
        ..EngineOptions::default()
    });
    let expected = whole.engine.score_blocking(request("a", &prompt)).unwrap();
    let (_file, chunked) = tiny_engine(EngineOptions {
        prefill_chunk: 16,
        ..EngineOptions::default()
    });
    let long = chunked.engine.submit(request("long", &prompt)).unwrap();
    let short = chunked.engine.submit(request("short", &[5, 6, 7])).unwrap();
    let short = short.blocking_recv().unwrap().unwrap();
    let long = long.blocking_recv().unwrap().unwrap();
    assert_eq!(long.logits, expected.logits, "chunking must not change a logit");
    assert_eq!((long.computed, long.reused), (200, 0));
    // The short job ran beside a chunk of the long prompt, not after all of it, and is
    // told that the pass held a chunk (at most 16 tokens) of another sequence's prompt; the
    // long prompt's last chunk ran alone.
    assert_eq!(short.batch_size, 2);
    assert!(
        (1..=16).contains(&short.others_prompt_tokens),
        "{}",
        short.others_prompt_tokens
    );
    assert_eq!(long.others_prompt_tokens, 0);
}

#[test]
fn two_jobs_for_one_sequence_both_complete() {
    let (_file, loaded) = tiny_engine(EngineOptions::default());
    let context: Vec<u32> = (0..40).map(|i| 3 + i).collect();
    let first = loaded.engine.submit(request("same", &context)).unwrap();
    let second = loaded.engine.submit(request("same", &context[..30])).unwrap();
    let third = loaded.engine.submit(request("other", &context)).unwrap();
    for receiver in [first, second, third] {
        let scores = receiver.blocking_recv().unwrap().unwrap();
        assert_eq!(scores.logits.len(), scores.vocab);
    }
}

#[test]
fn a_batch_window_collects_jobs_that_arrive_during_it() {
    let (_file, loaded) = tiny_engine(EngineOptions {
        batch_wait: Duration::from_millis(300),
        ..EngineOptions::default()
    });
    let first = loaded.engine.submit(request("a", &[3, 4, 5])).unwrap();
    std::thread::sleep(Duration::from_millis(30));
    let second = loaded.engine.submit(request("b", &[6, 7, 8])).unwrap();
    for receiver in [first, second] {
        assert_eq!(receiver.blocking_recv().unwrap().unwrap().batch_size, 2);
    }
}

#[test]
fn chunked_prompts_survive_their_caches_being_evicted_between_chunks() {
    // A one-byte cache bound keeps only the most recently used cache, so of two prompts
    // chunked side by side one loses its earlier chunks every pass and recomputes them.
    let prompt_a: Vec<u32> = (0..120).map(|i| 3 + (i * 7 % 250)).collect();
    let prompt_b: Vec<u32> = (0..120).map(|i| 3 + (i * 11 % 250)).collect();
    let (_whole_file, whole) = tiny_engine(EngineOptions::default());
    let expected_a = whole.engine.score_blocking(request("a", &prompt_a)).unwrap();
    let expected_b = whole.engine.score_blocking(request("b", &prompt_b)).unwrap();
    let (_file, tight) = tiny_engine(EngineOptions {
        prefill_chunk: 16,
        max_cache_bytes: 1,
        ..EngineOptions::default()
    });
    let a = tight.engine.submit(request("a", &prompt_a)).unwrap();
    let b = tight.engine.submit(request("b", &prompt_b)).unwrap();
    let (a, b) = (
        a.blocking_recv().unwrap().unwrap(),
        b.blocking_recv().unwrap().unwrap(),
    );
    assert_eq!(a.logits, expected_a.logits);
    assert_eq!(b.logits, expected_b.logits);
    assert!(a.reused <= prompt_a.len() && b.reused <= prompt_b.len());
}

#[test]
fn a_sequence_starts_from_another_sequences_cached_prefix_with_the_same_logits() {
    let system: Vec<u32> = (0..100).map(|i| 3 + (i * 7 % 250)).collect();
    let with_question = |question: u32| -> Vec<u32> {
        let mut context = system.clone();
        context.extend((0..20).map(|i| 3 + (question * 13 + i) % 250));
        context
    };
    let (first, second) = (with_question(1), with_question(2));
    // Head size 16 keeps keys by position; 64 in tiles of 16 positions on CPUs with SIMD
    // attention, and 100 shared positions end inside a tile.
    for n_head in [4, 1] {
        let spec = SyntheticSpec {
            n_head,
            n_head_kv: 1,
            ..SyntheticSpec::default()
        };
        let (_fresh_file, fresh) = engine_of(&spec, EngineOptions::default());
        let expected = fresh.engine.score_blocking(request("b", &second)).unwrap();
        assert_eq!((expected.computed, expected.reused), (120, 0));

        let (_file, loaded) = engine_of(&spec, EngineOptions::default());
        loaded.engine.score_blocking(request("a", &first)).unwrap();
        let shared = loaded.engine.score_blocking(request("b", &second)).unwrap();
        assert_eq!(
            shared.logits, expected.logits,
            "a copied prefix must not change a logit"
        );
        assert_eq!((shared.computed, shared.reused), (20, 100));
        // The donor's own cache is untouched: its next step reuses all of it.
        let mut next = first.clone();
        next.push(9);
        let again = loaded.engine.score_blocking(request("a", &next)).unwrap();
        assert_eq!((again.computed, again.reused), (1, 120));
    }
}

#[test]
fn without_prefix_sharing_a_sequence_reuses_only_its_own_cache() {
    let (_file, loaded) = tiny_engine(EngineOptions {
        share_prefixes: false,
        ..EngineOptions::default()
    });
    let context: Vec<u32> = (0..100).map(|i| 3 + (i * 7 % 250)).collect();
    let first = loaded.engine.score_blocking(request("a", &context)).unwrap();
    let other = loaded.engine.score_blocking(request("b", &context)).unwrap();
    assert_eq!((other.computed, other.reused), (100, 0), "nothing copied from a");
    assert_eq!(other.logits, first.logits);
    let mut next = context.clone();
    next.push(9);
    let own = loaded.engine.score_blocking(request("a", &next)).unwrap();
    assert_eq!(
        (own.computed, own.reused),
        (1, 100),
        "a's own cache still serves a"
    );
}

#[test]
fn the_pass_log_keeps_each_pass_while_recording_and_only_then() {
    let (_file, loaded) = tiny_engine(EngineOptions {
        prefill_chunk: 0,
        share_prefixes: false,
        ..EngineOptions::default()
    });
    let engine = &loaded.engine;
    let context: Vec<u32> = (0..20).map(|i| 3 + (i * 7 % 250)).collect();
    engine.score_blocking(request("before", &context)).unwrap();
    engine.start_pass_log();
    // A prompt (logits at its last position), then three drafts verified at once.
    engine.score_blocking(request("a", &context)).unwrap();
    let mut verified = context.clone();
    verified.extend([5, 6, 7, 8]);
    engine
        .score_blocking(ScoreRequest {
            sequence: "a".into(),
            context: verified.clone(),
            logits_from: context.len(),
        })
        .unwrap();
    let log = engine.take_pass_log();
    let shapes: Vec<_> = log
        .iter()
        .map(|p| (p.sequences, p.tokens, p.prompt_tokens))
        .collect();
    assert_eq!(shapes, [(1, 20, 19), (1, 4, 0)]);
    assert!(log.iter().all(|p| p.forward_seconds > 0.0));
    // Not recording after the take, and a new start begins from an empty log.
    engine.score_blocking(request("b", &context)).unwrap();
    assert!(engine.take_pass_log().is_empty());
    engine.start_pass_log();
    engine.score_blocking(request("c", &context)).unwrap();
    assert_eq!(engine.take_pass_log().len(), 1);
}

/// Submits three 48-token prompts together to an engine computing 16 prompt tokens per pass
/// in `order`, and returns the pass that answered each. The first pass waits for all three
/// (a busy test machine could otherwise start it with the first alone).
fn passes_answering_three_prompts(order: PrefillOrder) -> Vec<u64> {
    let (_file, loaded) = tiny_engine(EngineOptions {
        prefill_chunk: 16,
        prefill_order: order,
        batch_wait: Duration::from_millis(30),
        ..EngineOptions::default()
    });
    let prompt = |seed: u32| -> Vec<u32> { (0..49).map(|i| 3 + (i * seed % 250)).collect() };
    let receivers: Vec<_> = [7, 11, 13]
        .iter()
        .enumerate()
        .map(|(i, &seed)| {
            loaded
                .engine
                .submit(request(&format!("p{i}"), &prompt(seed)))
                .unwrap()
        })
        .collect();
    receivers
        .into_iter()
        .map(|r| r.blocking_recv().unwrap().unwrap().pass)
        .collect()
}

#[test]
fn prompts_that_arrive_together_are_computed_one_after_another() {
    // The first finishes in the third pass and the others follow, rather than all three
    // finishing together in the last.
    assert_eq!(
        passes_answering_three_prompts(PrefillOrder::LeastLeft),
        [3, 6, 9],
        "passes that answered each prompt"
    );
}

#[test]
fn prompts_take_turns_when_told_to() {
    // A chunk each per pass, so all three finish in the last passes.
    assert_eq!(
        passes_answering_three_prompts(PrefillOrder::Turns),
        [7, 8, 9],
        "passes that answered each prompt"
    );
}

#[test]
fn prefill_orders_parse_from_their_flag_values() {
    assert_eq!("least-left".parse(), Ok(PrefillOrder::LeastLeft));
    assert_eq!("turns".parse(), Ok(PrefillOrder::Turns));
    assert!(
        "fifo"
            .parse::<PrefillOrder>()
            .unwrap_err()
            .contains("least-left or turns")
    );
}
