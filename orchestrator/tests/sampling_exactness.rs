//! Sampled speculative decoding, through the full generator (drafter, verifier, acceptance),
//! draws from exactly the target model's distribution. The drafter is the target's weights
//! quantised to 4 bits, so its q is close to but not the target's p: drafts are often
//! accepted and often rejected. With top-k = 3
//! the exact distribution of the first two generated tokens is computable from the target's
//! own logits. A chi-square test compares the observed outcomes with it.

use std::collections::HashMap;
use std::sync::Arc;

use specd_drafter::{DrafterCore, LmDrafter, NgramConfig};
use specd_model::synthetic::{SyntheticSpec, write_tiny_llama};
use specd_model::{EngineOptions, SamplingParams, ScoreRequest, TextModel, warp};
use specd_orchestrator::Generator;
use specd_orchestrator::setup::GeneratorSettings;
use specd_proto::v1 as pb;
use specd_verifier::VerifierCore;

const RUNS: usize = 4_000;
const TOP_K: usize = 3;

/// Chi-square critical value for `dof` degrees of freedom at a false-failure rate of 1e-4
/// (Wilson–Hilferty approximation, z = 3.719).
fn chi_square_critical(dof: usize) -> f64 {
    let k = dof as f64;
    let z = 3.719;
    k * (1.0 - 2.0 / (9.0 * k) + z * (2.0 / (9.0 * k)).sqrt()).powi(3)
}

#[tokio::test(flavor = "multi_thread")]
async fn sampled_speculation_matches_the_target_distribution() {
    let dir = tempfile::tempdir().unwrap();
    let target_path = dir.path().join("target.gguf");
    let draft_path = dir.path().join("draft.gguf");
    write_tiny_llama(
        &target_path,
        &SyntheticSpec {
            seed: 11,
            ..SyntheticSpec::default()
        },
    )
    .unwrap();
    write_tiny_llama(
        &draft_path,
        &SyntheticSpec {
            seed: 11,
            dtype: candle_core::quantized::GgmlDType::Q4_0,
            ..SyntheticSpec::default()
        },
    )
    .unwrap();
    let target = specd_model::load(&target_path, EngineOptions::default()).unwrap();
    let draft = specd_model::load(&draft_path, EngineOptions::default()).unwrap();
    assert_eq!(target.tokenizer.identity(), draft.tokenizer.identity());

    let params = SamplingParams {
        temperature: 1.0,
        top_k: TOP_K,
        top_p: 1.0,
    };
    let prompt = "the";
    let prompt_ids = target.tokenizer.encode(prompt).unwrap();
    let eog = |t: u32| target.tokenizer.is_end_of_generation(t);

    // The exact distribution of outcomes (the first two tokens; generation ends at eog).
    let engine = target.engine.clone();
    let next = |context: Vec<u32>| {
        let engine = engine.clone();
        let scores = std::thread::spawn(move || {
            engine.score_blocking(ScoreRequest {
                sequence: "exact".into(),
                logits_from: context.len() - 1,
                context,
            })
        })
        .join()
        .unwrap()
        .unwrap();
        warp(scores.row(0), &params)
    };
    let mut expected: HashMap<Vec<u32>, f64> = HashMap::new();
    let first = next(prompt_ids.clone());
    for (&t1, &p1) in first.ids.iter().zip(&first.probs) {
        if eog(t1) {
            *expected.entry(vec![]).or_default() += p1 as f64;
            continue;
        }
        let second = next([prompt_ids.clone(), vec![t1]].concat());
        for (&t2, &p2) in second.ids.iter().zip(&second.probs) {
            let outcome = if eog(t2) { vec![t1] } else { vec![t1, t2] };
            *expected.entry(outcome).or_default() += p1 as f64 * p2 as f64;
        }
    }

    let generator = Generator::new(
        Arc::new(VerifierCore::new(target.engine.clone(), "in-process".into())),
        Some(Arc::new(DrafterCore::new(
            NgramConfig::default(),
            Some(LmDrafter::new(draft.engine.clone())),
        ))),
        TextModel {
            tokenizer: target.tokenizer.clone(),
            chat_template: target.chat_template.clone(),
            config: target.config.clone(),
        },
        GeneratorSettings {
            max_sessions: RUNS + 10,
            ..GeneratorSettings::default()
        },
    );
    let mut observed: HashMap<Vec<u32>, usize> = HashMap::new();
    let (mut proposed, mut accepted) = (0u32, 0u32);
    for seed in 0..RUNS as u64 {
        let request = pb::GenerateRequest {
            input: Some(pb::generate_request::Input::Prompt(prompt.into())),
            max_tokens: 3,
            sampling: Some(pb::SamplingParams {
                temperature: params.temperature,
                top_k: TOP_K as u32,
                top_p: 1.0,
            }),
            seed: Some(seed),
            speculation: Some(pb::SpeculationOptions {
                max_k: 2,
                drafter: pb::DrafterKind::Lm as i32,
                fixed_k: true,
                disable: false,
            }),
            ..Default::default()
        };
        let response = generator.generate(&request, None).await.unwrap();
        let stats = response.stats.unwrap();
        proposed += stats.proposed;
        accepted += stats.accepted;
        // The first two tokens (a third may follow; it is not part of the test).
        let first_two = response.token_ids[..response.token_ids.len().min(2)].to_vec();
        *observed.entry(first_two).or_default() += 1;
    }
    // The test only means something if drafts were both accepted and rejected.
    assert!(
        accepted > 0 && accepted < proposed,
        "accepted {accepted} of {proposed}"
    );
    let unexpected: Vec<_> = observed.keys().filter(|k| !expected.contains_key(*k)).collect();
    assert!(
        unexpected.is_empty(),
        "outcomes outside the target's support: {unexpected:?}"
    );
    let chi2: f64 = expected
        .iter()
        .map(|(outcome, p)| {
            let e = p * RUNS as f64;
            let o = *observed.get(outcome).unwrap_or(&0) as f64;
            (o - e).powi(2) / e
        })
        .sum();
    let critical = chi_square_critical(expected.len() - 1);
    eprintln!(
        "{} outcomes, chi-square {chi2:.2} (critical {critical:.2} at 1e-4); drafts accepted {accepted}/{proposed}",
        expected.len()
    );
    assert!(chi2 < critical, "chi-square {chi2} >= {critical}");
}
