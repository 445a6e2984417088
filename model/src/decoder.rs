//! The decoder: one implementation for Llama, Qwen2 (qkv bias) and Qwen3 (q/k norm).
//!
//! Inputs are flat token streams (tokens,) with explicit position ids; attention goes
//! through an [`AttentionBackend`] so that packed training rows and paged inference share
//! this code. Only differentiable ops are used: composites (see [`crate::ops`]), or on
//! the CPU custom ops with their own backward (see [`crate::fused`]).

use candle_core::{DType, Result, Tensor};

use crate::attention::{AttentionBackend, LayerKernels, Projection, QkNorms};
use crate::behaviour::Shaping;
use crate::config::ModelConfig;
use crate::fused::{add, rms_norm, silu_mul};
use crate::linear::{linear, linear_many, projection, with_bias};
use crate::lm_head::{lm_head_token_stats, TokenStats};
use crate::rope::{Rope, RopeAt};
use crate::train_layer::{LayerGrads, LayerParams, TrainPass};
use crate::weights::Weights;

#[derive(Debug, Clone)]
struct Mlp {
    gate_proj: Tensor,
    up_proj: Tensor,
    down_proj: Tensor,
    /// gate and up concatenated, where the weights were fused (inference).
    gate_up: Option<Tensor>,
}

impl Mlp {
    fn new(cfg: &ModelConfig, w: &Weights, prefix: &str) -> crate::Result<Self> {
        let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
        Ok(Self {
            gate_proj: w.get(&format!("{prefix}.gate_proj.weight"), &[i, h])?,
            up_proj: w.get(&format!("{prefix}.up_proj.weight"), &[i, h])?,
            down_proj: w.get(&format!("{prefix}.down_proj.weight"), &[h, i])?,
            gate_up: w.fused(&format!("{prefix}.gate_up_proj.weight")).cloned(),
        })
    }

    fn forward(&self, x: &Tensor, kernels: Option<&dyn LayerKernels>) -> Result<Tensor> {
        let [gate, up] = match &self.gate_up {
            Some(gate_up) => {
                let y = linear(x, gate_up, None)?;
                if let Some(kernels) = kernels {
                    return linear(&kernels.silu_mul_halves(&y)?, &self.down_proj, None);
                }
                let i = self.gate_proj.dim(0)?;
                [y.narrow(1, 0, i)?, y.narrow(1, i, i)?]
            }
            None => linear_many(x, [&self.gate_proj, &self.up_proj], [None, None])?,
        };
        linear(&silu_mul(&gate, &up)?, &self.down_proj, None)
    }
}

/// `(x + residual, rms_norm(x + residual) * weight)` (`x` alone without a residual): by the
/// backend's `kernels` where it has them, else by the model's ops.
fn add_norm(
    kernels: Option<&dyn LayerKernels>,
    x: &Tensor,
    residual: Option<Tensor>,
    (weight, eps): (&Tensor, f64),
) -> Result<(Tensor, Tensor)> {
    if let Some(kernels) = kernels {
        return kernels.add_rms_norm(x, residual.as_ref(), weight, eps);
    }
    let sum = match residual {
        Some(r) => add(x, &r)?,
        None => x.clone(),
    };
    let normed = rms_norm(&sum, weight, eps)?;
    Ok((sum, normed))
}

#[derive(Debug, Clone)]
struct Attention {
    // projections
    q_proj: Tensor,
    k_proj: Tensor,
    v_proj: Tensor,
    o_proj: Tensor,
    q_bias: Option<Tensor>,
    k_bias: Option<Tensor>,
    v_bias: Option<Tensor>,
    o_bias: Option<Tensor>,
    /// q, k and v (weight and bias) concatenated, where the weights were fused (inference).
    qkv: Option<(Tensor, Option<Tensor>)>,
    // norms (Qwen3)
    q_norm: Option<Tensor>,
    k_norm: Option<Tensor>,
    // hyper params
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    eps: f64,
}

impl Attention {
    fn new(cfg: &ModelConfig, w: &Weights, prefix: &str) -> crate::Result<Self> {
        let h = cfg.hidden_size;
        let q_dim = cfg.num_attention_heads * cfg.head_dim;
        let kv_dim = cfg.num_key_value_heads * cfg.head_dim;
        let get = |name: &str, shape: &[usize]| w.get(&format!("{prefix}.{name}"), shape);
        let opt = |on: bool, name: &str, shape: &[usize]| on.then(|| get(name, shape)).transpose();
        Ok(Self {
            q_proj: get("q_proj.weight", &[q_dim, h])?,
            k_proj: get("k_proj.weight", &[kv_dim, h])?,
            v_proj: get("v_proj.weight", &[kv_dim, h])?,
            o_proj: get("o_proj.weight", &[h, q_dim])?,
            q_bias: opt(cfg.qkv_bias, "q_proj.bias", &[q_dim])?,
            k_bias: opt(cfg.qkv_bias, "k_proj.bias", &[kv_dim])?,
            v_bias: opt(cfg.qkv_bias, "v_proj.bias", &[kv_dim])?,
            o_bias: opt(cfg.o_bias, "o_proj.bias", &[h])?,
            qkv: w.fused(&format!("{prefix}.qkv_proj.weight")).map(|qkv| {
                let bias = w.fused(&format!("{prefix}.qkv_proj.bias")).cloned();
                (qkv.clone(), bias)
            }),
            q_norm: opt(cfg.qk_norm, "q_norm.weight", &[cfg.head_dim])?,
            k_norm: opt(cfg.qk_norm, "k_norm.weight", &[cfg.head_dim])?,
            num_heads: cfg.num_attention_heads,
            num_kv_heads: cfg.num_key_value_heads,
            head_dim: cfg.head_dim,
            eps: cfg.rms_norm_eps,
        })
    }

    fn forward(
        &self,
        x: &Tensor,
        rope: &RopeAt,
        layer_idx: usize,
        backend: &mut dyn AttentionBackend,
    ) -> Result<Tensor> {
        let tokens = x.dim(0)?;
        // 1. Project: (tokens, hidden) -> (tokens, heads, head_dim)
        let [q, k, v] = match &self.qkv {
            Some((qkv, bias)) => {
                let y = projection(x, qkv)?;
                // A backend may bias, norm, rotate and attend from the projection itself.
                let norms = match (&self.q_norm, &self.k_norm) {
                    (Some(q), Some(k)) => Some(Some(QkNorms {
                        q,
                        k,
                        eps: self.eps,
                    })),
                    (None, None) => Some(None),
                    // One norm alone: the model's ops.
                    _ => None,
                };
                if let Some(norms) = norms.filter(|n| backend.takes_projection(n.is_some())) {
                    let projection = Projection {
                        qkv: &y,
                        bias: bias.as_ref(),
                        norms,
                    };
                    let attn = backend.attend_projected(layer_idx, projection, rope)?;
                    return self.output(&attn, tokens);
                }
                let y = with_bias(y, bias.as_ref())?;
                let (q_dim, kv_dim) = (self.q_proj.dim(0)?, self.k_proj.dim(0)?);
                [
                    y.narrow(1, 0, q_dim)?,
                    y.narrow(1, q_dim, kv_dim)?,
                    y.narrow(1, q_dim + kv_dim, kv_dim)?,
                ]
            }
            None => linear_many(
                x,
                [&self.q_proj, &self.k_proj, &self.v_proj],
                [
                    self.q_bias.as_ref(),
                    self.k_bias.as_ref(),
                    self.v_bias.as_ref(),
                ],
            )?,
        };
        let q = q.reshape((tokens, self.num_heads, self.head_dim))?;
        let k = k.reshape((tokens, self.num_kv_heads, self.head_dim))?;
        let v = v.reshape((tokens, self.num_kv_heads, self.head_dim))?;
        // 2. Qwen3: RMSNorm over each head's vector, before rope
        let (q, k) = match (&self.q_norm, &self.k_norm) {
            (Some(qn), Some(kn)) => (rms_norm(&q, qn, self.eps)?, rms_norm(&k, kn, self.eps)?),
            _ => (q, k),
        };
        // 3. Rope at the given positions
        let q = rope.apply(&q)?;
        let k = rope.apply(&k)?;
        // 4. Attention (backend decides visibility) -> (tokens, heads * head_dim)
        let attn = backend.attend(layer_idx, &q, &k, &v.contiguous()?)?;
        self.output(&attn, tokens)
    }

    /// The output projection of the attention's (tokens, heads, head_dim).
    fn output(&self, attn: &Tensor, tokens: usize) -> Result<Tensor> {
        let attn = attn.reshape((tokens, self.num_heads * self.head_dim))?;
        linear(&attn, &self.o_proj, self.o_bias.as_ref())
    }
}

#[derive(Debug, Clone)]
struct DecoderLayer {
    attn: Attention,
    mlp: Mlp,
    input_layernorm: Tensor,
    post_attention_layernorm: Tensor,
    eps: f64,
}

impl DecoderLayer {
    fn new(cfg: &ModelConfig, w: &Weights, layer_idx: usize) -> crate::Result<Self> {
        let prefix = format!("model.layers.{layer_idx}");
        let h = cfg.hidden_size;
        Ok(Self {
            attn: Attention::new(cfg, w, &format!("{prefix}.self_attn"))?,
            mlp: Mlp::new(cfg, w, &format!("{prefix}.mlp"))?,
            input_layernorm: w.get(&format!("{prefix}.input_layernorm.weight"), &[h])?,
            post_attention_layernorm: w
                .get(&format!("{prefix}.post_attention_layernorm.weight"), &[h])?,
            eps: cfg.rms_norm_eps,
        })
    }

    /// The weights, as the training layer takes them.
    fn params(&self) -> LayerParams {
        let (a, m) = (&self.attn, &self.mlp);
        LayerParams(
            [
                Some(&self.input_layernorm),
                Some(&a.q_proj),
                Some(&a.k_proj),
                Some(&a.v_proj),
                Some(&a.o_proj),
                Some(&self.post_attention_layernorm),
                Some(&m.gate_proj),
                Some(&m.up_proj),
                Some(&m.down_proj),
                a.q_bias.as_ref(),
                a.k_bias.as_ref(),
                a.v_bias.as_ref(),
                a.o_bias.as_ref(),
                a.q_norm.as_ref(),
                a.k_norm.as_ref(),
            ]
            .map(|t| t.cloned()),
        )
    }
}

/// A decoder-only causal language model built from a [`Weights`] map.
///
/// Holds tensors, not state: building one from new weights is cheap (tensors are shared),
/// which is how the engine swaps policies between iterations.
#[derive(Debug, Clone)]
pub struct CausalLm {
    embed_tokens: Tensor,
    layers: Vec<DecoderLayer>,
    norm: Tensor,
    lm_head: Tensor,
    rope: Rope,
    cfg: ModelConfig,
    /// Where the training layers put their weights' gradients (see
    /// [`CausalLm::with_layer_grads`]).
    layer_grads: Option<LayerGrads>,
}

impl CausalLm {
    /// Builds the model, checking every tensor's presence and shape.
    pub fn new(cfg: &ModelConfig, w: &Weights) -> crate::Result<Self> {
        let (v, h) = (cfg.vocab_size, cfg.hidden_size);
        let embed_tokens = w.get("model.embed_tokens.weight", &[v, h])?;
        let lm_head = if cfg.tie_word_embeddings {
            embed_tokens.clone()
        } else {
            w.get("lm_head.weight", &[v, h])?
        };
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| DecoderLayer::new(cfg, w, i))
            .collect::<crate::Result<Vec<_>>>()?;
        let rope = Rope::new(
            cfg.head_dim,
            cfg.rope_theta,
            cfg.max_position_embeddings,
            embed_tokens.device(),
        )?;
        Ok(Self {
            embed_tokens,
            layers,
            norm: w.get("model.norm.weight", &[h])?,
            lm_head,
            rope,
            cfg: cfg.clone(),
            layer_grads: None,
        })
    }

    /// This model for training on the CPU: on packed rows, each f32 decoder layer runs as
    /// one op with its own backward pass ([`crate::train_layer`]), and the gradients of the
    /// layers' weights are added to `grads` instead of candle's gradient store.
    pub fn with_layer_grads(&self, grads: LayerGrads) -> Self {
        Self {
            layer_grads: Some(grads),
            ..self.clone()
        }
    }

    /// The training pass of a forward over `backend`, when the layers run as single ops.
    fn train_pass(
        &self,
        x: &Tensor,
        rope: &RopeAt,
        backend: &dyn AttentionBackend,
    ) -> Result<Option<TrainPass>> {
        let (Some(grads), Some(cu_seqlens)) = (&self.layer_grads, backend.packed_seqlens()) else {
            return Ok(None);
        };
        if !x.track_op() {
            return Ok(None);
        }
        Ok(Some(TrainPass::new(
            &self.cfg,
            cu_seqlens.to_vec(),
            rope.tables(DType::F32)?,
            grads.clone(),
        )))
    }

    /// The device the weights live on.
    pub fn device(&self) -> &candle_core::Device {
        self.embed_tokens.device()
    }

    /// The dtype of the layers' weights (and so of the activations and K/V).
    pub fn dtype(&self) -> candle_core::DType {
        self.norm.dtype()
    }

    /// The configuration the model was built with.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// Final hidden states (tokens, hidden) of `input_ids` (tokens,) u32 at `positions`
    /// (tokens,) u32. Positions must be below `max_position_embeddings`.
    pub fn forward(
        &self,
        input_ids: &Tensor,
        positions: &Tensor,
        backend: &mut dyn AttentionBackend,
    ) -> Result<Tensor> {
        // The embedding may be wider than the layers (the learner keeps it f32 under bf16
        // compute, so that its gradient accumulates in f32).
        let mut x = self
            .embed_tokens
            .index_select(input_ids, 0)?
            .to_dtype(self.dtype())?;
        let rope = self.rope.at(positions)?;
        let train = self.train_pass(&x, &rope, backend)?;
        // The MLP's output waits to be added where the next norm reads the sum, so that a
        // backend's kernel can take the add and the norm together.
        let mut pending: Option<Tensor> = None;
        for (layer_idx, layer) in self.layers.iter().enumerate() {
            if let Some(train) = &train {
                let params = layer.params();
                if let Some(mlp) = pending.take() {
                    x = add(&x, &mlp)?;
                }
                if train.applies(&x, &params) {
                    x = train.layer(&x, params)?;
                    continue;
                }
            }
            let norm = (&layer.input_layernorm, layer.eps);
            let (sum, normed) = add_norm(backend.layer_kernels(), &x, pending.take(), norm)?;
            let attn = layer.attn.forward(&normed, &rope, layer_idx, backend)?;
            let norm = (&layer.post_attention_layernorm, layer.eps);
            let (sum, normed) = add_norm(backend.layer_kernels(), &sum, Some(attn), norm)?;
            x = sum;
            pending = Some(layer.mlp.forward(&normed, backend.layer_kernels())?);
        }
        let norm = (&self.norm, self.cfg.rms_norm_eps);
        Ok(add_norm(backend.layer_kernels(), &x, pending, norm)?.1)
    }

    /// Logits (tokens, vocab) of final hidden states (tokens, hidden).
    pub fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        linear(&hidden.to_dtype(self.lm_head.dtype())?, &self.lm_head, None)
    }

    /// Log-probabilities of `targets` (tokens,) u32 and next-token entropies at final hidden
    /// states (tokens, hidden), without ever holding the (tokens, vocab) logits whole on the
    /// CPU (see [`crate::lm_head`]): what training needs of the lm-head.
    /// The hidden states are cast to the lm-head's dtype (f32 under bf16 compute).
    pub fn token_stats(&self, hidden: &Tensor, targets: &Tensor) -> Result<TokenStats> {
        self.shaped_token_stats(hidden, targets, Shaping::NONE)
    }

    /// [`CausalLm::token_stats`] of the distribution the engine samples from with
    /// `shaping` (temperature, min-p, top-k, top-p): on the CPU in f32, the sampler's
    /// logprobs bit for bit.
    pub fn shaped_token_stats(
        &self,
        hidden: &Tensor,
        targets: &Tensor,
        shaping: Shaping,
    ) -> Result<TokenStats> {
        let hidden = hidden.to_dtype(self.lm_head.dtype())?;
        lm_head_token_stats(&hidden, &self.lm_head, targets, shaping)
    }
}
