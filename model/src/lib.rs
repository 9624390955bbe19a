//! specd's model engine. It loads any llama-architecture GGUF (quantized or not), builds the
//! tokenizer and chat template from the file's own metadata, and runs a llama forward pass
//! whose KV cache lives outside the model: a cache can be extended by many tokens at once
//! (logits at any subset of them), truncated to roll back a rejected draft, and several
//! sequences of different lengths run in one batched pass. The model runs on its own thread
//! ([`engine`]); [`sampling`] holds the distribution math shared with speculative acceptance.

pub mod attention;
pub mod cache_store;
pub mod chat;
pub mod config;
pub mod device;
pub mod engine;
pub mod error;
pub mod fetch;
pub mod gguf;
pub mod host;
pub mod kernels;
pub mod kv_cache;
pub mod llama;
pub mod sampling;
pub mod synthetic;
pub mod tokenizer;

pub use chat::{ChatMessage, ChatTemplate};
pub use config::LlamaConfig;
pub use device::{DeviceSpec, set_compute_threads};
pub use engine::{
    Engine, EngineOptions, LoadedModel, Logits, ModelInfo, PassRecord, PrefillOrder, ScoreRequest, Scores,
    TextModel, load, load_text_model,
};
pub use error::{ModelError, Result};
pub use sampling::{Sampler, SamplingParams, SparseDist, argmax, warp};
pub use tokenizer::TextTokenizer;
