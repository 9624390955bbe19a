//! Kernel tests on random data against a plain f64 reference, for odd shapes and tails, plus
//! batch invariance (a row's result does not depend on how many rows came with it).

use candle_core::{Device, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use super::*;

fn random(len: usize, seed: u64) -> Vec<f32> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    (0..len).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

fn matrix(format: GgmlDType, n: usize, k: usize, seed: u64) -> (QTensor, QuantMatrix) {
    let t = Tensor::from_vec(random(n * k, seed), (n, k), &Device::Cpu).unwrap();
    let q = QTensor::quantize(&t, format).unwrap();
    let packed = QuantMatrix::from_qtensor(&q).expect("supported format");
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

const SHAPES: [(usize, usize, usize); 7] = [
    (1, 1, 32),
    (1, 5, 64),
    (3, 7, 96),
    (8, 9, 128),
    (9, 13, 608),
    (17, 4, 1536),
    (2, 37, 576),
];

#[test]
fn kernels_match_the_reference_on_odd_shapes() {
    for format in [GgmlDType::Q4_1, GgmlDType::Q8_0] {
        for (s, &(m, n, k)) in SHAPES.iter().enumerate() {
            let (q, packed) = matrix(format, n, k, s as u64);
            let x = random(m * k, 100 + s as u64);
            let got = packed.matmul(&x, m);
            let (want, mag) = reference(&q, &packed, &x, m);
            for i in 0..m * n {
                // Q8_1's sum term travels as f16 (as in llama.cpp): ~1e-3 relative.
                let bound = 2e-3 * mag[i] + 1e-4;
                assert!(
                    (got[i] as f64 - want[i]).abs() <= bound,
                    "{format:?} m{m} n{n} k{k} [{i}]: {} vs {} (bound {bound})",
                    got[i],
                    want[i]
                );
            }
        }
    }
}

#[test]
fn portable_and_simd_kernels_agree() {
    if Kernel::detect() != Kernel::Avx2 {
        return; // only one implementation runs on this CPU; the reference test covers it
    }
    for format in [GgmlDType::Q4_1, GgmlDType::Q8_0] {
        let (m, n, k) = (5, 11, 608);
        let (_, packed) = matrix(format, n, k, 7);
        let x = packed.quantize(&random(m * k, 8), m);
        for j in 0..n {
            let (mut simd, mut portable) = ([0f32; ROW_TILE], [0f32; ROW_TILE]);
            packed.column(Kernel::Avx2, j, &x, 0, m, &mut simd);
            packed.column(Kernel::Portable, j, &x, 0, m, &mut portable);
            for t in 0..m {
                assert!(
                    (simd[t] - portable[t]).abs() <= 1e-4 * simd[t].abs().max(1.0),
                    "{format:?} {j} {t}"
                );
            }
        }
    }
}

#[test]
fn results_are_batch_invariant() {
    for format in [GgmlDType::Q4_1, GgmlDType::Q8_0] {
        let (m, n, k) = (13, 21, 576);
        let (_, packed) = matrix(format, n, k, 3);
        let x = random(m * k, 4);
        let together = packed.matmul(&x, m);
        for r in 0..m {
            let alone = packed.matmul(&x[r * k..(r + 1) * k], 1);
            assert_eq!(
                &together[r * n..(r + 1) * n],
                alone.as_slice(),
                "{format:?} row {r}"
            );
        }
    }
}

#[test]
fn other_formats_are_left_to_candle() {
    let t = Tensor::from_vec(random(64, 1), (2, 32), &Device::Cpu).unwrap();
    assert!(QuantMatrix::from_qtensor(&QTensor::quantize(&t, GgmlDType::Q4_0).unwrap()).is_none());
}

#[test]
fn several_matrices_at_once_equal_each_alone() {
    let (m, k) = (3, 576);
    let (_, a) = matrix(GgmlDType::Q4_1, 17, k, 5);
    let (_, b) = matrix(GgmlDType::Q4_1, 9, k, 6);
    let x = random(m * k, 7);
    let both = QuantMatrix::matmul_many(&[&a, &b], &x, m);
    assert_eq!(both[0], a.matmul(&x, m));
    assert_eq!(both[1], b.matmul(&x, m));
    let (_, c) = matrix(GgmlDType::Q8_0, 9, k, 8);
    assert!(!QuantMatrix::compatible(&[&a, &c]));
}
