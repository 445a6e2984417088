//! Chat templates: the Jinja source from `tokenizer_config.json` (or GGUF metadata),
//! rendered with minijinja the way transformers' `apply_chat_template` renders it.

use minijinja::{Environment, Error, ErrorKind};
use serde::{Deserialize, Serialize};

use crate::{ModelError, Result};

/// One chat message, as in the OpenAI and HF APIs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    /// A message with `role` and `content`.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A chat template (its source, syntax-checked at construction) plus the special tokens it
/// may refer to.
#[derive(Debug, Clone)]
pub struct ChatTemplate {
    source: String,
    bos_token: String,
    eos_token: String,
}

impl ChatTemplate {
    /// Compiles `source` once to report syntax errors at load time, not at first use.
    pub fn new(source: impl Into<String>, bos_token: &str, eos_token: &str) -> Result<Self> {
        let source = source.into();
        environment()
            .template_from_str(&source)
            .map_err(|e| ModelError::Template(describe(&e)))?;
        Ok(Self {
            source,
            bos_token: bos_token.to_string(),
            eos_token: eos_token.to_string(),
        })
    }

    /// The Jinja source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders `messages`; with `add_generation_prompt` the text ends where the assistant's
    /// reply begins.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        let env = environment();
        let template = env
            .template_from_str(&self.source)
            .map_err(|e| ModelError::Template(describe(&e)))?;
        template
            .render(minijinja::context! {
                messages => messages,
                add_generation_prompt => add_generation_prompt,
                bos_token => &self.bos_token,
                eos_token => &self.eos_token,
            })
            .map_err(|e| ModelError::Template(describe(&e)))
    }
}

/// The Jinja environment HF uses: trim_blocks, lstrip_blocks, Python string methods,
/// `raise_exception`.
fn environment() -> Environment<'static> {
    let mut env = Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function(
        "raise_exception",
        |msg: String| -> std::result::Result<String, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, msg))
        },
    );
    env
}

/// The error with its whole cause chain and, where known, the template line.
fn describe(e: &Error) -> String {
    let mut text = e.to_string();
    if let Some(line) = e.line() {
        text.push_str(&format!(" (template line {line})"));
    }
    let mut source = std::error::Error::source(e);
    while let Some(inner) = source {
        text.push_str(&format!(": {inner}"));
        source = inner.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

    #[test]
    fn renders_chatml() {
        let t = ChatTemplate::new(CHATML, "", "<|im_end|>").unwrap();
        let text = t.render(&[ChatMessage::new("user", "hi")], true).unwrap();
        assert_eq!(
            text,
            "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn python_methods_and_blocks_trimmed() {
        let src = "{% for m in messages %}\n  {% if m.role == 'user' %}{{ m.content.strip().upper() }}|{% endif %}{% endfor %}";
        let t = ChatTemplate::new(src, "", "").unwrap();
        let text = t
            .render(&[ChatMessage::new("user", "  a b ")], false)
            .unwrap();
        assert_eq!(text, "A B|");
    }

    #[test]
    fn errors_are_clear() {
        let err = ChatTemplate::new("{% for %}", "", "")
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("chat template:"), "{err}");
        let t = ChatTemplate::new("{{ raise_exception('roles must alternate') }}", "", "").unwrap();
        let err = t.render(&[], false).unwrap_err().to_string();
        assert!(err.contains("roles must alternate"), "{err}");
    }
}
