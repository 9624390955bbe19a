//! Intel AMX (advanced matrix extensions) kernels over weights in the tile layout (see
//! `Layout::Tiles`). One `tdpbsud`/`tdpbssd` multiplies up to 16 activation rows by 16
//! weight rows over a whole 32-value block (8,192 multiply-adds for a full tile) into a tile
//! of int32 sums; AVX-512 then converts each activation row's 16 sums and scales them into
//! its accumulator. Compared with the AVX-512 VNNI kernels, the integer work per activation
//! row nearly vanishes and the float scaling runs once per block and 16 weight rows, so an
//! extra row of a verify pass costs about a third of what it does there.
//!
//! Every number of rows, one to sixteen, goes through this same code, and each output
//! element's arithmetic (exact integer block sums, then one fused multiply-add chain over the
//! blocks in order) does not depend on the rows beside it: results are batch-invariant.
//!
//! Rust has no stable AMX intrinsics, so the tile instructions are inline assembly. Linux
//! hands out the tile registers' state only on request (`arch_prctl`), once per process.

#![allow(clippy::needless_range_loop)]

use std::arch::asm;
use std::arch::x86_64::*;
use std::cell::Cell;

use super::{BLOCK, QuantMatrix, QuantizedRows, TILE_COLS, TILE_ROWS};

/// Bytes of one block of 16 weight rows: 4-bit (nibbles) and 8-bit.
const NIBBLE_RECORD: usize = TILE_COLS * BLOCK / 2;
const BYTE_RECORD: usize = TILE_COLS * BLOCK;

/// Whether this CPU has AMX-TILE and AMX-INT8 and the kernel lets this process use them.
pub(super) fn supported() -> bool {
    // CPUID leaf 7, sub-leaf 0, EDX: bit 24 AMX-TILE, bit 25 AMX-INT8.
    // CPUID leaf 7 exists on every x86-64 CPU with AVX-512 (checked by the caller).
    let edx = __cpuid_count(7, 0).edx;
    if edx & (1 << 24) == 0 || edx & (1 << 25) == 0 {
        return false;
    }
    request_tile_state()
}

/// Asks Linux for permission to use the tile data state (XFEATURE 18) in this process.
#[cfg(target_os = "linux")]
fn request_tile_state() -> bool {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: arch_prctl with these arguments only changes this process's permissions.
    unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 }
}

#[cfg(not(target_os = "linux"))]
fn request_tile_state() -> bool {
    false
}

thread_local! {
    /// The activation rows this thread's tile configuration is set up for (0: none yet).
    static CONFIGURED_ROWS: Cell<usize> = const { Cell::new(0) };
}

/// The 64-byte tile configuration (palette 1): tmm0 and tmm1 hold `rows` × 32 bytes of
/// activations, tmm2 and tmm3 8 × 64 bytes of weights (a block of 16 weight rows as groups
/// of 4 consecutive values), tmm4 and tmm5 `rows` × 16 int32 sums.
#[repr(C, align(64))]
struct TileConfig([u8; 64]);

/// Loads the tile configuration for `rows` activation rows, unless this thread has it.
///
/// # Safety
/// The CPU must have AMX and the process its permission ([`supported`]).
unsafe fn configure(rows: usize) {
    if CONFIGURED_ROWS.get() == rows {
        return;
    }
    let mut config = TileConfig([0; 64]);
    config.0[0] = 1;
    let shapes = [
        (rows, BLOCK),
        (rows, BLOCK),
        (8, 64),
        (8, 64),
        (rows, 64),
        (rows, 64),
    ];
    for (t, (tile_rows, bytes)) in shapes.into_iter().enumerate() {
        config.0[16 + 2 * t..18 + 2 * t].copy_from_slice(&(bytes as u16).to_le_bytes());
        config.0[48 + t] = tile_rows as u8;
    }
    // SAFETY: a valid palette-1 configuration (rows ≤ 16, bytes per row ≤ 64).
    unsafe { asm!("ldtilecfg [{}]", in(reg) config.0.as_ptr(), options(nostack, readonly)) };
    CONFIGURED_ROWS.set(rows);
}

/// Where the scratch tiles live: the unpacked weights of two blocks, and two blocks' sums.
#[repr(C, align(64))]
struct Scratch {
    weights: [u8; 2 * BYTE_RECORD],
    sums: [i32; 2 * TILE_ROWS * TILE_COLS],
}

/// The integer block sums of activation rows `r0..r0 + rows` (tile of `rows` × 32 bytes at
/// `x.quants`, stride k) with two blocks of 16 weight rows, `b` and `b + 1`: weights at
/// `weights[0]` and `weights[1]` (8 rows of 64 bytes each), activations at `activations[0]`
/// and `[1]`; sums to `sums` (`[block][row][column]`). Weights are unsigned 4-bit values
/// with `UNSIGNED`, else signed bytes.
///
/// # Safety
/// The tiles must be configured for `rows`; every pointer must cover its tile.
#[inline(always)]
unsafe fn two_blocks<const UNSIGNED: bool>(
    activations: [*const i8; 2],
    stride: usize,
    weights: [*const u8; 2],
    sums: *mut i32,
) {
    // SAFETY: as the caller guarantees; tiles are this thread's own state.
    unsafe {
        if !UNSIGNED {
            asm!(
                "tileloadd tmm0, [{a0} + {s}*1]",
                "tileloadd tmm1, [{a1} + {s}*1]",
                "tileloadd tmm2, [{w0} + {ws}*1]",
                "tileloadd tmm3, [{w1} + {ws}*1]",
                "tilezero tmm4",
                "tilezero tmm5",
                "tdpbssd tmm4, tmm0, tmm2",
                "tdpbssd tmm5, tmm1, tmm3",
                "tilestored [{c0} + {ws}*1], tmm4",
                "tilestored [{c1} + {ws}*1], tmm5",
                a0 = in(reg) activations[0], a1 = in(reg) activations[1], s = in(reg) stride,
                w0 = in(reg) weights[0], w1 = in(reg) weights[1], ws = in(reg) 64usize,
                c0 = in(reg) sums, c1 = in(reg) sums.add(TILE_ROWS * TILE_COLS),
                options(nostack),
            );
        } else {
            asm!(
                "tileloadd tmm0, [{a0} + {s}*1]",
                "tileloadd tmm1, [{a1} + {s}*1]",
                "tileloadd tmm2, [{w0} + {ws}*1]",
                "tileloadd tmm3, [{w1} + {ws}*1]",
                "tilezero tmm4",
                "tilezero tmm5",
                "tdpbsud tmm4, tmm0, tmm2",
                "tdpbsud tmm5, tmm1, tmm3",
                "tilestored [{c0} + {ws}*1], tmm4",
                "tilestored [{c1} + {ws}*1], tmm5",
                a0 = in(reg) activations[0], a1 = in(reg) activations[1], s = in(reg) stride,
                w0 = in(reg) weights[0], w1 = in(reg) weights[1], ws = in(reg) 64usize,
                c0 = in(reg) sums, c1 = in(reg) sums.add(TILE_ROWS * TILE_COLS),
                options(nostack),
            );
        }
    }
}

/// Unpacks one block of 16 rows of 4-bit weights (4 × 64 bytes: low nibbles are tile rows
/// 0..4, high nibbles rows 4..8) into the 8 × 64 bytes a weight tile reads.
///
/// # Safety
/// The CPU must have AVX-512 F and BW; `from` must hold 256 bytes and `to` 512.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn unpack_nibbles(from: *const u8, to: *mut u8) {
    let low = _mm512_set1_epi8(0x0F);
    for j in 0..4 {
        // SAFETY: in bounds as the caller guarantees.
        unsafe {
            let packed = _mm512_loadu_si512(from.add(64 * j) as *const __m512i);
            _mm512_store_si512(to.add(64 * j) as *mut __m512i, _mm512_and_si512(packed, low));
            let high = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
            _mm512_store_si512(to.add(64 * (j + 4)) as *mut __m512i, high);
        }
    }
}

/// Checks the bounds every unchecked access of [`tiles`] relies on.
fn check(w: &QuantMatrix, group: usize, x: &QuantizedRows, r0: usize, rows: usize, nibbles: bool) {
    let nb = x.blocks;
    assert!((1..=TILE_ROWS).contains(&rows) && r0 + rows <= x.m && w.k == x.k);
    assert!(x.quants.len() >= x.m * x.k && x.scales.len() >= x.m * nb && x.sums.len() >= x.m * nb);
    let records = (group + 1) * nb;
    let record_bytes = if nibbles { NIBBLE_RECORD } else { BYTE_RECORD };
    assert!(w.quants.len() >= records * record_bytes && w.scales.len() >= records * TILE_COLS);
    assert!(!nibbles || w.mins.len() >= records * TILE_COLS);
}

/// Weight rows `16 · group .. + 16` (4-bit with `NIBBLES`, else signed 8-bit) × activation
/// rows `r0..r0 + R` into `out[t * 16 + c]`: per block, the tile of integer sums, then for
/// each activation row `acc = fma(sum, d_w · d_x, acc)` and, for 4-bit weights, `acc =
/// fma(min_w, d_x · Σx, acc)`.
///
/// # Safety
/// The CPU must have AMX-INT8 and AVX-512 F, BW and VL, and the process AMX permission;
/// `w` must be in the tile layout.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,f16c,fma")]
pub unsafe fn tiles<const R: usize, const NIBBLES: bool>(
    w: &QuantMatrix,
    group: usize,
    x: &QuantizedRows,
    r0: usize,
    out: &mut [f32],
) {
    check(w, group, x, r0, R, NIBBLES);
    assert!(out.len() >= R * TILE_COLS);
    // SAFETY: the caller guarantees AMX and its permission.
    unsafe { configure(R) };
    let (nb, k) = (x.blocks, x.k);
    let record_bytes = if NIBBLES { NIBBLE_RECORD } else { BYTE_RECORD };
    let mut scratch = Scratch {
        weights: [0; 2 * BYTE_RECORD],
        sums: [0; 2 * TILE_ROWS * TILE_COLS],
    };
    let mut acc = [_mm512_setzero_ps(); R];
    let rows_at = x.quants.as_ptr().wrapping_add(r0 * k);
    let mut b = 0;
    while b < nb {
        // A lone last block pairs with itself; its second result is ignored.
        let second = if b + 1 < nb { b + 1 } else { b };
        let records = [group * nb + b, group * nb + second];
        // SAFETY: records and activation blocks are in bounds (checked above); the scratch
        // tiles are 64-byte aligned and as large as the tiles.
        unsafe {
            let ahead = w.quants.as_ptr().wrapping_add((records[0] + 8) * record_bytes);
            for line in (0..2 * record_bytes).step_by(64) {
                _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(line) as *const i8);
            }
            let weights = if NIBBLES {
                for (slot, &record) in records.iter().enumerate() {
                    let to = scratch.weights.as_mut_ptr().add(slot * BYTE_RECORD);
                    unpack_nibbles(w.quants.as_ptr().add(record * NIBBLE_RECORD), to);
                }
                [0, 1].map(|slot| scratch.weights.as_ptr().add(slot * BYTE_RECORD))
            } else {
                records.map(|record| w.quants.as_ptr().add(record * BYTE_RECORD))
            };
            let activations = [rows_at.add(b * BLOCK), rows_at.add(second * BLOCK)];
            two_blocks::<NIBBLES>(activations, k, weights, scratch.sums.as_mut_ptr());
        }
        for (slot, block) in [b, second].into_iter().enumerate().take(second + 1 - b) {
            let record = group * nb + block;
            // SAFETY: the record's 16 scales (and minimums) are in bounds (checked above).
            let (dw, mins) = unsafe {
                let meta = |v: &[u16]| {
                    _mm512_cvtph_ps(_mm256_loadu_si256(
                        v.as_ptr().add(record * TILE_COLS) as *const __m256i
                    ))
                };
                (
                    meta(&w.scales),
                    if NIBBLES {
                        meta(&w.mins)
                    } else {
                        _mm512_setzero_ps()
                    },
                )
            };
            for t in 0..R {
                let at = (r0 + t) * nb + block;
                // SAFETY: row t's 16 sums of this slot lie in the scratch.
                let sums = unsafe {
                    _mm512_load_si512(
                        scratch.sums.as_ptr().add((slot * TILE_ROWS + t) * TILE_COLS) as *const __m512i
                    )
                };
                let scale = _mm512_mul_ps(dw, _mm512_set1_ps(x.scales[at]));
                acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), scale, acc[t]);
                if NIBBLES {
                    acc[t] = _mm512_fmadd_ps(mins, _mm512_set1_ps(x.sums[at]), acc[t]);
                }
            }
        }
        b += 2;
    }
    for t in 0..R {
        // SAFETY: `out` holds R rows of 16 (checked above).
        unsafe { _mm512_storeu_ps(out.as_mut_ptr().add(t * TILE_COLS), acc[t]) };
    }
}
