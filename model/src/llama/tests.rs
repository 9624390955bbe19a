//! Forward-pass properties on tiny random models: one pass == token by token, truncate and
//! re-append == fresh, batched == alone, every supported tensor encoding loads and agrees
//! with f32, and malformed files are refused with precise errors.

use candle_core::Device;
use candle_core::quantized::GgmlDType;

use super::*;
use crate::synthetic::{SyntheticSpec, tiny_llama_bytes};

/// Logits of the same positions computed along different paths (one pass or token by token,
/// alone or batched, fresh or after a rollback) must be bit-identical: greedy speculative
/// decoding and failover depend on it.
const SAME_PATH_TOLERANCE: f32 = 0.0;

fn load(spec: &SyntheticSpec) -> Llama {
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), tiny_llama_bytes(spec).unwrap()).unwrap();
    Llama::load(&mut GgufFile::open(file.path()).unwrap(), &Device::Cpu).unwrap()
}

fn open_error(bytes: &[u8]) -> ModelError {
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), bytes).unwrap();
    match GgufFile::open(file.path()).and_then(|mut f| Llama::load(&mut f, &Device::Cpu)) {
        Ok(_) => panic!("malformed model loaded"),
        Err(e) => e,
    }
}

fn rows(t: &Tensor) -> Vec<Vec<f32>> {
    t.to_vec2::<f32>().unwrap()
}

fn max_abs_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .flat_map(|(x, y)| x.iter().zip(y).map(|(p, q)| (p - q).abs()))
        .fold(0.0, f32::max)
}

fn score(model: &Llama, cache: &mut KvCache, tokens: &[u32], logits_at: &[usize]) -> Vec<Vec<f32>> {
    let mut steps = [SequenceStep {
        cache,
        tokens,
        logits_at,
    }];
    rows(&model.forward(&mut steps).unwrap()[0])
}

fn one_pass(model: &Llama, tokens: &[u32]) -> Vec<Vec<f32>> {
    let mut cache = model.new_cache().unwrap();
    let all: Vec<usize> = (0..tokens.len()).collect();
    score(model, &mut cache, tokens, &all)
}

const TOKENS: [u32; 12] = [5, 80, 17, 200, 3, 99, 150, 42, 7, 260, 1, 64];

#[test]
fn one_pass_equals_token_by_token() {
    for dtype in [GgmlDType::F32, GgmlDType::Q4_1, GgmlDType::Q8_0] {
        one_pass_equals_token_by_token_for(dtype);
    }
}

fn one_pass_equals_token_by_token_for(dtype: GgmlDType) {
    let model = load(&SyntheticSpec {
        dtype,
        ..SyntheticSpec::default()
    });
    let batched = one_pass(&model, &TOKENS);
    let mut cache = model.new_cache().unwrap();
    let incremental: Vec<Vec<f32>> = TOKENS
        .iter()
        .flat_map(|t| score(&model, &mut cache, &[*t], &[0]))
        .collect();
    let diff = max_abs_diff(&batched, &incremental);
    assert!(diff <= SAME_PATH_TOLERANCE, "max abs diff {diff}");
    for (a, b) in batched.iter().zip(&incremental) {
        assert_eq!(crate::argmax(a), crate::argmax(b));
    }
    assert_eq!(cache.tokens(), &TOKENS);
}

/// A pass of 16 rows or more makes and quantises its activations once on the calling thread;
/// a pass of fewer rows on each pool thread (`QuantMatrix::matmul_many_from`). Both give the
/// same logits bit for bit.
#[test]
fn a_pass_of_many_rows_equals_passes_of_a_few() {
    for dtype in [GgmlDType::Q4_1, GgmlDType::Q8_0] {
        let model = load(&SyntheticSpec {
            dtype,
            ..SyntheticSpec::default()
        });
        let tokens: Vec<u32> = (0..20u32).map(|i| (i * 37 + 5) % 256).collect();
        let together = one_pass(&model, &tokens);
        let mut cache = model.new_cache().unwrap();
        let mut in_threes = Vec::new();
        for chunk in tokens.chunks(3) {
            in_threes.extend(score(
                &model,
                &mut cache,
                chunk,
                &(0..chunk.len()).collect::<Vec<_>>(),
            ));
        }
        assert_eq!(together, in_threes, "{dtype:?}");
    }
}

#[test]
fn logits_at_a_subset_match_the_full_pass() {
    let model = load(&SyntheticSpec::default());
    let full = one_pass(&model, &TOKENS);
    let mut cache = model.new_cache().unwrap();
    let some = score(&model, &mut cache, &TOKENS, &[11, 2, 7]);
    let expected = vec![full[11].clone(), full[2].clone(), full[7].clone()];
    assert!(max_abs_diff(&some, &expected) <= SAME_PATH_TOLERANCE);
}

#[test]
fn truncate_and_reappend_equals_fresh() {
    let model = load(&SyntheticSpec::default());
    let mut cache = model.new_cache().unwrap();
    score(&model, &mut cache, &TOKENS, &[0]);
    // Roll back to 5 tokens, then append a different continuation.
    cache.truncate(5);
    assert_eq!(cache.len(), 5);
    let continuation = [33u32, 44, 55, 66];
    let after_rollback = score(&model, &mut cache, &continuation, &[0, 1, 2, 3]);
    let fresh_tokens: Vec<u32> = TOKENS[..5].iter().chain(&continuation).copied().collect();
    let fresh = one_pass(&model, &fresh_tokens);
    let diff = max_abs_diff(&after_rollback, &fresh[5..]);
    assert!(diff <= SAME_PATH_TOLERANCE, "max abs diff {diff}");
}

#[test]
fn batched_sequences_equal_each_alone() {
    let model = load(&SyntheticSpec::default());
    let prefixes: [&[u32]; 3] = [&TOKENS[..3], &TOKENS[..9], &[]];
    let news: [&[u32]; 3] = [&[70, 71, 72, 73], &[8], &[100, 101]];
    // Alone: prefill each prefix, then score the new tokens.
    let mut alone = Vec::new();
    let mut caches = Vec::new();
    for (prefix, new) in prefixes.iter().zip(news) {
        let mut a = model.new_cache().unwrap();
        let mut b = model.new_cache().unwrap();
        if !prefix.is_empty() {
            score(&model, &mut a, prefix, &[0]);
            score(&model, &mut b, prefix, &[0]);
        }
        let all: Vec<usize> = (0..new.len()).collect();
        alone.push(score(&model, &mut a, new, &all));
        caches.push(b);
    }
    let logits_at: Vec<Vec<usize>> = news.iter().map(|n| (0..n.len()).collect()).collect();
    let mut steps: Vec<SequenceStep<'_>> = caches
        .iter_mut()
        .zip(news.iter().zip(&logits_at))
        .map(|(cache, (tokens, at))| SequenceStep {
            cache,
            tokens,
            logits_at: at,
        })
        .collect();
    let together = model.forward(&mut steps).unwrap();
    for (one, batched) in alone.iter().zip(&together) {
        let diff = max_abs_diff(one, &rows(batched));
        assert!(diff <= SAME_PATH_TOLERANCE, "max abs diff {diff}");
    }
}

#[test]
fn every_supported_encoding_loads_and_tracks_f32() {
    // K-quants need rows that are multiples of 256.
    let base = SyntheticSpec {
        n_embd: 256,
        n_ff: 512,
        n_head: 4,
        n_head_kv: 2,
        ..SyntheticSpec::default()
    };
    let reference = one_pass(&load(&base), &TOKENS);
    let scale = reference.iter().flatten().fold(0.0f32, |m, x| m.max(x.abs()));
    // Relative error bound per encoding: coarser formats drift more.
    for (dtype, bound) in [
        (GgmlDType::F16, 0.01),
        (GgmlDType::Q8_0, 0.05),
        (GgmlDType::Q6K, 0.08),
        (GgmlDType::Q4K, 0.25),
        (GgmlDType::Q4_1, 0.25),
        (GgmlDType::Q4_0, 0.25),
    ] {
        let model = load(&SyntheticSpec {
            dtype,
            ..base.clone()
        });
        let logits = one_pass(&model, &TOKENS);
        let rel = max_abs_diff(&logits, &reference) / scale;
        assert!(rel < bound, "{dtype:?}: relative logit error {rel} >= {bound}");
    }
}

#[test]
fn tied_embeddings_use_the_embedding_as_lm_head() {
    let model = load(&SyntheticSpec {
        tied_embeddings: true,
        ..SyntheticSpec::default()
    });
    let logits = one_pass(&model, &TOKENS);
    assert_eq!(logits[0].len(), crate::synthetic::vocab_size());
}

#[test]
fn another_architecture_is_refused() {
    let bytes = tiny_llama_bytes(&SyntheticSpec {
        architecture: "mamba".into(),
        ..SyntheticSpec::default()
    })
    .unwrap();
    let err = open_error(&bytes);
    assert!(
        matches!(err, ModelError::UnsupportedArchitecture { ref found } if found == "mamba"),
        "{err}"
    );
}

#[test]
fn a_missing_tensor_is_named() {
    let bytes = tiny_llama_bytes(&SyntheticSpec {
        omit_tensors: vec!["blk.1.ffn_up.weight".into()],
        ..SyntheticSpec::default()
    })
    .unwrap();
    let err = open_error(&bytes);
    assert!(
        matches!(err, ModelError::MissingTensor(ref n) if n == "blk.1.ffn_up.weight"),
        "{err}"
    );
}

#[test]
fn truncated_and_garbage_files_are_refused() {
    let bytes = tiny_llama_bytes(&SyntheticSpec::default()).unwrap();
    let err = open_error(&bytes[..bytes.len() - 100]);
    assert!(matches!(err, ModelError::Truncated { .. }), "{err}");
    let err = open_error(&bytes[..1000]);
    assert!(
        matches!(err, ModelError::InvalidGguf { .. } | ModelError::Truncated { .. }),
        "{err}"
    );
    let err = open_error(b"definitely not a gguf file");
    assert!(matches!(err, ModelError::InvalidGguf { .. }), "{err}");
}

#[test]
fn bad_steps_are_refused_without_touching_the_cache() {
    let model = load(&SyntheticSpec::default());
    let mut cache = model.new_cache().unwrap();
    score(&model, &mut cache, &TOKENS[..4], &[0]);
    for (tokens, at) in [
        (&[1u32, 9999][..], &[0usize][..]),
        (&[1, 2][..], &[2][..]),
        (&[][..], &[][..]),
    ] {
        let mut steps = [SequenceStep {
            cache: &mut cache,
            tokens,
            logits_at: at,
        }];
        assert!(model.forward(&mut steps).is_err());
    }
    assert_eq!(cache.tokens(), &TOKENS[..4]);
}

#[test]
fn context_overflow_is_an_error() {
    let model = load(&SyntheticSpec {
        context_length: 16,
        ..SyntheticSpec::default()
    });
    let mut cache = model.new_cache().unwrap();
    score(&model, &mut cache, &TOKENS, &[0]);
    let mut steps = [SequenceStep {
        cache: &mut cache,
        tokens: &TOKENS[..5],
        logits_at: &[0],
    }];
    let err = model.forward(&mut steps).unwrap_err();
    assert!(
        matches!(
            err,
            ModelError::ContextOverflow {
                requested: 17,
                limit: 16
            }
        ),
        "{err}"
    );
}
