//! Chat formatting with the model's own `tokenizer.chat_template` (a Jinja template in the
//! GGUF metadata), rendered with minijinja and Python-compatible string methods.

use minijinja::{Environment, ErrorKind, context};
use serde::{Deserialize, Serialize};

use crate::error::{ModelError, Result};

/// One chat message, as chat templates expect it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A compiled chat template plus the special tokens it may refer to.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

impl ChatTemplate {
    pub fn new(source: &str, bos_token: String, eos_token: String) -> Result<Self> {
        let mut env = Environment::new();
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |message: String| -> std::result::Result<String, minijinja::Error> {
                Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
            },
        );
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| ModelError::ChatTemplate(e.to_string()))?;
        Ok(Self {
            env,
            bos_token,
            eos_token,
        })
    }

    /// Renders `messages`; with `add_generation_prompt` the text ends where the assistant's
    /// reply begins.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        if messages.is_empty() {
            return Err(ModelError::ChatTemplate("no messages to format".into()));
        }
        let template = self
            .env
            .get_template("chat")
            .map_err(|e| ModelError::ChatTemplate(e.to_string()))?;
        template
            .render(context! {
                messages => messages,
                add_generation_prompt => add_generation_prompt,
                bos_token => self.bos_token,
                eos_token => self.eos_token,
            })
            .map_err(|e| ModelError::ChatTemplate(e.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMOLLM2_TEMPLATE: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    #[test]
    fn renders_chatml_with_default_system_prompt() {
        let template =
            ChatTemplate::new(SMOLLM2_TEMPLATE, "<|im_start|>".into(), "<|im_end|>".into()).unwrap();
        let text = template.render(&[ChatMessage::new("user", "Hi")], true).unwrap();
        assert_eq!(
            text,
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn python_string_methods_and_raise_exception_work() {
        let source = "{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}{{ messages[0].content.strip() }}";
        let template = ChatTemplate::new(source, String::new(), String::new()).unwrap();
        assert_eq!(
            template
                .render(&[ChatMessage::new("user", "  x  ")], false)
                .unwrap(),
            "x"
        );
        let err = template
            .render(&[ChatMessage::new("system", "x")], false)
            .unwrap_err();
        assert!(err.to_string().contains("first must be user"), "{err}");
    }

    #[test]
    fn empty_conversation_is_refused() {
        let template = ChatTemplate::new("{{ messages }}", String::new(), String::new()).unwrap();
        assert!(template.render(&[], true).is_err());
    }
}
