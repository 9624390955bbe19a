//! Quantized matmul kernels for the CPU, computed as llama.cpp computes them: weights stay
//! quantized, activations are quantised per 32-value block to int8, and each block's integer
//! dot product is scaled in f32.
//!
//! Formats, repacked at load into kernel families:
//! - **4-bit** (`scale · q + min`, 32 values of nibbles per block): Q4_0, Q4_1 and Q4_K
//!   (each Q4_K sub-block of 32 becomes one block with its own f16 scale and minimum);
//! - **8-bit** (`scale · q`): Q8_0, and Q6_K (values `q − 32` as signed bytes, a scale per
//!   16 values).
//!
//! Implementations, chosen once at run time from the CPU's features (one binary runs on any
//! x86-64 and uses the best it finds): with AVX-512 VNNI, 4-bit and Q8_0 weights as blocks of
//! 16 weight rows (see [`Layout::Tiles`]) and Q6_K as interleaved blocks of 4 rows (see
//! [`Layout::Lanes`]); with AMX-INT8 too, tile multiplies compute the tile layout's products
//! where enough rows share them; AVX2 + FMA (see [`Layout::Groups`] and
//! [`Layout::Lanes`]); and a portable version over plain rows for everything else.
//! Multi-row: each weight block is loaded and unpacked once for a tile of up to 8 (16 for
//! tiles) activation rows, which is what makes scoring K + 1 tokens cheaper than K + 1
//! passes. Every output element is computed by the same arithmetic, over the same blocks, in
//! the same order whatever the number of rows, so results are batch-invariant.

use candle_core::quantized::{GgmlDType, QTensor};
use half::f16;

#[cfg(target_arch = "x86_64")]
mod amx;
#[cfg(target_arch = "x86_64")]
mod avx2_groups;
#[cfg(target_arch = "x86_64")]
mod avx2_lanes;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "x86_64")]
mod groups;
mod portable;
mod quantize;
mod repack;
mod split;
#[cfg(target_arch = "x86_64")]
mod tiles;

pub(crate) use split::{PARALLEL_ROWS, SendPtr, for_parts, for_row_chunks, for_row_ranges};

/// Rows of activations processed against each unpacked weight block.
const ROW_TILE: usize = 8;
/// In the tile layout, above this many row tiles a product goes in bands of this many, each
/// over every column group before the next band: a band's activations (16 rows a tile, of
/// up to 1,536 bytes each) stay in L1 while its groups' weights stream past, where all the
/// tiles of a 64-row prompt chunk together did not (kernel bench, one thread: its
/// feed-forward 10-14% faster with AMX, within the noise with the VNNI kernel and with the
/// AVX2 kernels' 8-row tiles, which therefore keep one band). Each product's arithmetic is
/// unchanged; only the order of the work items moves.
const BAND_TILES: usize = 2;
/// Weight rows (output columns) processed together, for independent accumulators.
const COL_TILE: usize = 4;
const BLOCK: usize = 32;
/// Bytes of one row's interleaved activations per block pair (see [`Layout::Lanes`]).
const LANE_PAIR_BYTES: usize = 2 * BLOCK;
/// Weight rows and activation rows of an AMX tile (see [`Layout::Tiles`]).
const TILE_COLS: usize = 16;
const TILE_ROWS: usize = 16;
/// Outputs of the largest tile a kernel call computes (AMX's).
const MAX_TILE: usize = TILE_COLS * TILE_ROWS;

/// How a repacked matrix's blocks are stored, and so which kernel multiplies them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// `scale · q + min`, q in 0..16, two per byte (low nibbles: values 0..16 of the block).
    Nibbles,
    /// `scale · q`, q a signed byte.
    Bytes,
    /// `scale · q`, q a signed byte, one scale per 16 values (Q6_K).
    Bytes16,
}

/// How blocks are laid out in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Layout {
    /// Row after row, block after block (the portable kernels).
    Rows,
    /// For the AVX2 kernels of 8-bit weights: groups of [`COL_TILE`] rows (zero-padded), and
    /// within a group each pair of blocks of all its rows together (a record), so the kernel
    /// reads one sequential stream. Per record: the rows' quants (the two blocks' 64 bytes per
    /// row), placed as in [`Layout::Lanes`] but signed (AVX2's `maddubs` takes the weights'
    /// magnitudes and moves their signs to the activations), then `[row][block]` f16 scales
    /// (Q6_K: `[row][block][half]`). The metadata layout, with `[row][block]` minimums for
    /// 4-bit weights, is also [`Layout::Lanes`]'s.
    Groups,
    /// For the AVX-512 kernel of Q6_K weights, and the AVX2 kernel of 4-bit weights (which
    /// reads each 64-byte register as two 256-bit halves): the records of [`Layout::Groups`], with the 8 blocks of a
    /// record ("slots" s = 2 · row + block) interleaved across four 64-byte registers:
    /// register j holds, for every slot, values `4j..4j + 4` and `16 + 4j..16 + 4j + 4` at
    /// bytes `8s..8s + 8`. One `vpdpbusd` lane then always sums values of one half block.
    /// 4-bit: registers 0 and 1 share 64 bytes (low and high nibbles), as do 2 and 3; 8-bit:
    /// four 64-byte registers of values offset by 128 (unsigned). Metadata as in `Groups`.
    Lanes,
    /// For the AMX and AVX-512 VNNI kernels of 4-bit and Q8_0 weights: groups of 16 rows
    /// (zero-padded), and
    /// within a group one record per block, each an AMX weight tile: tile row r (values
    /// `4r..4r + 4`) holds those 4 values of every weight row n at bytes `4n..4n + 4`. 8-bit
    /// records are those 8 × 64 bytes (signed); 4-bit records 4 × 64 bytes whose low nibbles
    /// are tile rows 0..4 and high nibbles rows 4..8. Per record, the 16 rows' f16 scales
    /// (and minimums).
    Tiles,
}

/// A weight matrix `[n, k]` repacked for the kernels: per-block scales (and minimums) as f16
/// bits, as GGUF stores them (the kernels are bound by how many bytes they read), quants
/// contiguous per row.
pub struct QuantMatrix {
    family: Family,
    layout: Layout,
    source: GgmlDType,
    n: usize,
    k: usize,
    scales: Vec<u16>,
    mins: Vec<u16>,
    quants: Vec<u8>,
}

/// Activations quantised per 32-value block: scale, the scale times the block's sum (used
/// by the minimum term of 4-bit formats) and the int8 values. Reusable: quantising into an
/// existing value keeps its buffers.
#[derive(Default)]
pub struct QuantizedRows {
    m: usize,
    k: usize,
    blocks: usize,
    scales: Vec<f32>,
    sums: Vec<f32>,
    quants: Vec<i8>,
    /// Per block, `−128 · Σq`: what 8-bit weights offset by 128 (unsigned, as `vpdpbusd`
    /// needs) add to a block's integer sum, so the tile kernels start from it (filled by the
    /// AVX-512 quantiser, the only one whose kernels read it).
    offsets: Vec<i32>,
    /// For the lane kernels (filled by the AVX-512 and AVX2 quantisers): per row and block
    /// pair, the values interleaved as [`Layout::Lanes`] reads them (64 bytes: for j in
    /// 0..4, 8 bytes of the first block then 8 of the second, each as in a weight slot), the
    /// scales `[d₀, d₀, d₁, d₁]` and `−128 · Σ` over each half block (the correction of
    /// offset 8-bit weights), in the lane order of one 128-bit lane.
    lane_quants: Vec<i8>,
    lane_scales: Vec<f32>,
    lane_offsets: Vec<i32>,
    lanes_ready: bool,
}

/// Where a product's quantised activations come from (see [`QuantMatrix::matmul_many_from`]).
#[derive(Clone, Copy)]
enum ActivationSource<'a> {
    /// Quantised once by the caller, read by every thread.
    Shared(&'a QuantizedRows),
    /// Written by `input` and quantised by each thread for itself (with the lane kernels'
    /// copy if `lanes`).
    PerThread {
        input: &'a (dyn Fn(&mut [f32]) + Sync),
        lanes: bool,
    },
}

fn read_f16(bytes: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([bytes[at], bytes[at + 1]])
}

fn to_f32(bits: u16) -> f32 {
    f16::from_bits(bits).to_f32()
}

fn to_f16(value: f32) -> u16 {
    f16::from_f32(value).to_bits()
}

/// Calls a kernel monomorphised for a tile's row count: `by_rows!(count, R => call)`
/// evaluates `call` with the const `R` set to `count` (1 to [`ROW_TILE`] = 8; 0 counts as 1).
#[cfg(target_arch = "x86_64")]
macro_rules! by_rows {
    ($count:expr, $rows:ident => $call:expr) => {
        by_rows!(@arms $count, $rows, $call, 8 7 6 5 4 3 2)
    };
    (@arms $count:expr, $rows:ident, $call:expr, $($n:literal)*) => {
        match $count {
            $($n => {
                const $rows: usize = $n;
                $call
            })*
            _ => {
                const $rows: usize = 1;
                $call
            }
        }
    };
}

impl QuantMatrix {
    /// Repacks a Q4_0, Q4_1, Q4_K, Q6_K or Q8_0 tensor for this CPU's best kernel; `None` for
    /// other formats or shapes.
    pub fn from_qtensor(tensor: &QTensor) -> Option<Self> {
        Self::from_qtensor_for(tensor, Kernel::detect())
    }

    /// Repacks a tensor in the layout `kernel` reads.
    pub fn from_qtensor_for(tensor: &QTensor, kernel: Kernel) -> Option<Self> {
        let (n, k) = tensor.shape().dims2().ok()?;
        let data = tensor.data().ok()?;
        let matrix = repack::repack(tensor.dtype(), n, k, &data)?;
        Some(match kernel {
            // Q6_K's scale per 16 values does not fit a 32-value tile: it keeps the lane
            // kernels.
            Kernel::Amx | Kernel::Avx512Vnni if matrix.family != Family::Bytes16 => {
                matrix.into_layout(Layout::Tiles)
            }
            Kernel::Amx | Kernel::Avx512Vnni => matrix.into_layout(Layout::Lanes),
            // AVX2 has no `vpdpbusd`: the lane layout pays for 4-bit weights (whose `maddubs`
            // products can be summed in i16), not for 8-bit ones.
            Kernel::Avx2 if matrix.family == Family::Nibbles => matrix.into_layout(Layout::Lanes),
            Kernel::Avx2 => matrix.into_layout(Layout::Groups),
            Kernel::Portable => matrix,
        })
    }

    pub fn rows(&self) -> usize {
        self.n
    }

    pub fn cols(&self) -> usize {
        self.k
    }

    /// The GGUF format the weights came in.
    pub fn source_format(&self) -> GgmlDType {
        self.source
    }

    /// Row `j` of the weights, dequantised (the embedding lookup of a tied embedding).
    pub fn dequantize_row(&self, j: usize, out: &mut [f32]) {
        for b in 0..self.k / BLOCK {
            let (scales, min, values) = self.block(j, b);
            for (i, (d, v)) in out[b * BLOCK..(b + 1) * BLOCK].iter_mut().zip(values).enumerate() {
                *d = to_f32(scales[i / 16]) * f32::from(v) + to_f32(min);
            }
        }
    }

    /// Quantises `m` rows of `k` activations (allocating; see [`QuantizedRows::quantize`]).
    pub fn quantize(&self, x: &[f32], m: usize) -> QuantizedRows {
        let mut rows = QuantizedRows::default();
        rows.quantize(x, m, self.k);
        rows
    }

    /// `x [m, k] · selfᵀ → [m, n]`, row-major.
    pub fn matmul(&self, x: &[f32], m: usize) -> Vec<f32> {
        Self::matmul_many(&[self], x, m)
            .pop()
            .expect("one product per matrix")
    }

    /// Whether any of these matrices is in a layout whose kernel reads the activations'
    /// interleaved lane copy (the lane and group kernels).
    pub(crate) fn any_reads_lanes(matrices: &[&QuantMatrix]) -> bool {
        matrices
            .iter()
            .any(|w| matches!(w.layout, Layout::Lanes | Layout::Groups))
    }

    /// Whether `matmul_many` can take these matrices together (same width).
    pub fn compatible(matrices: &[&QuantMatrix]) -> bool {
        matrices.windows(2).all(|w| w[0].k == w[1].k)
    }

    /// The products of the same activations with several matrices (allocating).
    pub fn matmul_many(matrices: &[&QuantMatrix], x: &[f32], m: usize) -> Vec<Vec<f32>> {
        assert!(!matrices.is_empty(), "at least one matrix");
        let k = matrices[0].k;
        assert_eq!(x.len(), m * k, "activations must be [m, k]");
        let mut rows = QuantizedRows::default();
        rows.quantize(x, m, k);
        let mut outs: Vec<Vec<f32>> = matrices.iter().map(|w| vec![0f32; m * w.n]).collect();
        let mut slices: Vec<&mut [f32]> = outs.iter_mut().map(|o| o.as_mut_slice()).collect();
        Self::matmul_many_into(matrices, &rows, &mut slices, false);
        outs
    }

    /// `outs[i] (=|+=) rows · matrices[i]ᵀ`, each `[m, n_i]` row-major: the activations are
    /// quantised once by the caller and all the work is one pass over the thread pool. With
    /// `accumulate`, products are added to what `outs` holds (a residual connection). Every
    /// element is computed exactly as it would be alone.
    pub fn matmul_many_into(
        matrices: &[&QuantMatrix],
        rows: &QuantizedRows,
        outs: &mut [&mut [f32]],
        accumulate: bool,
    ) {
        assert_eq!(
            rows.k, matrices[0].k,
            "activations must match the matrices' width"
        );
        Self::matmul_parts(matrices, rows.m, ActivationSource::Shared(rows), outs, accumulate);
    }

    /// As [`QuantMatrix::matmul_many_into`] from activations that `input` writes (`[m, k]`,
    /// into the buffer it is given; e.g. a norm of the residual stream), for fewer than
    /// [`PARALLEL_ROWS`](split::PARALLEL_ROWS) rows: each pool thread runs `input` and
    /// quantises its result into buffers of its own before its part of the products. That
    /// work is done twice, but at the same time, and no thread reads or overwrites lines the
    /// other one wrote or read: a few rows normed and quantised by the calling thread into
    /// shared buffers cost about three times their arithmetic inside a pass. `input` must
    /// write the same values on every thread (and dispatch nothing to the pool); results
    /// are then the same bit for bit.
    pub fn matmul_many_from(
        matrices: &[&QuantMatrix],
        m: usize,
        input: &(dyn Fn(&mut [f32]) + Sync),
        outs: &mut [&mut [f32]],
        accumulate: bool,
    ) {
        assert!(m < split::PARALLEL_ROWS && !matrices.is_empty(), "a few rows");
        let lanes = Self::any_reads_lanes(matrices);
        Self::matmul_parts(
            matrices,
            m,
            ActivationSource::PerThread { input, lanes },
            outs,
            accumulate,
        );
    }

    fn matmul_parts(
        matrices: &[&QuantMatrix],
        m: usize,
        activations: ActivationSource<'_>,
        outs: &mut [&mut [f32]],
        accumulate: bool,
    ) {
        assert!(
            !matrices.is_empty() && Self::compatible(matrices) && matrices.len() == outs.len(),
            "one output per matrix, all of the same width"
        );
        for (w, out) in matrices.iter().zip(outs.iter()) {
            assert_eq!(out.len(), m * w.n, "output must be [m, n]");
        }
        let ptrs: Vec<SendPtr> = outs.iter_mut().map(|o| SendPtr(o.as_mut_ptr())).collect();
        // Work items: (matrix, column group, row tile), matrices one after another and row
        // tiles innermost, so a thread reuses a column group's weights while they are hot and
        // consecutive items read consecutive weights (see `for_parts`); in the tile layout,
        // from more than BAND_TILES row tiles, (matrix, band of row tiles, column group, row
        // tile).
        let mut starts = Vec::with_capacity(matrices.len() + 1);
        let mut total = 0;
        for w in matrices {
            starts.push(total);
            let (col_tile, row_tile) = w.tile_shape();
            total += m.div_ceil(row_tile) * w.n.div_ceil(col_tile);
        }
        starts.push(total);
        let kernel = Kernel::detect();
        let run = |rows: &QuantizedRows, items: std::ops::Range<usize>| {
            let mut tile_out = [0f32; MAX_TILE];
            for item in items {
                let which = starts.partition_point(|&s| s <= item) - 1;
                let (w, local) = (matrices[which], item - starts[which]);
                let (col_tile, row_tile) = w.tile_shape();
                let tiles = m.div_ceil(row_tile);
                // Bands of `band` row tiles, each over every column group (the last band
                // perhaps narrower); one band of all the tiles is the plain order.
                let band = w.row_band(tiles);
                let span = band * w.n.div_ceil(col_tile);
                let (which_band, within) = (local / span, local % span);
                let band_tiles = band.min(tiles - which_band * band);
                let (group, tile) = (within / band_tiles, which_band * band + within % band_tiles);
                let (j0, r0) = (group * col_tile, tile * row_tile);
                let (cols, count) = (col_tile.min(w.n - j0), row_tile.min(m - r0));
                w.tile(kernel, j0, cols, rows, r0, count, &mut tile_out);
                for t in 0..count {
                    // SAFETY: each (matrix, row, column) is written by exactly one work item,
                    // and row r0 + t's columns j0..j0 + cols lie inside that matrix's output
                    // (sizes checked above).
                    let dst = unsafe {
                        std::slice::from_raw_parts_mut(ptrs[which].get().add((r0 + t) * w.n + j0), cols)
                    };
                    w.store_tile_row(&tile_out, t, dst, accumulate);
                }
            }
        };
        thread_local! {
            static OWN_INPUT: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
            static OWN_ROWS: std::cell::RefCell<QuantizedRows> = std::cell::RefCell::new(QuantizedRows::default());
        }
        let k = matrices[0].k;
        for_parts(total, |items| match activations {
            ActivationSource::Shared(rows) => run(rows, items),
            ActivationSource::PerThread { input, lanes } => OWN_INPUT.with_borrow_mut(|x| {
                x.resize(m * k, 0.0);
                input(x);
                OWN_ROWS.with_borrow_mut(|rows| {
                    // Fewer than PARALLEL_ROWS rows: quantised on this thread, no nested
                    // dispatch.
                    rows.quantize_with(kernel, x, m, k, lanes);
                    run(rows, items)
                })
            }),
        });
    }

    /// Writes (or with `accumulate` adds) activation row `t` of a kernel call's tile to `dst`,
    /// one value per weight row of the tile. Per row, not per value: this runs for every
    /// output of every product, so the layout's choice and the flag stay out of the loop.
    fn store_tile_row(&self, tile: &[f32; MAX_TILE], t: usize, dst: &mut [f32], accumulate: bool) {
        // Every kernel leaves each activation row's values contiguous, a tile's width apart.
        let (col_tile, _) = self.tile_shape();
        let row = &tile[t * col_tile..][..dst.len()];
        /// A full tile row as a fixed-size copy (vector moves, not a call to memmove).
        fn copy_full<const N: usize>(dst: &mut [f32], row: &[f32]) {
            let row: &[f32; N] = row.try_into().expect("a tile row");
            <&mut [f32; N]>::try_from(dst)
                .expect("a tile row")
                .copy_from_slice(row);
        }
        match (accumulate, dst.len()) {
            (false, TILE_COLS) => copy_full::<TILE_COLS>(dst, row),
            (false, COL_TILE) => copy_full::<COL_TILE>(dst, row),
            (false, _) => dst.copy_from_slice(row),
            (true, _) => {
                for (d, &v) in dst.iter_mut().zip(row) {
                    *d += v;
                }
            }
        }
    }

    /// Weight rows and activation rows of the tile one kernel call computes.
    fn tile_shape(&self) -> (usize, usize) {
        match self.layout {
            Layout::Tiles => (TILE_COLS, TILE_ROWS),
            _ => (COL_TILE, ROW_TILE),
        }
    }

    /// Row tiles per band of a product's work items ([`BAND_TILES`] in the tile layout; the
    /// other layouts keep all `tiles` in one band).
    fn row_band(&self, tiles: usize) -> usize {
        match self.layout {
            Layout::Tiles => BAND_TILES.min(tiles),
            _ => tiles,
        }
    }

    /// Where a kernel call leaves the product of weight row `c` and activation row `t` of
    /// its tile: activation row after activation row, each a tile's width of weight rows (as
    /// `store_tile_row` reads them).
    #[cfg(test)]
    fn tile_index(&self, c: usize, t: usize) -> usize {
        t * self.tile_shape().0 + c
    }

    /// Dot products of weight rows `j0..j0 + cols` with activation rows `r0..r0 + count`
    /// into `out[self.tile_index(c, t)]`.
    #[allow(clippy::too_many_arguments)]
    fn tile(
        &self,
        kernel: Kernel,
        j0: usize,
        cols: usize,
        x: &QuantizedRows,
        r0: usize,
        count: usize,
        out: &mut [f32],
    ) {
        #[cfg(target_arch = "x86_64")]
        if self.layout == Layout::Tiles {
            assert!(
                kernel.has_avx512() && j0.is_multiple_of(TILE_COLS),
                "weights in the tile layout need the AVX-512 (or AMX) kernels"
            );
            let group = j0 / TILE_COLS;
            // Both give the same results (see `tiles`); tile multiplies pay only from a few
            // rows (see `amx`).
            let amx = kernel == Kernel::Amx && amx::pays(self.family == Family::Nibbles, count);
            macro_rules! rows {
                ($nibbles:literal, $($r:literal)*) => {
                    // SAFETY: tile-layout weights exist only when the CPU has AVX-512 VNNI,
                    // and the AMX kernel runs only where it also has AMX-INT8 and the
                    // process AMX permission (see `from_qtensor_for`, `Kernel::available`);
                    // the kernels check every bound they use.
                    unsafe {
                        match (count, amx) {
                            $(($r, true) => amx::tiles::<$r, $nibbles>(self, group, x, r0, out),)*
                            $(($r, false) => tiles::q_tiles::<$r, $nibbles>(self, group, x, r0, out),)*
                            _ => unreachable!("1 to 16 rows per tile"),
                        }
                    }
                };
            }
            match self.family {
                Family::Nibbles => rows!(true, 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16),
                Family::Bytes => rows!(false, 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16),
                Family::Bytes16 => unreachable!("Q6_K keeps the lane layout"),
            }
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if self.layout == Layout::Groups {
            assert!(
                kernel != Kernel::Portable && j0.is_multiple_of(COL_TILE),
                "grouped weights need a SIMD kernel"
            );
            let group = j0 / COL_TILE;
            macro_rules! rows {
                ($halves:literal) => {
                    // SAFETY: grouped weights exist only when the CPU has AVX2, FMA and F16C
                    // (see `from_qtensor_for`); the kernel checks every bound it uses.
                    unsafe {
                        by_rows!(count, R => avx2_groups::q8_group::<R, $halves>(self, group, x, r0, out))
                    }
                };
            }
            match self.family {
                Family::Bytes => rows!(1),
                Family::Bytes16 => rows!(2),
                Family::Nibbles => unreachable!("4-bit weights take the lane layout on AVX2"),
            }
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if self.layout == Layout::Lanes && kernel == Kernel::Avx2 {
            assert!(
                self.family == Family::Nibbles && j0.is_multiple_of(COL_TILE),
                "the AVX2 lane kernel takes 4-bit weights"
            );
            let group = j0 / COL_TILE;
            // SAFETY: lane-layout weights exist only when the CPU has AVX2, FMA and F16C
            // (see `from_qtensor_for`); the kernel checks every bound it uses.
            unsafe { by_rows!(count, R => avx2_lanes::q4_lanes::<R>(self, group, x, r0, out)) }
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if self.layout == Layout::Lanes {
            assert!(
                kernel.has_avx512() && j0.is_multiple_of(COL_TILE),
                "weights in the lane layout need the AVX-512 kernels"
            );
            let group = j0 / COL_TILE;
            assert!(
                self.family == Family::Bytes16,
                "only Q6_K takes the lane layout with AVX-512"
            );
            // SAFETY: lane-layout weights exist only when the CPU has AVX-512 VNNI (see
            // `from_qtensor_for`); the kernel checks every bound it uses.
            unsafe { by_rows!(count, R => avx512::q6k_lanes::<R>(self, group, x, r0, out)) }
            return;
        }
        assert!(
            self.layout == Layout::Rows,
            "no kernel for this layout on this CPU"
        );
        let mut column = [0f32; ROW_TILE];
        for c in 0..cols {
            self.column(j0 + c, x, r0, count, &mut column);
            for (t, &value) in column[..count].iter().enumerate() {
                out[t * COL_TILE + c] = value;
            }
        }
    }

    /// Dot products of weight row `j` (row layout) with activation rows `r0..r0 + count`:
    /// the portable kernels.
    fn column(&self, j: usize, x: &QuantizedRows, r0: usize, count: usize, out: &mut [f32]) {
        let nb = self.k / BLOCK;
        let halves = self.halves();
        let scales = &self.scales[j * nb * halves..(j + 1) * nb * halves];
        match self.family {
            Family::Nibbles => {
                let mins = &self.mins[j * nb..(j + 1) * nb];
                let quants = &self.quants[j * nb * 16..(j + 1) * nb * 16];
                portable::q4(scales, mins, quants, x, r0, count, out);
            }
            Family::Bytes => portable::q8(
                scales,
                &self.quants[j * nb * BLOCK..(j + 1) * nb * BLOCK],
                x,
                r0,
                count,
                out,
            ),
            Family::Bytes16 => portable::q8x16(
                scales,
                &self.quants[j * nb * BLOCK..(j + 1) * nb * BLOCK],
                x,
                r0,
                count,
                out,
            ),
        }
    }
}

/// Which implementation runs, chosen once from the CPU's features.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    /// AMX-TILE and AMX-INT8 tile multiplies, with everything of [`Kernel::Avx512Vnni`].
    Amx,
    /// 512-bit registers and `vpdpbusd` (AVX-512 F, BW, VL and VNNI).
    Avx512Vnni,
    /// 256-bit AVX2 with FMA and F16C.
    Avx2,
    Portable,
}

impl Kernel {
    /// The best implementation this CPU runs (`SPECD_KERNEL=avx512|avx2|portable` caps it,
    /// to compare implementations on one machine).
    pub fn detect() -> Self {
        static KERNEL: std::sync::OnceLock<Kernel> = std::sync::OnceLock::new();
        *KERNEL.get_or_init(|| {
            let cap = std::env::var("SPECD_KERNEL").unwrap_or_default();
            let available = Self::available();
            available
                .iter()
                .copied()
                .find(|k| match cap.as_str() {
                    "avx512" => *k != Kernel::Amx,
                    "avx2" => !k.has_avx512(),
                    "portable" => *k == Kernel::Portable,
                    _ => true,
                })
                .unwrap_or(Kernel::Portable)
        })
    }

    /// Every implementation this CPU can run, best first.
    pub fn available() -> Vec<Self> {
        let mut kernels = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            if has!("avx512f") && has!("avx512bw") && has!("avx512vl") && has!("avx512vnni") {
                if has!("f16c") && has!("fma") && amx::supported() {
                    kernels.push(Kernel::Amx);
                }
                kernels.push(Kernel::Avx512Vnni);
            }
            if has!("avx2") && has!("fma") && has!("f16c") {
                kernels.push(Kernel::Avx2);
            }
        }
        kernels.push(Kernel::Portable);
        kernels
    }

    /// Whether this implementation has AVX-512 (VNNI) underneath, for the attention code.
    pub fn has_avx512(self) -> bool {
        matches!(self, Kernel::Amx | Kernel::Avx512Vnni)
    }

    pub fn name(self) -> &'static str {
        match self {
            Kernel::Amx => "amx-int8",
            Kernel::Avx512Vnni => "avx512-vnni",
            Kernel::Avx2 => "avx2",
            Kernel::Portable => "portable",
        }
    }
}

#[cfg(test)]
mod tests;
