//! What the grouped-layout kernels (AVX-512 and AVX2) share: the bounds they check and the
//! software prefetch of their weight stream.

use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};

use super::{COL_TILE, QuantMatrix, QuantizedRows, ROW_TILE};

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
