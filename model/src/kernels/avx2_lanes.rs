//! AVX2 kernel for 4-bit weights in the lane layout (see `Layout::Lanes`), read as two
//! 256-bit halves of each 512-bit register: half A holds the slots of weight rows 0 and 1,
//! half B those of rows 2 and 3. AVX2 has no `vpdpbusd`, so a record's dot products are
//! `maddubs` (nibble × int8 pairs into i16) summed over the four registers in i16 — at most
//! 4 · 2 · 15 · 127 = 15240 — then the two halves' sums added pairwise by one horizontal add,
//! still in i16 (at most 30480, so nothing can overflow), and widened once with `madd`. That
//! gives one 32-bit lane per block, so the int → float conversion and scaling run once per
//! record and activation row, instead of once per block, weight row and activation row as in
//! the grouped kernels. Each output element's arithmetic is the same whatever the number of
//! rows, so results are batch-invariant.

#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

use super::groups::{
    check, check_lanes, in_slot_order, min_terms, pair_products, pair4, prefetch, weight_row_sums,
};
use super::{BLOCK, COL_TILE, LANE_PAIR_BYTES, QuantMatrix, QuantizedRows, ROW_TILE};

/// A 4-bit record's four registers, nibbles unpacked, as two halves: `[0..4]` the 256-bit
/// half A (bytes 0..32 of each 64-byte register: weight rows 0 and 1), `[4..8]` half B (rows
/// 2 and 3).
///
/// # Safety
/// The CPU must have AVX2; `q` must point at a record's 128 bytes.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn unpack_record(q: *const u8) -> [__m256i; 8] {
    let low_nibbles = _mm256_set1_epi8(0x0F);
    // SAFETY: the record's 128 bytes, as four 32-byte loads.
    let bytes: [__m256i; 4] =
        std::array::from_fn(|i| unsafe { _mm256_loadu_si256(q.add(32 * i) as *const __m256i) });
    // Register j of half h: the low (j even) or high nibbles of bytes 64 · (j / 2) + 32 · h.
    std::array::from_fn(|i| {
        let (half, j) = (i / 4, i % 4);
        let source = bytes[2 * (j / 2) + half];
        if j % 2 == 0 {
            _mm256_and_si256(source, low_nibbles)
        } else {
            _mm256_and_si256(_mm256_srli_epi16(source, 4), low_nibbles)
        }
    })
}

/// Both halves' integer dot products of a record's unpacked registers with one activation
/// row's pair, at `at` (64 bytes): per half, the four `maddubs` products summed in i16, so
/// lanes 4s + 2h and 4s + 2h + 1 of half A's sum (B's) together hold Σ over the 16 values of
/// half h of the half's slot s, each lane at most 4 · 2 · 15 · 127 = 15240 in magnitude. Each
/// 16 activation bytes are loaded once, broadcast to both 128-bit lanes (slots of one weight
/// row read the same activations) and multiplied by both halves' register.
///
/// # Safety
/// The CPU must have AVX2; `at` must point at 64 readable bytes.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn record_dot(weights: &[__m256i; 8], at: *const i8) -> (__m256i, __m256i) {
    // SAFETY: the 64 bytes at `at` (the caller's guarantee).
    unsafe {
        pair_products(
            at,
            |i, x| _mm256_maddubs_epi16(weights[i], x),
            |sum, product| _mm256_add_epi16(sum, product),
        )
    }
}

/// 4-bit weights (`scale · q + min`) × int8 activations, for weight rows
/// `4 · group .. 4 · group + 4` and activation rows `r0..r0 + R` (a whole row tile), into
/// `out[t * COL_TILE + c]`. A record is unpacked once into eight registers for all R
/// rows, then each activation row takes both halves' products in turn, so only its two sums
/// are live beside the weights and the accumulators (with 8 rows some accumulators live in
/// memory, which costs less than unpacking the record twice: `cargo bench -p specd-model
/// --bench kernels`, feed-forward for 8 rows 12.8–13.0 ms with two calls of 4 rows, 11.4–11.7
/// with one of 8). Per record and row, `hadd` folds the two halves' lanes
/// (slot, half block) into one lane per slot, in the order `[s0, s1, s4, s5, s2, s3, s6, s7]`,
/// so one conversion and one multiply-add scale all 8 blocks.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; `w` must be in the lane layout and of the 4-bit
/// family; `x` must carry its interleaved copy.
#[target_feature(enable = "avx2,fma,f16c")]
pub unsafe fn q4_lanes<const R: usize>(
    w: &QuantMatrix,
    group: usize,
    x: &QuantizedRows,
    r0: usize,
    out: &mut [f32],
) {
    check(w, group, x, r0, R, BLOCK);
    check_lanes(x, r0, R);
    assert!(R <= ROW_TILE && w.mins.len() == w.scales.len());
    let nb = x.blocks;
    let pairs = nb.div_ceil(2);
    let mut acc = [_mm256_setzero_ps(); R];
    let ones = _mm256_set1_epi16(1);
    for p in 0..pairs {
        let (record, b, two) = (group * pairs + p, 2 * p, 2 * p + 1 < nb);
        prefetch(w, record, BLOCK);
        // SAFETY: the record is in bounds (checked above): 8 f16 scales and 128 bytes.
        let (dw, weights) = unsafe {
            let meta = _mm256_cvtph_ps(_mm_loadu_si128(
                w.scales.as_ptr().add(record * 2 * COL_TILE) as *const __m128i
            ));
            (
                in_slot_order(meta),
                unpack_record(w.quants.as_ptr().add(record * 4 * BLOCK)),
            )
        };
        for t in 0..R {
            let row = r0 + t;
            // SAFETY: row `row`'s pair p (64 bytes) and its blocks b (and b + 1 when two)
            // are in bounds (checked above).
            let ((first_half, second_half), dx) = unsafe {
                (
                    record_dot(
                        &weights,
                        x.lane_quants.as_ptr().add((row * pairs + p) * LANE_PAIR_BYTES),
                    ),
                    pair4(x.scales.as_ptr().add(row * nb + b), two),
                )
            };
            // `hadd` of the two halves' 16-bit sums (each pair at most 30480, so still no
            // overflow) and one widening `madd`: the same lanes as widening each half first
            // and adding pairs in 32 bits, for one multiply instruction instead of two.
            let dot = _mm256_madd_epi16(_mm256_hadd_epi16(first_half, second_half), ones);
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(dw, dx), acc[t]);
        }
    }
    // SAFETY: the records' minimums and the rows' sums are in bounds (checked above).
    let mins = unsafe { min_terms::<R>(w, group, x, r0) };
    for t in 0..R {
        let sums = weight_row_sums(acc[t]);
        for c in 0..COL_TILE {
            out[t * COL_TILE + c] = sums[c] + mins[t][c];
        }
    }
}

/// Writes the interleaved copy of quantised activations the lane kernels read (see
/// `QuantizedRows::lane_quants`) from `quants` (`rows · blocks` blocks of 32) and their
/// `scales`: per row and block pair, dwords `[0, 4, 1, 5, 2, 6, 3, 7]` of each block,
/// alternating 8 bytes of the first block and 8 of the second; the scales `[d₀, d₀, d₁, d₁]`
/// and `−128 · Σ` over each half block. A lone last block pairs with zeros.
///
/// # Safety
/// The CPU must have AVX2; the lane buffers must hold `rows · pairs` entries (64 bytes, 4
/// floats and 4 integers each).
#[target_feature(enable = "avx2")]
pub unsafe fn interleave(
    quants: &[i8],
    scales: &[f32],
    blocks: usize,
    lane_quants: &mut [i8],
    lane_scales: &mut [f32],
    lane_offsets: &mut [i32],
) {
    let pairs = blocks.div_ceil(2);
    let rows = quants.len() / BLOCK / blocks.max(1);
    assert!(
        quants.len() == rows * blocks * BLOCK
            && scales.len() == rows * blocks
            && lane_quants.len() == rows * pairs * LANE_PAIR_BYTES
            && lane_scales.len() == rows * pairs * 4
            && lane_offsets.len() == rows * pairs * 4
    );
    let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    let bias = _mm_set1_epi8(-128);
    // Σ of 16 signed bytes: |x + 128| summed by `sad`, less 16 · 128.
    let half_sum = |v: __m128i| {
        let s = _mm_sad_epu8(_mm_xor_si128(v, bias), _mm_setzero_si128());
        _mm_cvtsi128_si32(_mm_add_epi64(s, _mm_unpackhi_epi64(s, s))) - 16 * 128
    };
    for row in 0..rows {
        for p in 0..pairs {
            let (b, two) = (row * blocks + 2 * p, 2 * p + 1 < blocks);
            // SAFETY: block b (and b + 1 when two) is in bounds (checked above).
            let (first, second) = unsafe {
                let at = quants.as_ptr().add(b * BLOCK);
                (
                    _mm256_loadu_si256(at as *const __m256i),
                    if two {
                        _mm256_loadu_si256(at.add(BLOCK) as *const __m256i)
                    } else {
                        _mm256_setzero_si256()
                    },
                )
            };
            let (a, c) = (
                _mm256_permutevar8x32_epi32(first, order),
                _mm256_permutevar8x32_epi32(second, order),
            );
            let (low, high) = (_mm256_unpacklo_epi64(a, c), _mm256_unpackhi_epi64(a, c));
            let pair = row * pairs + p;
            // SAFETY: the pair's 64 bytes are in bounds (checked above).
            unsafe {
                let out = lane_quants.as_mut_ptr().add(pair * LANE_PAIR_BYTES) as *mut __m256i;
                _mm256_storeu_si256(out, _mm256_permute2x128_si256::<0x20>(low, high));
                _mm256_storeu_si256(out.add(1), _mm256_permute2x128_si256::<0x31>(low, high));
            }
            let (d0, d1) = (scales[b], if two { scales[b + 1] } else { 0.0 });
            lane_scales[4 * pair..4 * pair + 4].copy_from_slice(&[d0, d0, d1, d1]);
            let halves = [
                _mm256_castsi256_si128(first),
                _mm256_extracti128_si256::<1>(first),
                _mm256_castsi256_si128(second),
                _mm256_extracti128_si256::<1>(second),
            ];
            for (offset, half) in lane_offsets[4 * pair..4 * pair + 4].iter_mut().zip(halves) {
                *offset = -128 * half_sum(half);
            }
        }
    }
}
