//! The tiled attention of [`super`] with AVX2 and FMA, for CPUs without AVX-512: a tile row
//! (one dimension of 16 positions) is two 8-lane registers, so scores for 16 positions are
//! still plain multiply-adds with no horizontal sums, and the rows that read one KV head
//! share each load of its keys and values. Before this, AVX2 CPUs scored every (query row,
//! head) alone against keys stored by position, with a horizontal sum per position.
//!
//! The same rules keep results batch-invariant: a row's arithmetic does not depend on the
//! rows it shares an item with, positions it may not see are −∞ before its softmax and
//! exact zeros after, and its sums run in a fixed order.

#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

use half::f16;

use super::super::{EXP_LN2_HI, EXP_LN2_LO, EXP_TAYLOR, SequenceAttention};
use super::{Ahead, AttentionShape, Row, Scratch};
use crate::kernels::SendPtr;
use crate::kv_cache::KEY_TILE;

/// Query rows scored together against one key tile: per row two halves of 16 positions ×
/// [`SCORE_CHAINS`] accumulators, plus the two key registers and a query broadcast, fill
/// AVX2's sixteen registers.
const SCORE_ROWS: usize = 3;
const SCORE_CHAINS: usize = 2;
/// Registers of a head summed at once (32 floats), and the rows sharing each value load.
const VALUE_SLICE: usize = 4;
const VALUE_ROWS: usize = 3;

/// [`super::super::exp`] on 8 lanes (the same polynomial and operations).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) fn exp8(x: __m256) -> __m256 {
    let x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0)), _mm256_set1_ps(87.0));
    const NEAREST: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    let n = _mm256_round_ps::<NEAREST>(_mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)));
    let minus_n = _mm256_sub_ps(_mm256_setzero_ps(), n);
    let r = _mm256_fmadd_ps(
        minus_n,
        _mm256_set1_ps(EXP_LN2_LO),
        _mm256_fmadd_ps(minus_n, _mm256_set1_ps(EXP_LN2_HI), x),
    );
    let mut p = _mm256_set1_ps(EXP_TAYLOR[0]);
    for &c in &EXP_TAYLOR[1..] {
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
    }
    let bits = _mm256_slli_epi32::<23>(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)));
    _mm256_mul_ps(p, _mm256_castsi256_ps(bits))
}

/// 8 f16 values from `at` as floats.
///
/// # Safety
/// The CPU must have F16C; 8 values from `at` must be readable.
#[inline]
#[target_feature(enable = "avx,f16c")]
unsafe fn load8(at: *const f16) -> __m256 {
    // SAFETY: as the caller guarantees.
    unsafe { _mm256_cvtph_ps(_mm_loadu_si128(at as *const __m128i)) }
}

/// All-ones lanes for the positions of half `half` (0: tile positions 0..8, 1: 8..16) below
/// `seen`.
#[inline]
#[target_feature(enable = "avx2")]
fn seen_mask(seen: usize, half: usize) -> __m256 {
    let first = 8 * half as i32;
    let lanes = _mm256_setr_epi32(
        first,
        first + 1,
        first + 2,
        first + 3,
        first + 4,
        first + 5,
        first + 6,
        first + 7,
    );
    _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(seen as i32), lanes))
}

/// Σ of 8 lanes in a fixed order.
#[inline]
#[target_feature(enable = "avx2")]
fn lane_sum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)))
}

/// The largest of 8 lanes.
#[inline]
#[target_feature(enable = "avx2")]
fn lane_max(v: __m256) -> f32 {
    let m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)))
}

/// One work item: `rows` of sequence `seq` against the block of KV head `kv` that starts at
/// position `first` (see `super::item_attend`); writes each row's partial result.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; the sizes are as `super::attend` checks them; every row
/// sees into the block, and its partial slot lies in `partials` and belongs to this call.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn item_attend(
    shape: &AttentionShape,
    seq: &SequenceAttention<'_>,
    kv: usize,
    first: usize,
    rows: &[Row],
    queries: &[f32],
    scale: f32,
    scratch: &mut Scratch,
    partials: SendPtr,
) {
    let (nkv, hd) = (shape.n_head_kv, shape.head_dim);
    let span = scratch.prepare(rows, queries, hd, scale, first);
    for from in (0..rows.len()).step_by(SCORE_ROWS) {
        let chunk = &rows[from..(from + SCORE_ROWS).min(rows.len())];
        // SAFETY: as this function's.
        unsafe {
            match chunk.len() {
                3 => score_rows::<3>(seq, kv, nkv, hd, first, chunk, from, span, scratch),
                2 => score_rows::<2>(seq, kv, nkv, hd, first, chunk, from, span, scratch),
                _ => score_rows::<1>(seq, kv, nkv, hd, first, chunk, from, span, scratch),
            }
        }
    }
    // Softmax per row over exactly the positions of the block it sees; the rest become
    // exact zeros. The block's maximum and sum go to the row's partial result.
    for (r, row) in rows.iter().enumerate() {
        let weights = &mut scratch.weights[r * span..(r + 1) * span];
        let mut max = _mm256_set1_ps(f32::NEG_INFINITY);
        for half in weights.chunks_exact(8) {
            // SAFETY: 8 floats (masked positions are −∞ and do not raise the maximum).
            max = _mm256_max_ps(max, unsafe { _mm256_loadu_ps(half.as_ptr()) });
        }
        let block_max = lane_max(max);
        let max = _mm256_set1_ps(block_max);
        // Per-lane sums, then the lanes in a fixed order: positions past `visible` add exact
        // zeros, so the sum does not depend on the item's span.
        let seen_in_block = Scratch::seen_in_block(row, first);
        let mut sum = _mm256_setzero_ps();
        for (h, half) in weights.chunks_exact_mut(8).enumerate() {
            let seen = seen_in_block.saturating_sub((h / 2) * KEY_TILE).min(KEY_TILE);
            // SAFETY: 8 floats.
            let w = unsafe { _mm256_loadu_ps(half.as_ptr()) };
            let w = _mm256_and_ps(seen_mask(seen, h % 2), exp8(_mm256_sub_ps(w, max)));
            // SAFETY: as above.
            unsafe { _mm256_storeu_ps(half.as_mut_ptr(), w) };
            sum = _mm256_add_ps(sum, w);
        }
        // SAFETY: the row's partial slot belongs to this call (the caller's contract).
        unsafe {
            *partials.get().add(row.partial) = block_max;
            *partials.get().add(row.partial + 1) = lane_sum(sum);
        }
    }
    // Weighted sums of values, a slice of the head at a time: each value load serves a chunk
    // of rows.
    for slice in (0..hd).step_by(8 * VALUE_SLICE) {
        for from in (0..rows.len()).step_by(VALUE_ROWS) {
            let chunk = &rows[from..(from + VALUE_ROWS).min(rows.len())];
            // SAFETY: as this function's.
            unsafe {
                match chunk.len() {
                    3 => sum_values::<3>(
                        seq, kv, nkv, hd, first, slice, chunk, from, span, scratch, partials,
                    ),
                    2 => sum_values::<2>(
                        seq, kv, nkv, hd, first, slice, chunk, from, span, scratch, partials,
                    ),
                    _ => sum_values::<1>(
                        seq, kv, nkv, hd, first, slice, chunk, from, span, scratch, partials,
                    ),
                }
            }
        }
    }
}

/// Scores of `R` rows (scratch rows `from..from + R`) against every tile of the block (from
/// position `first`) they see, masked to −∞ past each row's visible positions.
///
/// # Safety
/// As [`item_attend`].
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn score_rows<const R: usize>(
    seq: &SequenceAttention<'_>,
    kv: usize,
    nkv: usize,
    hd: usize,
    first: usize,
    chunk: &[Row],
    from: usize,
    span: usize,
    scratch: &mut Scratch,
) {
    assert!(chunk.len() == R && scratch.queries.len() >= (from + R) * hd && hd.is_multiple_of(SCORE_CHAINS));
    assert!(first.is_multiple_of(KEY_TILE));
    let tile_floats = KEY_TILE * nkv * hd;
    let tiles = Scratch::seen_by_any(chunk, first).div_ceil(KEY_TILE);
    let first_tile = first / KEY_TILE;
    let queries = &scratch.queries[from * hd..(from + R) * hd];
    for t in 0..tiles {
        let tile = &seq.keys[(first_tile + t) * tile_floats + kv * hd * KEY_TILE..][..hd * KEY_TILE];
        let ahead = Ahead::new(seq, kv, nkv, hd, first_tile + t);
        // [row][chain][half of the tile]
        let mut acc = [[[_mm256_setzero_ps(); 2]; SCORE_CHAINS]; R];
        for d in (0..hd).step_by(SCORE_CHAINS) {
            for a in 0..SCORE_CHAINS {
                if from == 0 {
                    ahead.ask(d + a);
                }
                // SAFETY: the tile holds hd rows of 16 values.
                let keys = unsafe {
                    let at = tile.as_ptr().add((d + a) * KEY_TILE);
                    [load8(at), load8(at.add(8))]
                };
                for c in 0..R {
                    let q = _mm256_set1_ps(queries[c * hd + d + a]);
                    acc[c][a][0] = _mm256_fmadd_ps(q, keys[0], acc[c][a][0]);
                    acc[c][a][1] = _mm256_fmadd_ps(q, keys[1], acc[c][a][1]);
                }
            }
        }
        for c in 0..R {
            let seen = Scratch::seen_in_block(&chunk[c], first)
                .saturating_sub(t * KEY_TILE)
                .min(KEY_TILE);
            let at = (from + c) * span + t * KEY_TILE;
            assert!(at + KEY_TILE <= scratch.weights.len());
            for half in 0..2 {
                let scores = _mm256_blendv_ps(
                    _mm256_set1_ps(f32::NEG_INFINITY),
                    _mm256_add_ps(acc[c][0][half], acc[c][1][half]),
                    seen_mask(seen, half),
                );
                // SAFETY: 8 floats inside this row's span (checked).
                unsafe { _mm256_storeu_ps(scratch.weights.as_mut_ptr().add(at + 8 * half), scores) };
            }
        }
    }
}

/// `partial[row][slice..slice + 32] = Σⱼ weights[row][j] · values[first + j][slice..slice +
/// 32]` over the block, unnormalised, for `R` rows (scratch rows `from..from + R`).
///
/// # Safety
/// As [`item_attend`]; each row's partial slot belongs to this call.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn sum_values<const R: usize>(
    seq: &SequenceAttention<'_>,
    kv: usize,
    nkv: usize,
    hd: usize,
    first: usize,
    slice: usize,
    chunk: &[Row],
    from: usize,
    span: usize,
    scratch: &Scratch,
    partials: SendPtr,
) {
    let stride = nkv * hd;
    let positions = Scratch::seen_by_any(chunk, first);
    assert!(chunk.len() == R && positions <= span && seq.values.len() >= (first + positions) * stride);
    assert!(scratch.weights.len() >= (from + R) * span && slice + 8 * VALUE_SLICE <= hd);
    let mut acc = [[_mm256_setzero_ps(); VALUE_SLICE]; R];
    for j in 0..positions {
        // SAFETY: position first + j of this KV head is in bounds (checked above).
        let value = unsafe { seq.values.as_ptr().add((first + j) * stride + kv * hd + slice) };
        for g in 0..VALUE_SLICE {
            // SAFETY: as above; 8 floats at 8 g, inside the head (checked).
            let v = unsafe { load8(value.add(8 * g)) };
            for c in 0..R {
                // SAFETY: row from + c's weights hold span >= positions floats (checked).
                let w = _mm256_set1_ps(unsafe { *scratch.weights.get_unchecked((from + c) * span + j) });
                acc[c][g] = _mm256_fmadd_ps(w, v, acc[c][g]);
            }
        }
    }
    for c in 0..R {
        for g in 0..VALUE_SLICE {
            // SAFETY: the row's partial slot (2 + hd floats) lies in the partials and is
            // written only by this item.
            unsafe {
                _mm256_storeu_ps(
                    partials.get().add(chunk[c].partial + 2 + slice + 8 * g),
                    acc[c][g],
                )
            };
        }
    }
}
