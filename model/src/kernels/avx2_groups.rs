//! AVX2 kernels for 8-bit weights over the grouped layout (see `Layout::Groups`; 4-bit
//! weights use the lane layout, `avx2_lanes`): one sequential, prefetched weight stream per
//! group of 4 weight rows, one 32-value block per 256-bit register (`maddubs` products),
//! the eight blocks of a record folded into one register of lanes per activation row (see
//! [`q8_group`]). Each output element's arithmetic is the same whatever the number of rows,
//! so results are batch-invariant. Also the AVX2 activation quantiser.

#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

use super::groups::{check, pair4, prefetch};
use super::{BLOCK, COL_TILE, QuantMatrix, QuantizedRows, ROW_TILE};

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

/// Eight slots' dot products (8 i32 lanes each, lane l over values 4l..4l + 4) folded by
/// `hadd` into their sums over values 0..16 and 16..32, each as one lane per slot
/// `[s0, …, s7]`.
#[inline]
#[target_feature(enable = "avx2")]
fn fold_slots(m: &[__m256i; 8]) -> (__m256i, __m256i) {
    let low = _mm256_hadd_epi32(_mm256_hadd_epi32(m[0], m[1]), _mm256_hadd_epi32(m[2], m[3]));
    let high = _mm256_hadd_epi32(_mm256_hadd_epi32(m[4], m[5]), _mm256_hadd_epi32(m[6], m[7]));
    (
        _mm256_permute2x128_si256::<0x20>(low, high),
        _mm256_permute2x128_si256::<0x31>(low, high),
    )
}

/// Signed 8-bit weights × int8 activations, with one scale per block (`HALVES` = 1, Q8_0) or
/// per 16 values (`HALVES` = 2, Q6_K), for weight rows `4 · group .. 4 · group + 4` and
/// activation rows `r0..r0 + R`, into `out[t * COL_TILE + c]`.
///
/// A record's 8 blocks ("slots" s = 2 · weight row + block) are read once per call and
/// their magnitudes kept for all R rows. Per row, each slot's 32 products are `maddubs`
/// (|w| against x with w's sign) widened by `madd`, and `hadd` folds the eight slots into
/// one lane each, so the int → float conversion and the scaling run once per record and row
/// instead of once per block, weight row and activation row.
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
    out: &mut [f32],
) {
    check(w, group, x, r0, R, 2 * BLOCK);
    assert!(R <= ROW_TILE && w.halves() == HALVES);
    let (nb, pairs) = (x.blocks, x.blocks.div_ceil(2));
    let mut acc = [_mm256_setzero_ps(); R];
    let meta_per_record = 2 * HALVES * COL_TILE;
    let ones = _mm256_set1_epi16(1);
    for p in 0..pairs {
        let (record, b, two) = (group * pairs + p, 2 * p, 2 * p + 1 < nb);
        prefetch(w, record, 2 * BLOCK);
        // Per-half weight scales, one lane per slot: f16 `[row][block]` (Q8_0) is already
        // slot order; Q6_K's `[row][block][half]` has the halves of a slot side by side.
        // SAFETY: the record's scales are in bounds (checked above).
        let scales: [__m256; HALVES] = unsafe {
            let at = w.scales.as_ptr().add(record * meta_per_record);
            let first = _mm256_cvtph_ps(_mm_loadu_si128(at as *const __m128i));
            if HALVES == 1 {
                [first; HALVES]
            } else {
                let second = _mm256_cvtph_ps(_mm_loadu_si128(at.add(8) as *const __m128i));
                let order =
                    |v: __m256| _mm256_castpd_ps(_mm256_permute4x64_pd::<0b11_01_10_00>(_mm256_castps_pd(v)));
                let mut halves = [first; HALVES];
                halves[0] = order(_mm256_shuffle_ps::<0b10_00_10_00>(first, second));
                halves[HALVES - 1] = order(_mm256_shuffle_ps::<0b11_01_11_01>(first, second));
                halves
            }
        };
        // SAFETY: the record's 256 bytes of quants (checked above).
        let raw: [__m256i; 8] = std::array::from_fn(|s| unsafe {
            _mm256_loadu_si256(
                w.quants.as_ptr().add(record * COL_TILE * 2 * BLOCK + s * BLOCK) as *const __m256i
            )
        });
        let magnitude: [__m256i; 8] = std::array::from_fn(|s| _mm256_sign_epi8(raw[s], raw[s]));
        for t in 0..R {
            let r = r0 + t;
            // SAFETY: row r's blocks b (and b + 1 when two) are in bounds (checked above).
            let (xs, dx) = unsafe {
                (
                    [load_x(x, r, b, true), load_x(x, r, b + 1, two)],
                    pair4(x.scales.as_ptr().add(r * nb + b), two),
                )
            };
            let dots: [__m256i; 8] = std::array::from_fn(|s| {
                _mm256_madd_epi16(
                    _mm256_maddubs_epi16(magnitude[s], _mm256_sign_epi8(xs[s % 2], raw[s])),
                    ones,
                )
            });
            let (first, second) = fold_slots(&dots);
            if HALVES == 1 {
                let dot = _mm256_cvtepi32_ps(_mm256_add_epi32(first, second));
                acc[t] = _mm256_fmadd_ps(dot, _mm256_mul_ps(scales[0], dx), acc[t]);
            } else {
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(first), _mm256_mul_ps(scales[0], dx), acc[t]);
                acc[t] = _mm256_fmadd_ps(
                    _mm256_cvtepi32_ps(second),
                    _mm256_mul_ps(scales[HALVES - 1], dx),
                    acc[t],
                );
            }
        }
    }
    for t in 0..R {
        let mut lanes = [0f32; 8];
        // SAFETY: eight floats.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc[t]) };
        for c in 0..COL_TILE {
            out[t * COL_TILE + c] = lanes[2 * c] + lanes[2 * c + 1];
        }
    }
}

/// Quantises 32-value blocks with exactly the portable version's arithmetic (max |x| / 127,
/// multiply by its inverse, round half to even, f16 scale), eight lanes at a time.
///
/// # Safety
/// The CPU must have AVX2 and F16C; `quants` must hold `x.len()` values, `scales` and `sums`
/// one per block.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn quantize(x: &[f32], quants: &mut [i8], scales: &mut [f32], sums: &mut [f32]) {
    assert!(x.len().is_multiple_of(BLOCK) && quants.len() == x.len());
    assert!(scales.len() == x.len() / BLOCK && sums.len() == scales.len());
    let sign = _mm256_set1_ps(-0.0);
    for (((chunk, q), scale), scaled_sum) in x
        .chunks_exact(BLOCK)
        .zip(quants.chunks_exact_mut(BLOCK))
        .zip(scales.iter_mut())
        .zip(sums.iter_mut())
    {
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
            *scale = super::to_f32(super::to_f16(d));
            *scaled_sum = super::to_f32(super::to_f16(d * sum as f32));
        }
    }
}
