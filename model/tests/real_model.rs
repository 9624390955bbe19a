//! Agreement with llama.cpp (an independent implementation) on the real default model:
//! tokenizer ids, top-5 logits at every prompt position, and greedy continuations.
//! Fixtures come from `scripts/reference/make_fixtures.py`. The model is fetched once
//! (cached outside the repository) if it is not there.

use std::sync::OnceLock;

use serde::Deserialize;
use specd_model::{EngineOptions, LoadedModel, ScoreRequest, argmax};

/// Largest allowed |ours - llama.cpp| for a logit. Both quantise activations to 8 bits before
/// the 4-bit matmuls, but their kernels sum in different orders, and a last-bit difference
/// in one layer's output can flip an 8-bit rounding of the next layer's input, so the gaps
/// grow through 30 layers. Measured on logits of ~25-37 (665 compared): 0.74 with the
/// portable kernels, 1.03 and 1.33 with AVX2 on two AMD EPYC kinds, 1.22 with AVX-512. The
/// 1.33 is one position (prompt 8, position 17), where the portable kernels are off by 0.74
/// on the same two tokens in the same direction, behind a top-1 lead of 7.
const LOGIT_TOLERANCE: f32 = 1.5;
/// Where llama.cpp's top-1 leads its top-2 by more than this, both must pick the same token.
const CLEAR_MARGIN: f32 = 2.0 * LOGIT_TOLERANCE;

#[derive(Deserialize)]
struct TokenizerFixture {
    cases: Vec<TokenizerCase>,
}

#[derive(Deserialize)]
struct TokenizerCase {
    text: String,
    ids: Vec<u32>,
}

#[derive(Deserialize)]
struct ReferenceFixture {
    prompts: Vec<ReferencePrompt>,
}

#[derive(Deserialize)]
struct ReferencePrompt {
    text: String,
    ids: Vec<u32>,
    top: Vec<TopAt>,
    greedy: Vec<u32>,
    greedy_margins: Vec<f32>,
}

#[derive(Deserialize)]
struct TopAt {
    pos: usize,
    ids: Vec<u32>,
    logits: Vec<f32>,
}

fn model() -> &'static LoadedModel {
    static MODEL: OnceLock<LoadedModel> = OnceLock::new();
    MODEL.get_or_init(|| {
        let path = specd_model::fetch::ensure_default_model().expect("fetch the default model");
        specd_model::load(&path, EngineOptions::default()).expect("load the default model")
    })
}

fn fixture<T: for<'de> Deserialize<'de>>(name: &str) -> T {
    let path = format!("{}/tests/fixtures/{name}", env!("CARGO_MANIFEST_DIR"));
    serde_json::from_str(&std::fs::read_to_string(&path).expect(&path)).expect(&path)
}

#[test]
fn tokenizer_matches_llama_cpp_on_every_fixture_string() {
    let fixture: TokenizerFixture = fixture("tokenizer_smollm2.json");
    assert!(fixture.cases.len() >= 30);
    let tokenizer = &model().tokenizer;
    let mismatches: Vec<String> = fixture
        .cases
        .iter()
        .filter_map(|case| {
            let ours = tokenizer.encode(&case.text).unwrap();
            (ours != case.ids).then(|| format!("{:?}: ours {ours:?}, llama.cpp {:?}", case.text, case.ids))
        })
        .collect();
    assert!(
        mismatches.is_empty(),
        "{} mismatches:\n{}",
        mismatches.len(),
        mismatches.join("\n")
    );
    // Decoding round-trips every case, at once and streamed id by id (as generation streams
    // text): the deltas spell the text and never hold half a character.
    for case in &fixture.cases {
        assert_eq!(tokenizer.decode(&case.ids).unwrap(), case.text);
        let mut decoder = tokenizer.stream_decoder();
        let deltas: Vec<String> = case.ids.iter().map(|&id| decoder.push(id).unwrap()).collect();
        assert_eq!(deltas.concat(), case.text, "{deltas:?}");
        assert!(!deltas.iter().any(|d| d.contains('\u{FFFD}')), "{deltas:?}");
    }
}

#[test]
fn top5_logits_match_llama_cpp_at_every_prompt_position() {
    let fixture: ReferenceFixture = fixture("reference_smollm2.json");
    let model = model();
    let mut worst = 0.0f32;
    let mut compared = 0;
    for (n, prompt) in fixture.prompts.iter().enumerate() {
        assert_eq!(model.tokenizer.encode(&prompt.text).unwrap(), prompt.ids);
        let scores = model
            .engine
            .score_blocking(ScoreRequest {
                sequence: format!("top5-{n}"),
                context: prompt.ids.clone(),
                logits_from: 0,
            })
            .unwrap();
        for top in &prompt.top {
            let row = scores.row(top.pos);
            for (&id, &theirs) in top.ids.iter().zip(&top.logits) {
                worst = worst.max((row[id as usize] - theirs).abs());
                compared += 1;
            }
            if top.logits[0] - top.logits[1] > CLEAR_MARGIN {
                assert_eq!(argmax(row), top.ids[0], "prompt {n} position {}", top.pos);
            }
        }
    }
    eprintln!("compared {compared} top-5 logits; max |ours - llama.cpp| = {worst:.4}");
    assert!(
        worst < LOGIT_TOLERANCE,
        "max logit difference {worst} >= {LOGIT_TOLERANCE}"
    );
}

/// llama.cpp's greedy continuation, fed to our model in one pass: at every generated position
/// its token must be our argmax, or within the tolerance of it where the call is close.
#[test]
fn llama_cpp_greedy_continuations_are_greedy_under_our_model() {
    let fixture: ReferenceFixture = fixture("reference_smollm2.json");
    let model = model();
    let (mut positions, mut argmax_agree) = (0, 0);
    for (n, prompt) in fixture.prompts.iter().enumerate() {
        let mut context = prompt.ids.clone();
        context.extend(&prompt.greedy[..prompt.greedy.len() - 1]);
        let scores = model
            .engine
            .score_blocking(ScoreRequest {
                sequence: format!("forced-{n}"),
                logits_from: prompt.ids.len() - 1,
                context,
            })
            .unwrap();
        for (step, &theirs) in prompt.greedy.iter().enumerate() {
            let row = scores.row(step);
            let ours = argmax(row);
            positions += 1;
            argmax_agree += usize::from(ours == theirs);
            let gap = row[ours as usize] - row[theirs as usize];
            assert!(
                gap <= CLEAR_MARGIN,
                "prompt {n} step {step}: llama.cpp chose {theirs}, ours {ours} leads it by {gap}"
            );
        }
    }
    eprintln!("llama.cpp's greedy token is our argmax at {argmax_agree}/{positions} positions");
    assert!(argmax_agree * 10 >= positions * 9, "{argmax_agree}/{positions}");
}

/// Free-running greedy decoding, one token per forward pass (the incremental cache path):
/// identical to llama.cpp until the first step where llama.cpp itself had a near-tie, and
/// identical for at least 30% of all generated tokens. (Where a near-tie falls depends on
/// each implementation's summation order — our AVX2 and AVX-512 kernels differ in it — so
/// the share is a guard against a broken model, not a precision figure: measured 52% (AVX2)
/// and 60% (AVX-512) of 400.)
#[test]
fn greedy_continuations_match_llama_cpp() {
    let fixture: ReferenceFixture = fixture("reference_smollm2.json");
    let model = model();
    let (mut agreed_total, mut generated_total) = (0, 0);
    let mut report = Vec::new();
    for (n, prompt) in fixture.prompts.iter().enumerate() {
        let mut context = prompt.ids.clone();
        let mut generated = Vec::new();
        for _ in 0..prompt.greedy.len() {
            let scores = model
                .engine
                .score_blocking(ScoreRequest {
                    sequence: format!("greedy-{n}"),
                    logits_from: context.len() - 1,
                    context: context.clone(),
                })
                .unwrap();
            let next = argmax(scores.row(0));
            generated.push(next);
            context.push(next);
        }
        let agreed = generated
            .iter()
            .zip(&prompt.greedy)
            .take_while(|(a, b)| a == b)
            .count();
        if agreed < generated.len() {
            let margin = prompt.greedy_margins[agreed];
            assert!(
                margin < CLEAR_MARGIN,
                "prompt {n} diverged at step {agreed} where llama.cpp's margin was {margin}: ours {:?}, llama.cpp {:?}",
                &generated[..=agreed],
                &prompt.greedy[..=agreed]
            );
        }
        report.push(format!("{agreed}/{}", generated.len()));
        agreed_total += agreed;
        generated_total += generated.len();
    }
    eprintln!(
        "greedy tokens identical to llama.cpp per prompt: {}",
        report.join(", ")
    );
    assert!(
        agreed_total * 10 >= generated_total * 3,
        "only {agreed_total}/{generated_total} tokens agree: {report:?}"
    );
}
