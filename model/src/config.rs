//! Llama hyper-parameters, read from a GGUF file's metadata.

use candle_core::quantized::gguf_file::{Content, Value};

use crate::error::{ModelError, Result};

/// Architectures whose GGUF layout is the llama one (same tensor names and forward pass).
const LLAMA_FAMILY: &[&str] = &["llama"];

/// Shape and numerics of a llama-architecture model.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    pub n_layer: usize,
    pub n_embd: usize,
    pub n_ff: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub rope_dim: usize,
    pub rope_theta: f32,
    pub rms_eps: f64,
    pub context_length: usize,
    pub vocab_size: usize,
}

impl LlamaConfig {
    /// Reads the hyper-parameters; refuses any architecture outside the llama family.
    pub fn from_gguf(content: &Content) -> Result<Self> {
        let arch = string(content, "general.architecture")?;
        if !LLAMA_FAMILY.contains(&arch.as_str()) {
            return Err(ModelError::UnsupportedArchitecture { found: arch });
        }
        let key = |k: &str| format!("{arch}.{k}");
        let n_embd = usize_of(content, &key("embedding_length"))?;
        let n_head = usize_of(content, &key("attention.head_count"))?;
        let n_head_kv = optional_usize(content, &key("attention.head_count_kv"))?.unwrap_or(n_head);
        if n_head == 0 || n_head_kv == 0 || n_embd % n_head != 0 || n_head % n_head_kv != 0 {
            return Err(ModelError::Metadata {
                key: format!(
                    "{} (heads {n_head}/{n_head_kv}, width {n_embd})",
                    key("attention.head_count")
                ),
            });
        }
        let head_dim = n_embd / n_head;
        let rope_dim = optional_usize(content, &key("rope.dimension_count"))?.unwrap_or(head_dim);
        let vocab_size = match optional_usize(content, &key("vocab_size"))? {
            Some(v) => v,
            None => match content.metadata.get("tokenizer.ggml.tokens") {
                Some(Value::Array(tokens)) => tokens.len(),
                _ => return Err(metadata_err(&key("vocab_size"))),
            },
        };
        Ok(Self {
            n_layer: usize_of(content, &key("block_count"))?,
            n_embd,
            n_ff: usize_of(content, &key("feed_forward_length"))?,
            n_head,
            n_head_kv,
            head_dim,
            rope_dim,
            rope_theta: optional_f32(content, &key("rope.freq_base"))?.unwrap_or(10_000.0),
            rms_eps: optional_f32(content, &key("attention.layer_norm_rms_epsilon"))?.unwrap_or(1e-5) as f64,
            context_length: optional_usize(content, &key("context_length"))?.unwrap_or(2048),
            vocab_size,
        })
    }

    /// Bytes of KV cache one token occupies (f32 keys and values, all layers).
    pub fn kv_bytes_per_token(&self) -> usize {
        2 * self.n_layer * self.n_head_kv * self.head_dim * std::mem::size_of::<f32>()
    }
}

fn metadata_err(key: &str) -> ModelError {
    ModelError::Metadata { key: key.to_string() }
}

pub(crate) fn string(content: &Content, key: &str) -> Result<String> {
    match content.metadata.get(key) {
        Some(Value::String(s)) => Ok(s.clone()),
        _ => Err(metadata_err(key)),
    }
}

fn as_u64(v: &Value) -> Option<u64> {
    match v {
        Value::U8(x) => Some(*x as u64),
        Value::U16(x) => Some(*x as u64),
        Value::U32(x) => Some(*x as u64),
        Value::U64(x) => Some(*x),
        Value::I8(x) => u64::try_from(*x).ok(),
        Value::I16(x) => u64::try_from(*x).ok(),
        Value::I32(x) => u64::try_from(*x).ok(),
        Value::I64(x) => u64::try_from(*x).ok(),
        _ => None,
    }
}

pub(crate) fn optional_usize(content: &Content, key: &str) -> Result<Option<usize>> {
    match content.metadata.get(key) {
        None => Ok(None),
        Some(v) => as_u64(v)
            .and_then(|x| usize::try_from(x).ok())
            .map(Some)
            .ok_or_else(|| metadata_err(key)),
    }
}

fn usize_of(content: &Content, key: &str) -> Result<usize> {
    optional_usize(content, key)?.ok_or_else(|| metadata_err(key))
}

fn optional_f32(content: &Content, key: &str) -> Result<Option<f32>> {
    match content.metadata.get(key) {
        None => Ok(None),
        Some(Value::F32(x)) => Ok(Some(*x)),
        Some(Value::F64(x)) => Ok(Some(*x as f32)),
        Some(_) => Err(metadata_err(key)),
    }
}

pub(crate) fn optional_bool(content: &Content, key: &str) -> Result<Option<bool>> {
    match content.metadata.get(key) {
        None => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(_) => Err(metadata_err(key)),
    }
}
