//! The llama model: weights loaded from a GGUF, and the forward pass with the KV cache passed
//! in from outside. One call scores several sequences of different lengths: every weight
//! matrix is multiplied once over the rows of all sequences, attention runs per sequence
//! against its own cache, and logits are computed only at the requested positions. On the
//! CPU the pass runs over plain buffers ([`crate::host`]); on other devices it is built from
//! candle ops (below).

use std::sync::{Arc, Mutex};

use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{D, DType, Device, Module, Tensor};

use crate::config::LlamaConfig;
use crate::error::{ModelError, Result};
use crate::gguf::GgufFile;
use crate::host::Scratch;
use crate::kernels::QuantMatrix;
use crate::kv_cache::KvCache;

/// A weight matrix whose product with a batch of rows gives each row exactly the result it
/// would get alone. Q4_1 and Q8_0 weights on the CPU use our multi-row kernels
/// ([`crate::kernels`]); other quantized formats use candle's kernels, which also work row by
/// row; dense (f32/f16) weights go through a general matmul whose summation order depends on
/// the batch shape, so they are applied one row at a time.
pub(crate) enum Linear {
    Packed(QuantMatrix),
    Candle { inner: QMatMul, dense: bool },
}

impl Linear {
    fn new(tensor: QTensor, device: &Device) -> Result<Self> {
        if device.is_cpu()
            && let Some(packed) = QuantMatrix::from_qtensor(&tensor)
        {
            return Ok(Self::Packed(packed));
        }
        Self::from_qmatmul(QMatMul::from_qtensor(tensor)?)
    }

    fn from_qmatmul(inner: QMatMul) -> Result<Self> {
        let dense = !matches!(inner, QMatMul::QTensor(_));
        Ok(Self::Candle { inner, dense })
    }

    pub(crate) fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let rows = x.dim(0)?;
        match self {
            Self::Packed(matrix) => {
                let input = x.flatten_all()?.to_vec1::<f32>()?;
                Tensor::from_vec(matrix.matmul(&input, rows), (rows, matrix.rows()), x.device())
            }
            Self::Candle { inner, dense } if *dense && rows > 1 => {
                let outs = (0..rows)
                    .map(|r| inner.forward(&x.narrow(0, r, 1)?))
                    .collect::<candle_core::Result<Vec<_>>>()?;
                Tensor::cat(&outs, 0)
            }
            Self::Candle { inner, .. } => inner.forward(x),
        }
    }
}

pub(crate) struct Block {
    attn_norm: Tensor,
    pub(crate) attn_norm_host: Vec<f32>,
    pub(crate) wq: Linear,
    pub(crate) wk: Linear,
    pub(crate) wv: Linear,
    pub(crate) wo: Linear,
    ffn_norm: Tensor,
    pub(crate) ffn_norm_host: Vec<f32>,
    pub(crate) w_gate: Linear,
    pub(crate) w_up: Linear,
    pub(crate) w_down: Linear,
}

/// A loaded llama model. Immutable: all per-sequence state is in [`KvCache`].
pub struct Llama {
    cfg: LlamaConfig,
    token_embd: Arc<QTensor>,
    /// The LM head is the (packed) embedding matrix: embedding rows are read from it.
    tied_packed: bool,
    pub(crate) blocks: Vec<Block>,
    output_norm: Tensor,
    pub(crate) output_norm_host: Vec<f32>,
    pub(crate) lm_head: Linear,
    rope_cos: Tensor,
    rope_sin: Tensor,
    /// `[position][rope_dim / 2]` tables for the host pass.
    pub(crate) rope_cos_host: Vec<f32>,
    pub(crate) rope_sin_host: Vec<f32>,
    pub(crate) scratch: Mutex<Scratch>,
    device: Device,
}

/// One sequence's part of a batched forward: the tokens to append to its cache, and which of
/// them (indices into `tokens`) need logits.
pub struct SequenceStep<'a> {
    pub cache: &'a mut KvCache,
    pub tokens: &'a [u32],
    pub logits_at: &'a [usize],
}

impl Llama {
    /// Loads every tensor of a llama-architecture GGUF onto `device`.
    pub fn load(file: &mut GgufFile, device: &Device) -> Result<Self> {
        let cfg = LlamaConfig::from_gguf(&file.content)?;
        let (d, ff, hd) = (cfg.n_embd, cfg.n_ff, cfg.head_dim);
        let kv = cfg.n_head_kv * hd;
        let token_embd = Arc::new(file.tensor("token_embd.weight", Some(&[cfg.vocab_size, d]), device)?);
        let tied = !file.has_tensor("output.weight");
        let lm_head = if !tied {
            Linear::new(
                file.tensor("output.weight", Some(&[cfg.vocab_size, d]), device)?,
                device,
            )?
        } else if let Some(packed) = device
            .is_cpu()
            .then(|| QuantMatrix::from_qtensor(&token_embd))
            .flatten()
        {
            // Tied embeddings: the LM head is the embedding matrix.
            Linear::Packed(packed)
        } else {
            Linear::from_qmatmul(QMatMul::from_arc(token_embd.clone())?)?
        };
        let tied_packed = tied && matches!(lm_head, Linear::Packed(_));
        let vector = |file: &mut GgufFile, name: &str| -> Result<Tensor> {
            Ok(file.tensor(name, Some(&[d]), device)?.dequantize(device)?)
        };
        let host = |t: &Tensor| -> Result<Vec<f32>> {
            Ok(if device.is_cpu() {
                t.to_vec1::<f32>()?
            } else {
                Vec::new()
            })
        };
        let mut blocks = Vec::with_capacity(cfg.n_layer);
        for i in 0..cfg.n_layer {
            let p = format!("blk.{i}");
            let mut matrix = |name: &str, rows: usize, cols: usize| -> Result<Linear> {
                let t = file.tensor(&format!("{p}.{name}.weight"), Some(&[rows, cols]), device)?;
                Linear::new(t, device)
            };
            let wq = matrix("attn_q", d, d)?;
            let wk = matrix("attn_k", kv, d)?;
            let wv = matrix("attn_v", kv, d)?;
            let wo = matrix("attn_output", d, d)?;
            let w_gate = matrix("ffn_gate", ff, d)?;
            let w_up = matrix("ffn_up", ff, d)?;
            let w_down = matrix("ffn_down", d, ff)?;
            let attn_norm = vector(file, &format!("{p}.attn_norm.weight"))?;
            let ffn_norm = vector(file, &format!("{p}.ffn_norm.weight"))?;
            blocks.push(Block {
                attn_norm_host: host(&attn_norm)?,
                ffn_norm_host: host(&ffn_norm)?,
                attn_norm,
                ffn_norm,
                wq,
                wk,
                wv,
                wo,
                w_gate,
                w_up,
                w_down,
            });
        }
        let output_norm = vector(file, "output_norm.weight")?;
        let (rope_cos, rope_sin) = rope_tables(&cfg, device)?;
        let flat = |t: &Tensor| -> Result<Vec<f32>> {
            Ok(if device.is_cpu() {
                t.flatten_all()?.to_vec1::<f32>()?
            } else {
                Vec::new()
            })
        };
        Ok(Self {
            token_embd,
            tied_packed,
            blocks,
            output_norm_host: host(&output_norm)?,
            output_norm,
            lm_head,
            rope_cos_host: flat(&rope_cos)?,
            rope_sin_host: flat(&rope_sin)?,
            rope_cos,
            rope_sin,
            scratch: Mutex::new(Scratch::default()),
            device: device.clone(),
            cfg,
        })
    }

    pub fn config(&self) -> &LlamaConfig {
        &self.cfg
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// A fresh, empty cache for one sequence.
    pub fn new_cache(&self) -> Result<KvCache> {
        KvCache::new(&self.cfg, &self.device)
    }

    /// Appends each sequence's tokens to its cache in ONE batched forward pass and returns,
    /// per sequence, logits `[logits_at.len(), vocab]` (f32, on the CPU).
    pub fn forward(&self, steps: &mut [SequenceStep<'_>]) -> Result<Vec<Tensor>> {
        let rows: Vec<usize> = steps.iter().map(|s| s.logits_at.len()).collect();
        let logits = Tensor::from_vec(
            self.forward_rows(steps)?,
            (rows.iter().sum::<usize>(), self.cfg.vocab_size),
            &Device::Cpu,
        )?;
        let mut out = Vec::with_capacity(rows.len());
        let mut start = 0;
        for n in rows {
            out.push(logits.narrow(0, start, n)?);
            start += n;
        }
        Ok(out)
    }

    /// As [`Llama::forward`], with every sequence's logits rows in one host buffer, sequence
    /// after sequence, `[Σ logits_at.len(), vocab]`: the CPU pass's own output, not copied.
    pub fn forward_rows(&self, steps: &mut [SequenceStep<'_>]) -> Result<Vec<f32>> {
        self.validate(steps)?;
        for step in steps.iter_mut() {
            step.cache.reserve(step.tokens.len())?;
        }
        let logits = if self.device.is_cpu() {
            crate::host::forward(self, steps)?
        } else {
            self.forward_device(steps)?.flatten_all()?.to_vec1::<f32>()?
        };
        for step in steps.iter_mut() {
            step.cache.commit(step.tokens);
        }
        Ok(logits)
    }

    /// Embedding row of `token` into `out` (`n_embd` values).
    pub(crate) fn embed(&self, token: u32, out: &mut [f32]) -> Result<()> {
        match &self.lm_head {
            Linear::Packed(matrix) if self.tied_packed => matrix.dequantize_row(token as usize, out),
            _ => {
                let ids = Tensor::new(&[token], &Device::Cpu)?;
                let row = self.token_embd.embedding(&ids)?.flatten_all()?.to_vec1::<f32>()?;
                out.copy_from_slice(&row);
            }
        }
        Ok(())
    }

    /// The forward pass from candle ops, for non-CPU devices: the logits rows of every step,
    /// in order, on the CPU (the caller commits the caches).
    fn forward_device(&self, steps: &mut [SequenceStep<'_>]) -> Result<Tensor> {
        let all_tokens: Vec<u32> = steps.iter().flat_map(|s| s.tokens.iter().copied()).collect();
        let ids = Tensor::new(all_tokens.as_slice(), &self.device)?;
        let mut x = self.token_embd.embedding(&ids)?; // [T, d]
        let eps = self.cfg.rms_eps as f32;
        for (layer, block) in self.blocks.iter().enumerate() {
            let h = candle_nn::ops::rms_norm(&x, &block.attn_norm, eps)?;
            let (q, k, v) = (
                block.wq.forward(&h)?,
                block.wk.forward(&h)?,
                block.wv.forward(&h)?,
            );
            let mut outputs = Vec::with_capacity(steps.len());
            let mut row = 0;
            for step in steps.iter_mut() {
                let n = step.tokens.len();
                let attn = self.attention(
                    layer,
                    &mut *step.cache,
                    &q.narrow(0, row, n)?,
                    &k.narrow(0, row, n)?,
                    &v.narrow(0, row, n)?,
                )?;
                outputs.push(attn);
                row += n;
            }
            let attn = Tensor::cat(&outputs, 0)?;
            x = (x + block.wo.forward(&attn)?)?;
            let h = candle_nn::ops::rms_norm(&x, &block.ffn_norm, eps)?;
            let gated = (candle_nn::ops::silu(&block.w_gate.forward(&h)?)? * block.w_up.forward(&h)?)?;
            x = (x + block.w_down.forward(&gated)?)?;
        }
        // Only the requested rows go through the final norm and the (large) LM head.
        let wanted: Vec<u32> = logit_rows(steps).into_iter().map(|r| r as u32).collect();
        if wanted.is_empty() {
            return Ok(Tensor::zeros((0, self.cfg.vocab_size), DType::F32, &Device::Cpu)?);
        }
        let rows = x.index_select(&Tensor::new(wanted.as_slice(), &self.device)?, 0)?;
        let rows = candle_nn::ops::rms_norm(&rows, &self.output_norm, eps)?;
        Ok(self.lm_head.forward(&rows)?.to_device(&Device::Cpu)?)
    }

    fn validate(&self, steps: &[SequenceStep<'_>]) -> Result<()> {
        for step in steps {
            if step.tokens.is_empty() {
                return Err(ModelError::InvalidRequest("a sequence step has no tokens".into()));
            }
            if let Some(&id) = step.tokens.iter().find(|&&id| id as usize >= self.cfg.vocab_size) {
                return Err(ModelError::TokenOutOfRange {
                    id,
                    vocab: self.cfg.vocab_size,
                });
            }
            if let Some(&i) = step.logits_at.iter().find(|&&i| i >= step.tokens.len()) {
                return Err(ModelError::InvalidRequest(format!(
                    "logits requested at position {i} of a {}-token step",
                    step.tokens.len()
                )));
            }
        }
        Ok(())
    }

    /// Causal self-attention of `n` new rows of one sequence against its cache.
    /// `q`: `[n, n_head*hd]`, `k`/`v`: `[n, n_head_kv*hd]`; returns `[n, n_head*hd]`.
    ///
    /// Each query row is computed on its own, against exactly the keys it may see, with the
    /// same shapes whether it arrives alone (decode) or with others (prompt, draft
    /// verification). So a row's result does not depend on how tokens were grouped into
    /// passes: verifying K drafts in one pass gives bit-identical logits to decoding them one
    /// by one, and a replica that rebuilds a cache in one pass gets the same cache.
    fn attention(
        &self,
        layer: usize,
        cache: &mut KvCache,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<Tensor> {
        let cfg = &self.cfg;
        let (n, hd) = (q.dim(0)?, cfg.head_dim);
        let start = cache.len();
        let group = cfg.n_head / cfg.n_head_kv;
        let q = q.reshape((1, n, cfg.n_head, hd))?.transpose(1, 2)?.contiguous()?;
        let k = k
            .reshape((1, n, cfg.n_head_kv, hd))?
            .transpose(1, 2)?
            .contiguous()?;
        let (q, k) = self.apply_rope(&q, &k, start, n)?;
        let (keys, values) = cache.write_device(layer, start, &k, v)?;
        // Query heads sharing a KV head are stacked so one matmul serves the group.
        let q = q.reshape((cfg.n_head_kv, group, n, hd))?;
        let scale = 1.0 / (hd as f64).sqrt();
        let mut rows = Vec::with_capacity(n);
        for i in 0..n {
            let visible = start + i + 1;
            let q_i = q.narrow(2, i, 1)?.reshape((cfg.n_head_kv, group, hd))?;
            let keys_t = keys.narrow(1, 0, visible)?.t()?; // [kv, hd, visible], no copy
            let scores = (q_i.matmul(&keys_t)? * scale)?; // [kv, group, visible]
            let probs = candle_nn::ops::softmax_last_dim(&scores)?;
            let out = probs.matmul(&values.narrow(1, 0, visible)?)?; // [kv, group, hd]
            rows.push(out.reshape((1, cfg.n_head * hd))?);
        }
        Ok(Tensor::cat(&rows, 0)?)
    }

    fn apply_rope(&self, q: &Tensor, k: &Tensor, start: usize, n: usize) -> Result<(Tensor, Tensor)> {
        let cos = self.rope_cos.narrow(0, start, n)?;
        let sin = self.rope_sin.narrow(0, start, n)?;
        let rd = self.cfg.rope_dim;
        let rotate = |x: &Tensor| -> Result<Tensor> {
            if rd == self.cfg.head_dim {
                return Ok(candle_nn::rotary_emb::rope_i(x, &cos, &sin)?);
            }
            // Partial rotary: only the first `rope_dim` dims of each head rotate.
            let rotated =
                candle_nn::rotary_emb::rope_i(&x.narrow(D::Minus1, 0, rd)?.contiguous()?, &cos, &sin)?;
            let rest = x.narrow(D::Minus1, rd, self.cfg.head_dim - rd)?;
            Ok(Tensor::cat(&[&rotated, &rest], D::Minus1)?.contiguous()?)
        };
        Ok((rotate(q)?, rotate(k)?))
    }
}

/// Rows of a batched pass (steps' tokens one after another) whose logits are wanted, in order.
pub(crate) fn logit_rows(steps: &[SequenceStep<'_>]) -> Vec<usize> {
    let mut wanted = Vec::new();
    let mut row = 0;
    for step in steps {
        wanted.extend(step.logits_at.iter().map(|&i| row + i));
        row += step.tokens.len();
    }
    wanted
}

/// Interleaved (GPT-J style) rotary tables, the layout llama.cpp's GGUF conversion expects.
fn rope_tables(cfg: &LlamaConfig, device: &Device) -> Result<(Tensor, Tensor)> {
    let half = cfg.rope_dim / 2;
    let inv_freq: Vec<f32> = (0..half)
        .map(|i| 1.0 / cfg.rope_theta.powf(2.0 * i as f32 / cfg.rope_dim as f32))
        .collect();
    let positions = cfg.context_length;
    let mut angles = Vec::with_capacity(positions * half);
    for p in 0..positions {
        angles.extend(inv_freq.iter().map(|f| p as f32 * f));
    }
    let angles = Tensor::from_vec(angles, (positions, half), device)?;
    Ok((angles.cos()?, angles.sin()?))
}

#[cfg(test)]
mod tests;
