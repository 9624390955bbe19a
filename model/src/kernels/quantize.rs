//! Quantising activation rows to int8 blocks, as llama.cpp's Q8 activations: the
//! implementation for this CPU (AVX-512, AVX2, portable; all give identical results), the
//! lane kernels' interleaved copy, and the split of a pass's rows over the thread pool.

use half::f16;

use super::{BLOCK, Kernel, LANE_PAIR_BYTES, QuantMatrix, QuantizedRows, SendPtr, for_row_ranges};
#[cfg(target_arch = "x86_64")]
use super::{avx2_groups, avx2_lanes, avx512};

impl QuantizedRows {
    pub fn rows(&self) -> usize {
        self.m
    }

    /// Per-block int8 quantisation as llama.cpp does it: scale = max|x| / 127 stored as f16,
    /// values rounded to nearest-even, and scale · Σq (as f16) for the minimum term. `x` is
    /// `[m, k]`; `k` must be a multiple of 32. Reuses this value's buffers.
    pub fn quantize(&mut self, x: &[f32], m: usize, k: usize) {
        self.quantize_with(Kernel::detect(), x, m, k, true);
    }

    /// As [`QuantizedRows::quantize`], for these matrices only (all of width k): the
    /// interleaved copy for the lane and group kernels is written only if one of them reads
    /// it.
    pub fn quantize_for(&mut self, matrices: &[&QuantMatrix], x: &[f32], m: usize) {
        assert!(!matrices.is_empty() && QuantMatrix::compatible(matrices));
        let lanes = QuantMatrix::any_reads_lanes(matrices);
        self.quantize_with(Kernel::detect(), x, m, matrices[0].k, lanes);
    }

    /// As [`QuantizedRows::quantize`] with a given implementation (all give identical
    /// results), and the lane kernels' interleaved copy if `lanes`. Rows are independent, so
    /// from [`PARALLEL_ROWS`](super::split::PARALLEL_ROWS) rows up they are quantised on every pool thread (see
    /// [`for_row_ranges`]).
    pub(crate) fn quantize_with(&mut self, kernel: Kernel, x: &[f32], m: usize, k: usize, lanes: bool) {
        assert!(
            k.is_multiple_of(BLOCK) && x.len() == m * k,
            "activations must be [m, k], k % 32 == 0"
        );
        let blocks = k / BLOCK;
        self.m = m;
        self.k = k;
        self.blocks = blocks;
        self.lanes_ready = false;
        // The AVX-512 quantiser also writes the offset corrections and the lane copy.
        let avx512 = cfg!(target_arch = "x86_64") && kernel.has_avx512();
        let pairs = if avx512 && lanes { blocks.div_ceil(2) } else { 0 };
        let offsets_per_row = if avx512 { blocks } else { 0 };
        // Every quantiser writes each entry of the values, scales, sums and offsets, so they
        // are only sized (what a previous quantisation left is overwritten); zeroing them
        // first was a second pass over lines the pool's other thread last read. The lane
        // copy's last pair may be half empty, so it is zeroed.
        fn sized<T: Copy + Default>(buffer: &mut Vec<T>, len: usize) -> SendPtr<T> {
            buffer.resize(len, T::default());
            SendPtr(buffer.as_mut_ptr())
        }
        fn zeroed<T: Copy + Default>(buffer: &mut Vec<T>, len: usize) -> SendPtr<T> {
            buffer.clear();
            sized(buffer, len)
        }
        let quants = sized(&mut self.quants, m * k);
        let scales = sized(&mut self.scales, m * blocks);
        let sums = sized(&mut self.sums, m * blocks);
        let offsets = sized(&mut self.offsets, m * offsets_per_row);
        let lane_quants = zeroed(&mut self.lane_quants, m * pairs * LANE_PAIR_BYTES);
        let lane_scales = zeroed(&mut self.lane_scales, m * pairs * 4);
        let lane_offsets = zeroed(&mut self.lane_offsets, m * pairs * 4);
        for_row_ranges(m, |rows| {
            let per_row = |width: usize| rows.start * width..rows.end * width;
            // SAFETY: each range of rows is handed to one thread, and a row's entries lie in
            // every buffer (sized above for m rows).
            let out = unsafe {
                RowsOut {
                    quants: quants.slice(per_row(k)),
                    scales: scales.slice(per_row(blocks)),
                    sums: sums.slice(per_row(blocks)),
                    offsets: offsets.slice(per_row(offsets_per_row)),
                    lane_quants: lane_quants.slice(per_row(pairs * LANE_PAIR_BYTES)),
                    lane_scales: lane_scales.slice(per_row(pairs * 4)),
                    lane_offsets: lane_offsets.slice(per_row(pairs * 4)),
                }
            };
            quantize_rows(kernel, &x[per_row(k)], blocks, out);
        });
        #[cfg(target_arch = "x86_64")]
        if lanes {
            match kernel {
                Kernel::Amx | Kernel::Avx512Vnni => self.lanes_ready = true,
                Kernel::Avx2 => self.interleave_lanes(),
                Kernel::Portable => {}
            }
        }
    }
}

/// Where [`quantize_rows`] writes a range of rows: the buffers of [`QuantizedRows`], those
/// rows' part of each.
struct RowsOut<'a> {
    quants: &'a mut [i8],
    scales: &'a mut [f32],
    sums: &'a mut [f32],
    offsets: &'a mut [i32],
    lane_quants: &'a mut [i8],
    lane_scales: &'a mut [f32],
    lane_offsets: &'a mut [i32],
}

/// Quantises whole rows `x` (`blocks` blocks each) with `kernel` into `out`.
fn quantize_rows(kernel: Kernel, x: &[f32], blocks: usize, out: RowsOut<'_>) {
    #[cfg(target_arch = "x86_64")]
    match kernel {
        Kernel::Amx | Kernel::Avx512Vnni => {
            // SAFETY: the CPU has the kernel's features (detected); buffers are sized and
            // zeroed by the caller.
            unsafe {
                avx512::quantize(
                    x,
                    blocks,
                    out.quants,
                    out.scales,
                    out.sums,
                    out.offsets,
                    out.lane_quants,
                    out.lane_scales,
                    out.lane_offsets,
                )
            };
            return;
        }
        Kernel::Avx2 => {
            // SAFETY: the CPU has the kernel's features (detected); buffers are sized by the
            // caller.
            unsafe { avx2_groups::quantize(x, out.quants, out.scales, out.sums) };
            return;
        }
        Kernel::Portable => {}
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (kernel, blocks);
    for (((chunk, q), scale), scaled_sum) in x
        .chunks_exact(BLOCK)
        .zip(out.quants.chunks_exact_mut(BLOCK))
        .zip(out.scales.iter_mut())
        .zip(out.sums.iter_mut())
    {
        let amax = chunk.iter().fold(0f32, |a, v| a.max(v.abs()));
        let d = amax / 127.0;
        let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
        let mut sum = 0i32;
        for (dst, v) in q.iter_mut().zip(chunk) {
            let r = (v * inv).round_ties_even() as i32;
            *dst = r as i8;
            sum += r;
        }
        *scale = f16::from_f32(d).to_f32();
        *scaled_sum = f16::from_f32(d * sum as f32).to_f32();
    }
}

impl QuantizedRows {
    /// Writes the interleaved copy the lane kernels read (see [`QuantizedRows::lane_quants`])
    /// from the quantised values, as the AVX-512 quantiser writes it directly.
    #[cfg(target_arch = "x86_64")]
    fn interleave_lanes(&mut self) {
        let pairs = self.m * self.blocks.div_ceil(2);
        self.lane_quants.clear();
        self.lane_quants.resize(pairs * LANE_PAIR_BYTES, 0);
        self.lane_scales.clear();
        self.lane_scales.resize(4 * pairs, 0.0);
        self.lane_offsets.clear();
        self.lane_offsets.resize(4 * pairs, 0);
        // SAFETY: called after the AVX2 quantiser, so the CPU has AVX2; buffers sized above.
        unsafe {
            avx2_lanes::interleave(
                &self.quants,
                &self.scales,
                self.blocks,
                &mut self.lane_quants,
                &mut self.lane_scales,
                &mut self.lane_offsets,
            )
        };
        self.lanes_ready = true;
    }
}
