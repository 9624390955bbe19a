//! `cargo bench -p specd-model --bench attention`: the cost of one pass's attention (30
//! layers of SmolLM2-135M's shape: 9 query heads, 3 KV heads of 64) over caches at a given
//! depth, for n scored rows of one sequence and for several sequences decoding together. It
//! is the phase whose cost grows with depth and with sessions in a batch: the KV cache (f16,
//! ~23 KB per position) is read once per pass, as the weights are.
//!
//! Before each run the CPU caches are flushed by streaming 64 MB, as a real pass's weight
//! stream evicts the KV cache between one pass and the next. Each figure is the minimum
//! over repetitions. `SPECD_BENCH_THREADS` sets the thread count (default 1),
//! `SPECD_BENCH_REPS` the repetitions (default 15), `SPECD_BENCH_DEPTH` the depth (256);
//! `SPECD_BENCH_FLUSH=0` keeps the caches warm instead (what is left is the arithmetic, as
//! far as the caches fit the CPU's).

use std::time::Instant;

use half::f16;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use specd_model::attention::{AttentionShape, SequenceAttention, attend};
use specd_model::kv_cache::{KEY_TILE, KeyLayout};

const LAYERS: usize = 30;
const SHAPE: AttentionShape = AttentionShape {
    n_head: 9,
    n_head_kv: 3,
    head_dim: 64,
};

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn random(len: usize, rng: &mut ChaCha8Rng) -> Vec<f32> {
    (0..len).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

fn random16(len: usize, rng: &mut ChaCha8Rng) -> Vec<f16> {
    random(len, rng).into_iter().map(f16::from_f32).collect()
}

/// One sequence's cache for every layer, holding `positions` positions.
struct Cache {
    layers: Vec<(Vec<f16>, Vec<f16>)>,
}

impl Cache {
    fn new(positions: usize, layout: KeyLayout, rng: &mut ChaCha8Rng) -> Self {
        let width = SHAPE.n_head_kv * SHAPE.head_dim;
        let key_positions = match layout {
            KeyLayout::Tiles => positions.div_ceil(KEY_TILE) * KEY_TILE,
            KeyLayout::Positions => positions,
        };
        Self {
            layers: (0..LAYERS)
                .map(|_| {
                    (
                        random16(key_positions * width, rng),
                        random16(positions * width, rng),
                    )
                })
                .collect(),
        }
    }
}

/// Milliseconds of the fastest of `reps` passes (30 layers) of attention for `n` new rows of
/// each cache, after `depth` cached positions.
fn pass_ms(
    caches: &[Cache],
    layout: KeyLayout,
    depth: usize,
    n: usize,
    reps: usize,
    flush: &mut [u8],
) -> f64 {
    let row_floats = SHAPE.n_head * SHAPE.head_dim;
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let queries = random(caches.len() * n * row_floats, &mut rng);
    let mut out = vec![0f32; queries.len()];
    (0..reps)
        .map(|rep| {
            // Evict the caches (a real pass streams ~100 MB of weights between two passes).
            // An empty flush buffer keeps them warm.
            for (i, b) in flush.iter_mut().enumerate().step_by(64) {
                *b = b.wrapping_add((i + rep) as u8);
            }
            let started = Instant::now();
            for layer in 0..LAYERS {
                let sequences: Vec<SequenceAttention<'_>> = caches
                    .iter()
                    .map(|c| SequenceAttention {
                        keys: &c.layers[layer].0,
                        key_layout: layout,
                        values: &c.layers[layer].1,
                        start: depth,
                        n,
                    })
                    .collect();
                attend(&SHAPE, &queries, &sequences, &mut out);
            }
            started.elapsed().as_secs_f64() * 1e3
        })
        .fold(f64::INFINITY, f64::min)
}

fn main() {
    let threads = env("SPECD_BENCH_THREADS", 1);
    let reps = env("SPECD_BENCH_REPS", 15);
    let depth = env("SPECD_BENCH_DEPTH", 256);
    specd_model::set_compute_threads(threads);
    let layout = KeyLayout::for_this_cpu(SHAPE.head_dim);
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let flushed = env("SPECD_BENCH_FLUSH", 1) != 0;
    let mut flush = vec![0u8; if flushed { 64 << 20 } else { 0 }];
    println!(
        "attention: {layout:?} keys · depth {depth} · {threads} thread(s) · minimum of {reps} runs · 30 layers · caches {}",
        if flushed { "flushed" } else { "warm" }
    );
    println!(
        "{:>9} {:>5} {:>10} {:>8} {:>12}",
        "sequences", "rows", "ms", "x n=1", "ms per row"
    );
    for sequences in [1usize, 16] {
        let caches: Vec<Cache> = (0..sequences)
            .map(|_| Cache::new(depth + 16, layout, &mut rng))
            .collect();
        let rows: &[usize] = if sequences == 1 {
            &[1, 2, 3, 4, 5, 8, 16]
        } else {
            &[1, 4]
        };
        let mut base = None;
        for &n in rows {
            let ms = pass_ms(&caches, layout, depth, n, reps, &mut flush);
            let ms1 = *base.get_or_insert(ms);
            let per_row = if n > 1 {
                format!("{:.3}", (ms - ms1) / (n - 1) as f64)
            } else {
                "-".into()
            };
            println!("{sequences:>9} {n:>5} {ms:>10.3} {:>8.2} {per_row:>12}", ms / ms1);
        }
    }
}
