//! Validation of a `GenerateRequest` into generation parameters: every field checked, every
//! refusal an InvalidArgument whose message names the field and the limit.

use specd_model::{ChatMessage, SamplingParams};
use specd_proto::v1 as pb;

use crate::error::OrchestratorError;

/// Request bounds, set by flags.
#[derive(Debug, Clone)]
pub struct Limits {
    pub max_new_tokens: usize,
    pub default_max_tokens: usize,
    pub max_prompt_bytes: usize,
    pub max_messages: usize,
    pub max_stop_strings: usize,
    pub max_stop_bytes: usize,
    pub max_k: usize,
    pub default_k: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_new_tokens: 4096,
            default_max_tokens: 256,
            max_prompt_bytes: 256 * 1024,
            max_messages: 256,
            max_stop_strings: 8,
            max_stop_bytes: 64,
            max_k: 16,
            default_k: 8,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum Input {
    Prompt(String),
    Chat(Vec<ChatMessage>),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Drafter {
    Ngram,
    Lm,
}

/// A validated request.
#[derive(Debug, Clone)]
pub struct GenerationParams {
    pub input: Input,
    pub max_tokens: usize,
    pub stop: Vec<String>,
    pub sampling: SamplingParams,
    pub seed: u64,
    pub speculate: bool,
    pub max_k: usize,
    pub fixed_k: bool,
    pub drafter: Drafter,
    pub session_id: Option<String>,
}

fn invalid(message: impl Into<String>) -> OrchestratorError {
    OrchestratorError::InvalidArgument(message.into())
}

pub fn validate(
    request: &pb::GenerateRequest,
    limits: &Limits,
    vocab: usize,
) -> Result<GenerationParams, OrchestratorError> {
    let input = match &request.input {
        None => {
            return Err(invalid("the request has neither a prompt nor chat messages"));
        }
        Some(pb::generate_request::Input::Prompt(p)) => {
            if p.is_empty() {
                return Err(invalid("prompt is empty"));
            }
            if p.len() > limits.max_prompt_bytes {
                return Err(invalid(format!(
                    "prompt is {} bytes; the limit is {}",
                    p.len(),
                    limits.max_prompt_bytes
                )));
            }
            Input::Prompt(p.clone())
        }
        Some(pb::generate_request::Input::Chat(chat)) => {
            if chat.messages.is_empty() {
                return Err(invalid("chat has no messages"));
            }
            if chat.messages.len() > limits.max_messages {
                return Err(invalid(format!(
                    "chat has {} messages; the limit is {}",
                    chat.messages.len(),
                    limits.max_messages
                )));
            }
            let bytes: usize = chat.messages.iter().map(|m| m.content.len() + m.role.len()).sum();
            if bytes > limits.max_prompt_bytes {
                return Err(invalid(format!(
                    "chat is {bytes} bytes; the limit is {}",
                    limits.max_prompt_bytes
                )));
            }
            if let Some((i, _)) = chat.messages.iter().enumerate().find(|(_, m)| m.role.is_empty()) {
                return Err(invalid(format!("chat message {i} has no role")));
            }
            Input::Chat(
                chat.messages
                    .iter()
                    .map(|m| ChatMessage::new(&m.role, &m.content))
                    .collect(),
            )
        }
    };
    let max_tokens = match request.max_tokens as usize {
        0 => limits.default_max_tokens,
        n if n > limits.max_new_tokens => {
            return Err(invalid(format!(
                "max_tokens is {n}; the limit is {}",
                limits.max_new_tokens
            )));
        }
        n => n,
    };
    if request.stop.len() > limits.max_stop_strings {
        return Err(invalid(format!(
            "{} stop strings; the limit is {}",
            request.stop.len(),
            limits.max_stop_strings
        )));
    }
    if let Some(s) = request
        .stop
        .iter()
        .find(|s| s.is_empty() || s.len() > limits.max_stop_bytes)
    {
        return Err(invalid(format!(
            "stop string {s:?} must be 1 to {} bytes",
            limits.max_stop_bytes
        )));
    }
    let sampling = specd_common::convert::sampling_from_proto(request.sampling.as_ref());
    sampling
        .validate()
        .map_err(|e| invalid(e.to_string().replace("invalid request: ", "")))?;
    if sampling.top_k > vocab {
        return Err(invalid(format!(
            "top_k is {}; the vocabulary has {vocab} tokens",
            sampling.top_k
        )));
    }
    let spec = request.speculation.unwrap_or_default();
    let max_k = match spec.max_k as usize {
        0 => limits.default_k,
        k if k > limits.max_k => {
            return Err(invalid(format!(
                "speculation.max_k is {k}; it must be in [0, {}]",
                limits.max_k
            )));
        }
        k => k,
    };
    let drafter = match pb::DrafterKind::try_from(spec.drafter) {
        Ok(pb::DrafterKind::Unspecified | pb::DrafterKind::Ngram) => Drafter::Ngram,
        Ok(pb::DrafterKind::Lm) => Drafter::Lm,
        Err(_) => {
            return Err(invalid(format!(
                "speculation.drafter {} is not a drafter kind",
                spec.drafter
            )));
        }
    };
    if request.session_id.len() > 256 {
        return Err(invalid("session_id is longer than 256 bytes"));
    }
    Ok(GenerationParams {
        input,
        max_tokens,
        stop: request.stop.clone(),
        sampling,
        seed: request.seed.unwrap_or_else(rand::random),
        speculate: !spec.disable,
        max_k,
        fixed_k: spec.fixed_k,
        drafter,
        session_id: (!request.session_id.is_empty()).then(|| request.session_id.clone()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prompt(text: &str) -> pb::GenerateRequest {
        pb::GenerateRequest {
            input: Some(pb::generate_request::Input::Prompt(text.into())),
            ..Default::default()
        }
    }

    fn refused(request: pb::GenerateRequest, needle: &str) {
        match validate(&request, &Limits::default(), 1000) {
            Err(OrchestratorError::InvalidArgument(m)) => {
                assert!(m.contains(needle), "{m:?} lacks {needle:?}")
            }
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
    }

    #[test]
    fn defaults_fill_in() {
        let p = validate(&prompt("hi"), &Limits::default(), 1000).unwrap();
        assert_eq!(p.max_tokens, 256);
        assert_eq!(p.max_k, 8);
        assert!(p.speculate);
        assert!(p.sampling.is_greedy());
        assert_eq!(p.drafter, Drafter::Ngram);
    }

    #[test]
    fn every_bad_field_is_named() {
        refused(pb::GenerateRequest::default(), "neither a prompt");
        refused(prompt(""), "prompt is empty");
        refused(prompt(&"x".repeat(300_000)), "bytes; the limit");
        refused(
            pb::GenerateRequest {
                max_tokens: 5000,
                ..prompt("a")
            },
            "max_tokens is 5000",
        );
        refused(
            pb::GenerateRequest {
                stop: vec![String::new()],
                ..prompt("a")
            },
            "stop string",
        );
        refused(
            pb::GenerateRequest {
                stop: vec!["s".into(); 9],
                ..prompt("a")
            },
            "9 stop strings",
        );
        let sampling = |temperature, top_k, top_p| {
            Some(pb::SamplingParams {
                temperature,
                top_k,
                top_p,
            })
        };
        refused(
            pb::GenerateRequest {
                sampling: sampling(-1.0, 0, 1.0),
                ..prompt("a")
            },
            "temperature",
        );
        refused(
            pb::GenerateRequest {
                sampling: sampling(1.0, 0, 1.5),
                ..prompt("a")
            },
            "top_p",
        );
        refused(
            pb::GenerateRequest {
                sampling: sampling(1.0, 5000, 1.0),
                ..prompt("a")
            },
            "top_k",
        );
        let spec = |max_k, drafter| {
            Some(pb::SpeculationOptions {
                max_k,
                drafter,
                ..Default::default()
            })
        };
        refused(
            pb::GenerateRequest {
                speculation: spec(17, 0),
                ..prompt("a")
            },
            "max_k is 17",
        );
        refused(
            pb::GenerateRequest {
                speculation: spec(4, 9),
                ..prompt("a")
            },
            "drafter 9",
        );
        let chat = |messages: Vec<pb::ChatMessage>| {
            Some(pb::generate_request::Input::Chat(pb::ChatMessages { messages }))
        };
        refused(
            pb::GenerateRequest {
                input: chat(vec![]),
                ..Default::default()
            },
            "no messages",
        );
        let nameless = pb::ChatMessage {
            role: String::new(),
            content: "x".into(),
        };
        refused(
            pb::GenerateRequest {
                input: chat(vec![nameless]),
                ..Default::default()
            },
            "no role",
        );
    }
}
