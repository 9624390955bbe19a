//! Causal attention over host KV caches, one (query row, head) at a time: dot products with
//! exactly the keys the row may see, softmax, weighted sum of values. Each row's result is
//! computed by the same code whatever else is in the pass, so verifying K drafts in one pass
//! gives bit-identical results to decoding them one by one, alone or batched with other
//! sequences. All rows of all sequences of a pass are one pass over candle's thread pool.

use crate::kernels::SendPtr;

/// Shapes of one attention call.
pub struct AttentionShape {
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
}

/// One sequence's part of a pass: its cache (`[position][kv_head][head_dim]`, holding
/// positions `0..start + n`) and its `n` new query rows, which follow the previous
/// sequence's rows in the query matrix.
pub struct SequenceAttention<'a> {
    pub keys: &'a [f32],
    pub values: &'a [f32],
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
    out.fill(0.0);
    let out_ptr = SendPtr(out.as_mut_ptr());
    candle_core::utils::barrier_pool().execute_chunked(rows * nh, |items| {
        let mut scores = Vec::new();
        for item in items {
            let (row, h) = (item / nh, item % nh);
            let which = first_row.partition_point(|&r| r <= row) - 1;
            let seq = &sequences[which];
            let i = row - first_row[which];
            let kv = h / group;
            let visible = seq.start + i + 1;
            let q = &queries[(row * nh + h) * hd..(row * nh + h + 1) * hd];
            scores.clear();
            let mut max = f32::NEG_INFINITY;
            for j in 0..visible {
                let k = &seq.keys[(j * nkv + kv) * hd..(j * nkv + kv + 1) * hd];
                let s = dot(q, k) * scale;
                max = max.max(s);
                scores.push(s);
            }
            let mut total = 0f32;
            for s in scores.iter_mut() {
                *s = (*s - max).exp();
                total += *s;
            }
            let inv = 1.0 / total;
            // SAFETY: each (row, head) item owns its own head_dim slice of the output, which
            // lies inside `out` (size checked above).
            let dst = unsafe { std::slice::from_raw_parts_mut(out_ptr.get().add((row * nh + h) * hd), hd) };
            for (j, &p) in scores.iter().enumerate() {
                let v = &seq.values[(j * nkv + kv) * hd..(j * nkv + kv + 1) * hd];
                let w = p * inv;
                for (d, &x) in dst.iter_mut().zip(v) {
                    *d += w * x;
                }
            }
        }
    });
}

/// A dot product with eight independent accumulators (vectorises; fixed summation order).
fn dot(a: &[f32], b: &[f32]) -> f32 {
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
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}
