//! Attention over tiled keys (see [`KeyLayout::Tiles`]) with AVX-512 (or AVX2, [`avx2`]):
//! every query row that
//! reads one KV head — the heads of its group (grouped-query attention) and, when verifying
//! drafts, every scored position — shares each load of the keys and values. Scores for 16
//! positions are 16-lane multiply-adds against one tile row per dimension (no horizontal
//! sums); the weighted sum of values loads each value row once for several query rows.
//!
//! Work is split by KV head and by blocks of [`BLOCK_POSITIONS`] cached positions (as
//! flash-decoding does): each item reads one block of one KV head's keys and values once for
//! every query row of the sequence that sees into it, and leaves per (row, head, block) a
//! partial result (the block's score maximum, its softmax sum and unnormalised value sum);
//! a second pass combines a row's blocks in order. Splitting by position rather than by
//! query row keeps both threads busy on one sequence's decode without reading a block twice.
//!
//! Each row's arithmetic is the same whatever other rows share its work item: blocks start
//! at fixed positions, positions a row may not see are masked to −∞ before its softmax and
//! their weights are exact zeros, and blocks combine in a fixed order, so results stay
//! batch-invariant (a verified draft scores bit-identically to decoding it).
//!
//! [`KeyLayout::Tiles`]: crate::kv_cache::KeyLayout::Tiles

#![allow(clippy::needless_range_loop)]

use std::arch::x86_64::*;

use half::f16;

mod avx2;

pub(crate) use avx2::exp8;

use super::{AttentionShape, EXP_LN2_HI, EXP_LN2_LO, EXP_TAYLOR, SequenceAttention};
use crate::kernels::SendPtr;
use crate::kv_cache::KEY_TILE;

/// Query rows scored together against one key tile, with [`SCORE_CHAINS`] accumulators
/// each (independent multiply-add chains, so even one row is not bound by their latency;
/// the same for every row whatever its company, for batch invariance).
const SCORE_ROWS: usize = 6;
const SCORE_CHAINS: usize = 4;
/// Registers for the value accumulators of the rows summed together.
const VALUE_REGISTERS: usize = 24;
/// Cached positions per block (a multiple of the key tile): a work item's span, and the unit
/// in which a row's partial results are combined.
const BLOCK_POSITIONS: usize = 64;
/// Most query rows in one work item; an item of more rows (a prompt chunk) is split, as its
/// arithmetic outweighs reading the block once more.
const ITEM_ROWS: usize = 48;

/// One work item: query rows `rows` (in `(position, head in group)` order) of sequence
/// `sequence` against block `block` of KV head `kv`.
struct Item {
    sequence: usize,
    kv: usize,
    block: usize,
    rows: std::ops::Range<usize>,
}

impl Item {
    /// Scores the item computes (rows × positions), to schedule the largest first.
    fn work(&self, seq: &SequenceAttention<'_>, group: usize) -> usize {
        let first = self.block * BLOCK_POSITIONS;
        let last_visible = seq.start + (self.rows.end - 1) / group + 1;
        self.rows.len() * (last_visible.min(first + BLOCK_POSITIONS) - first)
    }
}

/// Floats of one partial result: the block's score maximum, its softmax sum, and the
/// unnormalised weighted sum of values (head_dim floats).
fn partial_floats(hd: usize) -> usize {
    hd + 2
}

/// The whole attention of a pass, as [`super::attend`] specifies, for sequences whose keys
/// are tiled.
///
/// # Safety
/// The CPU must have AVX-512 F, or AVX2 and FMA; the caller checks the sizes of `queries`
/// and `out`.
pub unsafe fn attend(
    shape: &AttentionShape,
    queries: &[f32],
    sequences: &[SequenceAttention<'_>],
    first_row: &[usize],
    out: &mut [f32],
) {
    let avx512 = crate::kernels::Kernel::detect().has_avx512();
    // SAFETY: as this function's.
    unsafe { attend_with(avx512, shape, queries, sequences, first_row, out) }
}

/// [`attend`] with AVX-512 or with AVX2 (tests run both where the CPU has AVX-512).
///
/// # Safety
/// As [`attend`], and the CPU must have AVX-512 F if `avx512`.
unsafe fn attend_with(
    avx512: bool,
    shape: &AttentionShape,
    queries: &[f32],
    sequences: &[SequenceAttention<'_>],
    first_row: &[usize],
    out: &mut [f32],
) {
    let (nh, nkv, hd) = (shape.n_head, shape.n_head_kv, shape.head_dim);
    assert!(matches!(hd, 64 | 128) && nh.is_multiple_of(nkv));
    let group = nh / nkv;
    for seq in sequences {
        let visible = seq.start + seq.n;
        assert!(
            seq.keys.len() >= visible.div_ceil(KEY_TILE) * KEY_TILE * nkv * hd
                && seq.values.len() >= visible * nkv * hd,
            "the cache must hold every visible position"
        );
    }
    let blocks_of = |visible: usize| visible.div_ceil(BLOCK_POSITIONS);
    let max_blocks = sequences
        .iter()
        .map(|s| blocks_of(s.start + s.n))
        .max()
        .unwrap_or(0);
    let mut items = Vec::new();
    for (sequence, seq) in sequences.iter().enumerate() {
        for kv in 0..nkv {
            for block in 0..blocks_of(seq.start + seq.n) {
                // The rows that see into the block: positions at or after its first − start.
                let first_row = (block * BLOCK_POSITIONS).saturating_sub(seq.start) * group;
                for from in (first_row..seq.n * group).step_by(ITEM_ROWS) {
                    items.push(Item {
                        sequence,
                        kv,
                        block,
                        rows: from..(from + ITEM_ROWS).min(seq.n * group),
                    });
                }
            }
        }
    }
    // Largest first, so the pool's threads finish together.
    items.sort_by_key(|item| std::cmp::Reverse(item.work(&sequences[item.sequence], group)));
    let total_rows = *first_row.last().expect("one entry per sequence and the end");
    let floats = partial_floats(hd);
    let scale = 1.0 / (hd as f32).sqrt();
    thread_local! {
        static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::new(Scratch::default());
        static PARTIALS: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    PARTIALS.with_borrow_mut(|partials| {
        // Every slot a row's combine reads is written by the item of that block.
        partials.resize(total_rows * nh * max_blocks * floats, 0.0);
        let partials_ptr = SendPtr(partials.as_mut_ptr());
        let partial_at =
            |row: usize, head: usize, block: usize| ((row * nh + head) * max_blocks + block) * floats;
        type AttendItem = unsafe fn(
            &AttentionShape,
            &SequenceAttention<'_>,
            usize,
            usize,
            &[Row],
            &[f32],
            f32,
            &mut Scratch,
            SendPtr,
        );
        let attend_item: AttendItem = if avx512 { item_attend } else { avx2::item_attend };
        candle_core::utils::barrier_pool().execute_chunked(items.len(), |range| {
            SCRATCH.with_borrow_mut(|scratch| {
                // The row list is reused from item to item (taken out while the scratch is lent).
                let mut rows = std::mem::take(&mut scratch.rows);
                for item in &items[range] {
                    let seq = &sequences[item.sequence];
                    rows.clear();
                    rows.extend(item.rows.clone().map(|r| {
                        let (i, head) = (r / group, item.kv * group + r % group);
                        let row = first_row[item.sequence] + i;
                        Row {
                            query: (row * nh + head) * hd,
                            visible: seq.start + i + 1,
                            partial: partial_at(row, head, item.block),
                        }
                    }));
                    let first = item.block * BLOCK_POSITIONS;
                    // SAFETY: the CPU has AVX-512 F, or else AVX2 and FMA (the caller's contract);
                    // bounds checked above and in `item_attend`; each (row, head, block) partial
                    // belongs to one item.
                    unsafe {
                        attend_item(
                            shape,
                            seq,
                            item.kv,
                            first,
                            &rows,
                            queries,
                            scale,
                            scratch,
                            partials_ptr,
                        )
                    };
                }
                scratch.rows = rows;
            });
        });
        // Each (row, head): its blocks' partial results, combined in block order.
        let partials = &partials[..];
        let out_ptr = SendPtr(out.as_mut_ptr());
        candle_core::utils::barrier_pool().execute_chunked(total_rows * nh, |range| {
            for item in range {
                let (row, head) = (item / nh, item % nh);
                let sequence = first_row.partition_point(|&r| r <= row) - 1;
                let seq = &sequences[sequence];
                let visible = seq.start + row - first_row[sequence] + 1;
                let base = partial_at(row, head, 0);
                // SAFETY: each (row, head) output slice lies in `out` (checked by the caller)
                // and is written by this item only.
                let dst = unsafe { std::slice::from_raw_parts_mut(out_ptr.get().add(item * hd), hd) };
                combine(&partials[base..base + blocks_of(visible) * floats], hd, dst);
            }
        });
    });
}

/// `dst = Σ_b e^(m_b − m) · acc_b / Σ_b e^(m_b − m) · l_b` over a row's blocks' partials
/// `[m_b, l_b, acc_b…]` (m the largest m_b), in block order.
fn combine(partials: &[f32], hd: usize, dst: &mut [f32]) {
    let floats = partial_floats(hd);
    let max = partials
        .chunks_exact(floats)
        .map(|p| p[0])
        .fold(f32::NEG_INFINITY, f32::max);
    dst.fill(0.0);
    let mut sum = 0.0f32;
    for p in partials.chunks_exact(floats) {
        let factor = super::exp(p[0] - max);
        sum += factor * p[1];
        for (d, &a) in dst.iter_mut().zip(&p[2..]) {
            *d += factor * a;
        }
    }
    let inverse = 1.0 / sum;
    for d in dst.iter_mut() {
        *d *= inverse;
    }
}

/// What a tile's scoring asks the memory system for ahead of use: the next key tile and
/// this tile's 16 positions of values (read next by the value sums). Each is hd / 2 cache
/// lines, so over the tile's hd steps one line of each every other step.
struct Ahead {
    next_keys: *const f16,
    values: *const f16,
    value_stride: usize,
    /// log2 of the cache lines of one position's values (hd / 32, a power of two).
    value_lines_log2: u32,
}

impl Ahead {
    /// Values per cache line.
    const LINE: usize = 32;

    #[inline(always)]
    fn new(seq: &SequenceAttention<'_>, kv: usize, nkv: usize, hd: usize, tile: usize) -> Self {
        let value_stride = nkv * hd;
        Self {
            next_keys: seq
                .keys
                .as_ptr()
                .wrapping_add(((tile + 1) * nkv + kv) * hd * KEY_TILE),
            values: seq
                .values
                .as_ptr()
                .wrapping_add((tile * KEY_TILE * nkv + kv) * hd),
            value_stride,
            value_lines_log2: (hd / Self::LINE).trailing_zeros(),
        }
    }

    /// Step `step` (0..hd) of the tile's scoring. The hints may name any address (past the
    /// cache they are dropped) and never fault.
    #[inline(always)]
    fn ask(&self, step: usize) {
        if step.is_multiple_of(2) {
            let line = step / 2;
            let shift = self.value_lines_log2;
            let (position, part) = (line >> shift, line & ((1 << shift) - 1));
            // SAFETY: prefetch hints only (SSE is baseline on x86-64).
            unsafe {
                _mm_prefetch::<_MM_HINT_T0>(self.next_keys.wrapping_add(line * Self::LINE) as *const i8);
                _mm_prefetch::<_MM_HINT_T0>(
                    self.values
                        .wrapping_add(position * self.value_stride + part * Self::LINE)
                        as *const i8,
                );
            }
        }
    }
}

/// 16 f16 values from `at` as floats.
///
/// # Safety
/// The CPU must have AVX-512 F; 16 values from `at` must be readable.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn load16(at: *const f16) -> __m512 {
    // SAFETY: as the caller guarantees.
    unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(at as *const __m256i)) }
}

/// [`super::exp`] on 16 lanes (the same polynomial, so within 2 ulp of `f32::exp`).
#[inline]
#[target_feature(enable = "avx512f,fma")]
pub(crate) fn exp16(x: __m512) -> __m512 {
    let x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0)), _mm512_set1_ps(87.0));
    const NEAREST: i32 = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    let n = _mm512_roundscale_ps::<NEAREST>(_mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E)));
    let minus_n = _mm512_sub_ps(_mm512_setzero_ps(), n);
    let r = _mm512_fmadd_ps(
        minus_n,
        _mm512_set1_ps(EXP_LN2_LO),
        _mm512_fmadd_ps(minus_n, _mm512_set1_ps(EXP_LN2_HI), x),
    );
    let mut p = _mm512_set1_ps(EXP_TAYLOR[0]);
    for &c in &EXP_TAYLOR[1..] {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
    }
    let bits = _mm512_slli_epi32::<23>(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)));
    _mm512_mul_ps(p, _mm512_castsi512_ps(bits))
}

/// A query row of a work item: where its query starts, how many positions it sees, and
/// where its partial result for the item's block goes.
struct Row {
    query: usize,
    visible: usize,
    partial: usize,
}

#[derive(Default)]
struct Scratch {
    /// The work item's query rows.
    rows: Vec<Row>,
    /// Scaled queries, `[row][head_dim]`.
    queries: Vec<f32>,
    /// Softmax weights (unnormalised) over the item's block, `[row][span]`.
    weights: Vec<f32>,
}

impl Scratch {
    /// Readies the scratch for a work item's rows against the block starting at `first`:
    /// their queries scaled, their weights `[row][span]` all −∞ (a score chunk whose rows see
    /// fewer tiles than the item's longest leaves the rest so). Returns the span: the
    /// positions of the block the longest row sees, in whole tiles.
    fn prepare(&mut self, rows: &[Row], queries: &[f32], hd: usize, scale: f32, first: usize) -> usize {
        let span = Self::seen_by_any(rows, first).div_ceil(KEY_TILE) * KEY_TILE;
        self.queries.clear();
        for row in rows {
            self.queries
                .extend(queries[row.query..row.query + hd].iter().map(|&q| q * scale));
        }
        self.weights.clear();
        self.weights.resize(rows.len() * span, f32::NEG_INFINITY);
        span
    }

    /// Positions of the block (from `first`) that `row` sees.
    fn seen_in_block(row: &Row, first: usize) -> usize {
        row.visible.min(first + BLOCK_POSITIONS) - first
    }

    /// Positions of the block (from `first`) that the longest of `rows` sees.
    fn seen_by_any(rows: &[Row], first: usize) -> usize {
        rows.iter()
            .map(|r| Self::seen_in_block(r, first))
            .max()
            .unwrap_or(0)
    }
}

/// One work item: `rows` of sequence `seq` against the block of KV head `kv` that starts at
/// position `first`; writes each row's partial result (see [`combine`]).
///
/// # Safety
/// As [`attend`]; every row sees into the block, and its partial slot lies in `partials` and
/// belongs to this call.
#[target_feature(enable = "avx512f,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn item_attend(
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
    // Scores, SCORE_ROWS rows at a time against each tile they see.
    for from in (0..rows.len()).step_by(SCORE_ROWS) {
        let chunk = &rows[from..(from + SCORE_ROWS).min(rows.len())];
        macro_rules! scores {
            ($r:literal) => {
                // SAFETY: as this function's.
                unsafe {
                    match hd {
                        64 => score_rows::<$r, 64>(seq, kv, nkv, first, chunk, from, span, scratch),
                        _ => score_rows::<$r, 128>(seq, kv, nkv, first, chunk, from, span, scratch),
                    }
                }
            };
        }
        match chunk.len() {
            6 => scores!(6),
            5 => scores!(5),
            4 => scores!(4),
            3 => scores!(3),
            2 => scores!(2),
            _ => scores!(1),
        }
    }
    // Softmax per row over exactly the positions of the block it sees; the rest become
    // exact zeros. The block's maximum and sum go to the row's partial result.
    for (r, row) in rows.iter().enumerate() {
        let weights = &mut scratch.weights[r * span..(r + 1) * span];
        let mut max = _mm512_set1_ps(f32::NEG_INFINITY);
        for tile in weights.chunks_exact(KEY_TILE) {
            // SAFETY: 16 floats (masked positions are −∞ and do not raise the maximum).
            max = _mm512_max_ps(max, unsafe { _mm512_loadu_ps(tile.as_ptr()) });
        }
        let block_max = _mm512_reduce_max_ps(max);
        let max = _mm512_set1_ps(block_max);
        // Sixteen lane sums, then the lanes in a fixed order: positions past `visible` add
        // exact zeros, so the sum does not depend on the item's span.
        let seen_in_block = Scratch::seen_in_block(row, first);
        let mut sum = _mm512_setzero_ps();
        for (t, tile) in weights.chunks_exact_mut(KEY_TILE).enumerate() {
            let seen = seen_in_block.saturating_sub(t * KEY_TILE).min(KEY_TILE);
            // SAFETY: 16 floats.
            let w = unsafe { _mm512_loadu_ps(tile.as_ptr()) };
            let w = _mm512_maskz_mov_ps(((1u32 << seen) - 1) as __mmask16, exp16(_mm512_sub_ps(w, max)));
            // SAFETY: as above.
            unsafe { _mm512_storeu_ps(tile.as_mut_ptr(), w) };
            sum = _mm512_add_ps(sum, w);
        }
        // SAFETY: the row's partial slot belongs to this call (the caller's contract).
        unsafe {
            *partials.get().add(row.partial) = block_max;
            *partials.get().add(row.partial + 1) = _mm512_reduce_add_ps(sum);
        }
    }
    // Weighted sums of values: each value row loaded once for a chunk of rows.
    macro_rules! values {
        ($g:literal, $($r:literal)+) => {{
            const PER_CHUNK: usize = VALUE_REGISTERS / $g;
            for from in (0..rows.len()).step_by(PER_CHUNK) {
                let chunk = &rows[from..(from + PER_CHUNK).min(rows.len())];
                match chunk.len() {
                    // SAFETY: as this function's.
                    $($r => unsafe { sum_values::<$r, $g>(seq, kv, nkv, first, chunk, from, span, scratch, partials) },)+
                    _ => unreachable!("chunks hold 1..={PER_CHUNK} rows"),
                }
            }
        }};
    }
    match hd {
        64 => values!(4, 1 2 3 4 5 6),
        128 => values!(8, 1 2 3),
        _ => unreachable!("tiled keys need a head of 64 or 128"),
    }
}

/// Scores of `R` rows (scratch rows `from..from + R`) against every tile of the block (from
/// position `first`) they see, masked to −∞ past each row's visible positions; heads of
/// `HD` floats (a constant, so the loops over a tile's rows unroll).
///
/// # Safety
/// As [`attend`].
#[target_feature(enable = "avx512f,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn score_rows<const R: usize, const HD: usize>(
    seq: &SequenceAttention<'_>,
    kv: usize,
    nkv: usize,
    first: usize,
    chunk: &[Row],
    from: usize,
    span: usize,
    scratch: &mut Scratch,
) {
    assert!(chunk.len() == R && scratch.queries.len() >= (from + R) * HD && first.is_multiple_of(KEY_TILE));
    let tile_floats = KEY_TILE * nkv * HD;
    let tiles = Scratch::seen_by_any(chunk, first).div_ceil(KEY_TILE);
    let first_tile = first / KEY_TILE;
    let queries = &scratch.queries[from * HD..(from + R) * HD];
    for t in 0..tiles {
        let tile = &seq.keys[(first_tile + t) * tile_floats + kv * HD * KEY_TILE..][..HD * KEY_TILE];
        let ahead = Ahead::new(seq, kv, nkv, HD, first_tile + t);
        let mut acc = [[_mm512_setzero_ps(); SCORE_CHAINS]; R];
        for d in (0..HD).step_by(SCORE_CHAINS) {
            for a in 0..SCORE_CHAINS {
                let step = d + a;
                if from == 0 {
                    ahead.ask(step);
                }
                // SAFETY: the tile holds HD rows of 16 values (HD a multiple of 4).
                let keys = unsafe { load16(tile.as_ptr().add(step * KEY_TILE)) };
                for c in 0..R {
                    // SAFETY: c < R and step < HD, inside the R × HD queries (sliced above).
                    let q = _mm512_set1_ps(unsafe { *queries.get_unchecked(c * HD + step) });
                    acc[c][a] = _mm512_fmadd_ps(q, keys, acc[c][a]);
                }
            }
        }
        for c in 0..R {
            let seen = Scratch::seen_in_block(&chunk[c], first)
                .saturating_sub(t * KEY_TILE)
                .min(KEY_TILE);
            let mask = ((1u32 << seen) - 1) as __mmask16;
            let [a0, a1, a2, a3] = acc[c];
            let scores = _mm512_mask_blend_ps(
                mask,
                _mm512_set1_ps(f32::NEG_INFINITY),
                _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)),
            );
            let at = (from + c) * span + t * KEY_TILE;
            assert!(at + KEY_TILE <= scratch.weights.len());
            // SAFETY: 16 floats inside this row's span (checked).
            unsafe { _mm512_storeu_ps(scratch.weights.as_mut_ptr().add(at), scores) };
        }
    }
}

/// `partial[row] = Σⱼ weights[row][j] · values[first + j]` over the block, unnormalised,
/// for `R` rows (scratch rows `from..from + R`), heads of `16 · G` floats.
///
/// # Safety
/// As [`item_attend`]; each row's partial slot belongs to this call.
#[target_feature(enable = "avx512f,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn sum_values<const R: usize, const G: usize>(
    seq: &SequenceAttention<'_>,
    kv: usize,
    nkv: usize,
    first: usize,
    chunk: &[Row],
    from: usize,
    span: usize,
    scratch: &Scratch,
    partials: SendPtr,
) {
    let hd = 16 * G;
    let stride = nkv * hd;
    let positions = Scratch::seen_by_any(chunk, first);
    assert!(chunk.len() == R && positions <= span && seq.values.len() >= (first + positions) * stride);
    assert!(scratch.weights.len() >= (from + R) * span);
    let mut acc = [[_mm512_setzero_ps(); G]; R];
    for j in 0..positions {
        // SAFETY: position first + j of this KV head is in bounds (checked above).
        let value = unsafe { seq.values.as_ptr().add((first + j) * stride + kv * hd) };
        for g in 0..G {
            // SAFETY: as above; 16 values at 16 g < hd.
            let v = unsafe { load16(value.add(16 * g)) };
            for c in 0..R {
                // SAFETY: row from + c's weights hold span >= positions floats (checked).
                let w = _mm512_set1_ps(unsafe { *scratch.weights.get_unchecked((from + c) * span + j) });
                acc[c][g] = _mm512_fmadd_ps(w, v, acc[c][g]);
            }
        }
    }
    for c in 0..R {
        for g in 0..G {
            // SAFETY: the row's partial slot (2 + hd floats) lies in the partials and is
            // written only by this item.
            unsafe { _mm512_storeu_ps(partials.get().add(chunk[c].partial + 2 + 16 * g), acc[c][g]) };
        }
    }
}

#[cfg(test)]
mod tests;
