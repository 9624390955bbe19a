//! Conversions between the model crate's sampling types and their wire forms, with the
//! validation a wire value needs before it is trusted.

use specd_model::{ModelInfo, SamplingParams, SparseDist};
use specd_proto::v1 as pb;

/// Below this share of the vocabulary a distribution travels as (id, prob) pairs; above it
/// as a dense array (4 bytes per token instead of ~8 per listed token).
const SPARSE_MAX_SHARE: usize = 2;

/// Wire sampling parameters to model ones; unset top_p (0) means 1.0 (off).
pub fn sampling_from_proto(params: Option<&pb::SamplingParams>) -> SamplingParams {
    match params {
        None => SamplingParams::GREEDY,
        Some(p) => SamplingParams {
            temperature: p.temperature,
            top_k: p.top_k as usize,
            top_p: if p.top_p == 0.0 { 1.0 } else { p.top_p },
        },
    }
}

pub fn sampling_to_proto(params: &SamplingParams) -> pb::SamplingParams {
    pb::SamplingParams {
        temperature: params.temperature,
        top_k: params.top_k as u32,
        top_p: params.top_p,
    }
}

/// The most compact exact wire form of a distribution.
pub fn distribution_to_proto(dist: &SparseDist, vocab: usize) -> pb::Distribution {
    use pb::distribution::Repr;
    let repr = if dist.len() == 1 {
        Repr::Point(dist.ids[0])
    } else if dist.len() * SPARSE_MAX_SHARE <= vocab {
        Repr::Sparse(pb::SparseDistribution {
            ids: dist.ids.clone(),
            probs: dist.probs.clone(),
        })
    } else {
        let mut values = vec![0.0f32; vocab];
        for (&id, &p) in dist.ids.iter().zip(&dist.probs) {
            values[id as usize] = p;
        }
        Repr::Dense(pb::DenseDistribution { values })
    };
    pb::Distribution { repr: Some(repr) }
}

/// A validated distribution from the wire: ids inside the vocabulary, probabilities finite,
/// non-negative and summing to 1 (within 1e-3).
pub fn distribution_from_proto(dist: &pb::Distribution, vocab: usize) -> Result<SparseDist, String> {
    use pb::distribution::Repr;
    let out = match &dist.repr {
        None => return Err("distribution has no representation".into()),
        Some(Repr::Point(id)) => SparseDist::point(*id),
        Some(Repr::Sparse(s)) => {
            if s.ids.len() != s.probs.len() || s.ids.is_empty() {
                return Err(format!(
                    "sparse distribution has {} ids and {} probs",
                    s.ids.len(),
                    s.probs.len()
                ));
            }
            let mut seen = std::collections::HashSet::with_capacity(s.ids.len());
            if let Some(id) = s.ids.iter().find(|&&id| !seen.insert(id)) {
                // Mass split over duplicates would make p(x) and q(x) wrong in acceptance.
                return Err(format!("sparse distribution lists token {id} twice"));
            }
            SparseDist {
                ids: s.ids.clone(),
                probs: s.probs.clone(),
            }
        }
        Some(Repr::Dense(d)) => {
            if d.values.len() != vocab {
                return Err(format!(
                    "dense distribution has {} values for a vocabulary of {vocab}",
                    d.values.len()
                ));
            }
            let mut ids: Vec<u32> = (0..vocab as u32)
                .filter(|&i| d.values[i as usize] > 0.0)
                .collect();
            ids.sort_by(|a, b| {
                d.values[*b as usize]
                    .total_cmp(&d.values[*a as usize])
                    .then(a.cmp(b))
            });
            let probs = ids.iter().map(|&i| d.values[i as usize]).collect();
            SparseDist { ids, probs }
        }
        Some(Repr::Logits(_)) => return Err("raw logits are not a distribution".into()),
    };
    if let Some(&id) = out.ids.iter().find(|&&id| id as usize >= vocab) {
        return Err(format!("token id {id} is outside the vocabulary ({vocab})"));
    }
    if out.probs.iter().any(|p| !p.is_finite() || *p < 0.0) {
        return Err("distribution has a negative or non-finite probability".into());
    }
    let total: f64 = out.probs.iter().map(|&p| p as f64).sum();
    if (total - 1.0).abs() > 1e-3 {
        return Err(format!("distribution sums to {total}, not 1"));
    }
    Ok(out)
}

/// The wire identity of a loaded model.
pub fn identity_of(info: &ModelInfo) -> pb::ModelIdentity {
    pb::ModelIdentity {
        name: info.name.clone(),
        architecture: info.architecture.clone(),
        tokenizer_identity: info.tokenizer_identity.clone(),
        vocab_size: info.vocab_size as u32,
        context_length: info.context_length as u32,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn distributions_round_trip_in_every_form() {
        let vocab = 10;
        let point = SparseDist::point(4);
        let sparse = SparseDist {
            ids: vec![3, 1],
            probs: vec![0.75, 0.25],
        };
        let dense = SparseDist {
            ids: vec![0, 1, 2, 3, 4, 5],
            probs: vec![0.5, 0.2, 0.1, 0.1, 0.05, 0.05],
        };
        for d in [point, sparse, dense] {
            let wire = distribution_to_proto(&d, vocab);
            let back = distribution_from_proto(&wire, vocab).unwrap();
            for id in 0..vocab as u32 {
                assert_eq!(back.prob(id), d.prob(id));
            }
        }
    }

    #[test]
    fn invalid_distributions_are_refused() {
        use pb::distribution::Repr;
        let wire = |repr| pb::Distribution { repr: Some(repr) };
        let sparse =
            |ids: Vec<u32>, probs: Vec<f32>| wire(Repr::Sparse(pb::SparseDistribution { ids, probs }));
        assert!(distribution_from_proto(&pb::Distribution { repr: None }, 10).is_err());
        assert!(distribution_from_proto(&wire(Repr::Point(10)), 10).is_err());
        assert!(distribution_from_proto(&sparse(vec![1], vec![0.5, 0.5]), 10).is_err());
        assert!(distribution_from_proto(&sparse(vec![1, 2], vec![0.5, 0.6]), 10).is_err());
        assert!(distribution_from_proto(&sparse(vec![1, 2], vec![f32::NAN, 1.0]), 10).is_err());
        assert!(distribution_from_proto(&sparse(vec![1, 2], vec![-0.5, 1.5]), 10).is_err());
        // Found by the property tests: duplicate ids would split a token's mass.
        let duplicate = distribution_from_proto(&sparse(vec![5, 5], vec![0.5, 0.5]), 10);
        assert!(duplicate.unwrap_err().contains("twice"));
        assert!(
            distribution_from_proto(
                &wire(Repr::Dense(pb::DenseDistribution { values: vec![1.0; 3] })),
                10
            )
            .is_err()
        );
    }

    #[test]
    fn unset_top_p_means_off() {
        let p = sampling_from_proto(Some(&pb::SamplingParams {
            temperature: 0.7,
            top_k: 40,
            top_p: 0.0,
        }));
        assert_eq!(p.top_p, 1.0);
        assert_eq!(sampling_from_proto(None), SamplingParams::GREEDY);
    }
}
