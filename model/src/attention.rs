//! Causal attention over a host KV cache, one (query row, head) at a time: dot products with
//! exactly the keys the row may see, softmax, weighted sum of values. Each row's result is
//! computed by the same code whatever else is in the pass, so verifying K drafts in one pass
//! gives bit-identical results to decoding them one by one. Work items run on candle's
//! thread pool.

use crate::kernels::SendPtr;

/// Shapes of one attention call.
pub struct AttentionShape {
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
}

/// `queries`: `[n_head][n][head_dim]` (rotated); `keys`/`values`: `[position][kv][head_dim]`
/// holding positions `0..start + n`. Returns `[n][n_head * head_dim]`.
pub fn attend(
    shape: &AttentionShape,
    queries: &[f32],
    keys: &[f32],
    values: &[f32],
    start: usize,
    n: usize,
) -> Vec<f32> {
    let (nh, nkv, hd) = (shape.n_head, shape.n_head_kv, shape.head_dim);
    let group = nh / nkv;
    let scale = 1.0 / (hd as f32).sqrt();
    let mut out = vec![0f32; n * nh * hd];
    let out_ptr = SendPtr(out.as_mut_ptr());
    candle_core::utils::barrier_pool().execute_chunked(n * nh, |items| {
        let mut scores = Vec::with_capacity(start + n);
        for item in items {
            let (i, h) = (item / nh, item % nh);
            let kv = h / group;
            let visible = start + i + 1;
            let q = &queries[(h * n + i) * hd..(h * n + i + 1) * hd];
            scores.clear();
            let mut max = f32::NEG_INFINITY;
            for j in 0..visible {
                let k = &keys[(j * nkv + kv) * hd..(j * nkv + kv + 1) * hd];
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
            // SAFETY: each (row, head) item owns its own head_dim slice of the output.
            let dst = unsafe { std::slice::from_raw_parts_mut(out_ptr.get().add((i * nh + h) * hd), hd) };
            for (j, &p) in scores.iter().enumerate() {
                let v = &values[(j * nkv + kv) * hd..(j * nkv + kv + 1) * hd];
                let w = p * inv;
                for (d, &x) in dst.iter_mut().zip(v) {
                    *d += w * x;
                }
            }
        }
    });
    out
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
