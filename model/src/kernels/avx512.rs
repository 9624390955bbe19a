//! AVX-512 VNNI kernels over weights in the grouped layout (see `Layout::Groups`): one
//! sequential stream per group of 4 weight rows, two 32-value blocks per 512-bit register and
//! `vpdpbusd` (unsigned × signed bytes summed into 32-bit lanes in one instruction). A group
//! × up to 4 activation rows keeps 16 independent accumulators in registers, so one-token
//! decode is not bound by the latency of one accumulation chain. Each output element's
//! arithmetic is the same whatever the number of rows, so results are batch-invariant.

#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

use super::groups::{check, prefetch};
use super::{BLOCK, COL_TILE, QuantMatrix, QuantizedRows, ROW_TILE};

/// `[v[0]; 8] ++ [v[1]; 8]` from two consecutive floats (the second is zero when `two` is
/// false).
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn pair_of(v: *const f32, two: bool) -> __m512 {
    let low = unsafe {
        if two {
            _mm_castpd_ps(_mm_load_sd(v as *const f64))
        } else {
            _mm_load_ss(v)
        }
    };
    spread(low)
}

#[inline]
#[target_feature(enable = "avx512f")]
fn spread(low: __m128) -> __m512 {
    let index = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    _mm512_permutexvar_ps(index, _mm512_castps128_ps512(low))
}

/// For activation rows `r0..r0 + R`: blocks `b` (and `b + 1` when `two`) and their scales
/// as [`pair_of`] spreads them.
///
/// # Safety
/// As [`load_x`], for every row.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn load_rows<const R: usize>(
    x: &QuantizedRows,
    r0: usize,
    b: usize,
    two: bool,
) -> ([__m512i; R], [__m512; R]) {
    let mut quants = [_mm512_setzero_si512(); R];
    let mut scales = [_mm512_setzero_ps(); R];
    for t in 0..R {
        // SAFETY: the caller guarantees rows r0..r0 + R hold these blocks.
        unsafe {
            quants[t] = load_x(x, r0 + t, b, two);
            scales[t] = pair_of(x.scales.as_ptr().add((r0 + t) * x.blocks + b), two);
        }
    }
    (quants, scales)
}

/// Activation blocks `b` (and `b + 1` when `two`) of row `r`: 64 (or 32, zero-extended) bytes.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn load_x(x: &QuantizedRows, r: usize, b: usize, two: bool) -> __m512i {
    let p = unsafe { x.quants.as_ptr().add((r * x.blocks + b) * BLOCK) };
    unsafe {
        if two {
            _mm512_loadu_si512(p as *const __m512i)
        } else {
            _mm512_zextsi256_si512(_mm256_loadu_si256(p as *const __m256i))
        }
    }
}

/// The group's f16 metadata for one pair, `[row][block]`, as 8 floats.
#[inline]
#[target_feature(enable = "avx512f,f16c")]
unsafe fn meta8(v: *const u16) -> __m256 {
    unsafe { _mm256_cvtph_ps(_mm_loadu_si128(v as *const __m128i)) }
}

/// For weight row c of a group: lanes 0..8 = scale of its first block, 8..16 = of its second.
#[inline]
#[target_feature(enable = "avx512f")]
fn row_pair(meta: __m512, c: usize) -> __m512 {
    let (a, b) = (2 * c as i32, 2 * c as i32 + 1);
    _mm512_permutexvar_ps(
        _mm512_set_epi32(b, b, b, b, b, b, b, b, a, a, a, a, a, a, a, a),
        meta,
    )
}

/// 4-bit weights (`scale · q + min`) × int8 activations, for weight rows
/// `4 · group .. 4 · group + 4` and activation rows `r0..r0 + R`; `out[c * ROW_TILE + t]`.
///
/// # Safety
/// The CPU must have AVX-512 F, BW, VL and VNNI; `w` must be grouped and of the 4-bit family.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")]
pub unsafe fn q4_group<const R: usize>(
    w: &QuantMatrix,
    group: usize,
    x: &QuantizedRows,
    r0: usize,
    out: &mut [f32],
) {
    check(w, group, x, r0, R, BLOCK);
    assert!(w.mins.len() == w.scales.len());
    let nb = x.blocks;
    let pairs = nb.div_ceil(2);
    // 16 accumulators, the rows' activations and scales, one weight row at a time: within
    // AVX-512's 32 registers, so nothing spills to the stack in the hot loop.
    let mut acc = [[_mm512_setzero_ps(); R]; COL_TILE];
    let low_nibbles = _mm512_set1_epi8(0x0F);
    for p in 0..pairs {
        let (record, b, two) = (group * pairs + p, 2 * p, 2 * p + 1 < nb);
        prefetch(w, record, BLOCK);
        // SAFETY: the record is in bounds (checked above).
        let scales = unsafe { _mm512_castps256_ps512(meta8(w.scales.as_ptr().add(record * 2 * COL_TILE))) };
        // SAFETY: blocks of rows r0..r0 + R are in bounds (checked above).
        let (xq, dx) = unsafe { load_rows::<R>(x, r0, b, two) };
        for c in 0..COL_TILE {
            // SAFETY: as above; 32 bytes per weight row.
            let raw = unsafe {
                _mm512_broadcast_i64x4(_mm256_loadu_si256(
                    w.quants.as_ptr().add((record * COL_TILE + c) * BLOCK) as *const __m256i,
                ))
            };
            // Low half: low nibbles (first block); high half: high nibbles (second block).
            let weights = _mm512_and_si512(_mm512_mask_srli_epi16(raw, 0xFFFF_0000, raw, 4), low_nibbles);
            let dw = row_pair(scales, c);
            for t in 0..R {
                let dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), weights, xq[t]);
                acc[c][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dw, dx[t]), acc[c][t]);
            }
        }
    }
    // The minimums' term, Σ min · (activation scale · Σq), in a second, light pass: lanes
    // [row][block] per activation row.
    let mut min_acc = [_mm256_setzero_ps(); R];
    for p in 0..pairs {
        let (record, b, two) = (group * pairs + p, 2 * p, 2 * p + 1 < nb);
        // SAFETY: the record and row r0 + t's blocks are in bounds (checked above).
        let mins = unsafe { meta8(w.mins.as_ptr().add(record * 2 * COL_TILE)) };
        for t in 0..R {
            let sums = unsafe {
                let s = x.sums.as_ptr().add((r0 + t) * nb + b);
                if two {
                    _mm_castpd_ps(_mm_load_sd(s as *const f64))
                } else {
                    _mm_load_ss(s)
                }
            };
            let sums = _mm256_castpd_ps(_mm256_broadcastsd_pd(_mm_castps_pd(sums)));
            min_acc[t] = _mm256_fmadd_ps(mins, sums, min_acc[t]);
        }
    }
    for t in 0..R {
        let mut lanes = [0f32; 8];
        // SAFETY: eight floats.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), min_acc[t]) };
        for c in 0..COL_TILE {
            out[c * ROW_TILE + t] = _mm512_reduce_add_ps(acc[c][t]) + (lanes[2 * c] + lanes[2 * c + 1]);
        }
    }
}

/// Signed 8-bit weights × int8 activations, with one scale per block (`HALVES` = 1, Q8_0)
/// or per 16 values (`HALVES` = 2, Q6_K). `vpdpbusd` needs an unsigned side: it takes |w|
/// and x with w's sign (a mask register per weight row). Registers as in [`q4_group`].
///
/// # Safety
/// The CPU must have AVX-512 F, BW, VL and VNNI; `w` must be grouped and of an 8-bit family
/// with `HALVES` scales per block.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")]
pub unsafe fn q8_group<const R: usize, const HALVES: usize>(
    w: &QuantMatrix,
    group: usize,
    x: &QuantizedRows,
    r0: usize,
    out: &mut [f32],
) {
    check(w, group, x, r0, R, 2 * BLOCK);
    assert!(w.halves() == HALVES);
    let nb = x.blocks;
    let pairs = nb.div_ceil(2);
    let mut acc = [[_mm512_setzero_ps(); R]; COL_TILE];
    for p in 0..pairs {
        let (record, b, two) = (group * pairs + p, 2 * p, 2 * p + 1 < nb);
        prefetch(w, record, 2 * BLOCK);
        // SAFETY: the record's scales are in bounds (checked above).
        let scales = unsafe {
            let at = w.scales.as_ptr().add(record * 2 * HALVES * COL_TILE);
            if HALVES == 1 {
                _mm512_castps256_ps512(meta8(at))
            } else {
                _mm512_cvtph_ps(_mm256_loadu_si256(at as *const __m256i))
            }
        };
        // SAFETY: blocks of rows r0..r0 + R are in bounds (checked above).
        let (xq, dx) = unsafe { load_rows::<R>(x, r0, b, two) };
        for c in 0..COL_TILE {
            // SAFETY: as above; 64 bytes per weight row.
            let raw = unsafe {
                _mm512_loadu_si512(
                    w.quants.as_ptr().add((record * COL_TILE + c) * 2 * BLOCK) as *const __m512i
                )
            };
            let magnitude = _mm512_abs_epi8(raw);
            let negative = _mm512_movepi8_mask(raw);
            let dw = if HALVES == 1 {
                row_pair(scales, c)
            } else {
                // Lanes 4i..4i + 4 hold values 16i'.. of block i / 2, half i % 2.
                let base = 4 * c as i32;
                let (a, b1, c1, d) = (base, base + 1, base + 2, base + 3);
                _mm512_permutexvar_ps(
                    _mm512_set_epi32(d, d, d, d, c1, c1, c1, c1, b1, b1, b1, b1, a, a, a, a),
                    scales,
                )
            };
            for t in 0..R {
                let signed = _mm512_mask_sub_epi8(xq[t], negative, _mm512_setzero_si512(), xq[t]);
                let dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), magnitude, signed);
                acc[c][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dw, dx[t]), acc[c][t]);
            }
        }
    }
    for c in 0..COL_TILE {
        for t in 0..R {
            out[c * ROW_TILE + t] = _mm512_reduce_add_ps(acc[c][t]);
        }
    }
}

/// Quantises 32-value blocks of `x` into `quants` and pushes each block's scale and scaled
/// sum, with exactly the arithmetic of the portable version (max |x| / 127, multiply by its
/// inverse, round half to even, f16 scale), sixteen lanes at a time.
///
/// # Safety
/// The CPU must have AVX-512 F and BW; `quants` must hold `x.len()` values.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c")]
pub unsafe fn quantize(x: &[f32], quants: &mut [i8], scales: &mut Vec<f32>, sums: &mut Vec<f32>) {
    assert!(x.len().is_multiple_of(BLOCK) && quants.len() == x.len());
    for (chunk, q) in x.chunks_exact(BLOCK).zip(quants.chunks_exact_mut(BLOCK)) {
        // SAFETY: each chunk holds 32 floats and each q 32 bytes.
        unsafe {
            let v0 = _mm512_loadu_ps(chunk.as_ptr());
            let v1 = _mm512_loadu_ps(chunk.as_ptr().add(16));
            let amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
            let d = amax / 127.0;
            let inv = _mm512_set1_ps(if d > 0.0 { 1.0 / d } else { 0.0 });
            const NEAREST: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
            let q0 = _mm512_cvt_roundps_epi32::<NEAREST>(_mm512_mul_ps(v0, inv));
            let q1 = _mm512_cvt_roundps_epi32::<NEAREST>(_mm512_mul_ps(v1, inv));
            _mm_storeu_si128(q.as_mut_ptr() as *mut __m128i, _mm512_cvtsepi32_epi8(q0));
            _mm_storeu_si128(q.as_mut_ptr().add(16) as *mut __m128i, _mm512_cvtsepi32_epi8(q1));
            let sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
            scales.push(super::to_f32(super::to_f16(d)));
            sums.push(super::to_f32(super::to_f16(d * sum as f32)));
        }
    }
}
