//! Text <-> token ids, plus the chat template and special tokens that travel with them.

use std::collections::HashMap;
use std::path::Path;

use candle_core::quantized::gguf_file::Value as GgufValue;
use serde_json::{json, Value};

use crate::template::{ChatMessage, ChatTemplate};
use crate::weights::write_atomic;
use crate::{ModelError, Result};

/// A HF `tokenizers` tokenizer with its chat template and special tokens.
#[derive(Clone)]
pub struct TextTokenizer {
    inner: tokenizers::Tokenizer,
    chat_template: Option<ChatTemplate>,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

impl std::fmt::Debug for TextTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TextTokenizer")
            .field("vocab_size", &self.vocab_size())
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .field("has_chat_template", &self.chat_template.is_some())
            .finish()
    }
}

fn tok_err(origin: &str, reason: impl std::fmt::Display) -> ModelError {
    ModelError::Tokenizer {
        origin: origin.to_string(),
        reason: reason.to_string(),
    }
}

impl TextTokenizer {
    /// Assembles a tokenizer; the template (if any) is compiled now so errors show at load.
    pub fn new(
        inner: tokenizers::Tokenizer,
        chat_template: Option<String>,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Result<Self> {
        let chat_template = chat_template
            .map(|src| {
                ChatTemplate::new(
                    src,
                    bos_token.as_deref().unwrap_or(""),
                    eos_token.as_deref().unwrap_or(""),
                )
            })
            .transpose()?;
        Ok(Self {
            inner,
            chat_template,
            bos_token,
            eos_token,
        })
    }

    /// Parses a `tokenizer.json` document; `origin` names it in errors.
    pub fn from_json(json: &str, origin: &str) -> Result<tokenizers::Tokenizer> {
        // The tokenizers crate panics (`expect("Helper")`) on a syntax error inside the
        // decoder: reject broken JSON before it looks.
        serde_json::from_str::<serde::de::IgnoredAny>(json)
            .map_err(|e| tok_err(origin, format!("not valid JSON: {e}")))?;
        tokenizers::Tokenizer::from_bytes(json.as_bytes()).map_err(|e| tok_err(origin, e))
    }

    /// Loads `tokenizer.json` and, when present, `tokenizer_config.json` (chat template,
    /// bos/eos tokens) or `chat_template.jinja` from an HF directory.
    pub fn from_hf_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        let origin = path.display().to_string();
        let text = std::fs::read_to_string(&path).map_err(|e| ModelError::io(&path, e))?;
        let inner = Self::from_json(&text, &origin)?;
        let cfg_path = dir.join("tokenizer_config.json");
        let cfg: Value = match std::fs::read_to_string(&cfg_path) {
            Ok(t) => {
                serde_json::from_str(&t).map_err(|e| tok_err(&cfg_path.display().to_string(), e))?
            }
            Err(_) => Value::Null,
        };
        let jinja_path = dir.join("chat_template.jinja");
        let template = match std::fs::read_to_string(&jinja_path) {
            Ok(t) => Some(t),
            Err(_) => template_from_config(&cfg)
                .map_err(|r| tok_err(&cfg_path.display().to_string(), r))?,
        };
        Self::new(
            inner,
            template,
            special_token(&cfg, "bos_token"),
            special_token(&cfg, "eos_token"),
        )
    }

    /// Token ids of `text`; `add_special_tokens` applies the tokenizer's post-processor
    /// (e.g. a BOS). Chat prompts are encoded without it: the template wrote them already.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, add_special_tokens)
            .map_err(|e| tok_err("encode", e))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Text of `ids`, optionally without special tokens.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| tok_err("decode", e))
    }

    /// Renders `messages` with the chat template.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String> {
        let template = self.chat_template.as_ref().ok_or_else(|| {
            ModelError::Template("this tokenizer has no chat template".to_string())
        })?;
        template.render(messages, add_generation_prompt)
    }

    /// The chat template, if any.
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.chat_template.as_ref()
    }

    /// Id of a token string (special tokens included).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The EOS token string, if declared.
    pub fn eos_token(&self) -> Option<&str> {
        self.eos_token.as_deref()
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Writes `tokenizer.json` and `tokenizer_config.json` into `dir`, atomically.
    pub fn save_hf(&self, dir: &Path) -> Result<()> {
        let json = self
            .inner
            .to_string(false)
            .map_err(|e| tok_err("save", e))?;
        write_atomic(&dir.join("tokenizer.json"), json.as_bytes())?;
        let mut cfg = json!({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "clean_up_tokenization_spaces": false,
            "model_max_length": 1_000_000_000_000_000_000u64,
        });
        if let Some(b) = &self.bos_token {
            cfg["bos_token"] = b.as_str().into();
        }
        if let Some(e) = &self.eos_token {
            cfg["eos_token"] = e.as_str().into();
        }
        if let Some(t) = &self.chat_template {
            cfg["chat_template"] = t.source().into();
        }
        let text = serde_json::to_string_pretty(&cfg).expect("json value serialises");
        write_atomic(&dir.join("tokenizer_config.json"), text.as_bytes())
    }
}

/// `chat_template` of a tokenizer_config: a string, or a list of named templates.
fn template_from_config(cfg: &Value) -> std::result::Result<Option<String>, String> {
    match cfg.get("chat_template") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Array(named)) => {
            let pick = named
                .iter()
                .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                .or_else(|| named.first());
            Ok(pick
                .and_then(|t| t.get("template"))
                .and_then(Value::as_str)
                .map(str::to_string))
        }
        Some(other) => Err(format!(
            "chat_template must be a string or a list, got {other}"
        )),
    }
}

/// A special token in tokenizer_config: a string, or an AddedToken object with `content`.
fn special_token(cfg: &Value, key: &str) -> Option<String> {
    match cfg.get(key)? {
        Value::String(s) => Some(s.clone()),
        obj @ Value::Object(_) => obj
            .get("content")
            .and_then(Value::as_str)
            .map(str::to_string),
        _ => None,
    }
}

/// Rebuilds the tokenizer stored in GGUF metadata (`tokenizer.ggml.*`): byte-level BPE
/// (`tokenizer.ggml.model = "gpt2"`) with its merges, special tokens and chat template.
pub(crate) fn from_gguf_metadata(
    md: &HashMap<String, GgufValue>,
    origin: &str,
) -> Result<TextTokenizer> {
    let err = |key: &str, reason: &str| tok_err(origin, format!("metadata {key}: {reason}"));
    let strings = |key: &str| -> Result<Vec<String>> {
        let v = md.get(key).ok_or_else(|| err(key, "missing"))?;
        let items = v.to_vec().map_err(|_| err(key, "expected an array"))?;
        items
            .iter()
            .map(|x| {
                x.to_string()
                    .cloned()
                    .map_err(|_| err(key, "expected strings"))
            })
            .collect()
    };
    let id = |key: &str| md.get(key).and_then(|v| v.to_u32().ok());
    let model = md
        .get("tokenizer.ggml.model")
        .and_then(|v| v.to_string().ok())
        .ok_or_else(|| err("tokenizer.ggml.model", "missing"))?;
    if model != "gpt2" {
        return Err(err(
            "tokenizer.ggml.model",
            &format!("unsupported tokenizer model \"{model}\" (supported: gpt2 byte-level BPE)"),
        ));
    }
    let tokens = strings("tokenizer.ggml.tokens")?;
    let merges = strings("tokenizer.ggml.merges")?;
    let types: Vec<i32> = match md.get("tokenizer.ggml.token_type") {
        Some(v) => v
            .to_vec()
            .map_err(|_| err("tokenizer.ggml.token_type", "expected an array"))?
            .iter()
            .map(|x| x.to_i32().unwrap_or(1))
            .collect(),
        None => vec![1; tokens.len()],
    };
    let json = gpt2_tokenizer_json(&tokens, &merges, &types);
    let inner = TextTokenizer::from_json(&json.to_string(), origin)?;
    let name_of = |key: &str| id(key).and_then(|i| tokens.get(i as usize)).cloned();
    let template = md
        .get("tokenizer.chat_template")
        .and_then(|v| v.to_string().ok())
        .cloned();
    TextTokenizer::new(
        inner,
        template,
        name_of("tokenizer.ggml.bos_token_id"),
        name_of("tokenizer.ggml.eos_token_id"),
    )
}

/// GGUF token types: control (3) and user-defined (4) tokens become added tokens.
pub(crate) const CONTROL: i32 = 3;
const USER_DEFINED: i32 = 4;

/// The tokenizer.json of a byte-level BPE with the given vocab, merges and token types.
pub(crate) fn gpt2_tokenizer_json(tokens: &[String], merges: &[String], types: &[i32]) -> Value {
    let vocab: serde_json::Map<String, Value> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), json!(i)))
        .collect();
    let added: Vec<Value> = tokens
        .iter()
        .enumerate()
        .filter(|(i, _)| matches!(types.get(*i), Some(&CONTROL) | Some(&USER_DEFINED)))
        .map(|(i, t)| {
            json!({"id": i, "content": t, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": types[i] == CONTROL})
        })
        .collect();
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false,
                          "trim_offsets": true, "use_regex": true},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": true,
                           "trim_offsets": false, "use_regex": true},
        "decoder": {"type": "ByteLevel", "add_prefix_space": true,
                    "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
                  "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": merges},
    })
}
