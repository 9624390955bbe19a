//! Tiny random llama models written as real GGUF files, for tests that need a model but not
//! the real one: same loader, tokenizer builder and forward pass, in milliseconds.

use std::io::Cursor;
use std::path::Path;

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::error::{ModelError, Result};

/// Shape and encoding of a synthetic model.
#[derive(Debug, Clone)]
pub struct SyntheticSpec {
    pub architecture: String,
    pub n_embd: usize,
    pub n_ff: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub n_layer: usize,
    pub context_length: usize,
    /// Encoding of the 2-D weight matrices.
    pub dtype: GgmlDType,
    /// Without `output.weight`, the LM head is the token embedding.
    pub tied_embeddings: bool,
    /// Tensors to leave out (to test the loader's errors).
    pub omit_tensors: Vec<String>,
    pub seed: u64,
}

impl Default for SyntheticSpec {
    fn default() -> Self {
        Self {
            architecture: "llama".into(),
            n_embd: 64,
            n_ff: 128,
            n_head: 4,
            n_head_kv: 2,
            n_layer: 2,
            context_length: 512,
            dtype: GgmlDType::F32,
            tied_embeddings: false,
            omit_tensors: Vec::new(),
            seed: 7,
        }
    }
}

/// Special tokens of the synthetic vocabulary (ChatML, like SmolLM2).
pub const SPECIAL_TOKENS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
const MERGES: [(&str, &str); 6] = [
    ("t", "h"),
    ("th", "e"),
    ("Ġ", "the"),
    ("i", "n"),
    ("Ġ", "a"),
    ("e", "r"),
];
const CHAT_TEMPLATE: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// GPT-2's byte-to-character table: printable bytes map to themselves, the rest above 255.
fn byte_chars() -> Vec<char> {
    let mut out = vec!['\0'; 256];
    let mut extra = 0u32;
    for b in 0..256u32 {
        let printable = (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
        out[b as usize] = if printable {
            char::from_u32(b).unwrap_or('?')
        } else {
            extra += 1;
            char::from_u32(255 + extra).unwrap_or('?')
        };
    }
    out
}

/// The synthetic vocabulary: specials, 256 byte tokens, then merged tokens.
fn vocabulary() -> (Vec<String>, Vec<i32>, Vec<String>) {
    let mut tokens: Vec<String> = SPECIAL_TOKENS.iter().map(|s| s.to_string()).collect();
    let mut types = vec![3; SPECIAL_TOKENS.len()];
    for c in byte_chars() {
        tokens.push(c.to_string());
        types.push(1);
    }
    let mut merges = Vec::new();
    for (a, b) in MERGES {
        tokens.push(format!("{a}{b}"));
        types.push(1);
        merges.push(format!("{a} {b}"));
    }
    (tokens, types, merges)
}

/// Number of tokens in the synthetic vocabulary.
pub fn vocab_size() -> usize {
    SPECIAL_TOKENS.len() + 256 + MERGES.len()
}

/// The GGUF bytes of a random llama model.
pub fn tiny_llama_bytes(spec: &SyntheticSpec) -> Result<Vec<u8>> {
    let mut rng = ChaCha8Rng::seed_from_u64(spec.seed);
    let (tokens, types, merges) = vocabulary();
    let vocab = tokens.len();
    let (d, ff, hd) = (spec.n_embd, spec.n_ff, spec.n_embd / spec.n_head);
    let kv = spec.n_head_kv * hd;
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    let mut matrix =
        |rng: &mut ChaCha8Rng, name: String, rows: usize, cols: usize, scale: f32| -> Result<()> {
            let data: Vec<f32> = (0..rows * cols)
                .map(|_| rng.random_range(-1.0f32..1.0) * scale)
                .collect();
            let t = Tensor::from_vec(data, (rows, cols), &Device::Cpu)?;
            tensors.push((name, QTensor::quantize(&t, spec.dtype)?));
            Ok(())
        };
    matrix(&mut rng, "token_embd.weight".into(), vocab, d, 1.0)?;
    let w = 1.0 / (d as f32).sqrt();
    for i in 0..spec.n_layer {
        matrix(&mut rng, format!("blk.{i}.attn_q.weight"), d, d, 2.0 * w)?;
        matrix(&mut rng, format!("blk.{i}.attn_k.weight"), kv, d, 2.0 * w)?;
        matrix(&mut rng, format!("blk.{i}.attn_v.weight"), kv, d, w)?;
        matrix(&mut rng, format!("blk.{i}.attn_output.weight"), d, d, w)?;
        matrix(&mut rng, format!("blk.{i}.ffn_gate.weight"), ff, d, w)?;
        matrix(&mut rng, format!("blk.{i}.ffn_up.weight"), ff, d, w)?;
        matrix(
            &mut rng,
            format!("blk.{i}.ffn_down.weight"),
            d,
            ff,
            1.0 / (ff as f32).sqrt(),
        )?;
    }
    if !spec.tied_embeddings {
        matrix(&mut rng, "output.weight".into(), vocab, d, 2.0 * w)?;
    }
    let mut norms = vec!["output_norm.weight".to_string()];
    for i in 0..spec.n_layer {
        norms.push(format!("blk.{i}.attn_norm.weight"));
        norms.push(format!("blk.{i}.ffn_norm.weight"));
    }
    for name in norms {
        let data: Vec<f32> = (0..d).map(|_| 1.0 + rng.random_range(-0.1f32..0.1)).collect();
        let t = Tensor::from_vec(data, d, &Device::Cpu)?;
        tensors.push((name, QTensor::quantize(&t, GgmlDType::F32)?));
    }
    tensors.retain(|(name, _)| !spec.omit_tensors.contains(name));

    let arch = spec.architecture.as_str();
    let string_array =
        |items: &[String]| Value::Array(items.iter().map(|s| Value::String(s.clone())).collect());
    let metadata: Vec<(String, Value)> = vec![
        ("general.architecture".into(), Value::String(arch.into())),
        (
            "general.name".into(),
            Value::String("specd synthetic llama".into()),
        ),
        (format!("{arch}.block_count"), Value::U32(spec.n_layer as u32)),
        (
            format!("{arch}.context_length"),
            Value::U32(spec.context_length as u32),
        ),
        (format!("{arch}.embedding_length"), Value::U32(d as u32)),
        (format!("{arch}.feed_forward_length"), Value::U32(ff as u32)),
        (
            format!("{arch}.attention.head_count"),
            Value::U32(spec.n_head as u32),
        ),
        (
            format!("{arch}.attention.head_count_kv"),
            Value::U32(spec.n_head_kv as u32),
        ),
        (format!("{arch}.rope.freq_base"), Value::F32(10_000.0)),
        (
            format!("{arch}.attention.layer_norm_rms_epsilon"),
            Value::F32(1e-5),
        ),
        ("tokenizer.ggml.model".into(), Value::String("gpt2".into())),
        ("tokenizer.ggml.pre".into(), Value::String("smollm".into())),
        ("tokenizer.ggml.tokens".into(), string_array(&tokens)),
        (
            "tokenizer.ggml.token_type".into(),
            Value::Array(types.iter().map(|&t| Value::I32(t)).collect()),
        ),
        ("tokenizer.ggml.merges".into(), string_array(&merges)),
        ("tokenizer.ggml.bos_token_id".into(), Value::U32(1)),
        ("tokenizer.ggml.eos_token_id".into(), Value::U32(2)),
        ("tokenizer.ggml.add_bos_token".into(), Value::Bool(false)),
        (
            "tokenizer.chat_template".into(),
            Value::String(CHAT_TEMPLATE.into()),
        ),
    ];
    let metadata_refs: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tensor_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut out = Cursor::new(Vec::new());
    gguf_file::write(&mut out, &metadata_refs, &tensor_refs)?;
    Ok(out.into_inner())
}

/// Writes a random llama model to `path`.
pub fn write_tiny_llama(path: &Path, spec: &SyntheticSpec) -> Result<()> {
    std::fs::write(path, tiny_llama_bytes(spec)?).map_err(|source| ModelError::Open {
        path: path.to_path_buf(),
        source,
    })
}
