//! Built-in presets: a model config and a task tokenizer made in code, needing no file.

use candle_core::Device;
use serde_json::{json, Value};

use crate::config::{Arch, ModelConfig};
use crate::policy::Policy;
use crate::tokenizer::TextTokenizer;
use crate::weights::Weights;
use crate::{ModelError, Result};

/// Special tokens of the task tokenizer, in id order.
const SPECIALS: [&str; 5] = [
    "<|pad|>",
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|unk|>",
];
/// Whole-word tokens for the built-in tasks' prompts and answers.
const WORDS: [&str; 16] = [
    "answer",
    "assistant",
    "system",
    "user",
    "what",
    "is",
    "the",
    "of",
    "plus",
    "minus",
    "times",
    "sum",
    "product",
    "Answer",
    "What",
    "Compute",
];
/// ChatML, as SmolLM2 and Qwen use it.
pub(crate) const CHATML: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// Names accepted after `builtin:`.
pub const PRESETS: [&str; 1] = ["tiny"];

/// The preset `name` with freshly initialised, seeded weights.
pub fn load_preset(name: &str, device: &Device) -> Result<Policy> {
    match name {
        "tiny" => tiny(device),
        other => Err(ModelError::Config {
            origin: format!("builtin:{other}"),
            reason: format!("unknown preset (available: {})", PRESETS.join(", ")),
        }),
    }
}

fn tiny(device: &Device) -> Result<Policy> {
    let tokenizer = task_tokenizer()?;
    let id = |t: &str| {
        tokenizer
            .token_to_id(t)
            .expect("special token is in the vocab")
    };
    let config = ModelConfig {
        arch: Arch::Qwen3,
        vocab_size: tokenizer.vocab_size(),
        hidden_size: 64,
        intermediate_size: 176,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 16,
        rope_theta: 10_000.0,
        rms_norm_eps: 1e-6,
        tie_word_embeddings: true,
        max_position_embeddings: 512,
        qkv_bias: false,
        o_bias: false,
        qk_norm: true,
        bos_token_id: None,
        eos_token_ids: vec![id("<|im_end|>"), id("<|endoftext|>")],
    };
    let weights = Weights::random(&config, 0.02, 0, device)?;
    Policy::new(config, weights, tokenizer)
}

/// The task tokenizer: special tokens, a few whole words, then single characters
/// (digits, operators, letters, whitespace); anything else maps to `<|unk|>`.
pub fn task_tokenizer() -> Result<TextTokenizer> {
    let mut vocab: Vec<String> = SPECIALS
        .iter()
        .chain(WORDS.iter())
        .map(|s| s.to_string())
        .collect();
    let chars = "0123456789+-*/=()<>.,:;?!%^'\" \n\\{}[]_#$&|~`@"
        .chars()
        .chain('a'..='z')
        .chain('A'..='Z');
    vocab.extend(chars.map(String::from));
    let vocab_map: serde_json::Map<String, Value> = vocab
        .iter()
        .enumerate()
        .map(|(i, t)| (t.clone(), json!(i)))
        .collect();
    let added: Vec<Value> = SPECIALS
        .iter()
        .enumerate()
        .map(|(i, t)| {
            json!({"id": i, "content": t, "single_word": false, "lstrip": false,
                   "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    // Whole words first, then any single character: every piece is a vocab entry or unk.
    let pattern = format!("{}|[\\s\\S]", WORDS.join("|"));
    let json = json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": {"type": "Split", "pattern": {"Regex": pattern},
                          "behavior": "Isolated", "invert": false},
        "post_processor": null,
        "decoder": {"type": "Fuse"},
        "model": {"type": "WordLevel", "vocab": vocab_map, "unk_token": "<|unk|>"},
    });
    let inner = TextTokenizer::from_json(&json.to_string(), "builtin:tiny")?;
    TextTokenizer::new(
        inner,
        Some(CHATML.to_string()),
        None,
        Some("<|im_end|>".into()),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::template::ChatMessage;

    #[test]
    fn task_tokenizer_round_trips_arithmetic() {
        let tok = task_tokenizer().unwrap();
        let text = "What is 12+34*5? Answer: 182";
        let ids = tok.encode(text, false).unwrap();
        assert_eq!(tok.decode(&ids, false).unwrap(), text);
        // "What" and "is" are whole words; digits are single tokens.
        assert_eq!(ids[0], tok.token_to_id("What").unwrap());
        assert_eq!(ids.len(), 1 + 1 + 1 + 1 + 7 + 1 + 1 + 1 + 1 + 1 + 3);
    }

    #[test]
    fn chat_prompt_uses_special_tokens() {
        let tok = task_tokenizer().unwrap();
        let text = tok
            .apply_chat_template(&[ChatMessage::new("user", "1+1")], true)
            .unwrap();
        let ids = tok.encode(&text, false).unwrap();
        assert_eq!(ids[0], tok.token_to_id("<|im_start|>").unwrap());
        assert!(ids.contains(&tok.token_to_id("<|im_end|>").unwrap()));
        assert_eq!(tok.decode(&ids, false).unwrap(), text);
    }

    #[test]
    fn unknown_characters_map_to_unk() {
        let tok = task_tokenizer().unwrap();
        assert_eq!(
            tok.encode("é", false).unwrap(),
            vec![tok.token_to_id("<|unk|>").unwrap()]
        );
    }
}
