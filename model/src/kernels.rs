//! Quantized matmul kernels for the default model's formats: Q4_1 weights (against Q8_1
//! activations) and Q8_0 weights (against Q8_0 activations), as llama.cpp computes them.
//! Multi-row: each weight block is loaded and unpacked once for a tile of up to eight
//! activation rows, which is what makes scoring K + 1 tokens cheaper than K + 1 passes.
//! AVX2 + FMA when the CPU has them (detected at run time), a portable version otherwise.
//! Every output element is computed by the same code, over the same blocks, in the same order
//! whatever the number of rows, so results are batch-invariant.

use candle_core::quantized::{GgmlDType, QTensor};
use half::f16;

/// Rows of activations processed against each unpacked weight block.
const ROW_TILE: usize = 8;
const BLOCK: usize = 32;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Q4_1,
    Q8_0,
}

/// A weight matrix `[n, k]` repacked for the kernels: scales (and Q4_1 minimums) as f32,
/// quants contiguous per row.
pub struct QuantMatrix {
    format: Format,
    n: usize,
    k: usize,
    scales: Vec<f32>,
    mins: Vec<f32>,
    quants: Vec<u8>,
}

/// Activations quantised per 32-value block: scale, sum term (Q8_1 only) and int8 values.
pub struct QuantizedRows {
    m: usize,
    blocks: usize,
    scales: Vec<f32>,
    sums: Vec<f32>,
    quants: Vec<i8>,
}

fn read_f16(bytes: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([bytes[at], bytes[at + 1]])).to_f32()
}

impl QuantMatrix {
    /// Repacks a Q4_1 or Q8_0 tensor; `None` for other formats or shapes.
    pub fn from_qtensor(tensor: &QTensor) -> Option<Self> {
        let format = match tensor.dtype() {
            GgmlDType::Q4_1 => Format::Q4_1,
            GgmlDType::Q8_0 => Format::Q8_0,
            _ => return None,
        };
        let (n, k) = tensor.shape().dims2().ok()?;
        if k % BLOCK != 0 {
            return None;
        }
        let data = tensor.data().ok()?;
        let blocks = n * k / BLOCK;
        let (block_bytes, quant_bytes) = match format {
            Format::Q4_1 => (20, 16),
            Format::Q8_0 => (34, 32),
        };
        if data.len() != blocks * block_bytes {
            return None;
        }
        let mut scales = Vec::with_capacity(blocks);
        let mut mins = Vec::new();
        let mut quants = Vec::with_capacity(blocks * quant_bytes);
        for block in data.chunks_exact(block_bytes) {
            scales.push(read_f16(block, 0));
            match format {
                Format::Q4_1 => {
                    mins.push(read_f16(block, 2));
                    quants.extend_from_slice(&block[4..20]);
                }
                Format::Q8_0 => quants.extend_from_slice(&block[2..34]),
            }
        }
        Some(Self {
            format,
            n,
            k,
            scales,
            mins,
            quants,
        })
    }

    pub fn rows(&self) -> usize {
        self.n
    }

    pub fn cols(&self) -> usize {
        self.k
    }

    /// Quantises `m` rows of `k` activations for this matrix's format.
    pub fn quantize(&self, x: &[f32], m: usize) -> QuantizedRows {
        quantize_rows(x, m, self.k, self.format == Format::Q4_1)
    }

    /// `x [m, k] · selfᵀ → [m, n]`, row-major.
    pub fn matmul(&self, x: &[f32], m: usize) -> Vec<f32> {
        Self::matmul_many(&[self], x, m)
            .pop()
            .expect("one product per matrix")
    }

    /// Whether `matmul_many` can take these matrices together (same format and width).
    pub fn compatible(matrices: &[&QuantMatrix]) -> bool {
        matrices
            .windows(2)
            .all(|w| w[0].format == w[1].format && w[0].k == w[1].k)
    }

    /// The products of the same activations with several matrices (e.g. the Q, K and V
    /// projections): the activations are quantised once and all the work is one pass over
    /// the thread pool. Every element is computed exactly as `matmul` computes it.
    pub fn matmul_many(matrices: &[&QuantMatrix], x: &[f32], m: usize) -> Vec<Vec<f32>> {
        assert!(
            !matrices.is_empty() && Self::compatible(matrices),
            "matrices must share format and width"
        );
        let k = matrices[0].k;
        assert_eq!(x.len(), m * k, "activations must be [m, k]");
        let rows = matrices[0].quantize(x, m);
        let tiles = m.div_ceil(ROW_TILE);
        let mut outs: Vec<Vec<f32>> = matrices.iter().map(|w| vec![0f32; m * w.n]).collect();
        let ptrs: Vec<SendPtr> = outs.iter_mut().map(|o| SendPtr(o.as_mut_ptr())).collect();
        // Work items: (matrix, row tile, column), matrices one after another.
        let mut starts = Vec::with_capacity(matrices.len() + 1);
        let mut total = 0;
        for w in matrices {
            starts.push(total);
            total += tiles * w.n;
        }
        starts.push(total);
        let kernel = Kernel::detect();
        candle_core::utils::barrier_pool().execute_chunked(total, |items| {
            let mut tile_out = [0f32; ROW_TILE];
            for item in items {
                let which = starts.partition_point(|&s| s <= item) - 1;
                let (w, local) = (matrices[which], item - starts[which]);
                let (tile, j) = (local / w.n, local % w.n);
                let r0 = tile * ROW_TILE;
                let count = ROW_TILE.min(m - r0);
                w.column(kernel, j, &rows, r0, count, &mut tile_out);
                for (t, value) in tile_out[..count].iter().enumerate() {
                    // SAFETY: each (matrix, row, column) is written by exactly one work item.
                    unsafe { *ptrs[which].get().add((r0 + t) * w.n + j) = *value };
                }
            }
        });
        outs
    }

    /// Dot products of weight row `j` with activation rows `r0..r0 + count`.
    fn column(&self, kernel: Kernel, j: usize, x: &QuantizedRows, r0: usize, count: usize, out: &mut [f32]) {
        let nb = self.k / BLOCK;
        let scales = &self.scales[j * nb..(j + 1) * nb];
        match (self.format, kernel) {
            #[cfg(target_arch = "x86_64")]
            (Format::Q4_1, Kernel::Avx2) => unsafe {
                avx2::q4_1(
                    scales,
                    &self.mins[j * nb..(j + 1) * nb],
                    &self.quants[j * nb * 16..],
                    x,
                    r0,
                    count,
                    out,
                )
            },
            #[cfg(target_arch = "x86_64")]
            (Format::Q8_0, Kernel::Avx2) => unsafe {
                avx2::q8_0(scales, &self.quants[j * nb * 32..], x, r0, count, out)
            },
            (Format::Q4_1, _) => portable::q4_1(
                scales,
                &self.mins[j * nb..(j + 1) * nb],
                &self.quants[j * nb * 16..],
                x,
                r0,
                count,
                out,
            ),
            (Format::Q8_0, _) => portable::q8_0(scales, &self.quants[j * nb * 32..], x, r0, count, out),
        }
    }
}

/// An output pointer handed to pool threads that each write disjoint parts of it (kernels
/// write their own rows, attention its own (row, head) slices).
#[derive(Clone, Copy)]
pub(crate) struct SendPtr(pub(crate) *mut f32);
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}
impl SendPtr {
    pub(crate) fn get(self) -> *mut f32 {
        self.0
    }
}

/// Which implementation runs, chosen once from the CPU's features.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kernel {
    Avx2,
    Portable,
}

impl Kernel {
    pub fn detect() -> Self {
        static KERNEL: std::sync::OnceLock<Kernel> = std::sync::OnceLock::new();
        *KERNEL.get_or_init(|| {
            #[cfg(target_arch = "x86_64")]
            if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                return Kernel::Avx2;
            }
            Kernel::Portable
        })
    }
}

/// Per-block int8 quantisation as llama.cpp does it: scale = max|x| / 127 stored as f16,
/// values rounded to nearest-even; Q8_1 also keeps scale · Σq (as f16) for the minimum term.
fn quantize_rows(x: &[f32], m: usize, k: usize, with_sums: bool) -> QuantizedRows {
    let blocks = k / BLOCK;
    let mut scales = Vec::with_capacity(m * blocks);
    let mut sums = Vec::with_capacity(if with_sums { m * blocks } else { 0 });
    let mut quants = vec![0i8; m * k];
    for (b, (chunk, q)) in x
        .chunks_exact(BLOCK)
        .zip(quants.chunks_exact_mut(BLOCK))
        .enumerate()
    {
        let _ = b;
        let amax = chunk.iter().fold(0f32, |a, v| a.max(v.abs()));
        let d = amax / 127.0;
        let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
        let mut sum = 0i32;
        for (dst, v) in q.iter_mut().zip(chunk) {
            let r = (v * inv).round_ties_even() as i32;
            *dst = r as i8;
            sum += r;
        }
        scales.push(f16::from_f32(d).to_f32());
        if with_sums {
            sums.push(f16::from_f32(d * sum as f32).to_f32());
        }
    }
    QuantizedRows {
        m,
        blocks,
        scales,
        sums,
        quants,
    }
}

impl QuantizedRows {
    pub fn rows(&self) -> usize {
        self.m
    }
}

// Kernels walk several parallel arrays (scales, quants, rows) by block and row index.
#[allow(clippy::needless_range_loop)]
mod portable {
    use super::{BLOCK, QuantizedRows};

    pub fn q4_1(
        scales: &[f32],
        mins: &[f32],
        quants: &[u8],
        x: &QuantizedRows,
        r0: usize,
        count: usize,
        out: &mut [f32],
    ) {
        let nb = x.blocks;
        for t in 0..count {
            let r = r0 + t;
            let (mut acc, mut summ) = (0f32, 0f32);
            for b in 0..nb {
                let w = &quants[b * 16..b * 16 + 16];
                let xq = &x.quants[(r * nb + b) * BLOCK..(r * nb + b + 1) * BLOCK];
                let mut sumi = 0i32;
                for i in 0..16 {
                    sumi += i32::from(w[i] & 0x0F) * i32::from(xq[i]);
                    sumi += i32::from(w[i] >> 4) * i32::from(xq[i + 16]);
                }
                acc += scales[b] * x.scales[r * nb + b] * sumi as f32;
                summ += mins[b] * x.sums[r * nb + b];
            }
            out[t] = acc + summ;
        }
    }

    pub fn q8_0(scales: &[f32], quants: &[u8], x: &QuantizedRows, r0: usize, count: usize, out: &mut [f32]) {
        let nb = x.blocks;
        for t in 0..count {
            let r = r0 + t;
            let mut acc = 0f32;
            for b in 0..nb {
                let w = &quants[b * BLOCK..(b + 1) * BLOCK];
                let xq = &x.quants[(r * nb + b) * BLOCK..(r * nb + b + 1) * BLOCK];
                let sumi: i32 = w
                    .iter()
                    .zip(xq)
                    .map(|(&a, &b)| i32::from(a as i8) * i32::from(b))
                    .sum();
                acc += scales[b] * x.scales[r * nb + b] * sumi as f32;
            }
            out[t] = acc;
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop)]
mod avx2 {
    use std::arch::x86_64::*;

    use super::{BLOCK, QuantizedRows, ROW_TILE};

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

    /// # Safety
    /// The CPU must have AVX2 and FMA; slices must hold `x.blocks` blocks.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn q4_1(
        scales: &[f32],
        mins: &[f32],
        quants: &[u8],
        x: &QuantizedRows,
        r0: usize,
        count: usize,
        out: &mut [f32],
    ) {
        let nb = x.blocks;
        debug_assert!(count <= ROW_TILE && quants.len() >= nb * 16);
        let mut acc = [_mm256_setzero_ps(); ROW_TILE];
        let mut summ = [0f32; ROW_TILE];
        let mask = _mm_set1_epi8(0x0F);
        let ones = _mm256_set1_epi16(1);
        for b in 0..nb {
            // SAFETY: 16 bytes of this block's quants are in bounds (checked above).
            let raw = unsafe { _mm_loadu_si128(quants.as_ptr().add(b * 16) as *const __m128i) };
            let lo = _mm_and_si128(raw, mask);
            let hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
            let w = _mm256_set_m128i(hi, lo);
            let (dw, mw) = (scales[b], mins[b]);
            for t in 0..count {
                let xb = (r0 + t) * nb + b;
                // SAFETY: block xb of the activations has 32 int8 values.
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
    pub unsafe fn q8_0(
        scales: &[f32],
        quants: &[u8],
        x: &QuantizedRows,
        r0: usize,
        count: usize,
        out: &mut [f32],
    ) {
        let nb = x.blocks;
        debug_assert!(count <= ROW_TILE && quants.len() >= nb * BLOCK);
        let mut acc = [_mm256_setzero_ps(); ROW_TILE];
        let ones = _mm256_set1_epi16(1);
        for b in 0..nb {
            // SAFETY: 32 bytes of this block's quants are in bounds (checked above).
            let w = unsafe { _mm256_loadu_si256(quants.as_ptr().add(b * BLOCK) as *const __m256i) };
            let w_abs = _mm256_sign_epi8(w, w);
            let dw = scales[b];
            for t in 0..count {
                let xb = (r0 + t) * nb + b;
                // SAFETY: block xb of the activations has 32 int8 values.
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
}

#[cfg(test)]
mod tests;
