//! Causal attention over host KV caches (f16, converted to f32 as they are read): dot
//! products with exactly the keys a query row may see, softmax, weighted sum of values. Over tiled keys (AVX-512 or AVX2, see [`tiles`]) the rows
//! reading one KV head share its loads; otherwise (portable code) each (query row, head) runs alone. Each
//! row's result is computed by the same code whatever else is in the pass, so verifying K
//! drafts in one pass gives bit-identical results to decoding them one by one, alone or
//! batched with other sequences. All rows of all sequences of a pass are one pass over
//! candle's thread pool.

use half::f16;
use half::slice::HalfFloatSliceExt;

use crate::kernels::SendPtr;
use crate::kv_cache::KeyLayout;

#[cfg(target_arch = "x86_64")]
mod tiles;
#[cfg(target_arch = "x86_64")]
pub(crate) use tiles::{exp8, exp16};

/// Shapes of one attention call.
pub struct AttentionShape {
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
}

/// One sequence's part of a pass: its cache (f16 values `[position][kv_head][head_dim]`,
/// f16 keys in `key_layout`, holding positions `0..start + n`) and its `n` new query rows,
/// which follow the previous sequence's rows in the query matrix.
pub struct SequenceAttention<'a> {
    pub keys: &'a [f16],
    pub key_layout: KeyLayout,
    pub values: &'a [f16],
    pub start: usize,
    pub n: usize,
}

/// `queries`: `[rows][n_head * head_dim]` (rotated), rows of every sequence in order;
/// writes `out`: `[rows][n_head * head_dim]`.
pub fn attend(shape: &AttentionShape, queries: &[f32], sequences: &[SequenceAttention<'_>], out: &mut [f32]) {
    let (nh, nkv, hd) = (shape.n_head, shape.n_head_kv, shape.head_dim);
    let group = nh / nkv;
    let scale = 1.0 / (hd as f32).sqrt();
    let mut first_row = Vec::with_capacity(sequences.len() + 1);
    let mut rows = 0;
    for seq in sequences {
        first_row.push(rows);
        rows += seq.n;
    }
    first_row.push(rows);
    assert!(
        queries.len() == rows * nh * hd && out.len() == rows * nh * hd,
        "queries and output must be [rows, n_head * head_dim]"
    );
    if sequences.iter().any(|s| s.key_layout == KeyLayout::Tiles) {
        assert!(
            sequences.iter().all(|s| s.key_layout == KeyLayout::Tiles)
                && crate::kernels::Kernel::detect() != crate::kernels::Kernel::Portable,
            "tiled keys need the AVX-512 or AVX2 attention, for every sequence of the pass"
        );
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the CPU has AVX-512, or AVX2 and FMA (detected above); sizes are checked
        // above.
        unsafe {
            tiles::attend(shape, queries, sequences, &first_row, out)
        };
        return;
    }
    let out_ptr = SendPtr(out.as_mut_ptr());
    candle_core::utils::barrier_pool().execute_chunked(rows * nh, |items| {
        // Reused from (row, head) to (row, head): scores, and one position's keys or values
        // as floats.
        let (mut scores, mut position) = (Vec::new(), Vec::new());
        for item in items {
            let (row, h) = (item / nh, item % nh);
            let which = first_row.partition_point(|&r| r <= row) - 1;
            let seq = &sequences[which];
            let i = row - first_row[which];
            let kv = h / group;
            let visible = seq.start + i + 1;
            let q = &queries[(row * nh + h) * hd..(row * nh + h + 1) * hd];
            // SAFETY: each (row, head) item owns its own head_dim slice of the output, which
            // lies inside `out` (size checked above).
            let dst = unsafe { std::slice::from_raw_parts_mut(out_ptr.get().add((row * nh + h) * hd), hd) };
            let head = Head {
                keys: seq.keys,
                values: seq.values,
                stride: nkv * hd,
                offset: kv * hd,
                visible,
                scale,
            };
            head.attend(q, &mut scores, &mut position, dst);
        }
    });
}

/// One query row of one head against the keys and values of its KV head.
struct Head<'a> {
    keys: &'a [f16],
    values: &'a [f16],
    /// Floats between positions, and this KV head's offset within a position.
    stride: usize,
    offset: usize,
    visible: usize,
    scale: f32,
}

impl Head<'_> {
    fn attend(&self, q: &[f32], scores: &mut Vec<f32>, position: &mut Vec<f32>, dst: &mut [f32]) {
        assert!(
            self.visible * self.stride <= self.keys.len().min(self.values.len())
                && self.offset + q.len() <= self.stride
        );
        let hd = q.len();
        scores.clear();
        let mut max = f32::NEG_INFINITY;
        position.resize(hd, 0.0);
        for j in 0..self.visible {
            self.key(j, hd).convert_to_f32_slice(position);
            let s = dot(q, position) * self.scale;
            max = max.max(s);
            scores.push(s);
        }
        for s in scores.iter_mut() {
            *s = exp(*s - max);
        }
        let inv = 1.0 / scores.iter().sum::<f32>();
        dst.fill(0.0);
        for (j, &p) in scores.iter().enumerate() {
            let w = p * inv;
            self.value(j, hd).convert_to_f32_slice(position);
            for (d, &x) in dst.iter_mut().zip(position.iter()) {
                *d += w * x;
            }
        }
    }

    fn key(&self, j: usize, hd: usize) -> &[f16] {
        &self.keys[j * self.stride + self.offset..][..hd]
    }

    fn value(&self, j: usize, hd: usize) -> &[f16] {
        &self.values[j * self.stride + self.offset..][..hd]
    }
}

/// ln 2 split in two so n · ln 2 is subtracted without rounding error ([`exp`]).
const EXP_LN2_HI: f32 = 0.693_145_75;
const EXP_LN2_LO: f32 = 1.428_606_8e-6;
/// Taylor coefficients of eʳ on |r| <= ln2 / 2, highest power first, to r^7 (error < 1e-8
/// relative), evaluated by Horner's rule.
const EXP_TAYLOR: [f32; 8] = [
    1.0 / 5040.0,
    1.0 / 720.0,
    1.0 / 120.0,
    1.0 / 24.0,
    1.0 / 6.0,
    0.5,
    1.0,
    1.0,
];

/// `eˣ` as a branch-free polynomial that vectorises over a slice (within 2 ulp of `f32::exp`;
/// inputs are clamped to ±87).
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    let x = x.clamp(-87.0, 87.0);
    let n = (x * std::f32::consts::LOG2_E).round_ties_even();
    let r = (-n).mul_add(EXP_LN2_LO, (-n).mul_add(EXP_LN2_HI, x));
    let mut p = EXP_TAYLOR[0];
    for c in &EXP_TAYLOR[1..] {
        p = p.mul_add(r, *c);
    }
    p * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// A dot product with eight independent accumulators (vectorises; fixed summation order).
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        for l in 0..8 {
            acc[l] += a[c * 8 + l] * b[c * 8 + l];
        }
    }
    let mut tail = 0f32;
    for i in chunks * 8..a.len() {
        tail += a[i] * b[i];
    }
    sum_lanes(&acc, tail)
}

/// [`dot`]'s eight lane sums and its tail, added in its fixed order (vector code that keeps
/// the same lanes calls this to give the same result).
pub(crate) fn sum_lanes(lanes: &[f32; 8], tail: f32) -> f32 {
    ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7])) + tail
}

#[cfg(test)]
mod tests {
    #[test]
    fn exp_is_within_two_ulp_of_std() {
        let mut x = -87.0f32;
        while x <= 87.0 {
            let (ours, std) = (super::exp(x), x.exp());
            let ulps = (ours.to_bits() as i64 - std.to_bits() as i64).abs();
            assert!(ulps <= 2, "exp({x}) = {ours}, std {std} ({ulps} ulp)");
            x += 0.0137;
        }
        assert_eq!(super::exp(0.0), 1.0);
        assert!(super::exp(-1000.0) < 1e-37 && super::exp(1000.0).is_finite());
    }
}
