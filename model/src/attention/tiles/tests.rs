//! Tests of the tiled attention: it matches the per-row kernel and is batch-invariant.

use half::f16;

use super::super::{AttentionShape, SequenceAttention, attend};
use crate::kernels::Kernel;
use crate::kv_cache::{KEY_TILE, KeyLayout};

fn noise(len: usize, seed: usize) -> Vec<f32> {
    (0..len)
        .map(|i| (((i + seed) * 7919 + seed * 104_729) % 211) as f32 / 105.0 - 1.0)
        .collect()
}

fn noise16(len: usize, seed: usize) -> Vec<f16> {
    noise(len, seed).into_iter().map(f16::from_f32).collect()
}

/// `[position][kv][dim]` keys regrouped as `[tile][kv][dim][16]`.
fn tiled(keys: &[f16], positions: usize, width: usize) -> Vec<f16> {
    let mut out = vec![f16::ZERO; positions.div_ceil(KEY_TILE) * KEY_TILE * width];
    for p in 0..positions {
        for d in 0..width {
            out[(p / KEY_TILE) * KEY_TILE * width + d * KEY_TILE + p % KEY_TILE] = keys[p * width + d];
        }
    }
    out
}

struct Cache {
    keys: Vec<f16>,
    tiles: Vec<f16>,
    values: Vec<f16>,
    start: usize,
    n: usize,
}

/// The tiled attention with AVX-512 or AVX2 (`Some`), or the dispatching one (`None`).
fn run(
    shape: &AttentionShape,
    caches: &[&Cache],
    queries: &[f32],
    layout: KeyLayout,
    avx512: Option<bool>,
) -> Vec<f32> {
    let sequences: Vec<SequenceAttention<'_>> = caches
        .iter()
        .map(|c| SequenceAttention {
            keys: if layout == KeyLayout::Tiles {
                &c.tiles
            } else {
                &c.keys
            },
            key_layout: layout,
            values: &c.values,
            start: c.start,
            n: c.n,
        })
        .collect();
    let mut out = vec![0f32; queries.len()];
    match avx512 {
        None => attend(shape, queries, &sequences, &mut out),
        Some(avx512) => {
            let mut first_row = vec![0];
            for s in &sequences {
                first_row.push(first_row.last().unwrap() + s.n);
            }
            // SAFETY: the caller checked the CPU; sizes as `attend` checks them.
            unsafe { super::attend_with(avx512, shape, queries, &sequences, &first_row, &mut out) }
        }
    }
    out
}

#[test]
fn tiled_attention_matches_the_per_row_one_and_is_batch_invariant() {
    if Kernel::detect() == Kernel::Portable {
        eprintln!("no AVX2 here: tiled keys are never used on this CPU");
        return;
    }
    // AVX2 always; AVX-512 too where the CPU has it.
    let paths: &[bool] = if Kernel::detect().has_avx512() {
        &[false, true]
    } else {
        &[false]
    };
    for (hd, &avx512) in [64usize, 128]
        .into_iter()
        .flat_map(|hd| paths.iter().map(move |p| (hd, p)))
    {
        let shape = AttentionShape {
            n_head: 6,
            n_head_kv: 2,
            head_dim: hd,
        };
        let width = shape.n_head_kv * hd;
        // Short caches (one position block), and ones whose rows cross block boundaries
        // or start exactly at one (a prompt chunk among them).
        let caches: Vec<Cache> = [
            (37usize, 3usize),
            (0, 5),
            (20, 1),
            (15, 2),
            (150, 4),
            (0, 70),
            (63, 2),
            (128, 1),
        ]
        .iter()
        .enumerate()
        .map(|(s, &(start, n))| {
            let positions = start + n;
            let keys = noise16(positions * width, 11 + s);
            Cache {
                tiles: tiled(&keys, positions, width),
                keys,
                values: noise16(positions * width, 23 + s),
                start,
                n,
            }
        })
        .collect();
        let rows: usize = caches.iter().map(|c| c.n).sum();
        let queries = noise(rows * shape.n_head * hd, 5);
        let all: Vec<&Cache> = caches.iter().collect();
        let per_row = run(&shape, &all, &queries, KeyLayout::Positions, None);
        let together = run(&shape, &all, &queries, KeyLayout::Tiles, Some(avx512));
        for (i, (a, b)) in together.iter().zip(&per_row).enumerate() {
            assert!((a - b).abs() <= 1e-5, "hd {hd} avx512 {avx512} [{i}]: {a} vs {b}");
        }
        // Every row alone (its sequence's cache cut to what it sees) gives the same bits.
        let row_floats = shape.n_head * hd;
        let mut row = 0;
        for cache in &caches {
            for i in 0..cache.n {
                let alone = Cache {
                    keys: cache.keys.clone(),
                    tiles: cache.tiles.clone(),
                    values: cache.values.clone(),
                    start: cache.start + i,
                    n: 1,
                };
                let q = &queries[row * row_floats..(row + 1) * row_floats];
                let got = run(&shape, &[&alone], q, KeyLayout::Tiles, Some(avx512));
                assert_eq!(
                    got,
                    together[row * row_floats..(row + 1) * row_floats],
                    "hd {hd} avx512 {avx512} row {row}"
                );
                row += 1;
            }
        }
    }
}
