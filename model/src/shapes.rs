//! Random-weight models of real shapes (`random:qwen2.5-0.5b@seed=7`): a published
//! `config.json`, weights drawn on the host from a seed, and a synthetic byte-level
//! tokenizer of the real vocabulary size, to time and compare devices at real sizes without
//! carrying weights.

use std::fmt;
use std::str::FromStr;

use candle_core::{DType, Device};
use serde_json::Value;

use crate::config::ModelConfig;
use crate::policy::Policy;
use crate::presets::CHATML;
use crate::tokenizer::{gpt2_tokenizer_json, TextTokenizer, CONTROL};
use crate::weights::Weights;
use crate::{ModelError, Result};

/// What a model spec starts with to name a shape.
pub const PREFIX: &str = "random:";

/// A published model whose shape (not weights) is built in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shape {
    /// SmolLM2-135M(-Instruct): Llama, 30 layers, 576 wide, vocabulary 49,152.
    SmolLm2_135m,
    /// Qwen2.5-0.5B(-Instruct): Qwen2, 24 layers, 896 wide, vocabulary 151,936.
    Qwen25_0_5b,
    /// Qwen2.5-1.5B(-Instruct): Qwen2, 28 layers, 1536 wide, vocabulary 151,936.
    Qwen25_1_5b,
    /// Qwen3-1.7B: Qwen3, 28 layers, 2048 wide, vocabulary 151,936.
    Qwen3_1_7b,
}

impl Shape {
    /// Every shape, smallest first.
    pub const ALL: [Shape; 4] = [
        Shape::SmolLm2_135m,
        Shape::Qwen25_0_5b,
        Shape::Qwen25_1_5b,
        Shape::Qwen3_1_7b,
    ];

    /// The name after `random:`.
    pub fn name(self) -> &'static str {
        match self {
            Shape::SmolLm2_135m => "smollm2-135m",
            Shape::Qwen25_0_5b => "qwen2.5-0.5b",
            Shape::Qwen25_1_5b => "qwen2.5-1.5b",
            Shape::Qwen3_1_7b => "qwen3-1.7b",
        }
    }

    /// The model's HF `config.json`, as published (the instruct variants' where both exist).
    pub fn config_json(self) -> &'static str {
        match self {
            Shape::SmolLm2_135m => include_str!("../shapes/smollm2-135m.json"),
            Shape::Qwen25_0_5b => include_str!("../shapes/qwen2.5-0.5b.json"),
            Shape::Qwen25_1_5b => include_str!("../shapes/qwen2.5-1.5b.json"),
            Shape::Qwen3_1_7b => include_str!("../shapes/qwen3-1.7b.json"),
        }
    }

    /// The parsed config.
    pub fn config(self) -> Result<ModelConfig> {
        ModelConfig::from_hf_json(self.config_json(), &self.origin())
    }

    /// The config's `initializer_range`: the standard deviation HF draws matrices with.
    pub fn initializer_range(self) -> f64 {
        let json: Value = serde_json::from_str(self.config_json()).expect("built-in JSON");
        json["initializer_range"].as_f64().unwrap_or(0.02)
    }

    /// The real tokenizer's ChatML tokens at their real ids.
    fn specials(self) -> [(u32, &'static str); 3] {
        let first = match self {
            Shape::SmolLm2_135m => 0,
            _ => 151_643,
        };
        [
            (first, "<|endoftext|>"),
            (first + 1, "<|im_start|>"),
            (first + 2, "<|im_end|>"),
        ]
    }

    /// A byte-level tokenizer of exactly the config's vocabulary size: the ChatML special
    /// tokens at the real ids, one token per byte at the lowest free ids (so any text
    /// encodes, a byte a token) and placeholders `<|unused_ID|>` for the rest; ChatML
    /// template.
    pub fn tokenizer(self) -> Result<TextTokenizer> {
        let config = self.config()?;
        let origin = self.origin();
        let mut tokens: Vec<Option<String>> = vec![None; config.vocab_size];
        let mut types = vec![1; config.vocab_size];
        for (id, name) in self.specials() {
            tokens[id as usize] = Some(name.to_string());
            types[id as usize] = CONTROL;
        }
        let mut bytes = byte_chars();
        for slot in tokens.iter_mut().filter(|t| t.is_none()) {
            match bytes.next() {
                Some(c) => *slot = Some(c.to_string()),
                None => break,
            }
        }
        let tokens: Vec<String> = tokens
            .into_iter()
            .enumerate()
            .map(|(id, t)| t.unwrap_or_else(|| format!("<|unused_{id}|>")))
            .collect();
        let json = gpt2_tokenizer_json(&tokens, &[], &types);
        let inner = TextTokenizer::from_json(&json.to_string(), &origin)?;
        let name_of = |id: Option<u32>| id.map(|i| tokens[i as usize].clone());
        TextTokenizer::new(
            inner,
            Some(CHATML.to_string()),
            name_of(config.bos_token_id),
            name_of(config.eos_token_ids.first().copied()),
        )
    }

    /// The policy: weights drawn from `seed` straight into `dtype` on the host (normal(0,
    /// `initializer_range`), norms at 1, biases at 0), moved to `device` a tensor at a
    /// time. The same seed gives the same weights on every device.
    pub fn policy(self, seed: u64, dtype: DType, device: &Device) -> Result<Policy> {
        let config = self.config()?;
        let weights = Weights::draw(&config, self.initializer_range(), seed, dtype, device)?;
        Policy::new(config, weights, self.tokenizer()?)
    }

    fn origin(self) -> String {
        format!("{PREFIX}{}", self.name())
    }
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Shape {
    type Err = ModelError;

    fn from_str(s: &str) -> Result<Self> {
        Shape::ALL
            .into_iter()
            .find(|shape| shape.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| ModelError::Config {
                origin: format!("{PREFIX}{s}"),
                reason: format!("unknown shape (available: {})", names()),
            })
    }
}

/// What follows `random:` in a model spec: a shape and the seed of its weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RandomSpec {
    pub shape: Shape,
    /// 0 unless the spec says `@seed=N`.
    pub seed: u64,
}

impl RandomSpec {
    /// The policy this spec names, in f32 on `device`.
    pub fn load(self, device: &Device) -> Result<Policy> {
        self.shape.policy(self.seed, DType::F32, device)
    }
}

impl FromStr for RandomSpec {
    type Err = ModelError;

    /// `SHAPE` or `SHAPE@seed=N`.
    fn from_str(s: &str) -> Result<Self> {
        let (name, options) = match s.split_once('@') {
            Some((name, options)) => (name, Some(options)),
            None => (s, None),
        };
        let shape = name.parse()?;
        let seed = match options {
            None => 0,
            Some(o) => o
                .strip_prefix("seed=")
                .and_then(|n| n.parse().ok())
                .ok_or_else(|| ModelError::Config {
                    origin: format!("{PREFIX}{s}"),
                    reason: format!(
                        "expected @seed=N (N a whole number) after the shape, got @{o}"
                    ),
                })?,
        };
        Ok(Self { shape, seed })
    }
}

/// The shape names, for messages.
pub fn names() -> String {
    Shape::ALL.map(Shape::name).join(", ")
}

/// GPT-2's byte-level alphabet: the character standing for each byte 0..=255, in order.
fn byte_chars() -> impl Iterator<Item = char> {
    let printable = |b: u32| (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || b >= 0xae;
    let mut next_unprintable = 256;
    (0..256u32).map(move |b| {
        let code = if printable(b) {
            b
        } else {
            next_unprintable += 1;
            next_unprintable - 1
        };
        char::from_u32(code).expect("below the surrogates")
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::template::ChatMessage;

    #[test]
    fn configs_load_with_the_published_parameter_counts() {
        // HF's num_parameters(), a tied lm_head counted once (Qwen3-1.7B's safetensors also
        // store the tied copy: 2,031,739,904).
        let published = [
            (Shape::SmolLm2_135m, 134_515_008),
            (Shape::Qwen25_0_5b, 494_032_768),
            (Shape::Qwen25_1_5b, 1_543_714_304),
            (Shape::Qwen3_1_7b, 1_720_574_976),
        ];
        for (shape, count) in published {
            let c = shape.config().unwrap();
            assert_eq!(c.num_parameters(), count, "{shape}");
            assert!(c.tie_word_embeddings, "{shape}");
            assert_eq!(shape.name().parse::<Shape>().unwrap(), shape);
        }
        let initializer = Shape::ALL.map(Shape::initializer_range);
        assert_eq!(initializer, [0.041666666666666664, 0.02, 0.02, 0.02]);
    }

    #[test]
    fn specs_parse_and_refuse() {
        let spec: RandomSpec = "Qwen2.5-0.5B@seed=7".parse().unwrap();
        assert_eq!((spec.shape, spec.seed), (Shape::Qwen25_0_5b, 7));
        assert_eq!("qwen3-1.7b".parse::<RandomSpec>().unwrap().seed, 0);
        let err = "llama-7b".parse::<RandomSpec>().unwrap_err().to_string();
        assert!(
            err.contains("random:llama-7b") && err.contains("smollm2-135m"),
            "{err}"
        );
        let err = "qwen3-1.7b@seed=x"
            .parse::<RandomSpec>()
            .unwrap_err()
            .to_string();
        assert!(err.contains("@seed=N"), "{err}");
    }

    #[test]
    fn tokenizers_have_the_real_vocabulary_and_specials() {
        for shape in Shape::ALL {
            let config = shape.config().unwrap();
            let tok = shape.tokenizer().unwrap();
            assert_eq!(tok.vocab_size(), config.vocab_size, "{shape}");
            let im_end = tok.token_to_id("<|im_end|>").unwrap();
            assert_eq!(config.eos_token_ids, vec![im_end], "{shape}");
            assert_eq!(tok.eos_token(), Some("<|im_end|>"));
            let text = tok
                .apply_chat_template(&[ChatMessage::new("user", "2+2 = ? é ✓")], true)
                .unwrap();
            let ids = tok.encode(&text, false).unwrap();
            assert_eq!(ids[0], im_end - 1, "{shape}: <|im_start|>");
            assert_eq!(tok.decode(&ids, false).unwrap(), text, "{shape}");
        }
    }

    #[test]
    fn smallest_shape_loads_from_its_spec_and_runs() {
        let policy = Policy::load("random:smollm2-135m@seed=3", &Device::Cpu).unwrap();
        assert_eq!(policy.config, Shape::SmolLm2_135m.config().unwrap());
        let count: usize = policy
            .weights
            .tensors()
            .values()
            .map(|t| t.elem_count())
            .sum();
        assert_eq!(count, 134_515_008);
        let ids = policy.tokenizer.encode("Hello, world", false).unwrap();
        let row = crate::PackedRow::new(&[&ids], &Device::Cpu).unwrap();
        let model = policy.model().unwrap();
        let hidden = model
            .forward(&row.input_ids, &row.positions, &mut row.attention())
            .unwrap();
        let logits = model.logits(&hidden).unwrap();
        assert_eq!(logits.dims(), [ids.len(), 49_152]);
        let values = logits.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert!(values.iter().all(|x| x.is_finite()));
        assert!(values.iter().any(|&x| x != 0.0));
    }
}
