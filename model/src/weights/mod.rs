//! Named parameter tensors, and the files they come from and go to.

mod draw;
mod fuse;
mod gguf;
mod safetensors;
mod save;

use std::collections::BTreeMap;

use candle_core::{DType, Device, Tensor, Var};
use rand::{rngs::StdRng, Rng, SeedableRng};

use crate::config::ModelConfig;
use crate::{ModelError, Result};

pub use gguf::{load_gguf, GgufModel};
pub use safetensors::load_safetensors_dir;
pub use save::{save_safetensors_atomic, write_atomic};

/// Parameter tensors by HF name (`model.layers.0.self_attn.q_proj.weight`), f32 on CPU.
#[derive(Debug, Clone)]
pub struct Weights {
    tensors: BTreeMap<String, Tensor>,
    origin: String,
    /// Concatenated projections whose parts `tensors` holds as views (see [`fuse`]).
    fused: BTreeMap<String, Tensor>,
}

/// The parameters a config needs, in canonical order, with their shapes.
pub fn param_specs(cfg: &ModelConfig) -> Vec<(String, Vec<usize>)> {
    let (v, h, i, d) = (
        cfg.vocab_size,
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.head_dim,
    );
    let q = cfg.num_attention_heads * d;
    let kv = cfg.num_key_value_heads * d;
    let mut specs = vec![("model.embed_tokens.weight".to_string(), vec![v, h])];
    for l in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{l}");
        let mut push = |name: &str, shape: Vec<usize>| specs.push((format!("{p}.{name}"), shape));
        push("input_layernorm.weight", vec![h]);
        push("self_attn.q_proj.weight", vec![q, h]);
        push("self_attn.k_proj.weight", vec![kv, h]);
        push("self_attn.v_proj.weight", vec![kv, h]);
        push("self_attn.o_proj.weight", vec![h, q]);
        if cfg.qkv_bias {
            push("self_attn.q_proj.bias", vec![q]);
            push("self_attn.k_proj.bias", vec![kv]);
            push("self_attn.v_proj.bias", vec![kv]);
        }
        if cfg.o_bias {
            push("self_attn.o_proj.bias", vec![h]);
        }
        if cfg.qk_norm {
            push("self_attn.q_norm.weight", vec![d]);
            push("self_attn.k_norm.weight", vec![d]);
        }
        push("post_attention_layernorm.weight", vec![h]);
        push("mlp.gate_proj.weight", vec![i, h]);
        push("mlp.up_proj.weight", vec![i, h]);
        push("mlp.down_proj.weight", vec![h, i]);
    }
    specs.push(("model.norm.weight".to_string(), vec![h]));
    if !cfg.tie_word_embeddings {
        specs.push(("lm_head.weight".to_string(), vec![v, h]));
    }
    specs
}

impl Weights {
    /// Keeps exactly the tensors `cfg` needs, checking names and shapes. Half-precision
    /// tensors are widened to f32; extra tensors (a tied `lm_head.weight`, rope buffers)
    /// are dropped.
    pub fn from_tensors(
        cfg: &ModelConfig,
        mut tensors: BTreeMap<String, Tensor>,
        origin: impl Into<String>,
    ) -> Result<Self> {
        let origin = origin.into();
        let mut kept = BTreeMap::new();
        for (name, shape) in param_specs(cfg) {
            let t = tensors.remove(&name).ok_or_else(|| {
                ModelError::weights(&origin, format!("missing tensor {name} (shape {shape:?})"))
            })?;
            if t.dims() != shape.as_slice() {
                return Err(ModelError::weights(
                    &origin,
                    format!("tensor {name} has shape {:?}, expected {shape:?}", t.dims()),
                ));
            }
            let t = match t.dtype() {
                DType::F32 | DType::F64 => t,
                _ => t.to_dtype(DType::F32)?,
            };
            kept.insert(name, t);
        }
        if !tensors.is_empty() {
            tracing::debug!(origin, extra = ?tensors.keys().collect::<Vec<_>>(), "ignored tensors");
        }
        Ok(Self {
            tensors: kept,
            origin,
            fused: BTreeMap::new(),
        })
    }

    /// Random weights: normal(0, `std`) matrices, norms at 1, biases at 0; reproducible.
    pub fn random(cfg: &ModelConfig, std: f32, seed: u64, device: &Device) -> Result<Self> {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut tensors = BTreeMap::new();
        for (name, shape) in param_specs(cfg) {
            let n: usize = shape.iter().product();
            let data: Vec<f32> = match init_of(&name) {
                Init::Ones => vec![1.0; n],
                Init::Zeros => vec![0.0; n],
                Init::Normal => (0..n).map(|_| std * standard_normal(&mut rng)).collect(),
            };
            tensors.insert(name, Tensor::from_vec(data, shape, device)?);
        }
        Ok(Self {
            tensors,
            origin: format!("random(seed={seed})"),
            fused: BTreeMap::new(),
        })
    }

    /// Where these weights came from (a path or a preset name), for messages.
    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// The tensor `name`, checked against `shape`.
    pub fn get(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let t = self
            .tensors
            .get(name)
            .ok_or_else(|| ModelError::weights(&self.origin, format!("missing tensor {name}")))?;
        if t.dims() != shape {
            return Err(ModelError::weights(
                &self.origin,
                format!("tensor {name} has shape {:?}, expected {shape:?}", t.dims()),
            ));
        }
        Ok(t.clone())
    }

    /// All tensors by name, in canonical (sorted) order.
    pub fn tensors(&self) -> &BTreeMap<String, Tensor> {
        &self.tensors
    }

    /// The same weights cast to `dtype` (f64 for finite-difference checks, f16 on GPUs).
    pub fn to_dtype(&self, dtype: DType) -> Result<Self> {
        self.map(|_, t| t.to_dtype(dtype))
    }

    /// The same weights cast to `dtype` but for the tensors named in `keep`, which stay as
    /// they are (the learner's embedding and lm-head under bf16 compute). Differentiable:
    /// a model over weights that read vars computes in `dtype` and sends the gradients back.
    pub fn to_dtype_except(&self, dtype: DType, keep: &[&str]) -> Result<Self> {
        self.map(|name, t| {
            if keep.contains(&name) {
                Ok(t.clone())
            } else {
                t.to_dtype(dtype)
            }
        })
    }

    /// The same weights on `device` (a copy per tensor unless already there).
    pub fn to_device(&self, device: &Device) -> Result<Self> {
        self.map(|_, t| t.to_device(device))
    }

    /// An independent copy (new storage, no gradient tracking): frozen reference models.
    pub fn deep_copy(&self) -> Result<Self> {
        self.map(|_, t| Ok(t.copy()?.detach()))
    }

    /// Zeros of the same names, shapes, dtypes and devices, fused alike: buffers to write
    /// into.
    pub fn zeros_like(&self) -> Result<Self> {
        self.map(|_, t| t.zeros_like())
    }

    /// `f` of every tensor; fused projections stay fused (in new buffers).
    fn map(&self, f: impl Fn(&str, &Tensor) -> candle_core::Result<Tensor>) -> Result<Self> {
        let tensors = self
            .tensors
            .iter()
            .map(|(n, t)| Ok((n.clone(), f(n, t)?)))
            .collect::<Result<_>>()?;
        let mapped = Self {
            tensors,
            origin: self.origin.clone(),
            fused: BTreeMap::new(),
        };
        if self.fused.is_empty() {
            Ok(mapped)
        } else {
            mapped.fuse_projections()
        }
    }

    /// Trainable copies: one [`Var`] per parameter, plus weights that read those vars, so a
    /// model built from the returned weights is differentiable in every parameter.
    pub fn to_vars(&self) -> Result<(BTreeMap<String, Var>, Weights)> {
        let mut vars = BTreeMap::new();
        let mut tensors = BTreeMap::new();
        for (name, t) in &self.tensors {
            let var = Var::from_tensor(&t.copy()?)?;
            tensors.insert(name.clone(), var.as_tensor().clone());
            vars.insert(name.clone(), var);
        }
        let weights = Weights {
            tensors,
            origin: self.origin.clone(),
            fused: BTreeMap::new(),
        };
        Ok((vars, weights))
    }
}

/// How a fresh parameter starts.
enum Init {
    /// RMSNorm scales.
    Ones,
    /// Biases.
    Zeros,
    /// Matrices: normal(0, std).
    Normal,
}

/// The start of parameter `name`, as HF initialises it.
fn init_of(name: &str) -> Init {
    if name.contains("norm") {
        Init::Ones
    } else if name.ends_with(".bias") {
        Init::Zeros
    } else {
        Init::Normal
    }
}

/// One standard-normal draw (Box-Muller), so that presets need no extra crate.
fn standard_normal(rng: &mut StdRng) -> f32 {
    let u1: f64 = rng.random::<f64>().max(f64::MIN_POSITIVE);
    let u2: f64 = rng.random::<f64>();
    ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()) as f32
}
