//! Sampling math shared by plain generation and speculative acceptance: temperature, top-k
//! and top-p warping of logits into a (sparse) probability distribution, and seeded draws.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::error::{ModelError, Result};

/// How logits become a next-token distribution. `temperature == 0` means greedy.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    pub temperature: f32,
    /// Keep only the k most likely tokens; 0 disables.
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose mass reaches p; 1.0 disables.
    pub top_p: f32,
}

impl SamplingParams {
    pub const GREEDY: Self = Self {
        temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
    };

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    pub fn validate(&self) -> Result<()> {
        if !self.temperature.is_finite() || !(0.0..=100.0).contains(&self.temperature) {
            return Err(ModelError::InvalidRequest(format!(
                "temperature must be in [0, 100], got {}",
                self.temperature
            )));
        }
        if !(self.top_p.is_finite() && self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(ModelError::InvalidRequest(format!(
                "top_p must be in (0, 1], got {}",
                self.top_p
            )));
        }
        Ok(())
    }
}

/// A distribution over a subset of the vocabulary; tokens not listed have probability 0.
/// Entries are sorted by decreasing probability (ties by increasing id) and sum to 1.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SparseDist {
    pub ids: Vec<u32>,
    pub probs: Vec<f32>,
}

impl SparseDist {
    /// All mass on one token.
    pub fn point(id: u32) -> Self {
        Self {
            ids: vec![id],
            probs: vec![1.0],
        }
    }

    pub fn prob(&self, id: u32) -> f32 {
        self.ids
            .iter()
            .position(|&i| i == id)
            .map_or(0.0, |p| self.probs[p])
    }

    pub fn len(&self) -> usize {
        self.ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// Draws one token. `u` is uniform in [0, 1).
    pub fn sample_with(&self, u: f64) -> u32 {
        let total: f64 = self.probs.iter().map(|&p| p as f64).sum();
        let target = u * total;
        let mut acc = 0.0;
        for (&id, &p) in self.ids.iter().zip(&self.probs) {
            acc += p as f64;
            if target < acc {
                return id;
            }
        }
        // Rounding left `target` at the very top: the last token with mass.
        *self
            .ids
            .iter()
            .zip(&self.probs)
            .rev()
            .find(|(_, p)| **p > 0.0)
            .map(|(id, _)| id)
            .unwrap_or(&self.ids[0])
    }
}

/// Lanes of the running maxima in [`argmax`]: independent, so the loop compiles to vector
/// max instructions.
const ARGMAX_LANES: usize = 16;

/// Index of the largest logit (the first one on ties, as llama.cpp's greedy sampler; NaN
/// never wins; 0 when nothing is larger than −∞). Two vectorised passes, the largest value
/// and then its first position, instead of one loop that carries the best index from element
/// to element: ~10× faster over a 49k vocabulary, and the verifier takes it once per scored
/// position, between a forward pass and its reply.
pub fn argmax(logits: &[f32]) -> u32 {
    let larger = |a: f32, b: f32| if b > a { b } else { a };
    let mut lanes = [f32::NEG_INFINITY; ARGMAX_LANES];
    let chunks = logits.chunks_exact(ARGMAX_LANES);
    let tail = chunks.remainder();
    for chunk in chunks {
        for (lane, &v) in lanes.iter_mut().zip(chunk) {
            *lane = larger(*lane, v);
        }
    }
    let max = tail
        .iter()
        .chain(&lanes)
        .fold(f32::NEG_INFINITY, |a, &b| larger(a, b));
    let mut start = 0;
    for chunk in logits.chunks(4 * ARGMAX_LANES) {
        if chunk.iter().fold(false, |hit, &v| hit | (v == max)) {
            return (start + chunk.iter().position(|&v| v == max).unwrap_or(0)) as u32;
        }
        start += chunk.len();
    }
    0
}

/// The distribution generation samples from. Greedy parameters give a point mass on the
/// argmax; otherwise softmax(logits / T) restricted to top-k, then to the top-p nucleus,
/// renormalised.
pub fn warp(logits: &[f32], params: &SamplingParams) -> SparseDist {
    if params.is_greedy() {
        return SparseDist::point(argmax(logits));
    }
    let mut order: Vec<u32> = (0..logits.len() as u32).collect();
    let by_logit = |a: &u32, b: &u32| logits[*b as usize].total_cmp(&logits[*a as usize]).then(a.cmp(b));
    if params.top_k > 0 && params.top_k < order.len() {
        order.select_nth_unstable_by(params.top_k - 1, by_logit);
        order.truncate(params.top_k);
    }
    order.sort_unstable_by(by_logit);
    let max = logits[order[0] as usize];
    let inv_t = 1.0 / params.temperature as f64;
    let weights: Vec<f64> = order
        .iter()
        .map(|&i| ((logits[i as usize] - max) as f64 * inv_t).exp())
        .collect();
    let total: f64 = weights.iter().sum();
    let mut keep = order.len();
    if params.top_p < 1.0 {
        let mut acc = 0.0;
        for (n, w) in weights.iter().enumerate() {
            acc += w / total;
            if acc >= params.top_p as f64 {
                keep = n + 1;
                break;
            }
        }
    }
    let kept_total: f64 = weights[..keep].iter().sum();
    let mut ids = order;
    ids.truncate(keep);
    let probs: Vec<f32> = weights[..keep].iter().map(|w| (w / kept_total) as f32).collect();
    // Tokens whose mass underflowed carry nothing; drop them so the support is exact.
    let nonzero = probs.iter().rposition(|&p| p > 0.0).map_or(1, |i| i + 1);
    ids.truncate(nonzero);
    SparseDist {
        ids,
        probs: probs[..nonzero].to_vec(),
    }
}

/// A reproducible random source for one generation.
pub struct Sampler {
    rng: ChaCha8Rng,
}

impl Sampler {
    pub fn new(seed: u64) -> Self {
        Self {
            rng: ChaCha8Rng::seed_from_u64(seed),
        }
    }

    /// A uniform draw in [0, 1).
    pub fn uniform(&mut self) -> f64 {
        self.rng.random::<f64>()
    }

    /// Samples the next token from `logits` under `params`.
    pub fn next_token(&mut self, logits: &[f32], params: &SamplingParams) -> u32 {
        if params.is_greedy() {
            return argmax(logits);
        }
        let u = self.uniform();
        warp(logits, params).sample_with(u)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_k: usize, top_p: f32) -> SamplingParams {
        SamplingParams {
            temperature,
            top_k,
            top_p,
        }
    }

    #[test]
    fn argmax_takes_the_first_maximum() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
    }

    /// The one-loop argmax the vectorised one replaced.
    fn argmax_reference(logits: &[f32]) -> u32 {
        let mut best = 0;
        for (i, &v) in logits.iter().enumerate() {
            if v > logits[best] {
                best = i;
            }
        }
        best as u32
    }

    #[test]
    fn argmax_agrees_with_the_one_loop_reference_on_every_length_and_position() {
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            // Few distinct values, so ties are common.
            (state % 9) as f32 - 4.0
        };
        for len in [1, 2, 15, 16, 17, 63, 64, 65, 200, 1000, 49_152] {
            for round in 0..20 {
                let mut logits: Vec<f32> = (0..len).map(|_| next()).collect();
                assert_eq!(argmax(&logits), argmax_reference(&logits), "len {len}");
                // A unique maximum anywhere, the tail included.
                let at = (round * 7919 + len / 3) % len;
                logits[at] = 100.0;
                assert_eq!(argmax(&logits), at as u32, "len {len}");
            }
        }
        assert_eq!(argmax(&[]), 0);
        assert_eq!(argmax(&[f32::NEG_INFINITY; 40]), 0);
        assert_eq!(argmax(&[1.0, f32::NAN, 2.0, f32::NAN]), 2, "NaN never wins");
        assert_eq!(argmax(&[f32::NAN; 20]), 0);
        let mut infinite = vec![0.0; 70];
        infinite[66] = f32::INFINITY;
        assert_eq!(argmax(&infinite), 66);
    }

    #[test]
    fn temperature_one_is_softmax() {
        let logits = [0.0f32, (2.0f32).ln(), (5.0f32).ln()];
        let d = warp(&logits, &params(1.0, 0, 1.0));
        assert_eq!(d.ids, vec![2, 1, 0]);
        for (p, want) in d.probs.iter().zip([0.625, 0.25, 0.125]) {
            assert!((p - want).abs() < 1e-6, "{:?}", d.probs);
        }
    }

    #[test]
    fn top_k_and_top_p_restrict_the_support() {
        let logits = [0.0f32, (2.0f32).ln(), (5.0f32).ln(), (1.0f32).ln()];
        let d = warp(&logits, &params(1.0, 2, 1.0));
        assert_eq!(d.ids, vec![2, 1]);
        assert!((d.probs[0] - 5.0 / 7.0).abs() < 1e-6);
        // Masses 5/9, 2/9, 1/9, 1/9: p = 0.7 needs the first two.
        let d = warp(&logits, &params(1.0, 0, 0.7));
        assert_eq!(d.ids, vec![2, 1]);
        let d = warp(&logits, &params(1.0, 0, 0.5));
        assert_eq!(d.ids, vec![2]);
    }

    #[test]
    fn low_temperature_sharpens() {
        let logits = [1.0f32, 2.0];
        let hot = warp(&logits, &params(2.0, 0, 1.0));
        let cold = warp(&logits, &params(0.5, 0, 1.0));
        assert!(cold.probs[0] > hot.probs[0]);
    }

    #[test]
    fn sampling_follows_the_distribution() {
        let d = SparseDist {
            ids: vec![7, 3],
            probs: vec![0.75, 0.25],
        };
        let mut sampler = Sampler::new(1);
        let n = 40_000;
        let sevens = (0..n).filter(|_| d.sample_with(sampler.uniform()) == 7).count();
        // Binomial sd = sqrt(n * .75 * .25) ≈ 87; 6 sd ≈ 520 (false failure < 1e-8).
        assert!((sevens as i64 - 30_000).abs() < 520, "{sevens}");
    }

    #[test]
    fn same_seed_same_tokens() {
        let logits: Vec<f32> = (0..100).map(|i| (i as f32 * 0.37).sin()).collect();
        let p = params(0.8, 40, 0.95);
        let draw = |seed| {
            let mut s = Sampler::new(seed);
            (0..20).map(|_| s.next_token(&logits, &p)).collect::<Vec<_>>()
        };
        assert_eq!(draw(5), draw(5));
        assert_ne!(draw(5), draw(6));
    }

    #[test]
    fn invalid_parameters_are_refused() {
        assert!(params(-1.0, 0, 1.0).validate().is_err());
        assert!(params(f32::NAN, 0, 1.0).validate().is_err());
        assert!(params(1.0, 0, 0.0).validate().is_err());
        assert!(params(1.0, 0, 1.5).validate().is_err());
        assert!(params(0.7, 50, 0.9).validate().is_ok());
    }
}
