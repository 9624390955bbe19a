//! Kernels over weights in the tile layout (see `Layout::Tiles`: records of one 32-value
//! block of 16 weight rows, as an AMX weight tile) with AVX-512 VNNI, and what they share
//! with the AMX kernels of `amx.rs`, which read the same layout. Weight tile row r (values
//! `4r..4r + 4` of the 16 weight rows) is one 512-bit register, so one `vpdpbusd` against
//! those 4 activation values broadcast adds them into each weight row's 32-bit lane; eight
//! such steps give the block's exact integer sums for 16 weight rows, and the float scaling
//! then runs once per block, activation row and 16 weight rows.
//!
//! Each output element's arithmetic (exact integer block sums, then one fused multiply-add
//! chain over the blocks in order, [`scale_sums`]) does not depend on the rows beside it nor
//! on which of the two instruction sets computed the sums: results are batch-invariant, and
//! the AMX and VNNI kernels can share one batch.

#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

use super::{BLOCK, QuantMatrix, QuantizedRows, TILE_COLS, TILE_ROWS};

/// Bytes of one record (a block of 16 weight rows): 4-bit (nibbles) and 8-bit.
pub(super) const NIBBLE_RECORD: usize = TILE_COLS * BLOCK / 2;
pub(super) const BYTE_RECORD: usize = TILE_COLS * BLOCK;

/// One block's step of an activation row's accumulator (16 weight rows): `acc = fma(sums,
/// d_w · d_x, acc)`, then for 4-bit weights `acc = fma(min_w, d_x · Σx, acc)`. Both kernels
/// over the tile layout call this, so their results are identical.
#[inline(always)]
pub(super) fn scale_sums<const NIBBLES: bool>(
    acc: __m512,
    sums: __m512i,
    dw: __m512,
    mins: __m512,
    dx: f32,
    sx: f32,
) -> __m512 {
    // SAFETY: only reached from kernels compiled for AVX-512 F and FMA.
    unsafe {
        let scale = _mm512_mul_ps(dw, _mm512_set1_ps(dx));
        let acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), scale, acc);
        if NIBBLES {
            _mm512_fmadd_ps(mins, _mm512_set1_ps(sx), acc)
        } else {
            acc
        }
    }
}

/// A record's 16 f16 scales and (4-bit) minimums as floats.
///
/// # Safety
/// The record must be in bounds (see [`check`]).
#[inline]
#[target_feature(enable = "avx512f,f16c")]
pub(super) unsafe fn record_meta<const NIBBLES: bool>(w: &QuantMatrix, record: usize) -> (__m512, __m512) {
    let meta = |v: &[u16]| {
        // SAFETY: 16 values at the record (in bounds, as the caller guarantees).
        unsafe {
            _mm512_cvtph_ps(_mm256_loadu_si256(
                v.as_ptr().add(record * TILE_COLS) as *const __m256i
            ))
        }
    };
    (
        meta(&w.scales),
        if NIBBLES {
            meta(&w.mins)
        } else {
            _mm512_setzero_ps()
        },
    )
}

/// Records ahead of the current one that [`prefetch_ahead`] asks for: 6 KB of 4-bit weights,
/// 12 KB of 8-bit ones.
const PREFETCH_RECORDS: usize = 24;

/// Asks for the record [`PREFETCH_RECORDS`] ahead of `record` (a group's records are one
/// sequential stream; the hint may name any address and never faults) into L2, not L1. On the
/// AMD EPYC Zen 4, asking 8 records ahead into L1 as before, decoding (2 threads, 400 tokens)
/// took 1.13× and 1.28× as long as with this (two sets of alternating runs), and the cold LM
/// head at 5-6 rows ~1.4× (kernel bench, one thread); into L2 at 8 records it was slower than
/// before, and 16 or 32 records decoded as fast as 24. On the Xeon with AMX (CPU model 167)
/// decoding took 1.15× (2 threads) and 1.17× (1 thread) as long with the old setting, and 48
/// records decoded as fast as 24 (docs/SCALING-RUNS.md).
#[inline]
#[target_feature(enable = "sse")]
pub(super) fn prefetch_ahead(w: &QuantMatrix, record: usize, record_bytes: usize) {
    let ahead = w
        .quants
        .as_ptr()
        .wrapping_add((record + PREFETCH_RECORDS) * record_bytes);
    for line in (0..record_bytes).step_by(64) {
        _mm_prefetch::<_MM_HINT_T1>(ahead.wrapping_add(line) as *const i8);
    }
}

/// Writes each activation row's accumulator (16 weight rows) to `out[t * 16..]`.
///
/// # Safety
/// The CPU must have AVX-512 F; `out` must hold R rows of 16 (see [`check`]).
#[inline]
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn store_rows<const R: usize>(acc: &[__m512; R], out: &mut [f32]) {
    for (t, row) in acc.iter().enumerate() {
        // SAFETY: as the caller guarantees.
        unsafe { _mm512_storeu_ps(out.as_mut_ptr().add(t * TILE_COLS), *row) };
    }
}

/// Checks the bounds every unchecked access of the tile-layout kernels relies on.
pub(super) fn check(
    w: &QuantMatrix,
    group: usize,
    x: &QuantizedRows,
    r0: usize,
    rows: usize,
    nibbles: bool,
    outputs: usize,
) {
    let nb = x.blocks;
    assert!(outputs >= rows * TILE_COLS, "the output holds a tile");
    assert!((1..=TILE_ROWS).contains(&rows) && r0 + rows <= x.m && w.k == x.k);
    assert!(x.quants.len() >= x.m * x.k && x.scales.len() >= x.m * nb && x.sums.len() >= x.m * nb);
    assert!(
        nibbles || x.offsets.len() >= x.m * nb,
        "8-bit weights need the offset corrections"
    );
    let records = (group + 1) * nb;
    let record_bytes = if nibbles { NIBBLE_RECORD } else { BYTE_RECORD };
    assert!(w.quants.len() >= records * record_bytes && w.scales.len() >= records * TILE_COLS);
    assert!(!nibbles || w.mins.len() >= records * TILE_COLS);
}

/// Weight rows `16 · group .. + 16` (4-bit with `NIBBLES`, else signed 8-bit) × activation
/// rows `r0..r0 + R` into `out[t * 16 + c]`, with AVX-512 VNNI; bit for bit what
/// `amx::tiles` computes. Signed 8-bit weights go in as w + 128 (unsigned), their block sums
/// starting from `−128 · Σx` (`QuantizedRows::offsets`), which removes the offset exactly.
///
/// # Safety
/// The CPU must have AVX-512 F, BW, VL and VNNI; `w` must be in the tile layout.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,f16c,fma")]
pub unsafe fn q_tiles<const R: usize, const NIBBLES: bool>(
    w: &QuantMatrix,
    group: usize,
    x: &QuantizedRows,
    r0: usize,
    out: &mut [f32],
) {
    check(w, group, x, r0, R, NIBBLES, out.len());
    let (nb, k) = (x.blocks, x.k);
    let record_bytes = if NIBBLES { NIBBLE_RECORD } else { BYTE_RECORD };
    let mut acc = [_mm512_setzero_ps(); R];
    let low = _mm512_set1_epi8(0x0F);
    let offset = _mm512_set1_epi8(i8::MIN);
    for b in 0..nb {
        let record = group * nb + b;
        // SAFETY: the record is in bounds (checked above).
        let (weights, (dw, mins)) = unsafe {
            let at = w.quants.as_ptr().add(record * record_bytes);
            prefetch_ahead(w, record, record_bytes);
            let mut weights = [_mm512_setzero_si512(); 8];
            if NIBBLES {
                for j in 0..4 {
                    let packed = _mm512_loadu_si512(at.add(64 * j) as *const __m512i);
                    weights[j] = _mm512_and_si512(packed, low);
                    weights[j + 4] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
                }
            } else {
                for r in 0..8 {
                    let signed = _mm512_loadu_si512(at.add(64 * r) as *const __m512i);
                    // w XOR 0x80 is w + 128 as an unsigned byte.
                    weights[r] = _mm512_xor_si512(signed, offset);
                }
            }
            (weights, record_meta::<NIBBLES>(w, record))
        };
        for t in 0..R {
            let row = r0 + t;
            // SAFETY: row `row`'s block b is in bounds (checked above).
            let (sums, dx, sx) = unsafe {
                let xs = x.quants.as_ptr().add(row * k + b * BLOCK) as *const i32;
                let at = row * nb + b;
                // Two chains of four: integer sums are exact in any order. Offset 8-bit
                // weights start from the offset's correction.
                let start = if NIBBLES {
                    _mm512_setzero_si512()
                } else {
                    _mm512_set1_epi32(*x.offsets.get_unchecked(at))
                };
                let mut chains = [start, _mm512_setzero_si512()];
                for r in 0..8 {
                    let values = _mm512_set1_epi32(xs.add(r).read_unaligned());
                    chains[r % 2] = _mm512_dpbusd_epi32(chains[r % 2], weights[r], values);
                }
                (
                    _mm512_add_epi32(chains[0], chains[1]),
                    *x.scales.get_unchecked(at),
                    *x.sums.get_unchecked(at),
                )
            };
            acc[t] = scale_sums::<NIBBLES>(acc[t], sums, dw, mins, dx, sx);
        }
    }
    // SAFETY: `out` holds R rows of 16 (checked above).
    unsafe { store_rows(&acc, out) };
}
