//! `cargo bench -p specd-model --bench kernels`: the cost of multiplying m activation rows
//! by a model's worth of quantized weights, for m = 1..16, 32 and 64 (a prompt chunk), on one
//! thread (`SPECD_BENCH_THREADS` sets another count: the verifier runs on every core by
//! default; `SPECD_BENCH_ROWS=1,8` measures only those row counts, the first the base of the
//! ratios). It is the curve that decides what speculation and batching can gain: scoring
//! K + 1 tokens (or K + 1 sessions) in one pass pays only as far as an extra row costs less
//! than a whole pass; beyond 16 rows (one row tile) it is what a prompt token costs.
//!
//! The weights are SmolLM2-135M's shapes and formats (30 layers of Q4_1 feed-forward
//! matrices, 576 → 1536 → 576, and a Q8_0 LM head of 49152 × 576), random, so the sweep
//! streams ~80 MB from memory as a real pass does. Each figure is the minimum over
//! repetitions (the least disturbed run on a shared machine). The last column is the
//! quantisation of a pass's activations alone (per layer three 576-wide inputs and one
//! 1536-wide one, plus the LM head's), which runs on one thread before each product.
//!
//! The column "lm head, cold" times the LM head right after the feed-forward sweep, as a
//! real pass runs it, and takes the median: its weights have been pushed out of the nearer
//! caches by the others, which makes every extra row dearer than the warm minimum says.

use std::time::Instant;

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use specd_model::kernels::{Kernel, QuantMatrix, QuantizedRows};

const LAYERS: usize = 30;
const HIDDEN: usize = 576;
const FFN: usize = 1536;
const VOCAB: usize = 49152;
const ROWS: [usize; 12] = [1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 32, 64];

fn random(len: usize, rng: &mut ChaCha8Rng) -> Vec<f32> {
    (0..len).map(|_| rng.random_range(-1.0f32..1.0)).collect()
}

fn matrix(format: GgmlDType, n: usize, k: usize, rng: &mut ChaCha8Rng) -> QuantMatrix {
    let t = Tensor::from_vec(random(n * k, rng), (n, k), &Device::Cpu).expect("tensor");
    let q = QTensor::quantize(&t, format).expect("quantize");
    QuantMatrix::from_qtensor(&q).expect("supported format")
}

/// Seconds of the fastest of `reps` runs of `f`.
fn fastest(reps: usize, mut f: impl FnMut()) -> f64 {
    (0..reps)
        .map(|_| {
            let started = Instant::now();
            f();
            started.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min)
}

fn main() {
    let env = |name: &str, default: usize| -> usize {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    let threads = env("SPECD_BENCH_THREADS", 1).max(1);
    specd_model::set_compute_threads(threads);
    let reps = env("SPECD_BENCH_REPS", 15);
    let rows: Vec<usize> = match std::env::var("SPECD_BENCH_ROWS") {
        Ok(list) => list
            .split(',')
            .map(|m| m.trim().parse().expect("SPECD_BENCH_ROWS: row counts, e.g. 1,8"))
            .collect(),
        Err(_) => ROWS.to_vec(),
    };
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let layers: Vec<[QuantMatrix; 3]> = (0..LAYERS)
        .map(|_| {
            [
                matrix(GgmlDType::Q4_1, FFN, HIDDEN, &mut rng),
                matrix(GgmlDType::Q4_1, FFN, HIDDEN, &mut rng),
                matrix(GgmlDType::Q4_1, HIDDEN, FFN, &mut rng),
            ]
        })
        .collect();
    let head = matrix(GgmlDType::Q8_0, VOCAB, HIDDEN, &mut rng);
    println!(
        "kernels: {} · {threads} thread(s) · minimum of {reps} runs",
        Kernel::detect().name()
    );
    println!(
        "{:>4} {:>12} {:>8} {:>12} {:>12} {:>8} {:>12} {:>16} {:>8} {:>12}",
        "rows",
        "ffn ms",
        "x m=1",
        "ms per row",
        "lm head ms",
        "x m=1",
        "ms per row",
        "lm head, cold ms",
        "x m=1",
        "quantise ms"
    );
    let mut base: Option<(f64, f64, f64)> = None;
    for m in rows {
        let x_hidden = random(m * HIDDEN, &mut rng);
        let x_ffn = random(m * FFN, &mut rng);
        let (mut hidden_rows, mut ffn_rows) = (QuantizedRows::default(), QuantizedRows::default());
        let mut gate_up = [vec![0f32; m * FFN], vec![0f32; m * FFN]];
        let mut down = vec![0f32; m * HIDDEN];
        // The feed-forward matrices of every layer, as a pass multiplies them.
        let mut sweep = |hidden_rows: &mut QuantizedRows| {
            for [gate, up, down_w] in &layers {
                hidden_rows.quantize_for(&[gate, up], &x_hidden, m);
                let [g, u] = &mut gate_up;
                QuantMatrix::matmul_many_into(&[gate, up], hidden_rows, &mut [g, u], false);
                ffn_rows.quantize_for(&[down_w], &x_ffn, m);
                QuantMatrix::matmul_many_into(&[down_w], &ffn_rows, &mut [&mut down], false);
            }
        };
        let ffn = fastest(reps, || sweep(&mut hidden_rows));
        let mut logits = vec![0f32; m * VOCAB];
        let lm = fastest(reps, || {
            hidden_rows.quantize_for(&[&head], &x_hidden, m);
            QuantMatrix::matmul_many_into(&[&head], &hidden_rows, &mut [&mut logits], false);
        });
        let mut cold: Vec<f64> = (0..reps)
            .map(|_| {
                sweep(&mut hidden_rows);
                hidden_rows.quantize_for(&[&head], &x_hidden, m);
                let started = Instant::now();
                QuantMatrix::matmul_many_into(&[&head], &hidden_rows, &mut [&mut logits], false);
                started.elapsed().as_secs_f64()
            })
            .collect();
        cold.sort_by(f64::total_cmp);
        let lm_cold = cold[cold.len() / 2];
        let quantise = fastest(reps, || {
            for [gate, up, down_w] in &layers {
                for _ in 0..3 {
                    hidden_rows.quantize_for(&[gate, up], &x_hidden, m);
                }
                ffn_rows.quantize_for(&[down_w], &x_ffn, m);
            }
            hidden_rows.quantize_for(&[&head], &x_hidden, m);
        });
        let (ffn1, lm1, cold1) = *base.get_or_insert((ffn, lm, lm_cold));
        let per_row = |t: f64, t1: f64| {
            if m > 1 {
                format!("{:.3}", (t - t1) * 1e3 / (m - 1) as f64)
            } else {
                "-".into()
            }
        };
        println!(
            "{m:>4} {:>12.3} {:>8.2} {:>12} {:>12.3} {:>8.2} {:>12} {:>16.3} {:>8.2} {:>12.3}",
            ffn * 1e3,
            ffn / ffn1,
            per_row(ffn, ffn1),
            lm * 1e3,
            lm / lm1,
            per_row(lm, lm1),
            lm_cold * 1e3,
            lm_cold / cold1,
            quantise * 1e3
        );
    }
}
