//! Property tests (proptest) over what untrusted parties control: every field of a
//! `GenerateRequest` (validation must never panic and must enforce every bound), the
//! distributions a drafter or verifier sends (conversion must never panic and must only
//! accept proper distributions), and acceptance over any valid distributions (its
//! invariants hold for every input). Cases: 256 each by default; set PROPTEST_CASES for a
//! longer run (see the README's security section).

use proptest::prelude::*;
use specd_common::convert::distribution_from_proto;
use specd_model::SparseDist;
use specd_orchestrator::acceptance::{accept_greedy, accept_sampled};
use specd_orchestrator::request::{Input, Limits, validate};
use specd_proto::v1 as pb;

const VOCAB: usize = 64;

fn any_f32() -> impl Strategy<Value = f32> {
    prop_oneof![
        any::<f32>(),
        Just(f32::NAN),
        Just(f32::INFINITY),
        Just(-0.0f32),
        0.0f32..2.0
    ]
}

fn any_request() -> impl Strategy<Value = pb::GenerateRequest> {
    let text = prop_oneof![
        ".{0,40}",
        Just(String::new()),
        "[a-z ]{0,8}".prop_map(|s| s.repeat(5000))
    ];
    let input = prop_oneof![
        Just(None),
        text.clone()
            .prop_map(|t| Some(pb::generate_request::Input::Prompt(t))),
        prop::collection::vec((".{0,12}", text.clone()), 0..5).prop_map(|m| {
            Some(pb::generate_request::Input::Chat(pb::ChatMessages {
                messages: m
                    .into_iter()
                    .map(|(role, content)| pb::ChatMessage { role, content })
                    .collect(),
            }))
        }),
    ];
    let sampling = prop::option::of((any_f32(), any::<u32>(), any_f32()).prop_map(
        |(temperature, top_k, top_p)| pb::SamplingParams {
            temperature,
            top_k,
            top_p,
        },
    ));
    let speculation = prop::option::of(
        (any::<bool>(), any::<u32>(), any::<i32>(), any::<bool>()).prop_map(
            |(disable, max_k, drafter, fixed_k)| pb::SpeculationOptions {
                disable,
                max_k,
                drafter,
                fixed_k,
            },
        ),
    );
    (
        input,
        any::<u32>(),
        prop::collection::vec(".{0,10}", 0..12),
        sampling,
        prop::option::of(any::<u64>()),
        speculation,
        ".{0,8}",
    )
        .prop_map(
            |(input, max_tokens, stop, sampling, seed, speculation, session_id)| pb::GenerateRequest {
                input,
                max_tokens,
                stop,
                sampling,
                seed,
                speculation,
                session_id,
            },
        )
}

fn any_distribution() -> impl Strategy<Value = pb::Distribution> {
    use pb::distribution::Repr;
    let floats = || prop::collection::vec(any_f32(), 0..80);
    prop_oneof![
        Just(pb::Distribution { repr: None }),
        any::<u32>().prop_map(|id| pb::Distribution {
            repr: Some(Repr::Point(id % 100))
        }),
        (
            prop::collection::vec(0u32..100, 0..8),
            prop::collection::vec(any_f32(), 0..8)
        )
            .prop_map(|(ids, probs)| {
                pb::Distribution {
                    repr: Some(Repr::Sparse(pb::SparseDistribution { ids, probs })),
                }
            }),
        // Normalised, so the sum check passes and the rest is what decides.
        prop::collection::vec((0u32..6, 0.01f32..1.0), 1..8).prop_map(|pairs| {
            let total: f32 = pairs.iter().map(|p| p.1).sum();
            pb::Distribution {
                repr: Some(Repr::Sparse(pb::SparseDistribution {
                    ids: pairs.iter().map(|p| p.0).collect(),
                    probs: pairs.iter().map(|p| p.1 / total).collect(),
                })),
            }
        }),
        floats().prop_map(|values| pb::Distribution {
            repr: Some(Repr::Dense(pb::DenseDistribution { values }))
        }),
        floats().prop_map(|values| pb::Distribution {
            repr: Some(Repr::Logits(pb::DenseDistribution { values }))
        }),
    ]
}

/// A proper distribution over a few distinct ids of the vocabulary.
fn valid_dist() -> impl Strategy<Value = SparseDist> {
    prop::collection::btree_map(0u32..VOCAB as u32, 0.01f32..1.0, 1..6).prop_map(|m| {
        let total: f32 = m.values().sum();
        SparseDist {
            ids: m.keys().copied().collect(),
            probs: m.values().map(|p| p / total).collect(),
        }
    })
}

proptest! {
    #[test]
    fn validation_never_panics_and_enforces_every_bound(request in any_request()) {
        let limits = Limits::default();
        if let Ok(params) = validate(&request, &limits, VOCAB) {
            prop_assert!(params.max_tokens >= 1 && params.max_tokens <= limits.max_new_tokens);
            prop_assert!(params.max_k <= limits.max_k);
            prop_assert!(params.stop.len() <= limits.max_stop_strings);
            prop_assert!(params.stop.iter().all(|s| !s.is_empty() && s.len() <= limits.max_stop_bytes));
            let s = params.sampling;
            prop_assert!(s.temperature.is_finite() && s.temperature >= 0.0);
            prop_assert!(s.top_p.is_finite() && s.top_p > 0.0 && s.top_p <= 1.0);
            match params.input {
                Input::Prompt(p) => prop_assert!(!p.is_empty() && p.len() <= limits.max_prompt_bytes),
                Input::Chat(m) => {
                    prop_assert!(!m.is_empty() && m.len() <= limits.max_messages);
                    let bytes: usize = m.iter().map(|m| m.content.len()).sum();
                    prop_assert!(bytes <= limits.max_prompt_bytes);
                }
            }
        }
    }

    #[test]
    fn only_proper_distributions_are_accepted_from_the_wire(dist in any_distribution()) {
        if let Ok(d) = distribution_from_proto(&dist, VOCAB) {
            prop_assert!(!d.ids.is_empty());
            prop_assert_eq!(d.ids.len(), d.probs.len());
            prop_assert!(d.ids.iter().all(|&id| (id as usize) < VOCAB));
            let mut ids = d.ids.clone();
            ids.sort_unstable();
            ids.dedup();
            prop_assert_eq!(ids.len(), d.ids.len(), "duplicate ids");
            prop_assert!(d.probs.iter().all(|p| p.is_finite() && *p >= 0.0));
            let total: f64 = d.probs.iter().map(|&p| p as f64).sum();
            prop_assert!((total - 1.0).abs() <= 1e-3);
        }
    }

    #[test]
    fn acceptance_invariants_hold_for_any_distributions(
        steps in prop::collection::vec((0u32..VOCAB as u32, valid_dist(), valid_dist()), 0..8),
        last in valid_dist(),
        draws in prop::collection::vec(0.0f64..1.0, 32),
    ) {
        let draft: Vec<u32> = steps.iter().map(|s| s.0).collect();
        let q: Vec<SparseDist> = steps.iter().map(|s| s.1.clone()).collect();
        let mut p: Vec<SparseDist> = steps.iter().map(|s| s.2.clone()).collect();
        p.push(last);
        let mut i = 0;
        let outcome = accept_sampled(&draft, &q, &p, &mut || { i += 1; draws[(i - 1) % draws.len()] });
        prop_assert!(outcome.accepted <= draft.len());
        let tokens = outcome.tokens(&draft);
        prop_assert_eq!(tokens.len(), outcome.accepted + 1);
        prop_assert_eq!(&tokens[..outcome.accepted], &draft[..outcome.accepted]);
        // Every accepted draft had mass under its q; the last token has mass under p there.
        for k in 0..outcome.accepted {
            prop_assert!(q[k].prob(draft[k]) > 0.0);
        }
        prop_assert!(p[outcome.accepted].prob(outcome.next) > 0.0);
        // Greedy: the agreeing prefix, then the target's token.
        let target: Vec<u32> = p.iter().map(|d| d.ids[0]).collect();
        let greedy = accept_greedy(&draft, &target);
        prop_assert!(draft[..greedy.accepted] == target[..greedy.accepted]);
        prop_assert_eq!(greedy.next, target[greedy.accepted]);
    }
}
