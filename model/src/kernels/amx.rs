//! Intel AMX (advanced matrix extensions) kernels over weights in the tile layout (see
//! `Layout::Tiles`). One `tdpbsud`/`tdpbssd` multiplies up to 16 activation rows by 16
//! weight rows over a whole 32-value block (8,192 multiply-adds for a full tile) into a tile
//! of int32 sums, which AVX-512 then scales exactly as the VNNI kernels of `tiles.rs` do, so
//! the two give identical results and the dispatcher picks by the number of rows: a tile
//! multiply's latency and the sums' trip through memory pay only when enough rows share
//! them (measured, Sapphire Rapids class: 8-bit weights from 2 rows, 0.5–0.75× the VNNI
//! time; 4-bit weights, whose sums' scaling dominates either way, from about 6 rows, 0.8×
//! the VNNI time at 8 to 12 rows; `cargo bench -p specd-model --bench kernels` against
//! `SPECD_KERNEL=avx512`).
//!
//! Rust has no stable AMX intrinsics, so the tile instructions are inline assembly. Linux
//! hands out the tile registers' state only on request (`arch_prctl`), once per process.

#![allow(clippy::needless_range_loop)]

use std::arch::asm;
use std::arch::x86_64::*;
use std::cell::Cell;

use super::tiles::{BYTE_RECORD, NIBBLE_RECORD, check, prefetch_ahead, record_meta, scale_sums, store_rows};
use super::{BLOCK, QuantMatrix, QuantizedRows, TILE_COLS, TILE_ROWS};

/// Activation rows from which tile multiplies beat the VNNI kernels of `tiles.rs` (measured;
/// see the module documentation): 4-bit and 8-bit weights.
const NIBBLE_ROWS_FROM: usize = 6;
const BYTE_ROWS_FROM: usize = 2;

/// Whether tile multiplies pay for `rows` activation rows of 4-bit (`nibbles`) or 8-bit
/// weights; below that the VNNI kernels compute the same results faster.
pub(super) fn pays(nibbles: bool, rows: usize) -> bool {
    rows >= if nibbles { NIBBLE_ROWS_FROM } else { BYTE_ROWS_FROM }
}

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

/// How many blocks ahead 4-bit weights are unpacked: a tile load of bytes just stored waits
/// for the stores to reach the cache, so each block is unpacked a few steps before its
/// multiply (measured: loading straight after unpacking made a block cost ~3× as much).
const UNPACK_LEAD: usize = 2;
const UNPACKED_SLOTS: usize = 4;

/// Where the scratch tiles live: a ring of unpacked 4-bit weight blocks, and two blocks' sums.
#[repr(C, align(64))]
struct Scratch {
    weights: [u8; UNPACKED_SLOTS * BYTE_RECORD],
    sums: [i32; 2 * TILE_ROWS * TILE_COLS],
}

/// One step of the software pipeline, on tile set `$set` (activations `tmm0 + set`, weights
/// `tmm2 + set`, sums `tmm4 + set`): loads a block's activations (`$rows` × 32 bytes, stride
/// `$stride`) and weights (8 × 64 bytes), starts their multiply into fresh sums, and stores
/// the other set's sums (the previous block's, whose multiply is done) to `$previous`, so
/// each multiply overlaps the scaling of the block before it.
macro_rules! step {
    ($op:literal, $a:literal, $w:literal, $c:literal, $other:literal, $pointers:expr) => {
        asm!(
            concat!("tileloadd ", $a, ", [{a} + {s}*1]"),
            concat!("tileloadd ", $w, ", [{w} + {ws}*1]"),
            concat!("tilezero ", $c),
            concat!($op, " ", $c, ", ", $a, ", ", $w),
            concat!("tilestored [{p} + {ws}*1], ", $other),
            a = in(reg) $pointers.0, s = in(reg) $pointers.1, w = in(reg) $pointers.2,
            ws = in(reg) 64usize, p = in(reg) $pointers.3,
            options(nostack),
        )
    };
}

/// A pipeline step on tile set `set`; unsigned 4-bit weights with `UNSIGNED`, else signed.
///
/// # Safety
/// The tiles must be configured; each pointer must cover its tile (`previous`: 16 × 64 bytes).
#[inline(always)]
unsafe fn pipeline_step<const UNSIGNED: bool>(
    set: usize,
    activations: *const i8,
    stride: usize,
    weights: *const u8,
    previous: *mut i32,
) {
    // SAFETY: as the caller guarantees; tiles are this thread's own state.
    unsafe {
        let pointers = (activations, stride, weights, previous);
        match (UNSIGNED, set) {
            (true, 0) => step!("tdpbsud", "tmm0", "tmm2", "tmm4", "tmm5", pointers),
            (true, _) => step!("tdpbsud", "tmm1", "tmm3", "tmm5", "tmm4", pointers),
            (false, 0) => step!("tdpbssd", "tmm0", "tmm2", "tmm4", "tmm5", pointers),
            (false, _) => step!("tdpbssd", "tmm1", "tmm3", "tmm5", "tmm4", pointers),
        }
    }
}

/// Stores set `set`'s sums (the last block's) to `to` (16 × 64 bytes).
///
/// # Safety
/// The tiles must be configured; `to` must hold a tile.
#[inline(always)]
unsafe fn store_sums(set: usize, to: *mut i32) {
    // SAFETY: as the caller guarantees.
    unsafe {
        if set == 0 {
            asm!("tilestored [{p} + {ws}*1], tmm4", p = in(reg) to, ws = in(reg) 64usize, options(nostack));
        } else {
            asm!("tilestored [{p} + {ws}*1], tmm5", p = in(reg) to, ws = in(reg) 64usize, options(nostack));
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

/// Scales one block's sums (`sums`: R rows of 16) into the accumulators: block `block` of
/// weight group `group` and of activation rows `r0..r0 + R`. A function, always inlined,
/// rather than a closure, so that the accumulators stay in registers (measured: as
/// a closure it was left out of line for 6–12 rows of 4-bit and 8–14 rows of 8-bit weights,
/// each block's scaling went through memory, and 8 rows of 4-bit weights cost 30% more).
///
/// # Safety
/// The record and the rows' block must be in bounds (see `check`); `sums` must hold R rows
/// of 16 sums.
#[inline(always)]
unsafe fn scale_block<const R: usize, const NIBBLES: bool>(
    acc: &mut [__m512; R],
    (w, group): (&QuantMatrix, usize),
    (x, r0): (&QuantizedRows, usize),
    block: usize,
    sums: *const i32,
) {
    let nb = x.blocks;
    // SAFETY: as the caller guarantees.
    unsafe {
        let (dw, mins) = record_meta::<NIBBLES>(w, group * nb + block);
        for t in 0..R {
            let at = (r0 + t) * nb + block;
            let row = _mm512_load_si512(sums.add(t * TILE_COLS) as *const __m512i);
            let (dx, sx) = (*x.scales.get_unchecked(at), *x.sums.get_unchecked(at));
            acc[t] = scale_sums::<NIBBLES>(acc[t], row, dw, mins, dx, sx);
        }
    }
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
    check(w, group, x, r0, R, NIBBLES, out.len());
    // SAFETY: the caller guarantees AMX and its permission.
    unsafe { configure(R) };
    let (nb, k) = (x.blocks, x.k);
    let record_bytes = if NIBBLES { NIBBLE_RECORD } else { BYTE_RECORD };
    // Every byte of the scratch is written (by unpacking or a tile store) before it is read.
    let mut scratch = std::mem::MaybeUninit::<Scratch>::uninit();
    let mut acc = [_mm512_setzero_ps(); R];
    let rows_at = x.quants.as_ptr().wrapping_add(r0 * k);
    // Raw pointers into the scratch, written by tile stores and read by vector loads.
    let scratch = scratch.as_mut_ptr();
    // SAFETY: field addresses of a live local, not read.
    let (weights_scratch, sums_scratch) = unsafe {
        (
            (&raw mut (*scratch).weights) as *mut u8,
            (&raw mut (*scratch).sums) as *mut i32,
        )
    };
    let sums_at = |set: usize| sums_scratch.wrapping_add(set * TILE_ROWS * TILE_COLS);
    let unpack = |block: usize| {
        let to = weights_scratch.wrapping_add(block % UNPACKED_SLOTS * BYTE_RECORD);
        // SAFETY: the record is in bounds (checked above) and the slot in the scratch.
        unsafe { unpack_nibbles(w.quants.as_ptr().add((group * nb + block) * NIBBLE_RECORD), to) };
        to as *const u8
    };
    if NIBBLES {
        (0..UNPACK_LEAD.min(nb)).for_each(|block| _ = unpack(block));
    }
    for b in 0..nb {
        let (set, record) = (b % 2, group * nb + b);
        // SAFETY: the record and the rows' block b are in bounds (checked above); the scratch
        // tiles are 64-byte aligned and as large as the tiles. The first step stores stale
        // sums to the scratch, which nothing reads.
        unsafe {
            prefetch_ahead(w, record, record_bytes);
            let weights = if NIBBLES {
                if b + UNPACK_LEAD < nb {
                    unpack(b + UNPACK_LEAD);
                }
                weights_scratch.add(b % UNPACKED_SLOTS * BYTE_RECORD) as *const u8
            } else {
                w.quants.as_ptr().add(record * BYTE_RECORD)
            };
            pipeline_step::<NIBBLES>(set, rows_at.add(b * BLOCK), k, weights, sums_at(1 - set));
        }
        if b > 0 {
            // SAFETY: block b - 1 is in bounds (checked above); its sums are in the other set.
            unsafe { scale_block::<R, NIBBLES>(&mut acc, (w, group), (x, r0), b - 1, sums_at(1 - set)) };
        }
    }
    let last = (nb - 1) % 2;
    // SAFETY: the scratch holds a tile of sums per set.
    unsafe { store_sums(last, sums_at(last)) };
    // SAFETY: the last block is in bounds (checked above); its sums were just stored.
    unsafe { scale_block::<R, NIBBLES>(&mut acc, (w, group), (x, r0), nb - 1, sums_at(last)) };
    // SAFETY: `out` holds R rows of 16 (checked above).
    unsafe { store_rows(&acc, out) };
}
