//! The llama forward pass on the CPU over plain f32 buffers. The activation buffers of a
//! pass are in a [`Scratch`] sized once and reused (what is still allocated per op is a few
//! small index lists, and per pass the final rows and the logits): RMS norm feeds
//! one int8 quantisation of the activations shared by every matrix that reads them (Q, K
//! and V in one pass over the thread pool; gate and up in another), rotary embedding is
//! applied in place, SiLU·up is one loop, and the attention output and FFN products are
//! added straight into the residual stream. Attention for every sequence of a batch is one
//! pass over the pool. The row-by-row phases (norms, quantisation, rotary, SiLU) run on one
//! thread for a few rows and over the pool for many (a prompt chunk, a large batch; see
//! [`for_row_ranges`]). An optional [`ForwardProfile`] times each phase.

use std::time::Instant;

use candle_core::Tensor;

use crate::attention::{AttentionShape, SequenceAttention, attend};
use crate::error::Result;
use crate::kernels::{PARALLEL_ROWS, QuantMatrix, QuantizedRows, SendPtr, for_row_ranges};
use crate::llama::{Linear, Llama, SequenceStep};

mod elementwise;

use elementwise::{rms_norm, rotate, silu_mul_rows};

/// Buffers of one forward pass, reused from pass to pass.
#[derive(Default)]
pub(crate) struct Scratch {
    x: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    attn: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    staging: Staging,
    profile: Option<ForwardProfile>,
}

/// Where the calling thread makes a product's activations, and quantises them, when it makes
/// them for every thread (16 rows and more, or matrices candle multiplies).
#[derive(Default)]
struct Staging {
    values: Vec<f32>,
    quantized: QuantizedRows,
}

/// The activations a product reads, as what writes them (`rows × width` values into the
/// buffer it is given), so that for a few rows each pool thread makes its own (see
/// [`QuantMatrix::matmul_many_from`]).
struct Activations<'a> {
    write: &'a (dyn Fn(&mut [f32]) + Sync),
    width: usize,
    /// The phase their making counts under when the calling thread makes them (none: the
    /// product's own).
    phase: Option<Phase>,
}

/// The phases a forward pass is timed by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Embedding,
    RmsNorm,
    /// Only in passes of [`PARALLEL_ROWS`] rows or more, as the norms and SiLU: fewer rows
    /// are made and quantised by each thread inside the product that reads them, and
    /// counted there.
    QuantizeActivations,
    QkvMatmul,
    Rotary,
    CacheWrite,
    Attention,
    OutputMatmul,
    GateUpMatmul,
    SiluMul,
    DownMatmul,
    LmHead,
}

impl Phase {
    pub const ALL: [Phase; 12] = [
        Phase::Embedding,
        Phase::RmsNorm,
        Phase::QuantizeActivations,
        Phase::QkvMatmul,
        Phase::Rotary,
        Phase::CacheWrite,
        Phase::Attention,
        Phase::OutputMatmul,
        Phase::GateUpMatmul,
        Phase::SiluMul,
        Phase::DownMatmul,
        Phase::LmHead,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Phase::Embedding => "embedding lookup",
            Phase::RmsNorm => "rms norm",
            Phase::QuantizeActivations => "quantise activations",
            Phase::QkvMatmul => "matmul q/k/v",
            Phase::Rotary => "rotary",
            Phase::CacheWrite => "kv cache write",
            Phase::Attention => "attention",
            Phase::OutputMatmul => "matmul attn output",
            Phase::GateUpMatmul => "matmul ffn gate/up",
            Phase::SiluMul => "silu * up",
            Phase::DownMatmul => "matmul ffn down",
            Phase::LmHead => "final norm + lm head",
        }
    }
}

/// Seconds spent per phase over the profiled passes, and how many thread-pool dispatches
/// they made.
#[derive(Debug, Clone, Default)]
pub struct ForwardProfile {
    pub seconds: [f64; Phase::ALL.len()],
    pub passes: u64,
    pub tokens: u64,
    pub pool_dispatches: u64,
    pub total_seconds: f64,
}

impl ForwardProfile {
    pub fn phase(&self, phase: Phase) -> f64 {
        self.seconds[phase as usize]
    }

    /// Adds another profile's passes to this one.
    pub fn add(&mut self, other: &ForwardProfile) {
        for (total, s) in self.seconds.iter_mut().zip(other.seconds) {
            *total += s;
        }
        self.passes += other.passes;
        self.tokens += other.tokens;
        self.pool_dispatches += other.pool_dispatches;
        self.total_seconds += other.total_seconds;
    }
}

/// Laps of one pass, recorded only while profiling.
struct Laps {
    last: Instant,
    start: Instant,
    on: bool,
    seconds: [f64; Phase::ALL.len()],
    dispatches: u64,
}

impl Laps {
    fn new(on: bool) -> Self {
        let now = Instant::now();
        Self {
            last: now,
            start: now,
            on,
            seconds: [0.0; Phase::ALL.len()],
            dispatches: 0,
        }
    }

    fn lap(&mut self, phase: Phase, dispatches: u64) {
        if self.on {
            let now = Instant::now();
            self.seconds[phase as usize] += (now - self.last).as_secs_f64();
            self.dispatches += dispatches;
            self.last = now;
        }
    }

    fn finish(self, tokens: usize, profile: &mut Option<ForwardProfile>) {
        if let (true, Some(p)) = (self.on, profile.as_mut()) {
            for (total, s) in p.seconds.iter_mut().zip(self.seconds) {
                *total += s;
            }
            p.passes += 1;
            p.tokens += tokens as u64;
            p.pool_dispatches += self.dispatches;
            p.total_seconds += self.start.elapsed().as_secs_f64();
        }
    }
}

/// Products of the same activations with several linears into `outs`. Packed matrices share
/// one quantisation and one pool pass: for a few rows each pool thread makes and quantises
/// the activations itself (see [`QuantMatrix::matmul_many_from`]), else this thread does,
/// once, into `staging`. Other formats go through candle one at a time. Returns the pool
/// dispatches made.
fn project(
    linears: &[&Linear],
    activations: Activations<'_>,
    rows: usize,
    staging: &mut Staging,
    outs: &mut [&mut [f32]],
    accumulate: bool,
    laps: &mut Laps,
) -> Result<u64> {
    let packed: Vec<&QuantMatrix> = linears
        .iter()
        .filter_map(|l| match l {
            Linear::Packed(m) => Some(m),
            Linear::Candle { .. } => None,
        })
        .collect();
    let all_packed = packed.len() == linears.len() && QuantMatrix::compatible(&packed);
    if all_packed && rows < PARALLEL_ROWS {
        QuantMatrix::matmul_many_from(&packed, rows, activations.write, outs, accumulate);
        return Ok(1);
    }
    let Staging { values, quantized } = staging;
    values.resize(rows * activations.width, 0.0);
    (activations.write)(values);
    if let Some(phase) = activations.phase {
        laps.lap(phase, 0);
    }
    let input = &values[..];
    if !packed.is_empty() {
        quantized.quantize_for(&packed, input, rows);
        laps.lap(Phase::QuantizeActivations, 0);
    }
    if all_packed {
        QuantMatrix::matmul_many_into(&packed, quantized, outs, accumulate);
        return Ok(1);
    }
    let mut dispatches = 0;
    for (linear, out) in linears.iter().zip(outs.iter_mut()) {
        match linear {
            Linear::Packed(m) => {
                QuantMatrix::matmul_many_into(&[m], quantized, &mut [&mut **out], accumulate);
                dispatches += 1;
            }
            Linear::Candle { .. } => {
                let x = Tensor::from_slice(input, (rows, input.len() / rows), &candle_core::Device::Cpu)?;
                let y = linear.forward(&x)?.flatten_all()?.to_vec1::<f32>()?;
                if accumulate {
                    out.iter_mut().zip(&y).for_each(|(o, v)| *o += v);
                } else {
                    out.copy_from_slice(&y);
                }
            }
        }
    }
    Ok(dispatches)
}

/// One batched forward pass on the host (see [`Llama::forward`]); returns the logits rows
/// `[wanted, vocab]` in step order.
pub(crate) fn forward(model: &Llama, steps: &mut [SequenceStep<'_>]) -> Result<Vec<f32>> {
    let mut guard = model.scratch.lock().unwrap_or_else(|e| e.into_inner());
    let s = &mut *guard;
    let cfg = model.config();
    let (d, ff, hd) = (cfg.n_embd, cfg.n_ff, cfg.head_dim);
    let (qd, kvd) = (cfg.n_head * hd, cfg.n_head_kv * hd);
    let total: usize = steps.iter().map(|st| st.tokens.len()).sum();
    let mut laps = Laps::new(s.profile.is_some());
    for (buf, width) in [
        (&mut s.x, d),
        (&mut s.q, qd),
        (&mut s.k, kvd),
        (&mut s.v, kvd),
        (&mut s.attn, qd),
        (&mut s.gate, ff),
        (&mut s.up, ff),
    ] {
        buf.resize(total * width, 0.0);
    }
    let mut row = 0;
    for step in steps.iter() {
        for &token in step.tokens {
            model.embed(token, &mut s.x[row * d..(row + 1) * d])?;
            row += 1;
        }
    }
    laps.lap(Phase::Embedding, 0);
    // Each row's position in its sequence (for the rotary embedding).
    let positions: Vec<usize> = steps
        .iter()
        .flat_map(|step| step.cache.len()..step.cache.len() + step.tokens.len())
        .collect();
    let eps = cfg.rms_eps as f32;
    let half = cfg.rope_dim / 2;
    let shape = AttentionShape {
        n_head: cfg.n_head,
        n_head_kv: cfg.n_head_kv,
        head_dim: hd,
    };
    for (layer, block) in model.blocks.iter().enumerate() {
        let attention_norm = |out: &mut [f32]| rms_norm(&s.x, &block.attn_norm_host, eps, out);
        let n = project(
            &[&block.wq, &block.wk, &block.wv],
            Activations {
                write: &attention_norm,
                width: d,
                phase: Some(Phase::RmsNorm),
            },
            total,
            &mut s.staging,
            &mut [&mut s.q, &mut s.k, &mut s.v],
            false,
            &mut laps,
        )?;
        laps.lap(Phase::QkvMatmul, n);
        let (q, k) = (SendPtr(s.q.as_mut_ptr()), SendPtr(s.k.as_mut_ptr()));
        for_row_ranges(total, |rows| {
            for (row, &position) in rows.clone().zip(&positions[rows]) {
                let p = position * half;
                let (cos, sin) = (
                    &model.rope_cos_host[p..p + half],
                    &model.rope_sin_host[p..p + half],
                );
                // SAFETY: each row goes to one thread, and its q and k values lie in the
                // buffers (sized for `total` rows above).
                let (q_row, k_row) = unsafe {
                    (
                        q.slice(row * qd..(row + 1) * qd),
                        k.slice(row * kvd..(row + 1) * kvd),
                    )
                };
                rotate(q_row, hd, cfg.rope_dim, cos, sin);
                rotate(k_row, hd, cfg.rope_dim, cos, sin);
            }
        });
        laps.lap(Phase::Rotary, 0);
        let mut row = 0;
        for step in steps.iter_mut() {
            let (start, n) = (step.cache.len(), step.tokens.len());
            let rows = row * kvd..(row + n) * kvd;
            step.cache
                .write_host(layer, start, &s.k[rows.clone()], &s.v[rows])?;
            row += n;
        }
        laps.lap(Phase::CacheWrite, 0);
        let sequences = steps
            .iter()
            .map(|step| {
                let (keys, values) = step.cache.host_layer(layer)?;
                Ok(SequenceAttention {
                    keys,
                    key_layout: step.cache.key_layout(),
                    values,
                    start: step.cache.len(),
                    n: step.tokens.len(),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        attend(&shape, &s.q, &sequences, &mut s.attn);
        laps.lap(Phase::Attention, 1);
        let attention_out = |out: &mut [f32]| out.copy_from_slice(&s.attn);
        let n = project(
            &[&block.wo],
            Activations {
                write: &attention_out,
                width: qd,
                phase: None,
            },
            total,
            &mut s.staging,
            &mut [&mut s.x],
            true,
            &mut laps,
        )?;
        laps.lap(Phase::OutputMatmul, n);
        let ffn_norm = |out: &mut [f32]| rms_norm(&s.x, &block.ffn_norm_host, eps, out);
        let n = project(
            &[&block.w_gate, &block.w_up],
            Activations {
                write: &ffn_norm,
                width: d,
                phase: Some(Phase::RmsNorm),
            },
            total,
            &mut s.staging,
            &mut [&mut s.gate, &mut s.up],
            false,
            &mut laps,
        )?;
        laps.lap(Phase::GateUpMatmul, n);
        let silu_times_up = |out: &mut [f32]| {
            out.copy_from_slice(&s.gate);
            silu_mul_rows(out, &s.up, ff);
        };
        let n = project(
            &[&block.w_down],
            Activations {
                write: &silu_times_up,
                width: ff,
                phase: Some(Phase::SiluMul),
            },
            total,
            &mut s.staging,
            &mut [&mut s.x],
            true,
            &mut laps,
        )?;
        laps.lap(Phase::DownMatmul, n);
    }
    // Only the requested rows go through the final norm and the (large) LM head.
    let wanted = crate::llama::logit_rows(steps);
    let vocab = cfg.vocab_size;
    let mut logits = vec![0f32; wanted.len() * vocab];
    if !wanted.is_empty() {
        let selected: Vec<f32> = wanted
            .iter()
            .flat_map(|&r| s.x[r * d..(r + 1) * d].iter().copied())
            .collect();
        let output_norm = |out: &mut [f32]| rms_norm(&selected, &model.output_norm_host, eps, out);
        let n = project(
            &[&model.lm_head],
            Activations {
                write: &output_norm,
                width: d,
                phase: None,
            },
            wanted.len(),
            &mut s.staging,
            &mut [logits.as_mut_slice()],
            false,
            &mut laps,
        )?;
        laps.lap(Phase::LmHead, n);
    }
    laps.finish(total, &mut s.profile);
    Ok(logits)
}

impl Llama {
    /// Starts (or restarts) timing every forward pass by phase.
    pub fn start_profile(&self) {
        self.scratch.lock().unwrap_or_else(|e| e.into_inner()).profile = Some(ForwardProfile::default());
    }

    /// The profile since [`Llama::start_profile`], and stops profiling.
    pub fn take_profile(&self) -> Option<ForwardProfile> {
        self.scratch
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .profile
            .take()
    }
}

/// Seconds one empty dispatch over the thread pool takes (median of many): the fixed cost
/// each matmul and attention call pays before any work.
pub fn pool_dispatch_seconds() -> f64 {
    let pool = candle_core::utils::barrier_pool();
    let mut samples: Vec<f64> = (0..31)
        .map(|_| {
            let started = Instant::now();
            for _ in 0..100 {
                pool.execute_chunked(2, |items| {
                    std::hint::black_box(items);
                });
            }
            started.elapsed().as_secs_f64() / 100.0
        })
        .collect();
    samples.sort_by(f64::total_cmp);
    samples[samples.len() / 2]
}
