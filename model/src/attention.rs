//! The attention seam: one model definition, several ways to see keys and values.

use candle_core::{Device, Result, Tensor};

use crate::ops::at_least_f32;
use crate::rope::RopeAt;

/// How a layer's attention sees the keys and values of its tokens.
///
/// The model computes roped `q`, `k`, `v` for the tokens it was given and hands them to the
/// backend, which decides which keys each query may see (packed rows, paged caches) and may
/// store `k`/`v` for later calls. State lives in the backend, never in the model.
pub trait AttentionBackend {
    /// `q`: (tokens, heads, head_dim); `k`, `v`: (tokens, kv_heads, head_dim).
    /// Returns (tokens, heads, head_dim).
    fn attend(&mut self, layer_idx: usize, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor>;

    /// Whether the backend takes the fused q/k/v projection itself ([`Self::attend_projected`]),
    /// of a layer with q/k norms where `qk_norms`; if not, the model splits, biases, norms and
    /// rotates it and calls [`Self::attend`].
    fn takes_projection(&self, _qk_norms: bool) -> bool {
        false
    }

    /// Attention straight from the fused q/k/v projection, before its bias, q/k norms and
    /// rotary embedding, which the backend applies itself (one kernel where the model takes
    /// several ops). Called only where [`Self::takes_projection`].
    fn attend_projected(
        &mut self,
        _layer_idx: usize,
        _projection: Projection<'_>,
        _rope: &RopeAt,
    ) -> Result<Tensor> {
        candle_core::bail!("this attention backend does not take the q/k/v projection")
    }

    /// The sequence boundaries when the tokens are a packed training row (each sequence
    /// attending causally to itself only), which the training layer computes itself.
    fn packed_seqlens(&self) -> Option<&[usize]> {
        None
    }

    /// Kernels of the backend's own for the layer's other steps (inference on a GPU); the
    /// model's ops where `None`.
    fn layer_kernels(&self) -> Option<&dyn LayerKernels> {
        None
    }
}

/// A layer's fused q/k/v projection as [`AttentionBackend::attend_projected`] takes it.
#[derive(Debug, Clone, Copy)]
pub struct Projection<'a> {
    /// (tokens, q, k and v widths together), before the bias.
    pub qkv: &'a Tensor,
    pub bias: Option<&'a Tensor>,
    /// The RMSNorms of each q and k head (Qwen3), after the bias and before the rotation.
    pub norms: Option<QkNorms<'a>>,
}

/// A layer's RMSNorms of each q and k head: their weights (head_dim,) and epsilon.
#[derive(Debug, Clone, Copy)]
pub struct QkNorms<'a> {
    pub q: &'a Tensor,
    pub k: &'a Tensor,
    pub eps: f64,
}

/// A layer's elementwise steps as a backend's kernels take them (no gradient).
pub trait LayerKernels {
    /// `(s, rms_norm(s) * weight)` where `s` is `x + residual` (`x` without one); `x`,
    /// `residual`: (tokens, hidden).
    fn add_rms_norm(
        &self,
        x: &Tensor,
        residual: Option<&Tensor>,
        weight: &Tensor,
        eps: f64,
    ) -> Result<(Tensor, Tensor)>;

    /// `silu(gate) * up` where `gate_up` (tokens, 2 * width) holds gate then up in each row.
    fn silu_mul_halves(&self, gate_up: &Tensor) -> Result<Tensor>;
}

/// Reference backend: the whole input is one sequence starting at position 0, no cache.
#[derive(Debug, Default, Clone, Copy)]
pub struct CausalAttention;

impl AttentionBackend for CausalAttention {
    fn attend(&mut self, _layer_idx: usize, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        causal_attention(q, k, v, 0)
    }
}

/// Causal attention of `q` (q_len, heads, d) over `k`, `v` (num_cached + q_len, kv_heads, d):
/// query `i` sits at key position `num_cached + i` and sees keys `0..=num_cached + i`.
/// Differentiable ([`crate::fused::causal_softmax`]).
pub fn causal_attention(q: &Tensor, k: &Tensor, v: &Tensor, num_cached: usize) -> Result<Tensor> {
    causal_attention_batch(q, k, v, 1, num_cached)
}

/// [`causal_attention`] of `batch` independent sequences of equal length laid end to end:
/// `q` (batch * q_len, heads, d), `k`, `v` (batch * k_len, kv_heads, d). One batched matmul
/// per product instead of one per sequence: the same arithmetic, far fewer ops.
pub fn causal_attention_batch(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    batch: usize,
    num_cached: usize,
) -> Result<Tensor> {
    attention_batch(q, k, v, batch, |scores, scale| {
        crate::fused::causal_softmax(scores, scale, num_cached)
    })
}

/// Attention of `batch` sequences laid out as in [`causal_attention_batch`] where each
/// query sees the keys `mask` (q_len, k_len; additive, 0 or -inf, f32) leaves at 0, the
/// same for every sequence and head: a mask built once serves every layer. Composite ops.
pub fn masked_attention_batch(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    batch: usize,
    mask: &Tensor,
) -> Result<Tensor> {
    attention_batch(q, k, v, batch, |scores, scale| {
        masked_softmax(scores, scale, mask)
    })
}

/// Softmax over the last dimension of `scores * scale + mask` (`mask` broadcast over the
/// leading dimensions): the composite of differentiable ops.
pub fn masked_softmax(scores: &Tensor, scale: f64, mask: &Tensor) -> Result<Tensor> {
    let scores = (scores * scale)?.broadcast_add(&mask.to_dtype(scores.dtype())?)?;
    crate::ops::softmax_last_dim(&scores)
}

/// The attention products around `probs`, which turns the scores (batch, heads, q_len,
/// k_len; at least f32) and their scale into probabilities.
fn attention_batch(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    batch: usize,
    probs: impl FnOnce(&Tensor, f64) -> Result<Tensor>,
) -> Result<Tensor> {
    let (q_tokens, num_heads, head_dim) = q.dims3()?;
    let (q_len, k_len) = (q_tokens / batch, k.dim(0)? / batch);
    // (batch * tokens, heads, d) -> (batch, heads, tokens, d)
    let split = |x: &Tensor, len: usize| {
        x.reshape((batch, len, num_heads, head_dim))?
            .transpose(1, 2)?
            .contiguous()
    };
    let q = split(q, q_len)?;
    let k = split(&repeat_kv(k, num_heads)?, k_len)?;
    let v = split(&repeat_kv(v, num_heads)?, k_len)?;
    // (.., q_len, d) x (.., d, k_len) -> (batch, heads, q_len, k_len)
    // Scores and softmax in at least f32 whatever the inputs' dtype.
    let scale = 1.0 / (head_dim as f64).sqrt();
    let scores = at_least_f32(&q.matmul(&k.t()?)?)?;
    let probs = probs(&scores, scale)?.to_dtype(v.dtype())?;
    // (.., q_len, k_len) x (.., k_len, d) -> (batch, heads, q_len, d) -> (batch * q_len, heads, d)
    probs
        .matmul(&v)?
        .transpose(1, 2)?
        .reshape((q_tokens, num_heads, head_dim))
}

/// Additive mask (q_len, k_len): 0 where query `i` may see key `j` (`j <= num_cached + i`),
/// -inf where it must not.
pub fn causal_mask(
    q_len: usize,
    k_len: usize,
    num_cached: usize,
    device: &Device,
) -> Result<Tensor> {
    let mask: Vec<f32> = (0..q_len)
        .flat_map(|i| {
            (0..k_len).map(move |j| {
                if j <= num_cached + i {
                    0.0
                } else {
                    f32::NEG_INFINITY
                }
            })
        })
        .collect();
    Tensor::from_vec(mask, (q_len, k_len), device)
}

/// Additive block-diagonal causal mask (n, n), n the sum of `lens`: 0 where query `i` and
/// key `j` belong to one sequence (consecutive runs of `lens` tokens) and `j <= i`, -inf
/// elsewhere: sequences laid end to end, each attending causally to itself only.
pub fn block_causal_mask(lens: &[usize], device: &Device) -> Result<Tensor> {
    let n: usize = lens.iter().sum();
    let mut mask = vec![f32::NEG_INFINITY; n * n];
    let mut start = 0;
    for &len in lens {
        for i in start..start + len {
            mask[i * n + start..=i * n + i].fill(0.0);
        }
        start += len;
    }
    Tensor::from_vec(mask, (n, n), device)
}

/// Grouped-query attention: (tokens, kv_heads, d) -> (tokens, heads, d); kv head `g` serves
/// query heads `g * rep .. (g + 1) * rep` (the HF `repeat_kv` order).
pub fn repeat_kv(x: &Tensor, num_heads: usize) -> Result<Tensor> {
    let (tokens, kv_heads, d) = x.dims3()?;
    let rep = num_heads / kv_heads;
    if rep == 1 {
        return Ok(x.clone());
    }
    x.unsqueeze(2)?
        .broadcast_as((tokens, kv_heads, rep, d))?
        .reshape((tokens, num_heads, d))
}
