//! AVX2 kernels for 8-bit weights over the grouped layout (see `Layout::Groups`; 4-bit
//! weights use the lane layout, `avx2_lanes`): one sequential, prefetched weight stream per
//! group of 4 weight rows, one 32-value block per 256-bit register (`maddubs` products),
//! four independent accumulators per activation row. AVX2 has 16 registers, so a call takes
//! at most 2 activation rows. Each output element's arithmetic is the same whatever the
//! number of rows, so results are batch-invariant. Also the AVX2 activation quantiser.

#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

use super::groups::{check, pair4, prefetch};
use super::{BLOCK, COL_TILE, QuantMatrix, QuantizedRows, ROW_TILE};

#[inline]
#[target_feature(enable = "avx2,fma")]
fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)))
}

/// Block `b` of activation row `r` (zero when `present` is false: a lone last block's pair).
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn load_x(x: &QuantizedRows, r: usize, b: usize, present: bool) -> __m256i {
    if present {
        unsafe { _mm256_loadu_si256(x.quants.as_ptr().add((r * x.blocks + b) * BLOCK) as *const __m256i) }
    } else {
        _mm256_setzero_si256()
    }
}

/// Σ over 32 products of unsigned `w` and signed `x` bytes, as 8 i32 lanes (lane i: values
/// 4i..4i + 4).
#[inline]
#[target_feature(enable = "avx2")]
fn dot(w: __m256i, x: __m256i) -> __m256 {
    _mm256_cvtepi32_ps(_mm256_madd_epi16(
        _mm256_maddubs_epi16(w, x),
        _mm256_set1_epi16(1),
    ))
}

/// Signed 8-bit weights × int8 activations (`maddubs` takes |w| and x with w's sign), with
/// one scale per block (`HALVES` = 1, Q8_0) or per 16 values (`HALVES` = 2, Q6_K).
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; `w` must be grouped and of an 8-bit family with
/// `HALVES` scales per block.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn q8_group<const R: usize, const HALVES: usize>(
    w: &QuantMatrix,
    group: usize,
    x: &QuantizedRows,
    r0: usize,
    t0: usize,
    out: &mut [f32],
) {
    check(w, group, x, r0, R, 2 * BLOCK);
    assert!(t0 + R <= ROW_TILE && w.halves() == HALVES);
    let (nb, pairs) = (x.blocks, x.blocks.div_ceil(2));
    let mut acc = [[_mm256_setzero_ps(); R]; COL_TILE];
    let meta_per_record = 2 * HALVES * COL_TILE;
    for p in 0..pairs {
        let (record, b, two) = (group * pairs + p, 2 * p, 2 * p + 1 < nb);
        prefetch(w, record, 2 * BLOCK);
        // Scales `[row][block][half]`, 8 floats per vector.
        let mut scales = [_mm256_setzero_ps(); HALVES];
        for (i, s) in scales.iter_mut().enumerate() {
            // SAFETY: the record's scales are in bounds (checked above).
            *s = unsafe {
                _mm256_cvtph_ps(_mm_loadu_si128(
                    w.scales.as_ptr().add(record * meta_per_record + 8 * i) as *const __m128i,
                ))
            };
        }
        let mut ds = [[_mm256_setzero_ps(); HALVES]; R];
        let mut xs = [[_mm256_setzero_si256(); 2]; R];
        for t in 0..R {
            let r = r0 + t;
            // SAFETY: row r's blocks b (and b + 1 when two) are in bounds (checked above).
            unsafe {
                let dx = x.scales.as_ptr().add(r * nb + b);
                let pattern = if HALVES == 1 {
                    pair4(dx, two)
                } else {
                    // [b, b, b+1, b+1] twice: lanes [row][block][half] of two rows.
                    let (d0, d1) = (*dx, if two { *dx.add(1) } else { 0.0 });
                    _mm256_setr_ps(d0, d0, d1, d1, d0, d0, d1, d1)
                };
                for h in 0..HALVES {
                    ds[t][h] = _mm256_mul_ps(scales[h], pattern);
                }
                xs[t] = [load_x(x, r, b, true), load_x(x, r, b + 1, two)];
            }
        }
        for c in 0..COL_TILE {
            for block in 0..2 {
                // SAFETY: as above; 32 bytes per block of a weight row.
                let raw = unsafe {
                    _mm256_loadu_si256(
                        w.quants
                            .as_ptr()
                            .add((record * COL_TILE + c) * 2 * BLOCK + block * BLOCK)
                            as *const __m256i,
                    )
                };
                let magnitude = _mm256_sign_epi8(raw, raw);
                // Lane index in the scale vectors, and which vector.
                let (vector, lane) = if HALVES == 1 {
                    (0, 2 * c + block)
                } else {
                    (c / 2, (c % 2) * 4 + 2 * block)
                };
                let index = if HALVES == 1 {
                    _mm256_set1_epi32(lane as i32)
                } else {
                    let (a, b1) = (lane as i32, lane as i32 + 1);
                    _mm256_setr_epi32(a, a, a, a, b1, b1, b1, b1)
                };
                for t in 0..R {
                    let scale = _mm256_permutevar8x32_ps(ds[t][vector], index);
                    let product = dot(magnitude, _mm256_sign_epi8(xs[t][block], raw));
                    acc[c][t] = _mm256_fmadd_ps(product, scale, acc[c][t]);
                }
            }
        }
    }
    for c in 0..COL_TILE {
        for t in 0..R {
            out[c * ROW_TILE + t0 + t] = hsum(acc[c][t]);
        }
    }
}

/// Quantises 32-value blocks with exactly the portable version's arithmetic (max |x| / 127,
/// multiply by its inverse, round half to even, f16 scale), eight lanes at a time.
///
/// # Safety
/// The CPU must have AVX2 and F16C; `quants` must hold `x.len()` values.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn quantize(x: &[f32], quants: &mut [i8], scales: &mut Vec<f32>, sums: &mut Vec<f32>) {
    assert!(x.len().is_multiple_of(BLOCK) && quants.len() == x.len());
    let sign = _mm256_set1_ps(-0.0);
    for (chunk, q) in x.chunks_exact(BLOCK).zip(quants.chunks_exact_mut(BLOCK)) {
        // SAFETY: each chunk holds 32 floats and each q 32 bytes.
        unsafe {
            let v: [__m256; 4] = std::array::from_fn(|i| _mm256_loadu_ps(chunk.as_ptr().add(8 * i)));
            let m = v.iter().fold(_mm256_setzero_ps(), |m, &x| {
                _mm256_max_ps(m, _mm256_andnot_ps(sign, x))
            });
            let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
            let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
            let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
            let d = amax / 127.0;
            let inv = _mm256_set1_ps(if d > 0.0 { 1.0 / d } else { 0.0 });
            // Round to nearest even (the default MXCSR mode), as `round_ties_even`.
            let ints: [__m256i; 4] = std::array::from_fn(|i| {
                _mm256_cvtps_epi32(_mm256_round_ps(
                    _mm256_mul_ps(v[i], inv),
                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC,
                ))
            });
            let total = _mm256_add_epi32(
                _mm256_add_epi32(ints[0], ints[1]),
                _mm256_add_epi32(ints[2], ints[3]),
            );
            let s = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
            let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01_00_11_10));
            let sum = _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01)));
            // i32 → i16 → i8 with saturation; packs interleave 128-bit lanes, so restore order.
            let words = _mm256_permute4x64_epi64(_mm256_packs_epi32(ints[0], ints[1]), 0b11_01_10_00);
            let words2 = _mm256_permute4x64_epi64(_mm256_packs_epi32(ints[2], ints[3]), 0b11_01_10_00);
            let bytes = _mm256_permute4x64_epi64(_mm256_packs_epi16(words, words2), 0b11_01_10_00);
            _mm256_storeu_si256(q.as_mut_ptr() as *mut __m256i, bytes);
            scales.push(super::to_f32(super::to_f16(d)));
            sums.push(super::to_f32(super::to_f16(d * sum as f32)));
        }
    }
}
