//! What the grouped- and lane-layout kernels (AVX-512 and AVX2) share: the bounds they
//! check, the software prefetch of their weight stream and the minimum term of 4-bit
//! formats.

#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

use super::{COL_TILE, LANE_PAIR_BYTES, QuantMatrix, QuantizedRows, ROW_TILE};

/// Checks the bounds every unchecked access of a group kernel relies on.
pub(super) fn check(
    w: &QuantMatrix,
    group: usize,
    x: &QuantizedRows,
    r0: usize,
    rows: usize,
    quant_bytes: usize,
) {
    let pairs = x.blocks.div_ceil(2);
    assert!(rows <= ROW_TILE && r0 + rows <= x.m && w.k == x.k);
    assert!(
        x.quants.len() >= x.m * x.k && x.scales.len() >= x.m * x.blocks && x.sums.len() >= x.m * x.blocks
    );
    let records = (group + 1) * pairs;
    assert!(
        w.quants.len() >= records * COL_TILE * quant_bytes
            && w.scales.len() >= records * 2 * w.halves() * COL_TILE
            && (w.mins.is_empty() || w.mins.len() >= records * 2 * COL_TILE)
    );
}

/// Weights are one sequential stream, but the hardware prefetcher stops at every 4 KiB page
/// and restarts only after misses; asking for the quants a few records ahead (and the f16
/// metadata with them) keeps the stream flowing across pages. Prefetches never fault.
#[inline]
#[target_feature(enable = "sse")]
pub(super) fn prefetch(w: &QuantMatrix, record: usize, bytes_per_row: usize) {
    const AHEAD: usize = 16;
    let record_bytes = COL_TILE * bytes_per_row;
    let quants = w.quants.as_ptr().wrapping_add((record + AHEAD) * record_bytes);
    for line in (0..record_bytes).step_by(64) {
        // A hint: it may name any address and never faults.
        _mm_prefetch::<_MM_HINT_T0>(quants.wrapping_add(line) as *const i8);
    }
    let meta = w
        .scales
        .as_ptr()
        .wrapping_add((record + 4 * AHEAD) * 2 * w.halves() * COL_TILE);
    _mm_prefetch::<_MM_HINT_T0>(meta as *const i8);
    if !w.mins.is_empty() {
        let mins = w.mins.as_ptr().wrapping_add((record + 4 * AHEAD) * 2 * COL_TILE);
        _mm_prefetch::<_MM_HINT_T0>(mins as *const i8);
    }
}

/// `[a, b]` repeated four times, from two consecutive floats (`b` = 0 unless `two`).
#[inline]
#[target_feature(enable = "avx2")]
pub(super) unsafe fn pair4(v: *const f32, two: bool) -> __m256 {
    unsafe {
        let low = if two {
            _mm_load_sd(v as *const f64)
        } else {
            _mm_castps_pd(_mm_load_ss(v))
        };
        _mm256_castpd_ps(_mm256_broadcastsd_pd(low))
    }
}

/// f16-converted per-slot values of a record (`[row][block]`: slot s = 2 · row + block) in
/// the lane order the AVX2 lane and group kernels' `hadd` of a record's two halves leaves its
/// slots: `[s0, s1, s4, s5, s2, s3, s6, s7]`.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn in_slot_order(v: __m256) -> __m256 {
    _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7))
}

/// Per weight row c of a record, the sum of its two blocks' lanes in an accumulator in
/// [`in_slot_order`]'s order: `lane(s₂c) + lane(s₂c₊₁)`.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) fn weight_row_sums(acc: __m256) -> [f32; COL_TILE] {
    // Lane of slot 2c (block 0 of weight row c); block 1 is the next lane.
    const LANE: [usize; COL_TILE] = [0, 4, 2, 6];
    let mut lanes = [0f32; 8];
    // SAFETY: eight floats.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc) };
    LANE.map(|lane| lanes[lane] + lanes[lane + 1])
}

/// Bytes `16 j..16 j + 16` of a row's interleaved pair at `at` (see
/// `QuantizedRows::lane_quants`), in both 128-bit lanes: the slots of one weight row read the
/// same activations.
///
/// # Safety
/// The CPU must have AVX2; `at` must point at 64 readable bytes and `j` be below 4.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn pair_part(at: *const i8, j: usize) -> __m256i {
    // SAFETY: 16 of the 64 bytes (the caller's guarantee).
    unsafe { _mm256_broadcastsi128_si256(_mm_loadu_si128(at.add(16 * j) as *const __m128i)) }
}

/// A record's eight registers against one activation row's pair at `at` (64 bytes of the
/// lane copy), as the AVX2 lane and group kernels both take them: for j in 0..4, bytes
/// 16 j..16 j + 16 ([`pair_part`], loaded once) meet register j (half A) and register 4 + j
/// (half B) in `product`, and `add` sums each half's four products. The kernels differ only
/// in those two (4-bit: `maddubs` summed in i16; 8-bit: sign-carrying `maddubs` widened by
/// `madd`, summed in i32).
///
/// # Safety
/// The CPU must have AVX2; `at` must point at 64 readable bytes.
#[inline]
#[target_feature(enable = "avx2")]
pub(super) unsafe fn pair_products(
    at: *const i8,
    product: impl Fn(usize, __m256i) -> __m256i,
    add: impl Fn(__m256i, __m256i) -> __m256i,
) -> (__m256i, __m256i) {
    // SAFETY: the 64 bytes at `at` (the caller's guarantee).
    let x = unsafe { pair_part(at, 0) };
    let (mut a, mut b) = (product(0, x), product(4, x));
    for j in 1..4 {
        // SAFETY: as above.
        let x = unsafe { pair_part(at, j) };
        a = add(a, product(j, x));
        b = add(b, product(4 + j, x));
    }
    (a, b)
}

/// Bounds of the interleaved activations the lane kernels read.
pub(super) fn check_lanes(x: &QuantizedRows, r0: usize, rows: usize) {
    let pairs = x.blocks.div_ceil(2);
    assert!(
        x.lanes_ready
            && x.lane_quants.len() >= (r0 + rows) * pairs * LANE_PAIR_BYTES
            && x.lane_scales.len() >= (r0 + rows) * pairs * 4
            && x.lane_offsets.len() >= (r0 + rows) * pairs * 4,
        "activations must be quantised with their interleaved copy for the lane kernels"
    );
}

/// The minimums' term of 4-bit weights in the lane layout, Σ min · (activation scale · Σq),
/// for weight rows `4 · group ..` (index c) and activation rows `r0..r0 + R` (index t): a
/// light pass over the records' minimums, lanes `[row][block]` per activation row, each
/// row's two lanes added last.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; the bounds must have been checked ([`check`]).
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn min_terms<const R: usize>(
    w: &QuantMatrix,
    group: usize,
    x: &QuantizedRows,
    r0: usize,
) -> [[f32; COL_TILE]; R] {
    let nb = x.blocks;
    let pairs = nb.div_ceil(2);
    let mut acc = [_mm256_setzero_ps(); R];
    for p in 0..pairs {
        let (record, b, two) = (group * pairs + p, 2 * p, 2 * p + 1 < nb);
        // SAFETY: the record and row r0 + t's blocks are in bounds (checked by the caller).
        let mins = unsafe {
            _mm256_cvtph_ps(_mm_loadu_si128(
                w.mins.as_ptr().add(record * 2 * COL_TILE) as *const __m128i
            ))
        };
        for t in 0..R {
            // SAFETY: row r0 + t's blocks b (and b + 1 when two) are in bounds.
            let sums = unsafe { pair4(x.sums.as_ptr().add((r0 + t) * nb + b), two) };
            acc[t] = _mm256_fmadd_ps(mins, sums, acc[t]);
        }
    }
    let mut terms = [[0f32; COL_TILE]; R];
    for t in 0..R {
        let mut lanes = [0f32; 8];
        // SAFETY: eight floats.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc[t]) };
        for c in 0..COL_TILE {
            terms[t][c] = lanes[2 * c] + lanes[2 * c + 1];
        }
    }
    terms
}
