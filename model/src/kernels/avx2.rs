//! AVX2 + FMA kernels: one 32-value block per 256-bit register, `maddubs` products.

#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

use super::{BLOCK, QuantizedRows, ROW_TILE, to_f32};

#[inline]
#[target_feature(enable = "avx2,fma")]
fn hsum(v: __m256) -> f32 {
    let lo = _mm256_castps256_ps128(v);
    let hi = _mm256_extractf128_ps(v, 1);
    let s = _mm_add_ps(lo, hi);
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    _mm_cvtss_f32(s)
}

/// Rows are stored one after another, so a tile of rows is one stream; the hardware
/// prefetcher stops at 4 KiB pages, so ask for the quants 1 KiB ahead (and the f16 scales, a
/// line per 32 blocks). Minimums follow the scales' pattern closely enough to ride along in
/// L2. Prefetches are hints: any address, never a fault.
#[inline]
#[target_feature(enable = "avx2")]
fn prefetch(quants: *const u8, scales: *const u16, b: usize) {
    _mm_prefetch::<_MM_HINT_T0>(quants.wrapping_add(1024) as *const i8);
    if b.is_multiple_of(32) {
        _mm_prefetch::<_MM_HINT_T0>(scales.wrapping_add(512) as *const i8);
    }
}

/// # Safety
/// The CPU must have AVX2 and FMA; slices must hold `x.blocks` blocks.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn q4(
    scales: &[u16],
    mins: &[u16],
    quants: &[u8],
    x: &QuantizedRows,
    r0: usize,
    count: usize,
    out: &mut [f32],
) {
    let nb = x.blocks;
    assert!(count <= ROW_TILE && quants.len() >= nb * 16 && scales.len() >= nb && mins.len() >= nb);
    assert!((r0 + count) * nb * BLOCK <= x.quants.len());
    let mut acc = [_mm256_setzero_ps(); ROW_TILE];
    let mut summ = [0f32; ROW_TILE];
    let mask = _mm_set1_epi8(0x0F);
    let ones = _mm256_set1_epi16(1);
    for b in 0..nb {
        prefetch(
            quants.as_ptr().wrapping_add(b * 16),
            scales.as_ptr().wrapping_add(b),
            b,
        );
        // SAFETY: 16 bytes of this block's quants are in bounds (checked above).
        let raw = unsafe { _mm_loadu_si128(quants.as_ptr().add(b * 16) as *const __m128i) };
        let lo = _mm_and_si128(raw, mask);
        let hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
        let w = _mm256_set_m128i(hi, lo);
        let (dw, mw) = (to_f32(scales[b]), to_f32(mins[b]));
        for t in 0..count {
            let xb = (r0 + t) * nb + b;
            // SAFETY: block xb of the activations has 32 int8 values (checked above).
            let xq = unsafe { _mm256_loadu_si256(x.quants.as_ptr().add(xb * BLOCK) as *const __m256i) };
            let products = _mm256_madd_epi16(_mm256_maddubs_epi16(w, xq), ones);
            let scale = _mm256_set1_ps(dw * x.scales[xb]);
            acc[t] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(products), acc[t]);
            summ[t] += mw * x.sums[xb];
        }
    }
    for t in 0..count {
        out[t] = hsum(acc[t]) + summ[t];
    }
}

/// # Safety
/// The CPU must have AVX2 and FMA; slices must hold `x.blocks` blocks.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn q8(scales: &[u16], quants: &[u8], x: &QuantizedRows, r0: usize, count: usize, out: &mut [f32]) {
    let nb = x.blocks;
    assert!(count <= ROW_TILE && quants.len() >= nb * BLOCK && scales.len() >= nb);
    assert!((r0 + count) * nb * BLOCK <= x.quants.len());
    let mut acc = [_mm256_setzero_ps(); ROW_TILE];
    let ones = _mm256_set1_epi16(1);
    for b in 0..nb {
        prefetch(
            quants.as_ptr().wrapping_add(b * BLOCK),
            scales.as_ptr().wrapping_add(b),
            b,
        );
        // SAFETY: 32 bytes of this block's quants are in bounds (checked above).
        let w = unsafe { _mm256_loadu_si256(quants.as_ptr().add(b * BLOCK) as *const __m256i) };
        let w_abs = _mm256_sign_epi8(w, w);
        let dw = to_f32(scales[b]);
        for t in 0..count {
            let xb = (r0 + t) * nb + b;
            // SAFETY: block xb of the activations has 32 int8 values (checked above).
            let xq = unsafe { _mm256_loadu_si256(x.quants.as_ptr().add(xb * BLOCK) as *const __m256i) };
            let x_signed = _mm256_sign_epi8(xq, w);
            let products = _mm256_madd_epi16(_mm256_maddubs_epi16(w_abs, x_signed), ones);
            let scale = _mm256_set1_ps(dw * x.scales[xb]);
            acc[t] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(products), acc[t]);
        }
    }
    for t in 0..count {
        out[t] = hsum(acc[t]);
    }
}

/// As [`q8`] with a scale per 16 values: lanes 0..4 of the products hold values 0..16.
///
/// # Safety
/// The CPU must have AVX2 and FMA; slices must hold `x.blocks` blocks.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn q8x16(
    scales: &[u16],
    quants: &[u8],
    x: &QuantizedRows,
    r0: usize,
    count: usize,
    out: &mut [f32],
) {
    let nb = x.blocks;
    assert!(count <= ROW_TILE && quants.len() >= nb * BLOCK && scales.len() >= 2 * nb);
    assert!((r0 + count) * nb * BLOCK <= x.quants.len());
    let mut acc = [_mm256_setzero_ps(); ROW_TILE];
    let ones = _mm256_set1_epi16(1);
    for b in 0..nb {
        prefetch(
            quants.as_ptr().wrapping_add(b * BLOCK),
            scales.as_ptr().wrapping_add(2 * b),
            b,
        );
        // SAFETY: 32 bytes of this block's quants are in bounds (checked above).
        let w = unsafe { _mm256_loadu_si256(quants.as_ptr().add(b * BLOCK) as *const __m256i) };
        let w_abs = _mm256_sign_epi8(w, w);
        let dw = _mm256_set_m128(
            _mm_set1_ps(to_f32(scales[2 * b + 1])),
            _mm_set1_ps(to_f32(scales[2 * b])),
        );
        for t in 0..count {
            let xb = (r0 + t) * nb + b;
            // SAFETY: block xb of the activations has 32 int8 values (checked above).
            let xq = unsafe { _mm256_loadu_si256(x.quants.as_ptr().add(xb * BLOCK) as *const __m256i) };
            let x_signed = _mm256_sign_epi8(xq, w);
            let products = _mm256_madd_epi16(_mm256_maddubs_epi16(w_abs, x_signed), ones);
            let scale = _mm256_mul_ps(dw, _mm256_set1_ps(x.scales[xb]));
            acc[t] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(products), acc[t]);
        }
    }
    for t in 0..count {
        out[t] = hsum(acc[t]);
    }
}
