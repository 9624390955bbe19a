//! Property test of the engine's cache bookkeeping (longest-common-prefix reuse, truncation
//! on divergence, LRU eviction under a memory bound, prefixes copied between sessions, whose
//! contexts all start alike): for any sequence of requests — sessions that grow, roll back,
//! diverge, are released or evicted — every answer is bit-identical to scoring the same
//! context from nothing. The cache may only ever be an optimisation.
//! Cases: 32 by default; PROPTEST_CASES for a longer run.

use proptest::prelude::*;
use specd_model::synthetic::{SyntheticSpec, vocab_size, write_tiny_llama};
use specd_model::{Engine, EngineOptions, ScoreRequest};

#[derive(Debug, Clone)]
enum Op {
    /// Session `s` scores its context extended by `grow` tokens after cutting `cut` tokens.
    Score {
        session: u8,
        cut: usize,
        grow: Vec<u32>,
    },
    Release {
        session: u8,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let token = 3u32..vocab_size() as u32;
    prop_oneof![
        6 => (0u8..4, 0usize..6, prop::collection::vec(token, 1..6))
            .prop_map(|(session, cut, grow)| Op::Score { session, cut, grow }),
        1 => (0u8..4).prop_map(|session| Op::Release { session }),
    ]
}

fn engine(max_cache_bytes: usize) -> (tempfile::NamedTempFile, Engine) {
    let file = tempfile::NamedTempFile::new().unwrap();
    write_tiny_llama(file.path(), &SyntheticSpec::default()).unwrap();
    let loaded = specd_model::load(
        file.path(),
        EngineOptions {
            max_cache_bytes,
            ..EngineOptions::default()
        },
    )
    .unwrap();
    (file, loaded.engine)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: std::env::var("PROPTEST_CASES").ok().and_then(|c| c.parse().ok()).unwrap_or(32), ..ProptestConfig::default() })]

    #[test]
    fn cached_answers_equal_fresh_ones(ops in prop::collection::vec(op(), 1..24), bound in prop_oneof![Just(0usize), Just(20_000), Just(1 << 30)]) {
        let (_file, cached) = engine(bound);
        let (_file2, fresh) = engine(0);
        let mut contexts: Vec<Vec<u32>> = vec![vec![1]; 4];
        for (n, op) in ops.into_iter().enumerate() {
            match op {
                Op::Release { session } => {
                    cached.release(&format!("s{session}"));
                    contexts[session as usize] = vec![1];
                }
                Op::Score { session, cut, grow } => {
                    let context = &mut contexts[session as usize];
                    let keep = context.len().saturating_sub(cut).max(1);
                    context.truncate(keep);
                    context.extend(grow);
                    let logits_from = context.len().saturating_sub(3);
                    let request = |sequence: String| ScoreRequest {
                        sequence,
                        context: context.clone(),
                        logits_from,
                    };
                    let got = cached.score_blocking(request(format!("s{session}"))).unwrap();
                    // A sequence name never seen before, in an engine holding no other
                    // sequence (each is released), so nothing is cached or shared.
                    let want = fresh.score_blocking(request(format!("fresh{n}"))).unwrap();
                    fresh.release(&format!("fresh{n}"));
                    prop_assert_eq!(want.reused, 0);
                    prop_assert_eq!(got.reused + got.computed, context.len());
                    prop_assert!(got.logits == want.logits, "cached and fresh logits differ at op {}", n);
                }
            }
        }
    }
}
