//! The model's hyper-parameters, read from (and written back to) an HF `config.json`.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::{ModelError, Result};

/// Decoder families that share our one decoder implementation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Arch {
    /// Llama, SmolLM2: no biases, no q/k norm.
    Llama,
    /// Qwen2: bias on the q, k and v projections.
    Qwen2,
    /// Qwen3: RMSNorm over each head of q and k before rope.
    Qwen3,
}

impl Arch {
    /// The HF `model_type` string.
    pub fn model_type(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
        }
    }

    /// The HF class name written in `architectures`.
    pub fn hf_class(self) -> &'static str {
        match self {
            Arch::Llama => "LlamaForCausalLM",
            Arch::Qwen2 => "Qwen2ForCausalLM",
            Arch::Qwen3 => "Qwen3ForCausalLM",
        }
    }

    fn from_model_type(model_type: &str) -> Option<Self> {
        match model_type {
            "llama" => Some(Arch::Llama),
            "qwen2" => Some(Arch::Qwen2),
            "qwen3" => Some(Arch::Qwen3),
            _ => None,
        }
    }
}

/// Validated hyper-parameters of a decoder-only transformer.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub arch: Arch,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rope_theta: f64,
    pub rms_norm_eps: f64,
    pub tie_word_embeddings: bool,
    pub max_position_embeddings: usize,
    /// Bias on the q, k and v projections (Qwen2; Llama's `attention_bias`).
    pub qkv_bias: bool,
    /// Bias on the output projection (Llama's `attention_bias` only).
    pub o_bias: bool,
    /// Per-head RMSNorm of q and k (Qwen3).
    pub qk_norm: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

/// The subset of HF `config.json` we read; other keys are checked by [`refuse_unsupported`].
#[derive(Debug, Deserialize)]
struct HfConfig {
    model_type: Option<String>,
    architectures: Option<Vec<String>>,
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    #[serde(default = "default_rope_theta")]
    rope_theta: f64,
    #[serde(default = "default_eps")]
    rms_norm_eps: f64,
    tie_word_embeddings: Option<bool>,
    #[serde(default = "default_max_pos")]
    max_position_embeddings: usize,
    #[serde(default)]
    attention_bias: bool,
    bos_token_id: Option<u32>,
    eos_token_id: Option<Value>,
}

fn default_rope_theta() -> f64 {
    10_000.0
}
fn default_eps() -> f64 {
    1e-6
}
fn default_max_pos() -> usize {
    2048
}

/// The largest size a config may give any dimension (vocabulary, hidden, heads...): real
/// models stay far below, and the bound keeps shape arithmetic from overflowing and a lying
/// file from asking for absurd allocations.
const MAX_DIM: usize = 1 << 24;
/// The most layers a config may declare.
const MAX_LAYERS: usize = 1 << 12;
/// The longest context a config may declare (the rope tables are allocated for all of it).
const MAX_POSITIONS: usize = 1 << 20;

impl ModelConfig {
    /// Parses an HF `config.json`; `origin` names the file in error messages.
    pub fn from_hf_json(text: &str, origin: &str) -> Result<Self> {
        let bad = |reason: String| ModelError::Config {
            origin: origin.to_string(),
            reason,
        };
        let raw: Value =
            serde_json::from_str(text).map_err(|e| bad(format!("not valid JSON: {e}")))?;
        let obj = raw
            .as_object()
            .ok_or_else(|| bad("expected a JSON object".into()))?;
        let hf: HfConfig = serde_json::from_value(raw.clone()).map_err(|e| bad(e.to_string()))?;
        let arch = resolve_arch(&hf).map_err(bad)?;
        refuse_unsupported(obj, arch).map_err(bad)?;
        let rope_theta = rope_theta(obj, hf.rope_theta).map_err(bad)?;
        let eos_token_ids = match &hf.eos_token_id {
            None | Some(Value::Null) => Vec::new(),
            Some(v) => parse_token_ids(v).map_err(|e| bad(format!("eos_token_id: {e}")))?,
        };
        let cfg = ModelConfig {
            arch,
            vocab_size: hf.vocab_size,
            hidden_size: hf.hidden_size,
            intermediate_size: hf.intermediate_size,
            num_hidden_layers: hf.num_hidden_layers,
            num_attention_heads: hf.num_attention_heads,
            num_key_value_heads: hf.num_key_value_heads.unwrap_or(hf.num_attention_heads),
            head_dim: hf
                .head_dim
                .unwrap_or(hf.hidden_size / hf.num_attention_heads.max(1)),
            rope_theta,
            rms_norm_eps: hf.rms_norm_eps,
            // HF's PretrainedConfig defaults `tie_word_embeddings` to true; Qwen2 overrides it.
            tie_word_embeddings: hf.tie_word_embeddings.unwrap_or(arch != Arch::Qwen2),
            max_position_embeddings: hf.max_position_embeddings,
            qkv_bias: arch == Arch::Qwen2 || hf.attention_bias,
            o_bias: arch != Arch::Qwen2 && hf.attention_bias,
            qk_norm: arch == Arch::Qwen3,
            bos_token_id: hf.bos_token_id,
            eos_token_ids,
        };
        cfg.validate().map_err(bad)?;
        Ok(cfg)
    }

    /// Checks the shapes fit together (`from_hf_json` and the GGUF loader call it on what
    /// they read).
    pub(crate) fn validate(&self) -> std::result::Result<(), String> {
        let positive = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        if let Some((name, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return Err(format!("{name} must be positive"));
        }
        let limits = [
            ("num_hidden_layers", self.num_hidden_layers, MAX_LAYERS),
            (
                "max_position_embeddings",
                self.max_position_embeddings,
                MAX_POSITIONS,
            ),
        ];
        let sizes = positive.iter().map(|&(name, v)| (name, v, MAX_DIM));
        if let Some((name, v, max)) = limits.into_iter().chain(sizes).find(|(_, v, max)| v > max) {
            return Err(format!("{name} = {v} is implausibly large (at most {max})"));
        }
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            return Err(format!(
                "num_attention_heads ({}) must be a multiple of num_key_value_heads ({})",
                self.num_attention_heads, self.num_key_value_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(format!(
                "head_dim ({}) must be even for rope",
                self.head_dim
            ));
        }
        if !(self.rope_theta > 0.0 && self.rms_norm_eps > 0.0) {
            return Err("rope_theta and rms_norm_eps must be positive".into());
        }
        Ok(())
    }

    /// Writes the config as an HF `config.json` object that transformers loads.
    pub fn to_hf_json(&self) -> Value {
        let mut m = Map::new();
        let mut put = |k: &str, v: Value| {
            m.insert(k.to_string(), v);
        };
        put("architectures", serde_json::json!([self.arch.hf_class()]));
        put("model_type", self.arch.model_type().into());
        put("vocab_size", self.vocab_size.into());
        put("hidden_size", self.hidden_size.into());
        put("intermediate_size", self.intermediate_size.into());
        put("num_hidden_layers", self.num_hidden_layers.into());
        put("num_attention_heads", self.num_attention_heads.into());
        put("num_key_value_heads", self.num_key_value_heads.into());
        put("head_dim", self.head_dim.into());
        put("hidden_act", "silu".into());
        put("rope_theta", self.rope_theta.into());
        put("rms_norm_eps", self.rms_norm_eps.into());
        put("tie_word_embeddings", self.tie_word_embeddings.into());
        put(
            "max_position_embeddings",
            self.max_position_embeddings.into(),
        );
        put("rope_scaling", Value::Null);
        put("torch_dtype", "float32".into());
        put("use_cache", true.into());
        if self.arch != Arch::Qwen2 {
            put("attention_bias", self.qkv_bias.into());
        }
        if let Some(bos) = self.bos_token_id {
            put("bos_token_id", bos.into());
        }
        match self.eos_token_ids.as_slice() {
            [] => {}
            [one] => put("eos_token_id", (*one).into()),
            many => put("eos_token_id", many.to_vec().into()),
        }
        Value::Object(m)
    }

    /// Number of parameters, counting a tied lm_head once.
    pub fn num_parameters(&self) -> usize {
        let (h, d) = (self.hidden_size, self.head_dim);
        let q = self.num_attention_heads * d;
        let kv = self.num_key_value_heads * d;
        let mut attn = h * q + 2 * h * kv + q * h;
        if self.qkv_bias {
            attn += q + 2 * kv;
        }
        if self.o_bias {
            attn += h;
        }
        if self.qk_norm {
            attn += 2 * d;
        }
        let layer = attn + 3 * h * self.intermediate_size + 2 * h;
        let head = if self.tie_word_embeddings {
            0
        } else {
            self.vocab_size * h
        };
        self.vocab_size * h + self.num_hidden_layers * layer + h + head
    }

    /// FLOPs of one training step's forward and backward (about 6 per parameter per token)
    /// over `tokens` tokens of which only `lm_head_tokens` need the lm-head: the decoder
    /// layers and final norm for every token, the vocabulary projection for those alone
    /// (the embedding lookup costs no matmul; attention's own FLOPs are left out).
    pub fn train_flops(&self, tokens: usize, lm_head_tokens: usize) -> f64 {
        let projection = self.vocab_size * self.hidden_size;
        let untied_head = if self.tie_word_embeddings {
            0
        } else {
            projection
        };
        let body = self.num_parameters() - projection - untied_head;
        6.0 * (body * tokens + projection * lm_head_tokens) as f64
    }
}

fn resolve_arch(hf: &HfConfig) -> std::result::Result<Arch, String> {
    if let Some(mt) = &hf.model_type {
        return Arch::from_model_type(mt).ok_or_else(|| {
            format!("unsupported model_type \"{mt}\" (supported: llama, qwen2, qwen3)")
        });
    }
    let classes = hf.architectures.as_deref().unwrap_or_default();
    classes
        .iter()
        .find_map(|c| {
            [Arch::Llama, Arch::Qwen2, Arch::Qwen3]
                .into_iter()
                .find(|a| a.hf_class() == c)
        })
        .ok_or_else(|| {
            format!("unsupported architectures {classes:?} (supported: LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM)")
        })
}

/// `rope_theta`, top-level (transformers 4) or inside `rope_parameters` (transformers 5),
/// where only the default rope type is supported.
fn rope_theta(obj: &Map<String, Value>, top_level: f64) -> std::result::Result<f64, String> {
    let Some(params) = obj.get("rope_parameters").filter(|v| !v.is_null()) else {
        return Ok(top_level);
    };
    let kind = params
        .get("rope_type")
        .and_then(Value::as_str)
        .unwrap_or("default");
    if kind != "default" {
        return Err(format!(
            "unsupported rope_parameters {params} (only rope_type \"default\")"
        ));
    }
    match params.get("rope_theta") {
        None => Ok(top_level),
        Some(v) => v
            .as_f64()
            .ok_or_else(|| format!("rope_parameters.rope_theta must be a number, got {v}")),
    }
}

/// Refuses options that would change the maths if we ignored them.
fn refuse_unsupported(obj: &Map<String, Value>, arch: Arch) -> std::result::Result<(), String> {
    let get = |k: &str| obj.get(k).filter(|v| !v.is_null());
    if let Some(act) = get("hidden_act").or_else(|| get("hidden_activation")) {
        if act != "silu" {
            return Err(format!("unsupported hidden_act {act} (only \"silu\")"));
        }
    }
    if let Some(scaling) = get("rope_scaling") {
        let kind = scaling
            .get("rope_type")
            .or_else(|| scaling.get("type"))
            .and_then(Value::as_str);
        if kind != Some("default") {
            return Err(format!("unsupported rope_scaling {scaling}"));
        }
    }
    if get("mlp_bias").and_then(Value::as_bool) == Some(true) {
        return Err("unsupported mlp_bias = true".into());
    }
    if get("use_sliding_window").and_then(Value::as_bool) == Some(true) {
        return Err("unsupported use_sliding_window = true (sliding-window attention)".into());
    }
    if arch == Arch::Llama && get("pretraining_tp").and_then(Value::as_u64).unwrap_or(1) != 1 {
        return Err("unsupported pretraining_tp != 1".into());
    }
    if let Some(layer_types) = get("layer_types").and_then(Value::as_array) {
        if let Some(other) = layer_types.iter().find(|t| *t != "full_attention") {
            return Err(format!("unsupported layer type {other} in layer_types"));
        }
    }
    Ok(())
}

/// Reads a token id or a list of them (HF allows both for `eos_token_id`).
pub(crate) fn parse_token_ids(v: &Value) -> std::result::Result<Vec<u32>, String> {
    let one = |x: &Value| {
        x.as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| format!("expected a token id, got {x}"))
    };
    match v {
        Value::Array(items) => items.iter().map(one).collect(),
        other => Ok(vec![one(other)?]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const QWEN2: &str = r#"{"model_type":"qwen2","vocab_size":10,"hidden_size":8,
        "intermediate_size":16,"num_hidden_layers":1,"num_attention_heads":2,
        "num_key_value_heads":1,"eos_token_id":[3,4],"sliding_window":4096,
        "use_sliding_window":false,"rope_scaling":null}"#;

    #[test]
    fn qwen2_defaults() {
        let c = ModelConfig::from_hf_json(QWEN2, "t").unwrap();
        assert_eq!(c.arch, Arch::Qwen2);
        assert!(c.qkv_bias && !c.o_bias && !c.qk_norm && !c.tie_word_embeddings);
        assert_eq!(c.head_dim, 4);
        assert_eq!(c.eos_token_ids, vec![3, 4]);
    }

    #[test]
    fn round_trips_through_hf_json() {
        let c = ModelConfig::from_hf_json(QWEN2, "t").unwrap();
        let back = ModelConfig::from_hf_json(&c.to_hf_json().to_string(), "t").unwrap();
        assert_eq!(c, back);
    }

    #[test]
    fn refuses_what_it_cannot_run() {
        let cases = [
            (
                r#""model_type":"mistral""#,
                "unsupported model_type \"mistral\"",
            ),
            (r#""model_type":"llama","hidden_act":"gelu""#, "hidden_act"),
            (
                r#""model_type":"llama","rope_scaling":{"rope_type":"llama3","factor":8.0}"#,
                "rope_scaling",
            ),
            (
                r#""model_type":"qwen2","use_sliding_window":true"#,
                "sliding-window",
            ),
            (r#""model_type":"llama","mlp_bias":true"#, "mlp_bias"),
        ];
        for (extra, needle) in cases {
            let text = format!(
                r#"{{{extra},"vocab_size":10,"hidden_size":8,"intermediate_size":16,
                "num_hidden_layers":1,"num_attention_heads":2}}"#
            );
            let err = ModelConfig::from_hf_json(&text, "cfg.json")
                .unwrap_err()
                .to_string();
            assert!(
                err.contains(needle) && err.contains("cfg.json"),
                "{err} lacks {needle}"
            );
        }
    }

    #[test]
    fn reads_transformers5_rope_parameters() {
        let text = r#"{"model_type":"llama","vocab_size":10,"hidden_size":8,
            "intermediate_size":16,"num_hidden_layers":1,"num_attention_heads":2,
            "rope_parameters":{"rope_theta":500000.0,"rope_type":"default"}}"#;
        assert_eq!(
            ModelConfig::from_hf_json(text, "c").unwrap().rope_theta,
            500000.0
        );
        let yarn = text.replace("\"default\"", "\"yarn\"");
        let err = ModelConfig::from_hf_json(&yarn, "c")
            .unwrap_err()
            .to_string();
        assert!(err.contains("unsupported rope_parameters"), "{err}");
    }

    #[test]
    fn refuses_bad_gqa() {
        let text = r#"{"model_type":"llama","vocab_size":10,"hidden_size":12,
            "intermediate_size":16,"num_hidden_layers":1,"num_attention_heads":3,
            "num_key_value_heads":2}"#;
        let err = ModelConfig::from_hf_json(text, "c")
            .unwrap_err()
            .to_string();
        assert!(err.contains("multiple of num_key_value_heads"), "{err}");
    }
}
