//! A policy: config, weights and tokenizer, read from an HF directory or GGUF and saved
//! back as an HF directory.

use std::path::{Path, PathBuf};

use candle_core::Device;
use serde_json::json;

use crate::config::{parse_token_ids, ModelConfig};
use crate::decoder::CausalLm;
use crate::tokenizer::TextTokenizer;
use crate::weights::{
    load_gguf, load_safetensors_dir, save_safetensors_atomic, write_atomic, Weights,
};
use crate::{ModelError, Result};

/// Everything needed to run and train a model.
#[derive(Debug, Clone)]
pub struct Policy {
    pub config: ModelConfig,
    pub weights: Weights,
    pub tokenizer: TextTokenizer,
}

impl Policy {
    /// Checks that the parts agree (tokenizer ids fit the embedding).
    pub fn new(config: ModelConfig, weights: Weights, tokenizer: TextTokenizer) -> Result<Self> {
        if tokenizer.vocab_size() > config.vocab_size {
            return Err(ModelError::Config {
                origin: weights.origin().to_string(),
                reason: format!(
                    "tokenizer has {} tokens but the model's vocab_size is {}",
                    tokenizer.vocab_size(),
                    config.vocab_size
                ),
            });
        }
        Ok(Self {
            config,
            weights,
            tokenizer,
        })
    }

    /// Loads an HF directory: `config.json`, safetensors (single or sharded),
    /// `tokenizer.json` (+ `tokenizer_config.json`), and EOS ids from
    /// `generation_config.json` when present.
    pub fn from_hf_dir(dir: &Path, device: &Device) -> Result<Self> {
        let cfg_path = dir.join("config.json");
        let text = std::fs::read_to_string(&cfg_path).map_err(|e| ModelError::io(&cfg_path, e))?;
        let mut config = ModelConfig::from_hf_json(&text, &cfg_path.display().to_string())?;
        let gen_path = dir.join("generation_config.json");
        if let Ok(gen) = std::fs::read_to_string(&gen_path) {
            let bad = |reason: String| ModelError::Config {
                origin: gen_path.display().to_string(),
                reason,
            };
            let v: serde_json::Value =
                serde_json::from_str(&gen).map_err(|e| bad(format!("not valid JSON: {e}")))?;
            if let Some(eos) = v.get("eos_token_id").filter(|e| !e.is_null()) {
                let ids = parse_token_ids(eos).map_err(|e| bad(format!("eos_token_id: {e}")))?;
                for id in ids.into_iter().rev() {
                    if !config.eos_token_ids.contains(&id) {
                        config.eos_token_ids.insert(0, id);
                    }
                }
            }
        }
        let tensors = load_safetensors_dir(dir, device)?;
        let weights = Weights::from_tensors(&config, tensors, dir.display().to_string())?;
        let tokenizer = TextTokenizer::from_hf_dir(dir)?;
        Self::new(config, weights, tokenizer)
    }

    /// Loads a GGUF file, dequantised to f32.
    pub fn from_gguf(path: &Path, device: &Device) -> Result<Self> {
        let g = load_gguf(path, device)?;
        let weights = Weights::from_tensors(&g.config, g.tensors, path.display().to_string())?;
        Self::new(g.config, weights, g.tokenizer)
    }

    /// The model network over these weights.
    pub fn model(&self) -> Result<CausalLm> {
        CausalLm::new(&self.config, &self.weights)
    }

    /// Token ids that end a generation.
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.config.eos_token_ids
    }

    /// Saves as an HF directory (config, safetensors, tokenizer, generation config) that
    /// transformers loads. Atomic: the files are written to a sibling temporary directory
    /// that replaces `dir` in one rename, so a crash never leaves a half-written model.
    pub fn save_hf(&self, dir: &Path) -> Result<()> {
        let tmp = sibling(dir, "tmp");
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(&tmp).map_err(|e| ModelError::io(&tmp, e))?;
        let written = self.write_hf_files(&tmp);
        if let Err(e) = written {
            let _ = std::fs::remove_dir_all(&tmp);
            return Err(e);
        }
        let old = sibling(dir, "old");
        if dir.exists() {
            std::fs::rename(dir, &old).map_err(|e| ModelError::io(dir, e))?;
        }
        std::fs::rename(&tmp, dir).map_err(|e| ModelError::io(dir, e))?;
        let _ = std::fs::remove_dir_all(&old);
        Ok(())
    }

    fn write_hf_files(&self, dir: &Path) -> Result<()> {
        let config = serde_json::to_string_pretty(&self.config.to_hf_json()).expect("json");
        write_atomic(&dir.join("config.json"), config.as_bytes())?;
        let mut gen = json!({"do_sample": true});
        if let Some(bos) = self.config.bos_token_id {
            gen["bos_token_id"] = bos.into();
        }
        if !self.config.eos_token_ids.is_empty() {
            gen["eos_token_id"] = self.config.eos_token_ids.clone().into();
        }
        let gen = serde_json::to_string_pretty(&gen).expect("json");
        write_atomic(&dir.join("generation_config.json"), gen.as_bytes())?;
        save_safetensors_atomic(self.weights.tensors(), &dir.join("model.safetensors"))?;
        self.tokenizer.save_hf(dir)
    }
}

/// `dir` with a suffix, in the same parent (so renames stay on one filesystem).
fn sibling(dir: &Path, what: &str) -> PathBuf {
    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy())
        .unwrap_or_default();
    dir.with_file_name(format!(".{name}.{what}-{}", std::process::id()))
}
