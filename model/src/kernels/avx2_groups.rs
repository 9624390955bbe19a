//! AVX2 kernels for 8-bit weights over the grouped layout (see `Layout::Groups`; 4-bit
//! weights use the lane layout, `avx2_lanes`): one sequential, prefetched weight stream per
//! group of 4 weight rows, each 64-byte register of a record read as two 256-bit halves whose
//! lanes hold 4 values of each block (`maddubs` products of the weights' magnitudes with the
//! sign-carrying activations), so a record's eight blocks end in one register of lanes per
//! activation row after a single fold (see [`q8_group`]). Each output element's arithmetic
//! is the same whatever the number of rows, so results are batch-invariant. Also the AVX2
//! activation quantiser.

#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

use super::groups::{check, check_lanes, in_slot_order, pair_products, pair4, prefetch, weight_row_sums};
use super::{BLOCK, COL_TILE, LANE_PAIR_BYTES, QuantMatrix, QuantizedRows, ROW_TILE};

/// A record's eight registers as two halves of its four 64-byte registers (see
/// `Layout::Groups`): `[0..4]` bytes 0..32 of each (slots 0..4: weight rows 0 and 1),
/// `[4..8]` bytes 32..64 (slots 4..8: rows 2 and 3).
///
/// # Safety
/// The CPU must have AVX2; `q` must point at a record's 256 bytes.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn load_record(q: *const u8) -> [__m256i; 8] {
    // SAFETY: the record's 256 bytes (the caller's guarantee).
    std::array::from_fn(|i| unsafe {
        let (half, j) = (i / 4, i % 4);
        _mm256_loadu_si256(q.add(64 * j + 32 * half) as *const __m256i)
    })
}

/// Both halves' integer dot products of a record with one activation row's pair, at `at`
/// (the 64 bytes of the lane copy): per register, `maddubs` of the weights' magnitudes with
/// the activations carrying the weights' signs (each pair at most 2 · 128 · 127 = 32512, so
/// nothing saturates), widened by `madd` and summed in i32. Lane 2s' + h of half A's sum
/// (B's) is the dot product over half h (16 values) of the half's slot s'. Each 16 activation
/// bytes are loaded once and broadcast to both 128-bit lanes (the slots of one weight row
/// read the same activations).
///
/// # Safety
/// The CPU must have AVX2; `at` must point at 64 readable bytes.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn record_dot(raw: &[__m256i; 8], magnitude: &[__m256i; 8], at: *const i8) -> (__m256i, __m256i) {
    let ones = _mm256_set1_epi16(1);
    // SAFETY: the 64 bytes at `at` (the caller's guarantee).
    unsafe {
        pair_products(
            at,
            |i, x| {
                _mm256_madd_epi16(
                    _mm256_maddubs_epi16(magnitude[i], _mm256_sign_epi8(x, raw[i])),
                    ones,
                )
            },
            |sum, product| _mm256_add_epi32(sum, product),
        )
    }
}

/// Signed 8-bit weights × int8 activations, with one scale per block (`HALVES` = 1, Q8_0) or
/// per 16 values (`HALVES` = 2, Q6_K), for weight rows `4 · group .. 4 · group + 4` and
/// activation rows `r0..r0 + R`, into `out[t * COL_TILE + c]`.
///
/// A record's registers are read once per call and their magnitudes kept for all R rows.
/// Per row, [`record_dot`] leaves the sums of each half block in one lane, so no register
/// needs a horizontal fold of its own: for Q8_0 one `hadd` adds each slot's two halves into
/// the order `[s0, s1, s4, s5, s2, s3, s6, s7]`, and one conversion and one multiply-add
/// scale all 8 blocks; for Q6_K the halves are converted and scaled by their own scales
/// first (the record's `[row][block][half]` scales are the halves' lane order), then added
/// by a float `hadd`.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; `w` must be grouped and of an 8-bit family with
/// `HALVES` scales per block; `x` must carry its interleaved copy.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn q8_group<const R: usize, const HALVES: usize>(
    w: &QuantMatrix,
    group: usize,
    x: &QuantizedRows,
    r0: usize,
    out: &mut [f32],
) {
    check(w, group, x, r0, R, 2 * BLOCK);
    check_lanes(x, r0, R);
    assert!(R <= ROW_TILE && w.halves() == HALVES);
    let (nb, pairs) = (x.blocks, x.blocks.div_ceil(2));
    let mut acc = [_mm256_setzero_ps(); R];
    let meta_per_record = 2 * HALVES * COL_TILE;
    for p in 0..pairs {
        let (record, b, two) = (group * pairs + p, 2 * p, 2 * p + 1 < nb);
        prefetch(w, record, 2 * BLOCK);
        // SAFETY: the record's scales and 256 bytes of quants are in bounds (checked above).
        let (scales, raw): ([__m256; 2], [__m256i; 8]) = unsafe {
            let at = w.scales.as_ptr().add(record * meta_per_record);
            let first = _mm256_cvtph_ps(_mm_loadu_si128(at as *const __m128i));
            let scales = if HALVES == 1 {
                [in_slot_order(first); 2]
            } else {
                [
                    first,
                    _mm256_cvtph_ps(_mm_loadu_si128(at.add(8) as *const __m128i)),
                ]
            };
            (
                scales,
                load_record(w.quants.as_ptr().add(record * COL_TILE * 2 * BLOCK)),
            )
        };
        let magnitude: [__m256i; 8] = std::array::from_fn(|i| _mm256_abs_epi8(raw[i]));
        for t in 0..R {
            let row = r0 + t;
            // SAFETY: row `row`'s pair p (64 bytes) and its blocks b (and b + 1 when two)
            // are in bounds (checked above).
            let ((first_half, second_half), dx) = unsafe {
                (
                    record_dot(
                        &raw,
                        &magnitude,
                        x.lane_quants.as_ptr().add((row * pairs + p) * LANE_PAIR_BYTES),
                    ),
                    pair4(x.scales.as_ptr().add(row * nb + b), two),
                )
            };
            if HALVES == 1 {
                let dot = _mm256_cvtepi32_ps(_mm256_hadd_epi32(first_half, second_half));
                acc[t] = _mm256_fmadd_ps(dot, _mm256_mul_ps(scales[0], dx), acc[t]);
            } else {
                let scaled = _mm256_hadd_ps(
                    _mm256_mul_ps(_mm256_cvtepi32_ps(first_half), scales[0]),
                    _mm256_mul_ps(_mm256_cvtepi32_ps(second_half), scales[1]),
                );
                acc[t] = _mm256_fmadd_ps(scaled, dx, acc[t]);
            }
        }
    }
    for t in 0..R {
        out[t * COL_TILE..][..COL_TILE].copy_from_slice(&weight_row_sums(acc[t]));
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
