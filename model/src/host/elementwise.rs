//! The element-wise phases of a host forward pass: RMS norm, rotary embedding and SiLU·up.
//! Each has a vector path for this CPU that gives bit-identical results to its scalar code
//! (the same operations on each value, in the same order: no fused multiply-adds where the
//! scalar code has none, and the norm's sum in the scalar code's eight lanes), so which
//! path ran never changes a token. They run on the pass's own thread for a few rows, where
//! they sit between matmuls that use every core, so their speed there is what counts.

use crate::kernels::{Kernel, for_row_chunks};

/// `out = x · w / rms(x)` per row of `dim` values (candle's and llama.cpp's RMS norm), the
/// rows spread over the thread pool (see [`crate::kernels::for_row_ranges`]).
pub(super) fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let dim = weight.len();
    assert_eq!(x.len(), out.len());
    for_row_chunks(out, dim, |rows, out| {
        rms_norm_rows(&x[rows.start * dim..rows.end * dim], weight, eps, out);
    });
}

/// [`rms_norm`] on this thread.
fn rms_norm_rows(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let dim = weight.len();
    for (row, dst) in x.chunks_exact(dim).zip(out.chunks_exact_mut(dim)) {
        #[cfg(target_arch = "x86_64")]
        if Kernel::detect() != Kernel::Portable {
            // SAFETY: every kernel but the portable one needs AVX (detected); the row, the
            // weights and the output have `dim` values each.
            unsafe { rms_norm_row_avx(row, weight, eps, dst) };
            continue;
        }
        rms_norm_row(row, weight, eps, dst);
    }
}

/// One row of [`rms_norm`], scalar.
fn rms_norm_row(row: &[f32], weight: &[f32], eps: f32, dst: &mut [f32]) {
    let mean = crate::attention::dot(row, row) / row.len() as f32;
    let inv = 1.0 / (mean + eps).sqrt();
    for ((d, &v), &w) in dst.iter_mut().zip(row).zip(weight) {
        *d = v * inv * w;
    }
}

/// [`rms_norm_row`] with 8-lane vectors: the sum of squares in the same eight lanes and the
/// same final order as [`crate::attention::dot`], so the same result.
///
/// # Safety
/// The CPU must have AVX; `weight` and `dst` must be as long as `row`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
unsafe fn rms_norm_row_avx(row: &[f32], weight: &[f32], eps: f32, dst: &mut [f32]) {
    use std::arch::x86_64::*;
    assert!(weight.len() == row.len() && dst.len() == row.len());
    let whole = row.len() / 8 * 8;
    let mut acc = _mm256_setzero_ps();
    for at in (0..whole).step_by(8) {
        // SAFETY: 8 values at `at` (at + 8 <= whole).
        let v = unsafe { _mm256_loadu_ps(row.as_ptr().add(at)) };
        acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
    }
    let mut lanes = [0f32; 8];
    // SAFETY: eight floats.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc) };
    let tail: f32 = row[whole..].iter().fold(0.0, |t, &v| t + v * v);
    let sum = crate::attention::sum_lanes(&lanes, tail);
    let inv = 1.0 / (sum / row.len() as f32 + eps).sqrt();
    let inv8 = _mm256_set1_ps(inv);
    for at in (0..whole).step_by(8) {
        // SAFETY: 8 values at `at` in all three (lengths checked above).
        unsafe {
            let v = _mm256_loadu_ps(row.as_ptr().add(at));
            let w = _mm256_loadu_ps(weight.as_ptr().add(at));
            _mm256_storeu_ps(dst.as_mut_ptr().add(at), _mm256_mul_ps(_mm256_mul_ps(v, inv8), w));
        }
    }
    for ((d, &v), &w) in dst[whole..].iter_mut().zip(&row[whole..]).zip(&weight[whole..]) {
        *d = v * inv * w;
    }
}

/// Interleaved rotary embedding in place on each head of one row at one position: pairs
/// `(x[2i], x[2i+1])` of the first `rope_dim` values rotate by `position · θ_i` (`cos` and
/// `sin` hold the position's `rope_dim / 2` values).
pub(super) fn rotate(row: &mut [f32], head_dim: usize, rope_dim: usize, cos: &[f32], sin: &[f32]) {
    rotate_with(Kernel::detect(), row, head_dim, rope_dim, cos, sin);
}

/// [`rotate`] with the vector path of `kernel` (which this CPU must support).
fn rotate_with(kernel: Kernel, row: &mut [f32], head_dim: usize, rope_dim: usize, cos: &[f32], sin: &[f32]) {
    assert!(rope_dim <= head_dim && cos.len() >= rope_dim / 2 && sin.len() >= rope_dim / 2);
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the CPU has the features of the path taken (the caller's contract); sizes
    // checked above.
    let done = unsafe {
        if kernel.has_avx512() {
            rotate_avx512(row, head_dim, rope_dim, cos, sin)
        } else if kernel == Kernel::Avx2 {
            rotate_avx2(row, head_dim, rope_dim, cos, sin)
        } else {
            0
        }
    };
    #[cfg(not(target_arch = "x86_64"))]
    let done = {
        let _ = kernel;
        0
    };
    for head in row.chunks_exact_mut(head_dim) {
        rotate_pairs(head, done / 2..rope_dim / 2, cos, sin);
    }
}

/// Rotates pairs `pairs` of one head, scalar.
fn rotate_pairs(head: &mut [f32], pairs: std::ops::Range<usize>, cos: &[f32], sin: &[f32]) {
    for i in pairs {
        let (a, b) = (head[2 * i], head[2 * i + 1]);
        head[2 * i] = a * cos[i] - b * sin[i];
        head[2 * i + 1] = a * sin[i] + b * cos[i];
    }
}

/// [`rotate`] on the first multiple of 16 values of each head's `rope_dim`, 8 pairs per
/// vector: `x · (c, c) + swap(x) · (−s, s)` is `a·c − b·s, b·c + a·s` with the scalar code's
/// roundings (a product of a negated factor is the negated product; addition commutes).
/// Returns the values of each head it rotated.
///
/// # Safety
/// The CPU must have AVX-512 F; `cos` and `sin` must hold `rope_dim / 2` values and
/// `rope_dim <= head_dim`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn rotate_avx512(
    row: &mut [f32],
    head_dim: usize,
    rope_dim: usize,
    cos: &[f32],
    sin: &[f32],
) -> usize {
    use std::arch::x86_64::*;
    const MAX_VECTORS: usize = 16;
    let vectors = (rope_dim / 16).min(MAX_VECTORS);
    // Each pair's cosine twice, and its sine negated then as is, for the 8 pairs of a vector.
    let twice = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
    let signs = _mm512_set1_epi64(0x0000_0000_8000_0000);
    let mut cc = [_mm512_setzero_ps(); MAX_VECTORS];
    let mut ss = [_mm512_setzero_ps(); MAX_VECTORS];
    for v in 0..vectors {
        // SAFETY: pairs 8v..8v + 8 lie in `cos` and `sin` (16v + 16 <= rope_dim).
        let (c, s) = unsafe {
            (
                _mm512_castps256_ps512(_mm256_loadu_ps(cos.as_ptr().add(8 * v))),
                _mm512_castps256_ps512(_mm256_loadu_ps(sin.as_ptr().add(8 * v))),
            )
        };
        cc[v] = _mm512_permutexvar_ps(twice, c);
        let sines = _mm512_castps_si512(_mm512_permutexvar_ps(twice, s));
        ss[v] = _mm512_castsi512_ps(_mm512_xor_si512(sines, signs));
    }
    for head in row.chunks_exact_mut(head_dim) {
        for v in 0..vectors {
            // SAFETY: 16 values at 16v of the head (16v + 16 <= rope_dim <= head_dim).
            unsafe {
                let at = head.as_mut_ptr().add(16 * v);
                let x = _mm512_loadu_ps(at);
                let swapped = _mm512_permute_ps::<0b1011_0001>(x);
                let rotated = _mm512_add_ps(_mm512_mul_ps(x, cc[v]), _mm512_mul_ps(swapped, ss[v]));
                _mm512_storeu_ps(at, rotated);
            }
        }
    }
    16 * vectors
}

/// [`rotate_avx512`] with 8-value vectors (4 pairs).
///
/// # Safety
/// The CPU must have AVX2; as [`rotate_avx512`] otherwise.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn rotate_avx2(row: &mut [f32], head_dim: usize, rope_dim: usize, cos: &[f32], sin: &[f32]) -> usize {
    use std::arch::x86_64::*;
    const MAX_VECTORS: usize = 32;
    let vectors = (rope_dim / 8).min(MAX_VECTORS);
    let twice = _mm256_set_epi32(3, 3, 2, 2, 1, 1, 0, 0);
    let signs = _mm256_castsi256_ps(_mm256_set1_epi64x(0x0000_0000_8000_0000));
    let mut cc = [_mm256_setzero_ps(); MAX_VECTORS];
    let mut ss = [_mm256_setzero_ps(); MAX_VECTORS];
    for v in 0..vectors {
        // SAFETY: pairs 4v..4v + 4 lie in `cos` and `sin` (8v + 8 <= rope_dim).
        let (c, s) = unsafe {
            (
                _mm256_castps128_ps256(_mm_loadu_ps(cos.as_ptr().add(4 * v))),
                _mm256_castps128_ps256(_mm_loadu_ps(sin.as_ptr().add(4 * v))),
            )
        };
        cc[v] = _mm256_permutevar8x32_ps(c, twice);
        ss[v] = _mm256_xor_ps(_mm256_permutevar8x32_ps(s, twice), signs);
    }
    for head in row.chunks_exact_mut(head_dim) {
        for v in 0..vectors {
            // SAFETY: 8 values at 8v of the head (8v + 8 <= rope_dim <= head_dim).
            unsafe {
                let at = head.as_mut_ptr().add(8 * v);
                let x = _mm256_loadu_ps(at);
                let swapped = _mm256_permute_ps::<0b1011_0001>(x);
                let rotated = _mm256_add_ps(_mm256_mul_ps(x, cc[v]), _mm256_mul_ps(swapped, ss[v]));
                _mm256_storeu_ps(at, rotated);
            }
        }
    }
    8 * vectors
}

/// `gate = silu(gate) · up` over rows of `width` values, the rows spread over the thread
/// pool (see [`crate::kernels::for_row_ranges`]).
pub(super) fn silu_mul_rows(gate: &mut [f32], up: &[f32], width: usize) {
    assert_eq!(gate.len(), up.len());
    for_row_chunks(gate, width, |rows, gate| {
        silu_mul(gate, &up[rows.start * width..rows.end * width]);
    });
}

/// `gate = silu(gate) · up`, with the attention's `exp` (16 lanes at a time with AVX-512, 8
/// with AVX2: the same polynomial and operations, so the same results).
fn silu_mul(gate: &mut [f32], up: &[f32]) {
    silu_mul_with(Kernel::detect(), gate, up);
}

/// [`silu_mul`] with the vector path of `kernel` (which this CPU must support).
fn silu_mul_with(kernel: Kernel, gate: &mut [f32], up: &[f32]) {
    assert_eq!(gate.len(), up.len());
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the CPU has the features of the path taken (the caller's contract); lengths
    // are equal (checked).
    let done = unsafe {
        if kernel.has_avx512() {
            silu_mul_avx512(gate, up)
        } else if kernel == Kernel::Avx2 {
            silu_mul_avx2(gate, up)
        } else {
            0
        }
    };
    #[cfg(not(target_arch = "x86_64"))]
    let done = {
        let _ = kernel;
        0
    };
    for (g, &u) in gate[done..].iter_mut().zip(&up[done..]) {
        *g = *g / (1.0 + crate::attention::exp(-*g)) * u;
    }
}

/// [`silu_mul`] on the multiples of 16 values; returns how many it did.
///
/// # Safety
/// The CPU must have AVX-512 F and FMA; `up` must be as long as `gate`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
unsafe fn silu_mul_avx512(gate: &mut [f32], up: &[f32]) -> usize {
    use std::arch::x86_64::*;
    let whole = gate.len() / 16 * 16;
    for at in (0..whole).step_by(16) {
        // SAFETY: 16 values at `at` in both (lengths checked by the caller).
        unsafe {
            let g = _mm512_loadu_ps(gate.as_ptr().add(at));
            let e = crate::attention::exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
            let silu = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0), e));
            let product = _mm512_mul_ps(silu, _mm512_loadu_ps(up.as_ptr().add(at)));
            _mm512_storeu_ps(gate.as_mut_ptr().add(at), product);
        }
    }
    whole
}

/// [`silu_mul`] on the multiples of 8 values; returns how many it did.
///
/// # Safety
/// The CPU must have AVX2, FMA and F16C; `up` must be as long as `gate`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn silu_mul_avx2(gate: &mut [f32], up: &[f32]) -> usize {
    use std::arch::x86_64::*;
    let whole = gate.len() / 8 * 8;
    for at in (0..whole).step_by(8) {
        // SAFETY: 8 values at `at` in both (lengths checked by the caller).
        unsafe {
            let g = _mm256_loadu_ps(gate.as_ptr().add(at));
            let e = crate::attention::exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
            let silu = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0), e));
            let product = _mm256_mul_ps(silu, _mm256_loadu_ps(up.as_ptr().add(at)));
            _mm256_storeu_ps(gate.as_mut_ptr().add(at), product);
        }
    }
    whole
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Values over several orders of magnitude, both signs, from a seed.
    fn noise(len: usize, seed: u32) -> Vec<f32> {
        let mut state = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
        (0..len)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 17;
                state ^= state << 5;
                let unit = (state >> 8) as f32 / (1u32 << 24) as f32 - 0.5;
                unit * [0.01f32, 1.0, 30.0][state as usize % 3]
            })
            .collect()
    }

    /// Every path this CPU can run: the detected one, and AVX2 where AVX-512 was found.
    fn kernels_here() -> Vec<Kernel> {
        let mut kernels = vec![Kernel::detect(), Kernel::Portable];
        if Kernel::detect().has_avx512() {
            kernels.push(Kernel::Avx2);
        }
        kernels
    }

    #[test]
    fn silu_mul_gives_the_scalar_formula_bit_for_bit() {
        // 16- and 8-lane chunks and a tail, over the range where exp saturates both ways.
        let gate: Vec<f32> = (0..83).map(|i| (i as f32 - 41.0) * 2.3).collect();
        let up: Vec<f32> = (0..83).map(|i| 0.5 + i as f32 * 0.01).collect();
        for kernel in kernels_here() {
            let mut got = gate.clone();
            silu_mul_with(kernel, &mut got, &up);
            for (i, ((&g, &u), &v)) in gate.iter().zip(&up).zip(&got).enumerate() {
                let want = g / (1.0 + crate::attention::exp(-g)) * u;
                assert_eq!(
                    v.to_bits(),
                    want.to_bits(),
                    "{kernel:?} [{i}] silu({g}) · {u}: {v} vs {want}"
                );
            }
        }
    }

    #[test]
    fn rms_norm_gives_the_scalar_code_bit_for_bit() {
        // Widths with and without a tail past the last 8 values.
        for (dim, seed) in [(576usize, 1u32), (64, 2), (77, 3), (5, 4)] {
            let x = noise(3 * dim, seed);
            let weight = noise(dim, seed + 10);
            let mut got = vec![0f32; x.len()];
            rms_norm_rows(&x, &weight, 1e-5, &mut got);
            for (r, (row, got)) in x.chunks_exact(dim).zip(got.chunks_exact(dim)).enumerate() {
                let mut want = vec![0f32; dim];
                rms_norm_row(row, &weight, 1e-5, &mut want);
                for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                    assert_eq!(a.to_bits(), b.to_bits(), "dim {dim} row {r} [{i}]: {a} vs {b}");
                }
            }
        }
    }

    #[test]
    fn rotate_gives_the_scalar_code_bit_for_bit() {
        // Rotary over whole heads and over part of a head, with a tail past the vectors.
        for (head_dim, rope_dim) in [(64usize, 64usize), (128, 128), (64, 40), (96, 24), (32, 6)] {
            let heads = 3;
            let row = noise(heads * head_dim, head_dim as u32);
            let angles: Vec<f32> = (0..rope_dim / 2).map(|i| 0.37 * i as f32 + 0.11).collect();
            let cos: Vec<f32> = angles.iter().map(|a| a.cos()).collect();
            let sin: Vec<f32> = angles.iter().map(|a| a.sin()).collect();
            let mut want = row.clone();
            for head in want.chunks_exact_mut(head_dim) {
                rotate_pairs(head, 0..rope_dim / 2, &cos, &sin);
            }
            for kernel in kernels_here() {
                let mut got = row.clone();
                rotate_with(kernel, &mut got, head_dim, rope_dim, &cos, &sin);
                for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                    assert_eq!(
                        a.to_bits(),
                        b.to_bits(),
                        "{kernel:?} head_dim {head_dim} rope_dim {rope_dim} [{i}]: {a} vs {b}"
                    );
                }
            }
        }
    }
}
