//! Causal attention over host KV caches: dot products with exactly the keys a query row may
//! see, softmax, weighted sum of values. Over tiled keys (AVX-512 or AVX2, see [`tiles`]) the rows
//! reading one KV head share its loads; otherwise each (query row, head) runs alone. Each
//! row's result is computed by the same code whatever else is in the pass, so verifying K
//! drafts in one pass gives bit-identical results to decoding them one by one, alone or
//! batched with other sequences. All rows of all sequences of a pass are one pass over
//! candle's thread pool.

use crate::kernels::SendPtr;
use crate::kv_cache::KeyLayout;

#[cfg(target_arch = "x86_64")]
mod tiles;
#[cfg(target_arch = "x86_64")]
pub(crate) use tiles::exp16;

/// Shapes of one attention call.
pub struct AttentionShape {
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
}

/// One sequence's part of a pass: its cache (values `[position][kv_head][head_dim]`, keys
/// in `key_layout`, holding positions `0..start + n`) and its `n` new query rows, which
/// follow the previous sequence's rows in the query matrix.
pub struct SequenceAttention<'a> {
    pub keys: &'a [f32],
    pub key_layout: KeyLayout,
    pub values: &'a [f32],
    pub start: usize,
    pub n: usize,
}

/// `queries`: `[rows][n_head * head_dim]` (rotated), rows of every sequence in order;
/// writes `out`: `[rows][n_head * head_dim]`.
pub fn attend(shape: &AttentionShape, queries: &[f32], sequences: &[SequenceAttention<'_>], out: &mut [f32]) {
    let (nh, nkv, hd) = (shape.n_head, shape.n_head_kv, shape.head_dim);
    let group = nh / nkv;
    let scale = 1.0 / (hd as f32).sqrt();
    let mut first_row = Vec::with_capacity(sequences.len() + 1);
    let mut rows = 0;
    for seq in sequences {
        first_row.push(rows);
        rows += seq.n;
    }
    first_row.push(rows);
    assert!(
        queries.len() == rows * nh * hd && out.len() == rows * nh * hd,
        "queries and output must be [rows, n_head * head_dim]"
    );
    if sequences.iter().any(|s| s.key_layout == KeyLayout::Tiles) {
        assert!(
            sequences.iter().all(|s| s.key_layout == KeyLayout::Tiles)
                && crate::kernels::Kernel::detect() != crate::kernels::Kernel::Portable,
            "tiled keys need the AVX-512 or AVX2 attention, for every sequence of the pass"
        );
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU has AVX-512, or AVX2 and FMA (detected above); sizes are checked
        // above.
        unsafe {
            tiles::attend(shape, queries, sequences, &first_row, out)
        };
        return;
    }
    let out_ptr = SendPtr(out.as_mut_ptr());
    candle_core::utils::barrier_pool().execute_chunked(rows * nh, |items| {
        let mut scores = Vec::new();
        for item in items {
            let (row, h) = (item / nh, item % nh);
            let which = first_row.partition_point(|&r| r <= row) - 1;
            let seq = &sequences[which];
            let i = row - first_row[which];
            let kv = h / group;
            let visible = seq.start + i + 1;
            let q = &queries[(row * nh + h) * hd..(row * nh + h + 1) * hd];
            // SAFETY: each (row, head) item owns its own head_dim slice of the output, which
            // lies inside `out` (size checked above).
            let dst = unsafe { std::slice::from_raw_parts_mut(out_ptr.get().add((row * nh + h) * hd), hd) };
            let head = Head {
                keys: seq.keys,
                values: seq.values,
                stride: nkv * hd,
                offset: kv * hd,
                visible,
                scale,
            };
            head.attend(q, &mut scores, dst);
        }
    });
}

/// One query row of one head against the keys and values of its KV head.
struct Head<'a> {
    keys: &'a [f32],
    values: &'a [f32],
    /// Floats between positions, and this KV head's offset within a position.
    stride: usize,
    offset: usize,
    visible: usize,
    scale: f32,
}

impl Head<'_> {
    fn attend(&self, q: &[f32], scores: &mut Vec<f32>, dst: &mut [f32]) {
        assert!(
            self.visible * self.stride <= self.keys.len().min(self.values.len())
                && self.offset + q.len() <= self.stride
        );
        #[cfg(target_arch = "x86_64")]
        match (crate::kernels::Kernel::detect(), q.len()) {
            // SAFETY: the CPU has the kernel's features (detected); bounds are checked above.
            (kernel, 64) if kernel.has_avx512() => {
                return unsafe { self.attend_avx512::<4>(q, scores, dst) };
            }
            (kernel, 128) if kernel.has_avx512() => {
                return unsafe { self.attend_avx512::<8>(q, scores, dst) };
            }
            (crate::kernels::Kernel::Avx2, 64) => return unsafe { self.attend_avx2::<8>(q, scores, dst) },
            (crate::kernels::Kernel::Avx2, 128) => return unsafe { self.attend_avx2::<16>(q, scores, dst) },
            _ => {}
        }
        self.attend_portable(q, scores, dst);
    }

    fn key(&self, j: usize, hd: usize) -> &[f32] {
        &self.keys[j * self.stride + self.offset..][..hd]
    }

    fn value(&self, j: usize, hd: usize) -> &[f32] {
        &self.values[j * self.stride + self.offset..][..hd]
    }

    fn attend_portable(&self, q: &[f32], scores: &mut Vec<f32>, dst: &mut [f32]) {
        let hd = q.len();
        scores.clear();
        let mut max = f32::NEG_INFINITY;
        for j in 0..self.visible {
            let s = dot(q, self.key(j, hd)) * self.scale;
            max = max.max(s);
            scores.push(s);
        }
        for s in scores.iter_mut() {
            *s = exp(*s - max);
        }
        let inv = 1.0 / scores.iter().sum::<f32>();
        dst.fill(0.0);
        for (j, &p) in scores.iter().enumerate() {
            let w = p * inv;
            for (d, &x) in dst.iter_mut().zip(self.value(j, hd)) {
                *d += w * x;
            }
        }
    }

    /// The same with the head (`CH` × 16 floats) in registers.
    ///
    /// # Safety
    /// The CPU must have AVX-512 F; `q.len() == 16 · CH` and the bounds checked in `attend`.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,fma")]
    #[allow(clippy::needless_range_loop)] // registers indexed in lockstep with memory chunks
    unsafe fn attend_avx512<const CH: usize>(&self, q: &[f32], scores: &mut Vec<f32>, dst: &mut [f32]) {
        use std::arch::x86_64::*;
        assert!(q.len() == 16 * CH && dst.len() == 16 * CH);
        let mut qr = [_mm512_setzero_ps(); CH];
        for c in 0..CH {
            // SAFETY: q holds 16 · CH floats.
            qr[c] = unsafe { _mm512_loadu_ps(q.as_ptr().add(16 * c)) };
        }
        scores.clear();
        scores.resize(self.visible, 0.0);
        let mut max = f32::NEG_INFINITY;
        for (j, score) in scores.iter_mut().enumerate() {
            // SAFETY: position j < visible of this KV head is in bounds (checked in attend).
            let k = unsafe { self.keys.as_ptr().add(j * self.stride + self.offset) };
            let mut acc = _mm512_setzero_ps();
            for c in 0..CH {
                acc = _mm512_fmadd_ps(qr[c], unsafe { _mm512_loadu_ps(k.add(16 * c)) }, acc);
            }
            *score = _mm512_reduce_add_ps(acc) * self.scale;
            max = max.max(*score);
        }
        for s in scores.iter_mut() {
            *s = exp(*s - max);
        }
        let inv = 1.0 / scores.iter().sum::<f32>();
        let mut out = [_mm512_setzero_ps(); CH];
        for (j, &p) in scores.iter().enumerate() {
            let w = _mm512_set1_ps(p * inv);
            // SAFETY: as above.
            let v = unsafe { self.values.as_ptr().add(j * self.stride + self.offset) };
            for c in 0..CH {
                out[c] = _mm512_fmadd_ps(w, unsafe { _mm512_loadu_ps(v.add(16 * c)) }, out[c]);
            }
        }
        for c in 0..CH {
            // SAFETY: dst holds 16 · CH floats.
            unsafe { _mm512_storeu_ps(dst.as_mut_ptr().add(16 * c), out[c]) };
        }
    }

    /// As [`Head::attend_avx512`] with 256-bit registers (`CH` × 8 floats).
    ///
    /// # Safety
    /// The CPU must have AVX2 and FMA; `q.len() == 8 · CH` and the bounds checked in `attend`.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::needless_range_loop)] // registers indexed in lockstep with memory chunks
    unsafe fn attend_avx2<const CH: usize>(&self, q: &[f32], scores: &mut Vec<f32>, dst: &mut [f32]) {
        use std::arch::x86_64::*;
        assert!(q.len() == 8 * CH && dst.len() == 8 * CH);
        scores.clear();
        scores.resize(self.visible, 0.0);
        let mut max = f32::NEG_INFINITY;
        for (j, score) in scores.iter_mut().enumerate() {
            // SAFETY: position j < visible of this KV head is in bounds (checked in attend).
            let k = unsafe { self.keys.as_ptr().add(j * self.stride + self.offset) };
            let mut acc = [_mm256_setzero_ps(); 2];
            for c in 0..CH {
                // SAFETY: q and the key hold 8 · CH floats.
                let (qc, kc) = unsafe {
                    (
                        _mm256_loadu_ps(q.as_ptr().add(8 * c)),
                        _mm256_loadu_ps(k.add(8 * c)),
                    )
                };
                acc[c % 2] = _mm256_fmadd_ps(qc, kc, acc[c % 2]);
            }
            let v = _mm256_add_ps(acc[0], acc[1]);
            let s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
            let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
            *score = _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1))) * self.scale;
            max = max.max(*score);
        }
        for s in scores.iter_mut() {
            *s = exp(*s - max);
        }
        let inv = 1.0 / scores.iter().sum::<f32>();
        let mut out = [_mm256_setzero_ps(); CH];
        for (j, &p) in scores.iter().enumerate() {
            let w = _mm256_set1_ps(p * inv);
            // SAFETY: as above.
            let v = unsafe { self.values.as_ptr().add(j * self.stride + self.offset) };
            for c in 0..CH {
                out[c] = _mm256_fmadd_ps(w, unsafe { _mm256_loadu_ps(v.add(8 * c)) }, out[c]);
            }
        }
        for c in 0..CH {
            // SAFETY: dst holds 8 · CH floats.
            unsafe { _mm256_storeu_ps(dst.as_mut_ptr().add(8 * c), out[c]) };
        }
    }
}

/// ln 2 split in two so n · ln 2 is subtracted without rounding error ([`exp`]).
const EXP_LN2_HI: f32 = 0.693_145_75;
const EXP_LN2_LO: f32 = 1.428_606_8e-6;
/// Taylor coefficients of eʳ on |r| <= ln2 / 2, highest power first, to r^7 (error < 1e-8
/// relative), evaluated by Horner's rule.
const EXP_TAYLOR: [f32; 8] = [
    1.0 / 5040.0,
    1.0 / 720.0,
    1.0 / 120.0,
    1.0 / 24.0,
    1.0 / 6.0,
    0.5,
    1.0,
    1.0,
];

/// `eˣ` as a branch-free polynomial that vectorises over a slice (within 2 ulp of `f32::exp`;
/// inputs are clamped to ±87).
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    let x = x.clamp(-87.0, 87.0);
    let n = (x * std::f32::consts::LOG2_E).round_ties_even();
    let r = (-n).mul_add(EXP_LN2_LO, (-n).mul_add(EXP_LN2_HI, x));
    let mut p = EXP_TAYLOR[0];
    for c in &EXP_TAYLOR[1..] {
        p = p.mul_add(r, *c);
    }
    p * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// A dot product with eight independent accumulators (vectorises; fixed summation order).
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        for l in 0..8 {
            acc[l] += a[c * 8 + l] * b[c * 8 + l];
        }
    }
    let mut tail = 0f32;
    for i in chunks * 8..a.len() {
        tail += a[i] * b[i];
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

#[cfg(test)]
mod tests {
    use super::Head;

    #[test]
    fn the_simd_head_matches_the_portable_one() {
        for hd in [64usize, 128, 48] {
            let (nkv, visible) = (3, 37);
            let values: Vec<f32> = (0..visible * nkv * hd)
                .map(|i| ((i * 7919) % 101) as f32 / 50.0 - 1.0)
                .collect();
            let keys: Vec<f32> = (0..visible * nkv * hd)
                .map(|i| ((i * 104_729) % 97) as f32 / 48.0 - 1.0)
                .collect();
            let q: Vec<f32> = (0..hd).map(|i| ((i * 31) % 23) as f32 / 11.0 - 1.0).collect();
            let head = Head {
                keys: &keys,
                values: &values,
                stride: nkv * hd,
                offset: hd,
                visible,
                scale: 1.0 / (hd as f32).sqrt(),
            };
            let (mut fast, mut plain, mut scores) = (vec![0f32; hd], vec![0f32; hd], Vec::new());
            head.attend_portable(&q, &mut scores, &mut plain);
            let mut results = vec![("detected", {
                head.attend(&q, &mut scores, &mut fast);
                fast.clone()
            })];
            #[cfg(target_arch = "x86_64")]
            if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma") {
                let mut avx2 = vec![0f32; hd];
                // SAFETY: the CPU has AVX2 and FMA (checked); the bounds hold for this head.
                match hd {
                    64 => unsafe { head.attend_avx2::<8>(&q, &mut scores, &mut avx2) },
                    128 => unsafe { head.attend_avx2::<16>(&q, &mut scores, &mut avx2) },
                    _ => head.attend_portable(&q, &mut scores, &mut avx2),
                }
                results.push(("avx2", avx2));
            }
            for (name, got) in results {
                for (a, b) in got.iter().zip(&plain) {
                    assert!((a - b).abs() <= 1e-5, "{name} hd {hd}: {a} vs {b}");
                }
            }
        }
    }
    #[test]
    fn exp_is_within_two_ulp_of_std() {
        let mut x = -87.0f32;
        while x <= 87.0 {
            let (ours, std) = (super::exp(x), x.exp());
            let ulps = (ours.to_bits() as i64 - std.to_bits() as i64).abs();
            assert!(ulps <= 2, "exp({x}) = {ours}, std {std} ({ulps} ulp)");
            x += 0.0137;
        }
        assert_eq!(super::exp(0.0), 1.0);
        assert!(super::exp(-1000.0) < 1e-37 && super::exp(1000.0).is_finite());
    }
}
