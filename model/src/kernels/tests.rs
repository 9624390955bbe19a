//! Kernel tests on random data against a plain f64 reference, for odd shapes and tails, plus
//! batch invariance (a row's result does not depend on how many rows came with it).

use candle_core::{Device, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::split::PARALLEL_ROWS;
use super::*;

fn random(len: usize, seed: u64) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..len).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

fn matrix(format: GgmlDType, n: usize, k: usize, seed: u64) -> (QTensor, QuantMatrix) {
    matrix_for(format, n, k, seed, Kernel::detect())
}

/// A random matrix repacked in the layout `kernel` reads.
fn matrix_for(format: GgmlDType, n: usize, k: usize, seed: u64, kernel: Kernel) -> (QTensor, QuantMatrix) {
    let t = Tensor::from_vec(random(n * k, seed), (n, k), &Device::Cpu).unwrap();
    let q = QTensor::quantize(&t, format).unwrap();
    let packed = QuantMatrix::from_qtensor_for(&q, kernel).expect("supported format");
    (q, packed)
}

/// f64 dot products of the dequantised weights with the dequantised activations, and the
/// magnitude Σ|w||x| each error is measured against.
fn reference(q: &QTensor, packed: &QuantMatrix, x: &[f32], m: usize) -> (Vec<f64>, Vec<f64>) {
    let (n, k) = (packed.rows(), packed.cols());
    let w = q
        .dequantize(&Device::Cpu)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    let rows = packed.quantize(x, m);
    let xd: Vec<f64> = rows
        .quants
        .iter()
        .enumerate()
        .map(|(i, &v)| v as f64 * rows.scales[i / BLOCK] as f64)
        .collect();
    let mut out = vec![0f64; m * n];
    let mut mag = vec![0f64; m * n];
    for r in 0..m {
        for j in 0..n {
            for i in 0..k {
                out[r * n + j] += w[j * k + i] as f64 * xd[r * k + i];
                mag[r * n + j] += (w[j * k + i] as f64 * xd[r * k + i]).abs();
            }
        }
    }
    (out, mag)
}

const SHAPES: [(usize, usize, usize); 8] = [
    (1, 1, 32),
    (1, 5, 64),
    (3, 7, 96),
    (8, 9, 128),
    (9, 13, 608),
    (17, 4, 1536),
    (2, 37, 576),
    (3, 5, 768),
];

const FORMATS: [GgmlDType; 5] = [
    GgmlDType::Q4_0,
    GgmlDType::Q4_1,
    GgmlDType::Q4K,
    GgmlDType::Q6K,
    GgmlDType::Q8_0,
];

fn is_k_quant(format: GgmlDType) -> bool {
    matches!(format, GgmlDType::Q4K | GgmlDType::Q6K)
}

/// Shapes a format can take (K-quants need rows that are multiples of 256).
fn shapes(format: GgmlDType) -> impl Iterator<Item = (usize, (usize, usize, usize))> {
    let block = if is_k_quant(format) { 256 } else { 32 };
    SHAPES
        .into_iter()
        .enumerate()
        .filter(move |(_, (_, _, k))| k % block == 0)
}

/// The product computed column by column with one given implementation, the activations
/// quantised by that implementation too (with `SPECD_KERNEL` capping the detected one, the
/// detected quantiser would leave out what a better kernel reads).
fn matmul_with(kernel: Kernel, packed: &QuantMatrix, x: &[f32], m: usize) -> Vec<f32> {
    let mut rows = QuantizedRows::default();
    rows.quantize_with(kernel, x, m, packed.k, QuantMatrix::any_reads_lanes(&[packed]));
    let n = packed.rows();
    let (col_tile, row_tile) = packed.tile_shape();
    let mut out = vec![0f32; m * n];
    for r0 in (0..m).step_by(row_tile) {
        let count = row_tile.min(m - r0);
        for j0 in (0..n).step_by(col_tile) {
            let cols = col_tile.min(n - j0);
            let mut tile = [0f32; MAX_TILE];
            packed.tile(kernel, j0, cols, &rows, r0, count, &mut tile);
            for c in 0..cols {
                for t in 0..count {
                    out[(r0 + t) * n + j0 + c] = tile[packed.tile_index(c, t)];
                }
            }
        }
    }
    out
}

/// `kernel`'s product of `packed` (quantised from `q`) with `x` against [`reference`].
fn assert_matches_reference(
    kernel: Kernel,
    q: &QTensor,
    packed: &QuantMatrix,
    x: &[f32],
    m: usize,
    case: &str,
) {
    let (want, mag) = reference(q, packed, x, m);
    let got = matmul_with(kernel, packed, x, m);
    for (i, (&got, &want)) in got.iter().zip(&want).enumerate() {
        // The sum term of 4-bit formats travels as f16 (as in llama.cpp): ~1e-3.
        let bound = 2e-3 * mag[i] + 1e-4;
        assert!(
            (got as f64 - want).abs() <= bound,
            "{case} {kernel:?} [{i}]: {got} vs {want} (bound {bound})"
        );
    }
}

#[test]
fn every_kernel_matches_the_reference_on_odd_shapes() {
    let kernels = Kernel::available();
    for format in FORMATS {
        for (s, (m, n, k)) in shapes(format) {
            let x = random(m * k, 100 + s as u64);
            for &kernel in &kernels {
                let (q, packed) = matrix_for(format, n, k, s as u64, kernel);
                assert_matches_reference(kernel, &q, &packed, &x, m, &format!("{format:?} m{m} n{n} k{k}"));
            }
        }
    }
}

/// Weights at their format's extremes (every quant but one per block at the top of its
/// range) times activations at ±127: the largest partial sums the integer paths meet, where
/// a 16-bit intermediate with too little headroom would wrap (and miss by ~65536 · scale).
#[test]
fn integer_sums_at_the_extremes_do_not_overflow() {
    // 768 columns: K-quants take multiples of 256.
    let (m, n, k) = (3, 8, 768);
    let weights: Vec<f32> = (0..n * k)
        .map(|i| if i % BLOCK == 0 { -1.0 } else { 1.0 })
        .collect();
    let activations: Vec<f32> = (0..m * k)
        .map(|i| match i / k {
            0 => 1.0,
            1 => -1.0,
            _ if ((i % k) / BLOCK).is_multiple_of(2) => 1.0,
            _ => -1.0,
        })
        .collect();
    for format in FORMATS {
        let t = Tensor::from_vec(weights.clone(), (n, k), &Device::Cpu).unwrap();
        let q = QTensor::quantize(&t, format).unwrap();
        for kernel in Kernel::available() {
            let packed = QuantMatrix::from_qtensor_for(&q, kernel).expect("supported format");
            assert_matches_reference(kernel, &q, &packed, &activations, m, &format!("{format:?}"));
        }
    }
}

#[test]
fn the_pool_path_equals_the_detected_kernel() {
    for format in FORMATS {
        let (m, n, k) = (11, 19, 512);
        let (_, packed) = matrix(format, n, k, 21);
        let x = random(m * k, 22);
        assert_eq!(
            packed.matmul(&x, m),
            matmul_with(Kernel::detect(), &packed, &x, m),
            "{format:?}"
        );
    }
}

#[test]
fn every_kernel_agrees_with_the_portable_one() {
    for format in FORMATS {
        // 17 blocks: the 512-bit kernels' odd last block.
        let (m, n, k) = (5, 11, 544);
        if is_k_quant(format) {
            continue; // K-quants cannot take 544 columns; the reference test covers them
        }
        let x = random(m * k, 8);
        let (_, packed) = matrix_for(format, n, k, 7, Kernel::Portable);
        let portable = matmul_with(Kernel::Portable, &packed, &x, m);
        for kernel in Kernel::available() {
            let (_, packed) = matrix_for(format, n, k, 7, kernel);
            let simd = matmul_with(kernel, &packed, &x, m);
            for (i, (a, b)) in simd.iter().zip(&portable).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-4 * a.abs().max(1.0),
                    "{format:?} {kernel:?} [{i}]: {a} vs {b}"
                );
            }
        }
    }
}

#[test]
fn results_are_batch_invariant() {
    // Row counts whose tiles take 6, 8 and 5, 8 and 7 rows; each row alone takes 1. In the
    // AVX-512 tile layout 50 rows are two bands of row tiles, 2 × 16 and 16 + 2.
    for (format, m) in FORMATS
        .into_iter()
        .flat_map(|f| [(f, 6), (f, 13), (f, 15), (f, 50)])
    {
        let (n, k) = (21, 768);
        let (_, packed) = matrix(format, n, k, 3);
        let x = random(m * k, 4);
        let together = packed.matmul(&x, m);
        for r in 0..m {
            let alone = packed.matmul(&x[r * k..(r + 1) * k], 1);
            assert_eq!(
                &together[r * n..(r + 1) * n],
                alone.as_slice(),
                "{format:?} row {r} of {m}"
            );
        }
    }
}

#[test]
fn the_portable_quantiser_rounds_half_to_even_against_max_over_127() {
    // max |x| = 127, so the scale is exactly 1 and each value rounds to nearest, ties to even.
    let mut x = vec![0f32; 32];
    x[..6].copy_from_slice(&[127.0, 63.5, -63.5, 62.5, -0.5, 1.5]);
    let mut rows = QuantizedRows::default();
    rows.quantize_with(Kernel::Portable, &x, 1, 32, true);
    assert_eq!(&rows.quants[..6], &[127, 64, -64, 62, 0, 2]);
    assert_eq!(rows.scales, vec![1.0]);
    assert_eq!(rows.sums, vec![(127 + 64 - 64 + 62 + 2) as f32]);
}

#[test]
fn every_kernel_is_batch_invariant() {
    for kernel in Kernel::available() {
        for format in FORMATS {
            // More rows than one AMX tile (16 through tile multiplies, the last 2 and each
            // row alone through VNNI), and an odd block count where the format allows.
            let (m, n, k) = (18, 9, if is_k_quant(format) { 512 } else { 544 });
            let (_, packed) = matrix_for(format, n, k, 41, kernel);
            let x = random(m * k, 42);
            let together = matmul_with(kernel, &packed, &x, m);
            for r in 0..m {
                let alone = matmul_with(kernel, &packed, &x[r * k..(r + 1) * k], 1);
                assert_eq!(
                    &together[r * n..(r + 1) * n],
                    alone.as_slice(),
                    "{kernel:?} {format:?} row {r}"
                );
            }
        }
    }
}

#[test]
fn dequantized_rows_equal_candles_dequantization() {
    for (format, kernel) in FORMATS
        .into_iter()
        .flat_map(|f| Kernel::available().into_iter().map(move |k| (f, k)))
    {
        let (n, k) = (5, 512);
        let (q, packed) = matrix_for(format, n, k, 9, kernel);
        let want = q
            .dequantize(&Device::Cpu)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let mut row = vec![0f32; k];
        for j in 0..n {
            packed.dequantize_row(j, &mut row);
            // K-quants' sub-block scales are rounded to f16 when repacked.
            let bound = if is_k_quant(format) { 2e-3 } else { 1e-5 };
            for (i, (a, b)) in row.iter().zip(&want[j * k..(j + 1) * k]).enumerate() {
                assert!(
                    (a - b).abs() <= bound * b.abs().max(1.0),
                    "{format:?} row {j} [{i}]: {a} vs {b}"
                );
            }
        }
    }
}

#[test]
fn other_formats_are_left_to_candle() {
    let t = Tensor::from_vec(random(512, 1), (2, 256), &Device::Cpu).unwrap();
    for format in [GgmlDType::Q5K, GgmlDType::Q5_0, GgmlDType::F16] {
        assert!(QuantMatrix::from_qtensor(&QTensor::quantize(&t, format).unwrap()).is_none());
    }
}

#[test]
fn several_matrices_at_once_equal_each_alone() {
    let (m, k) = (3, 576);
    let (_, a) = matrix(GgmlDType::Q4_1, 17, k, 5);
    let (_, b) = matrix(GgmlDType::Q8_0, 9, k, 6);
    let x = random(m * k, 7);
    let both = QuantMatrix::matmul_many(&[&a, &b], &x, m);
    assert_eq!(both[0], a.matmul(&x, m));
    assert_eq!(both[1], b.matmul(&x, m));
    let (_, c) = matrix(GgmlDType::Q8_0, 9, 608, 8);
    assert!(!QuantMatrix::compatible(&[&a, &c]));
}

#[test]
fn quantising_on_each_thread_gives_the_shared_quantisations_products() {
    let k = 512; // K-quants take multiples of 256
    for format in FORMATS {
        // Two matrices at once, as q/k/v and gate/up are, over every row count the per-thread
        // path takes; with and without accumulating into a residual.
        let (_, a) = matrix(format, 37, k, 51);
        let (_, b) = matrix(format, 19, k, 52);
        for m in 1..PARALLEL_ROWS {
            let x = random(m * k, 53 + m as u64);
            for accumulate in [false, true] {
                let start = random(m * (37 + 19), 54);
                let (mut shared_a, mut shared_b) = (start[..m * 37].to_vec(), start[m * 37..].to_vec());
                let (mut own_a, mut own_b) = (shared_a.clone(), shared_b.clone());
                let rows = a.quantize(&x, m);
                QuantMatrix::matmul_many_into(
                    &[&a, &b],
                    &rows,
                    &mut [&mut shared_a, &mut shared_b],
                    accumulate,
                );
                let input = |buf: &mut [f32]| buf.copy_from_slice(&x);
                QuantMatrix::matmul_many_from(
                    &[&a, &b],
                    m,
                    &input,
                    &mut [&mut own_a, &mut own_b],
                    accumulate,
                );
                assert_eq!(
                    (&own_a, &own_b),
                    (&shared_a, &shared_b),
                    "{format:?} m{m} {accumulate}"
                );
            }
        }
    }
}

#[test]
fn accumulating_adds_to_the_output() {
    let (m, n, k) = (4, 6, 256);
    let (_, a) = matrix(GgmlDType::Q4_1, n, k, 11);
    let x = random(m * k, 12);
    let product = a.matmul(&x, m);
    let mut out = random(m * n, 13);
    let base = out.clone();
    let rows = a.quantize(&x, m);
    QuantMatrix::matmul_many_into(&[&a], &rows, &mut [out.as_mut_slice()], true);
    for i in 0..m * n {
        assert_eq!(out[i], base[i] + product[i]);
    }
}

#[test]
fn every_quantiser_gives_the_portable_result() {
    let k = 576;
    let mut x = random(3 * k, 31);
    // Ties, zeros and an all-zero block.
    x[5] = 0.5;
    x[6] = -0.0;
    for v in &mut x[k..k + 32] {
        *v = 0.0;
    }
    // A block whose scaled sum overflows f16 (scale 787, sum 4064) and one of tiny values.
    for (i, v) in x[2 * k..2 * k + 32].iter_mut().enumerate() {
        *v = 1e5 * (1.0 - i as f32 / 1e3);
    }
    for v in &mut x[2 * k + 32..2 * k + 64] {
        *v *= 1e-30;
    }
    let mut portable = QuantizedRows::default();
    portable.quantize_with(Kernel::Portable, &x, 3, k, true);
    assert_eq!(portable.scales.len(), 3 * k / BLOCK);
    // The all-zero block quantises to zeros with a zero scale.
    let zero_block = k / BLOCK;
    assert_eq!(
        (portable.scales[zero_block], portable.sums[zero_block]),
        (0.0, 0.0)
    );
    assert!(portable.quants[k..k + 32].iter().all(|&q| q == 0));
    // The interleaved copies for the lane kernels: the AVX-512 quantiser writes its own, the
    // AVX2 one derives it from the values; both must be the same bytes.
    let mut interleaved: Option<(Kernel, QuantizedRows)> = None;
    for kernel in Kernel::available() {
        let mut fast = QuantizedRows::default();
        let mut without_lanes = QuantizedRows::default();
        without_lanes.quantize_with(kernel, &x, 3, k, false);
        assert!(!without_lanes.lanes_ready, "{kernel:?}");
        fast.quantize_with(kernel, &x, 3, k, true);
        // The offset corrections the tile kernels start from (AVX-512 quantisers only).
        let offsets: Vec<i32> = portable
            .quants
            .chunks_exact(BLOCK)
            .map(|q| -128 * q.iter().map(|&v| i32::from(v)).sum::<i32>())
            .collect();
        for rows in [&fast, &without_lanes] {
            assert_eq!(rows.scales, portable.scales, "{kernel:?}");
            assert_eq!(rows.sums, portable.sums, "{kernel:?}");
            assert_eq!(rows.quants, portable.quants, "{kernel:?}");
            if kernel.has_avx512() {
                assert_eq!(rows.offsets, offsets, "{kernel:?}");
            }
        }
        if !fast.lanes_ready {
            continue;
        }
        // Value v of block b (pair b / 2, block h = b % 2) sits at 16 · (v % 16 / 4) + 8h +
        // 4 · (v / 16) + v % 4 of its pair's 64 bytes.
        let pairs = (k / BLOCK).div_ceil(2);
        for (i, &q) in fast.quants.iter().enumerate() {
            let (row, b, v) = (i / k, (i % k) / BLOCK, i % BLOCK);
            let at = (row * pairs + b / 2) * LANE_PAIR_BYTES
                + 16 * (v % 16 / 4)
                + 8 * (b % 2)
                + 4 * (v / 16)
                + v % 4;
            assert_eq!(fast.lane_quants[at], q, "{kernel:?} value {i}");
        }
        match &interleaved {
            Some((first, other)) => {
                assert_eq!(fast.lane_quants, other.lane_quants, "{kernel:?} vs {first:?}");
                assert_eq!(fast.lane_scales, other.lane_scales, "{kernel:?} vs {first:?}");
                assert_eq!(fast.lane_offsets, other.lane_offsets, "{kernel:?} vs {first:?}");
            }
            None => interleaved = Some((kernel, fast)),
        }
    }
}

#[test]
fn quantising_for_the_matrices_at_hand_gives_the_same_products() {
    for format in FORMATS {
        let (m, n, k) = (5, 20, 512);
        let (_, packed) = matrix(format, n, k, 51);
        let x = random(m * k, 52);
        let mut rows = QuantizedRows::default();
        rows.quantize_for(&[&packed], &x, m);
        let mut out = vec![0f32; m * n];
        QuantMatrix::matmul_many_into(&[&packed], &rows, &mut [&mut out[..]], false);
        assert_eq!(out, packed.matmul(&x, m), "{format:?}");
    }
}

/// Every buffer of two quantisations is the same.
fn assert_same_buffers(got: &QuantizedRows, want: &QuantizedRows, case: &str) {
    assert_eq!(got.quants, want.quants, "{case}");
    assert_eq!(got.scales, want.scales, "{case}");
    assert_eq!(got.sums, want.sums, "{case}");
    assert_eq!(got.offsets, want.offsets, "{case}");
    assert_eq!(got.lane_quants, want.lane_quants, "{case}");
    assert_eq!(got.lane_scales, want.lane_scales, "{case}");
    assert_eq!(got.lane_offsets, want.lane_offsets, "{case}");
}

#[test]
fn rows_quantised_together_equal_each_row_alone() {
    // From PARALLEL_ROWS rows up, a pass's rows are quantised on every pool thread (two or
    // more on a multi-core machine), each thread writing its own rows' part of every buffer.
    // Widths of an even and an odd number of blocks (the lane copy's last pair half empty).
    for k in [192, 96] {
        for kernel in Kernel::available() {
            for lanes in [false, true] {
                for m in [1, 2, 5, PARALLEL_ROWS - 1, PARALLEL_ROWS, PARALLEL_ROWS + 3, 41] {
                    let x = random(m * k, 90 + m as u64);
                    let mut together = QuantizedRows::default();
                    together.quantize_with(kernel, &x, m, k, lanes);
                    let mut alone = QuantizedRows::default();
                    let mut concatenated = QuantizedRows::default();
                    for row in x.chunks_exact(k) {
                        alone.quantize_with(kernel, row, 1, k, lanes);
                        concatenated.quants.extend_from_slice(&alone.quants);
                        concatenated.scales.extend_from_slice(&alone.scales);
                        concatenated.sums.extend_from_slice(&alone.sums);
                        concatenated.offsets.extend_from_slice(&alone.offsets);
                        concatenated.lane_quants.extend_from_slice(&alone.lane_quants);
                        concatenated.lane_scales.extend_from_slice(&alone.lane_scales);
                        concatenated.lane_offsets.extend_from_slice(&alone.lane_offsets);
                    }
                    let case = format!("{kernel:?}, lanes {lanes}, {m} rows of {k}");
                    assert_eq!(
                        (together.m, together.lanes_ready),
                        (m, alone.lanes_ready),
                        "{case}"
                    );
                    assert_same_buffers(&together, &concatenated, &case);
                }
            }
        }
    }
}

#[test]
fn a_reused_quantisation_equals_a_fresh_one() {
    // Buffers are resized, not cleared: every quantiser must write each entry it owns.
    for kernel in Kernel::available() {
        for lanes in [false, true] {
            let mut reused = QuantizedRows::default();
            reused.quantize_with(
                kernel,
                &random(7 * 576, 71).iter().map(|v| v * 40.0).collect::<Vec<_>>(),
                7,
                576,
                lanes,
            );
            for (m, k) in [(3usize, 96usize), (2, 576), (5, 192)] {
                let x = random(m * k, 72 + m as u64);
                reused.quantize_with(kernel, &x, m, k, lanes);
                let mut fresh = QuantizedRows::default();
                fresh.quantize_with(kernel, &x, m, k, lanes);
                let case = format!("{kernel:?}, lanes {lanes}, {m} rows of {k}");
                assert_eq!(
                    (reused.m, reused.k, reused.blocks),
                    (fresh.m, fresh.k, fresh.blocks),
                    "{case}"
                );
                assert_same_buffers(&reused, &fresh, &case);
            }
        }
    }
}
