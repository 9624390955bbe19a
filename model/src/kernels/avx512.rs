//! AVX-512 VNNI kernels over Q6_K weights in the lane layout (see `Layout::Lanes`; 4-bit and
//! Q8_0 weights take the tile layout and `tiles.rs`, whose 32-value records Q6_K's scale per
//! 16 values does not fit), and the AVX-512 activation quantiser. A record holds
//! two 32-value blocks of 4 weight rows (8 "slots"); each of its four 512-bit registers holds
//! 8 values of every slot, so `vpdpbusd` works on all 8 blocks at once and four of them sum a
//! whole record into one register per activation row: each 32-bit lane then holds the
//! integer dot product over 16 values of one block. The int → float conversion and the
//! scaling, which dominate when several activation rows share the weights, run once per
//! record and row rather than once per block pair, weight row and activation row. The
//! activations come interleaved to match (see `QuantizedRows::lane_quants`), so each register
//! of them is one 16-byte broadcast. Each output element's arithmetic is the same whatever the
//! number of rows, so results are batch-invariant.

#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

use super::groups::{check, check_lanes, prefetch};
use super::{BLOCK, COL_TILE, LANE_PAIR_BYTES, QuantMatrix, QuantizedRows};

/// One record's integer dot products with activation row `r`'s pair `p`: lane 4c + 2h + l
/// holds Σ over values 16l..16l + 16 of block 2p + h, weight row c. `start` is the initial
/// accumulator (the unsigned-offset correction of 8-bit weights, else zero).
///
/// # Safety
/// The CPU must have AVX-512 F and VNNI; row `r`'s pair `p` must exist (checked by callers).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
unsafe fn record_dot(
    weights: &[__m512i; 4],
    x: &QuantizedRows,
    r: usize,
    p: usize,
    start: __m512i,
) -> __m512i {
    let pairs = x.blocks.div_ceil(2);
    // SAFETY: 64 bytes per (row, pair), in bounds (checked by the caller).
    let at = unsafe { x.lane_quants.as_ptr().add((r * pairs + p) * LANE_PAIR_BYTES) };
    let mut dot = start;
    for j in 0..4 {
        // SAFETY: as above; 16 bytes at 16 j.
        let xs = unsafe { _mm512_broadcast_i32x4(_mm_loadu_si128(at.add(16 * j) as *const __m128i)) };
        dot = _mm512_dpbusd_epi32(dot, weights[j], xs);
    }
    dot
}

/// Row `r`'s block scales for pair `p`, `[d_2p, d_2p, d_2p+1, d_2p+1]` in every 128-bit lane.
///
/// # Safety
/// As [`record_dot`].
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn pair_scales(x: &QuantizedRows, r: usize, p: usize) -> __m512 {
    let pairs = x.blocks.div_ceil(2);
    unsafe { _mm512_broadcast_f32x4(_mm_loadu_ps(x.lane_scales.as_ptr().add((r * pairs + p) * 4))) }
}

/// Sums each 128-bit lane (weight row c) of `acc` into `out[c]`: `(l0 + l1) + (l2 + l3)`.
#[inline]
#[target_feature(enable = "avx512f")]
fn lane_sums(acc: __m512) -> [f32; 16] {
    let pairs = _mm512_add_ps(acc, _mm512_permute_ps::<0b10_11_00_01>(acc));
    let quads = _mm512_add_ps(pairs, _mm512_permute_ps::<0b01_00_11_10>(pairs));
    let mut lanes = [0f32; 16];
    // SAFETY: sixteen floats.
    unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), quads) };
    lanes
}

/// Q6_K weights (signed bytes, one scale per 16 values) × int8 activations. The weights are
/// stored offset by 128 (`vpdpbusd`
/// needs an unsigned side); the accumulator starts at −128 · Σx over each lane's values
/// (`QuantizedRows::lane_offsets`), which removes the offset exactly.
///
/// # Safety
/// The CPU must have AVX-512 F, BW, VL and VNNI; `w` must be Q6_K in the lane layout.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")]
pub unsafe fn q6k_lanes<const R: usize>(
    w: &QuantMatrix,
    group: usize,
    x: &QuantizedRows,
    r0: usize,
    out: &mut [f32],
) {
    check(w, group, x, r0, R, 2 * BLOCK);
    check_lanes(x, r0, R);
    assert!(w.halves() == 2, "Q6_K: two scales per block");
    let pairs = x.blocks.div_ceil(2);
    let mut acc = [_mm512_setzero_ps(); R];
    for p in 0..pairs {
        let record = group * pairs + p;
        prefetch(w, record, 2 * BLOCK);
        // SAFETY: the record is in bounds (checked above): its scales and 256 bytes.
        let (dw, weights) = unsafe {
            let at = w.scales.as_ptr().add(record * 4 * COL_TILE);
            // Lane 4c + 2h + l: row c, block h, half l: the stored order.
            let dw = _mm512_cvtph_ps(_mm256_loadu_si256(at as *const __m256i));
            let q = w.quants.as_ptr().add(record * 8 * BLOCK);
            let weights = [0, 1, 2, 3].map(|j| _mm512_loadu_si512(q.add(64 * j) as *const __m512i));
            (dw, weights)
        };
        for t in 0..R {
            // SAFETY: row r0 + t's pair p exists (checked above).
            let (dot, dx) = unsafe {
                let offsets = x.lane_offsets.as_ptr().add(((r0 + t) * pairs + p) * 4);
                let start = _mm512_broadcast_i32x4(_mm_loadu_si128(offsets as *const __m128i));
                (
                    record_dot(&weights, x, r0 + t, p, start),
                    pair_scales(x, r0 + t, p),
                )
            };
            acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(dw, dx), acc[t]);
        }
    }
    for t in 0..R {
        let sums = lane_sums(acc[t]);
        for c in 0..COL_TILE {
            out[t * COL_TILE + c] = sums[4 * c];
        }
    }
}

/// `value` rounded to the nearest f16 (ties to even) and back: `to_f32(to_f16(value))` in two
/// instructions, where the `half` crate's conversions are calls.
///
/// # Safety
/// The CPU must have F16C.
#[inline]
#[target_feature(enable = "f16c")]
unsafe fn round_to_f16(value: f32) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(
        _mm_set_ss(value),
    )))
}

/// Blocks quantised together by [`quantize_grouped`].
const GROUP: usize = 16;

/// [`quantize`] without the lane kernels' copy, [`GROUP`] blocks at a time: each block's
/// maximum and integer sum are reduced on its own, as before, but the scalar steps between
/// them (the scale's division, its inverse, both f16 roundings, the offsets) run once for
/// sixteen blocks in one register, and the results are stored sixteen at once. Per block
/// those steps were a chain of dependent scalar instructions; here they leave the blocks'
/// reductions independent, so they overlap. The arithmetic is the same instruction for
/// instruction (IEEE division and multiplication, round to nearest even, the same f16
/// conversions), so the results are identical (tested against the portable quantiser).
///
/// # Safety
/// As [`quantize`]; `quants` holds `x.len()` values.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c")]
unsafe fn quantize_grouped(
    x: &[f32],
    quants: &mut [i8],
    scales: &mut [f32],
    sums: &mut [f32],
    offsets: &mut [i32],
) {
    const NEAREST: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    let total = x.len() / BLOCK;
    assert!(quants.len() == x.len() && x.len().is_multiple_of(BLOCK));
    assert!(scales.len() == total && sums.len() == total && offsets.len() == total);
    let mut g = 0;
    while g < total {
        let n = (total - g).min(GROUP);
        let lanes = ((1u32 << n) - 1) as __mmask16;
        let mut amax = [0f32; GROUP];
        for (i, m) in amax.iter_mut().enumerate().take(n) {
            // SAFETY: block g + i lies in `x` (g + i < total).
            *m = unsafe {
                let at = x.as_ptr().add((g + i) * BLOCK);
                let (v0, v1) = (_mm512_loadu_ps(at), _mm512_loadu_ps(at.add(16)));
                _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)))
            };
        }
        // SAFETY: sixteen floats.
        let d = _mm512_div_ps(unsafe { _mm512_loadu_ps(amax.as_ptr()) }, _mm512_set1_ps(127.0));
        let positive = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(d, _mm512_setzero_ps());
        let mut inverse = [0f32; GROUP];
        // SAFETY: sixteen floats.
        unsafe {
            _mm512_storeu_ps(
                inverse.as_mut_ptr(),
                _mm512_maskz_div_ps(positive, _mm512_set1_ps(1.0), d),
            )
        };
        let mut block_sums = [0i32; GROUP];
        for i in 0..n {
            // SAFETY: block g + i lies in `x` and in `quants` (as above).
            block_sums[i] = unsafe {
                let at = x.as_ptr().add((g + i) * BLOCK);
                let inv = _mm512_set1_ps(inverse[i]);
                let q0 = _mm512_cvt_roundps_epi32::<NEAREST>(_mm512_mul_ps(_mm512_loadu_ps(at), inv));
                let q1 = _mm512_cvt_roundps_epi32::<NEAREST>(_mm512_mul_ps(_mm512_loadu_ps(at.add(16)), inv));
                let q = quants.as_mut_ptr().add((g + i) * BLOCK);
                _mm_storeu_si128(q as *mut __m128i, _mm512_cvtsepi32_epi8(q0));
                _mm_storeu_si128(q.add(16) as *mut __m128i, _mm512_cvtsepi32_epi8(q1));
                _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1))
            };
        }
        // SAFETY: sixteen integers.
        let block_sums = unsafe { _mm512_loadu_si512(block_sums.as_ptr() as *const __m512i) };
        let to_f16_and_back = |v: __m512| _mm512_cvtph_ps(_mm512_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v));
        let scale = to_f16_and_back(d);
        let scaled_sum = to_f16_and_back(_mm512_mul_ps(d, _mm512_cvtepi32_ps(block_sums)));
        let offset = _mm512_mullo_epi32(block_sums, _mm512_set1_epi32(-128));
        // SAFETY: entries g .. g + n exist (one per block, checked above).
        unsafe {
            _mm512_mask_storeu_ps(scales.as_mut_ptr().add(g), lanes, scale);
            _mm512_mask_storeu_ps(sums.as_mut_ptr().add(g), lanes, scaled_sum);
            _mm512_mask_storeu_epi32(offsets.as_mut_ptr().add(g), lanes, offset);
        }
        g += n;
    }
}

/// Quantises 32-value blocks of `x` (`blocks` per row) into `quants` and writes each block's
/// scale, scaled sum and offset correction `−128 · Σq` (for 8-bit weights offset to unsigned
/// in the tile kernels), with exactly the arithmetic of the portable version (max |x| / 127,
/// multiply by its inverse, round half to even, f16 scale), sixteen lanes at a time. Unless
/// the lane buffers are empty, also writes the interleaved copy the lane kernels read: per
/// row and block pair, value v of block h at byte `16 · (v % 16 / 4) + 8h + 4 · (v / 16) + v
/// % 4`, the pair's scales `[d_0, d_0, d_1, d_1]` and its offsets `−128 · Σ` over each half
/// block.
///
/// # Safety
/// The CPU must have AVX-512 F and BW; `quants` must hold `x.len()` values, `scales`, `sums`
/// and `offsets` one per block, and the lane buffers none or `rows · pairs` entries (64
/// bytes, 4 floats and 4 integers each), zeroed.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c")]
#[allow(clippy::too_many_arguments)]
pub unsafe fn quantize(
    x: &[f32],
    blocks: usize,
    quants: &mut [i8],
    scales: &mut [f32],
    sums: &mut [f32],
    offsets: &mut [i32],
    lane_quants: &mut [i8],
    lane_scales: &mut [f32],
    lane_offsets: &mut [i32],
) {
    assert!(x.len().is_multiple_of(BLOCK) && quants.len() == x.len());
    let pairs = blocks.div_ceil(2);
    let rows = x.len() / BLOCK / blocks.max(1);
    let lanes = !lane_quants.is_empty();
    assert!(
        !lanes
            || (lane_quants.len() == rows * pairs * LANE_PAIR_BYTES
                && lane_scales.len() == rows * pairs * 4
                && lane_offsets.len() == rows * pairs * 4)
    );
    let total = x.len() / BLOCK;
    assert!(scales.len() == total && sums.len() == total && offsets.len() == total);
    if !lanes {
        // SAFETY: as this function's.
        unsafe { quantize_grouped(x, quants, scales, sums, offsets) };
        return;
    }
    for (g, (chunk, q)) in x
        .chunks_exact(BLOCK)
        .zip(quants.chunks_exact_mut(BLOCK))
        .enumerate()
    {
        // SAFETY: each chunk holds 32 floats and each q 32 bytes.
        let (d, halves, half_sums) = unsafe {
            let v0 = _mm512_loadu_ps(chunk.as_ptr());
            let v1 = _mm512_loadu_ps(chunk.as_ptr().add(16));
            let amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
            let d = amax / 127.0;
            let inv = _mm512_set1_ps(if d > 0.0 { 1.0 / d } else { 0.0 });
            const NEAREST: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
            let q0 = _mm512_cvt_roundps_epi32::<NEAREST>(_mm512_mul_ps(v0, inv));
            let q1 = _mm512_cvt_roundps_epi32::<NEAREST>(_mm512_mul_ps(v1, inv));
            let halves = [_mm512_cvtsepi32_epi8(q0), _mm512_cvtsepi32_epi8(q1)];
            _mm_storeu_si128(q.as_mut_ptr() as *mut __m128i, halves[0]);
            _mm_storeu_si128(q.as_mut_ptr().add(16) as *mut __m128i, halves[1]);
            // One reduction for the block's sum; the lane copy needs each half's as well.
            let half_sums = if lanes {
                [_mm512_reduce_add_epi32(q0), _mm512_reduce_add_epi32(q1)]
            } else {
                [_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1)), 0]
            };
            (d, halves, half_sums)
        };
        let sum = half_sums[0] + half_sums[1];
        // SAFETY: the CPU has F16C (this function's features).
        let (d16, scaled_sum) = unsafe { (round_to_f16(d), round_to_f16(d * sum as f32)) };
        scales[g] = d16;
        sums[g] = scaled_sum;
        offsets[g] = -128 * sum;
        if !lanes {
            continue;
        }
        let (row, b) = (g / blocks, g % blocks);
        let (pair, h) = (row * pairs + b / 2, b % 2);
        let base = pair * LANE_PAIR_BYTES + 8 * h;
        for (l, half) in halves.iter().enumerate() {
            let mut bytes = [0i8; 16];
            // SAFETY: sixteen bytes.
            unsafe { _mm_storeu_si128(bytes.as_mut_ptr() as *mut __m128i, *half) };
            for j in 0..4 {
                let at = base + 16 * j + 4 * l;
                lane_quants[at..at + 4].copy_from_slice(&bytes[4 * j..4 * j + 4]);
            }
            lane_scales[pair * 4 + 2 * h + l] = d16;
            lane_offsets[pair * 4 + 2 * h + l] = -128 * half_sums[l];
        }
    }
}
