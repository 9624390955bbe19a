//! Plain Rust kernels: the fallback on CPUs without the SIMD features, and the reference the
//! SIMD versions are tested against.

// Kernels walk several parallel arrays (scales, quants, rows) by block and row index.
#![allow(clippy::needless_range_loop)]

use super::{BLOCK, QuantizedRows, to_f32};

pub fn q4(
    scales: &[u16],
    mins: &[u16],
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
            acc += to_f32(scales[b]) * x.scales[r * nb + b] * sumi as f32;
            summ += to_f32(mins[b]) * x.sums[r * nb + b];
        }
        out[t] = acc + summ;
    }
}

pub fn q8(scales: &[u16], quants: &[u8], x: &QuantizedRows, r0: usize, count: usize, out: &mut [f32]) {
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
            acc += to_f32(scales[b]) * x.scales[r * nb + b] * sumi as f32;
        }
        out[t] = acc;
    }
}

/// As [`q8`] with a scale per 16 values (two per block).
pub fn q8x16(scales: &[u16], quants: &[u8], x: &QuantizedRows, r0: usize, count: usize, out: &mut [f32]) {
    let nb = x.blocks;
    for t in 0..count {
        let r = r0 + t;
        let mut acc = 0f32;
        for b in 0..nb {
            let xq = &x.quants[(r * nb + b) * BLOCK..(r * nb + b + 1) * BLOCK];
            let mut halves = 0f32;
            for h in 0..2 {
                let w = &quants[b * BLOCK + 16 * h..b * BLOCK + 16 * h + 16];
                let sumi: i32 = w
                    .iter()
                    .zip(&xq[16 * h..16 * h + 16])
                    .map(|(&a, &b)| i32::from(a as i8) * i32::from(b))
                    .sum();
                halves += to_f32(scales[2 * b + h]) * sumi as f32;
            }
            acc += x.scales[r * nb + b] * halves;
        }
        out[t] = acc;
    }
}
