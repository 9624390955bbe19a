//! The model crate's one error type. Callers (services) map it to gRPC codes in one place.

use std::path::PathBuf;

/// Everything that can go wrong while loading or running a model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("cannot open model file {path}: {source}")]
    Open { path: PathBuf, source: std::io::Error },
    #[error("{path} is not a readable GGUF file: {reason}")]
    InvalidGguf { path: PathBuf, reason: String },
    #[error(
        "{path} is truncated: tensor `{tensor}` needs bytes up to offset {needed}, the file has {file_len}"
    )]
    Truncated {
        path: PathBuf,
        tensor: String,
        needed: u64,
        file_len: u64,
    },
    #[error("unsupported architecture `{found}` (specd runs llama-architecture models)")]
    UnsupportedArchitecture { found: String },
    #[error("GGUF metadata key `{key}` is missing or has the wrong type")]
    Metadata { key: String },
    #[error("GGUF is missing tensor `{0}`")]
    MissingTensor(String),
    #[error("tensor `{name}` has shape {found:?}, expected {expected:?}")]
    TensorShape {
        name: String,
        found: Vec<usize>,
        expected: Vec<usize>,
    },
    #[error("tensor `{name}` uses unsupported type {dtype}")]
    UnsupportedTensorType { name: String, dtype: String },
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    ChatTemplate(String),
    #[error("context of {requested} tokens exceeds the model's limit of {limit}")]
    ContextOverflow { requested: usize, limit: usize },
    #[error("token id {id} is outside the vocabulary (size {vocab})")]
    TokenOutOfRange { id: u32, vocab: usize },
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    #[error("forward pass failed: {0}")]
    Forward(String),
    #[error("the model engine's queue is full")]
    Overloaded,
    #[error("the model engine has stopped")]
    EngineStopped,
    #[error("model fetch failed: {0}")]
    Fetch(String),
    #[error("device: {0}")]
    Device(String),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

pub type Result<T, E = ModelError> = std::result::Result<T, E>;
