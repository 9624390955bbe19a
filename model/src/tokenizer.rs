//! The tokenizer, built from a GGUF file's own metadata (tokens, merges, token types, special
//! ids) as a `tokenizers::Tokenizer`. GPT-2 style byte-level BPE (SmolLM2, Llama 3, Qwen 2)
//! and SentencePiece-style vocabularies (TinyLlama, Llama 2) are supported; special tokens in
//! text (such as `<|im_start|>`) are recognised, as llama.cpp does.

use candle_core::quantized::gguf_file::{Content, Value};
use sha2::{Digest, Sha256};
use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::normalizers::{Prepend, Replace, Sequence as NormalizerSequence};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence as PreSequence;
use tokenizers::pre_tokenizers::split::Split;
use tokenizers::{
    AddedToken, DecodeStream, DecoderWrapper, ModelWrapper, NormalizerWrapper, PostProcessorWrapper,
    PreTokenizerWrapper, SplitDelimiterBehavior, Tokenizer,
};

use crate::config::{optional_bool, optional_usize, string};
use crate::error::{ModelError, Result};

/// GGUF token types (llama.cpp's `llama_token_type`).
const TOKEN_TYPE_CONTROL: i32 = 3;
const TOKEN_TYPE_USER_DEFINED: i32 = 4;

/// llama.cpp's GPT-2 word split, shared by several pre-tokenizer families.
const GPT2_SPLIT: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
/// Llama 3's split (digits in groups of up to three).
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen 2's split (single digits).
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// A tokenizer plus the special-token facts generation needs.
pub struct TextTokenizer {
    inner: Tokenizer,
    bos: Option<u32>,
    add_bos: bool,
    end_of_generation: Vec<u32>,
    identity: String,
    vocab_size: usize,
}

impl TextTokenizer {
    /// Builds the tokenizer described by a GGUF file's `tokenizer.ggml.*` metadata.
    pub fn from_gguf(content: &Content) -> Result<Self> {
        let model = string(content, "tokenizer.ggml.model")?;
        let tokens = string_array(content, "tokenizer.ggml.tokens")?;
        let types = match content.metadata.get("tokenizer.ggml.token_type") {
            Some(Value::Array(v)) => v.iter().map(|t| t.to_i32().unwrap_or(1)).collect(),
            _ => vec![1; tokens.len()],
        };
        let mut inner = match model.as_str() {
            "gpt2" => {
                let merges = string_array(content, "tokenizer.ggml.merges")?;
                let pre = string(content, "tokenizer.ggml.pre").unwrap_or_else(|_| "default".into());
                byte_level_bpe(&tokens, &merges, &pre)?
            }
            "llama" => sentencepiece_bpe(&tokens, content)?,
            other => {
                return Err(ModelError::Tokenizer(format!(
                    "tokenizer model `{other}` is not supported (gpt2 and llama are)"
                )));
            }
        };
        let special: Vec<AddedToken> = tokens
            .iter()
            .zip(&types)
            .filter(|(_, t)| **t == TOKEN_TYPE_CONTROL || **t == TOKEN_TYPE_USER_DEFINED)
            .map(|(text, _)| AddedToken::from(text.clone(), true))
            .collect();
        inner
            .add_special_tokens(special)
            .map_err(|e| ModelError::Tokenizer(e.to_string()))?;

        let id = |key: &str| -> Result<Option<u32>> { Ok(optional_usize(content, key)?.map(|v| v as u32)) };
        let bos = id("tokenizer.ggml.bos_token_id")?;
        let eos = id("tokenizer.ggml.eos_token_id")?;
        let eot = id("tokenizer.ggml.eot_token_id")?;
        let add_bos = optional_bool(content, "tokenizer.ggml.add_bos_token")?.unwrap_or(model == "llama");
        // Like llama.cpp, any of the well-known end markers ends generation, not only eos.
        let mut end_of_generation: Vec<u32> = eos.into_iter().chain(eot).collect();
        for marker in [
            "<|endoftext|>",
            "<|im_end|>",
            "<|eot_id|>",
            "<|end|>",
            "<end_of_turn>",
            "</s>",
        ] {
            if let Some(pos) = tokens.iter().position(|t| t == marker)
                && types.get(pos).copied() == Some(TOKEN_TYPE_CONTROL)
            {
                end_of_generation.push(pos as u32);
            }
        }
        end_of_generation.sort_unstable();
        end_of_generation.dedup();

        let mut hasher = Sha256::new();
        hasher.update(model.as_bytes());
        for (text, ty) in tokens.iter().zip(&types) {
            hasher.update(text.as_bytes());
            hasher.update([0u8]);
            hasher.update(ty.to_le_bytes());
        }
        let identity = hasher
            .finalize()
            .iter()
            .take(8)
            .map(|b| format!("{b:02x}"))
            .collect::<String>();
        Ok(Self {
            inner,
            bos,
            add_bos,
            end_of_generation,
            identity,
            vocab_size: tokens.len(),
        })
    }

    /// Token ids of `text`; special-token text is recognised. A BOS is prepended when the
    /// model asks for one and `text` does not already start with it.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let encoding = self
            .inner
            .encode(text, false)
            .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
        let mut ids = encoding.get_ids().to_vec();
        if let (true, Some(bos)) = (self.add_bos, self.bos)
            && ids.first() != Some(&bos)
        {
            ids.insert(0, bos);
        }
        Ok(ids)
    }

    /// The text of `ids`, special tokens included.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, false)
            .map_err(|e| ModelError::Tokenizer(e.to_string()))
    }

    /// An incremental decoder that emits text only once it forms complete UTF-8.
    pub fn stream_decoder(&self) -> StreamDecoder<'_> {
        StreamDecoder {
            stream: self.inner.decode_stream(false),
        }
    }

    pub fn is_end_of_generation(&self, id: u32) -> bool {
        self.end_of_generation.contains(&id)
    }

    pub fn end_of_generation(&self) -> &[u32] {
        &self.end_of_generation
    }

    pub fn bos(&self) -> Option<u32> {
        self.bos
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Short fingerprint of the vocabulary: two models may share proposals only if equal.
    pub fn identity(&self) -> &str {
        &self.identity
    }

    /// The token's text, e.g. `<|im_end|>`.
    pub fn token_text(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    pub fn inner(&self) -> &Tokenizer {
        &self.inner
    }
}

/// Decodes a growing id sequence into text deltas without splitting multi-byte characters.
/// Each id costs the same however long the output is: the `tokenizers` crate's stream
/// decoder keeps only the ids since the last complete character, with the text they had, and
/// decodes that window (re-decoding the whole output on each id cost time in proportion to
/// its length: `cargo bench -p specd-model --bench detokenize`).
pub struct StreamDecoder<'a> {
    stream: DecodeStream<
        'a,
        ModelWrapper,
        NormalizerWrapper,
        PreTokenizerWrapper,
        PostProcessorWrapper,
        DecoderWrapper,
    >,
}

impl StreamDecoder<'_> {
    /// Adds one id and returns the newly completed text (empty while a multi-byte character
    /// is incomplete).
    pub fn push(&mut self, id: u32) -> Result<String> {
        let delta = self
            .stream
            .step(id)
            .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
        Ok(delta.unwrap_or_default())
    }
}

fn string_array(content: &Content, key: &str) -> Result<Vec<String>> {
    match content.metadata.get(key) {
        Some(Value::Array(values)) => values
            .iter()
            .map(|v| {
                v.to_string()
                    .cloned()
                    .map_err(|_| ModelError::Metadata { key: key.into() })
            })
            .collect(),
        _ => Err(ModelError::Metadata { key: key.into() }),
    }
}

fn vocab_map(tokens: &[String]) -> Vocab {
    tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), i as u32))
        .collect()
}

fn split(pattern: &str) -> Result<PreTokenizerWrapper> {
    let split = Split::new(
        tokenizers::pre_tokenizers::split::SplitPattern::Regex(pattern.to_string()),
        SplitDelimiterBehavior::Isolated,
        false,
    )
    .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
    Ok(split.into())
}

/// Byte-level BPE with the word split llama.cpp uses for `tokenizer.ggml.pre`.
fn byte_level_bpe(tokens: &[String], merges: &[String], pre: &str) -> Result<Tokenizer> {
    let merges = merges
        .iter()
        .map(|m| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .ok_or_else(|| ModelError::Tokenizer(format!("malformed merge `{m}`")))
        })
        .collect::<Result<Vec<_>>>()?;
    let bpe = BPE::builder()
        .vocab_and_merges(vocab_map(tokens), merges)
        .build()
        .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
    let pre_tokenizer: PreTokenizerWrapper = match pre {
        "llama-bpe" | "llama3" | "falcon3" | "pixtral" => PreSequence::new(vec![
            split(LLAMA3_SPLIT)?,
            ByteLevel::new(false, false, false).into(),
        ])
        .into(),
        "qwen2" | "deepseek-r1-qwen" => PreSequence::new(vec![
            split(QWEN2_SPLIT)?,
            ByteLevel::new(false, false, false).into(),
        ])
        .into(),
        // Families that isolate every digit before the GPT-2 split (llama.cpp groups them).
        "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva" => {
            PreSequence::new(vec![
                Digits::new(true).into(),
                split(GPT2_SPLIT)?,
                ByteLevel::new(false, false, false).into(),
            ])
            .into()
        }
        "gpt2" | "default" | "gpt-2" | "mpt" | "olmo" | "jais" => PreSequence::new(vec![
            split(GPT2_SPLIT)?,
            ByteLevel::new(false, false, false).into(),
        ])
        .into(),
        other => {
            return Err(ModelError::Tokenizer(format!(
                "pre-tokenizer `{other}` is not supported yet"
            )));
        }
    };
    let mut tokenizer = Tokenizer::new(bpe);
    tokenizer.with_pre_tokenizer(Some(pre_tokenizer));
    tokenizer.with_decoder(Some(DecoderWrapper::from(ByteLevelDecoder::new(
        false, false, false,
    ))));
    Ok(tokenizer)
}

/// SentencePiece vocabularies (scores, no merges): BPE whose merges are derived from the
/// scores, as the Hugging Face converter does, with byte fallback and `▁` for spaces.
fn sentencepiece_bpe(tokens: &[String], content: &Content) -> Result<Tokenizer> {
    let scores: Vec<f32> = match content.metadata.get("tokenizer.ggml.scores") {
        Some(Value::Array(v)) => v.iter().map(|s| s.to_f32().unwrap_or(0.0)).collect(),
        _ => {
            return Err(ModelError::Metadata {
                key: "tokenizer.ggml.scores".into(),
            });
        }
    };
    let vocab = vocab_map(tokens);
    let mut merges: Vec<(f32, u32, String, String)> = Vec::new();
    for (piece, &id) in &vocab {
        let score = scores.get(id as usize).copied().unwrap_or(0.0);
        for (cut, _) in piece.char_indices().skip(1) {
            let (left, right) = piece.split_at(cut);
            if let (Some(&l), Some(&r)) = (vocab.get(left), vocab.get(right)) {
                merges.push((score, l.max(r), left.to_string(), right.to_string()));
            }
        }
    }
    merges.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    let merges = merges.into_iter().map(|(_, _, l, r)| (l, r)).collect();
    let unk = tokens
        .iter()
        .position(|t| t == "<unk>")
        .map(|_| "<unk>".to_string());
    let mut builder = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .byte_fallback(true)
        .fuse_unk(true);
    if let Some(unk) = unk {
        builder = builder.unk_token(unk);
    }
    let bpe = builder
        .build()
        .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
    let mut tokenizer = Tokenizer::new(bpe);
    let normalizer = NormalizerSequence::new(vec![
        NormalizerWrapper::from(Prepend::new("▁".into())),
        NormalizerWrapper::from(Replace::new(" ", "▁").map_err(|e| ModelError::Tokenizer(e.to_string()))?),
    ]);
    tokenizer
        .with_normalizer(Some(normalizer))
        .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
    let decoder = DecoderSequence::new(vec![
        tokenizers::normalizers::Replace::new("▁", " ")
            .map(DecoderWrapper::from)
            .map_err(|e| ModelError::Tokenizer(e.to_string()))?,
        DecoderWrapper::from(ByteFallback::new()),
        DecoderWrapper::from(Fuse::new()),
        DecoderWrapper::from(Strip::new(' ', 1, 0)),
    ]);
    tokenizer.with_decoder(Some(decoder));
    Ok(tokenizer)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// A byte-level vocabulary (GPT-2's byte-to-character mapping): `a`, `b`, a space, the
    /// two bytes of `é` (C3 A9, as `Ã` and `©`) alone and merged, and the four bytes of 😀
    /// (F0 9F 98 80) as two halves.
    const VOCAB: [&str; 8] = ["a", "b", "Ġ", "Ã", "©", "Ã©", "ðŁ", "ĺĢ"];

    fn tokenizer() -> TextTokenizer {
        let tokens: Vec<String> = VOCAB.iter().map(|t| t.to_string()).collect();
        let merges = vec!["Ã ©".to_string()];
        TextTokenizer {
            inner: byte_level_bpe(&tokens, &merges, "default").unwrap(),
            bos: None,
            add_bos: false,
            end_of_generation: Vec::new(),
            identity: String::new(),
            vocab_size: tokens.len(),
        }
    }

    fn stream(tokenizer: &TextTokenizer, ids: &[u32]) -> Vec<String> {
        let mut decoder = tokenizer.stream_decoder();
        ids.iter().map(|&id| decoder.push(id).unwrap()).collect()
    }

    #[test]
    fn deltas_wait_for_whole_characters_and_spell_the_decode() {
        let tokenizer = tokenizer();
        // a, é split in two bytes, a space, 😀 in two halves, é whole, b.
        let ids = [0, 3, 4, 2, 6, 7, 5, 1];
        assert_eq!(stream(&tokenizer, &ids), ["a", "", "é", " ", "", "😀", "é", "b"]);
        assert_eq!(tokenizer.decode(&ids).unwrap(), "aé 😀éb");
    }

    proptest! {
        /// Any id sequence, invalid UTF-8 included (a lone continuation byte, a character cut
        /// short): the deltas spell what decoding all the ids at once gives, but for an
        /// incomplete character at the end, which is held back.
        #[test]
        fn deltas_spell_the_whole_decode(ids in proptest::collection::vec(0u32..8, 0..40)) {
            let tokenizer = tokenizer();
            let streamed: String = stream(&tokenizer, &ids).concat();
            let whole = tokenizer.decode(&ids).unwrap();
            if whole.ends_with('\u{FFFD}') {
                prop_assert!(whole.starts_with(&streamed), "{streamed:?} vs {whole:?}");
            } else {
                prop_assert_eq!(streamed, whole);
            }
        }
    }
}
