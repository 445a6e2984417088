//! The attention seam: one model definition, several ways to see keys and values.

use candle_core::{Device, Result, Tensor};

use crate::ops::softmax_last_dim;

/// How a layer's attention sees the keys and values of its tokens.
///
/// The model computes roped `q`, `k`, `v` for the tokens it was given and hands them to the
/// backend, which decides which keys each query may see (packed rows, paged caches) and may
/// store `k`/`v` for later calls. State lives in the backend, never in the model.
pub trait AttentionBackend {
    /// `q`: (tokens, heads, head_dim); `k`, `v`: (tokens, kv_heads, head_dim).
    /// Returns (tokens, heads, head_dim).
    fn attend(&mut self, layer_idx: usize, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor>;
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
/// Differentiable (composite softmax).
pub fn causal_attention(q: &Tensor, k: &Tensor, v: &Tensor, num_cached: usize) -> Result<Tensor> {
    let (q_len, num_heads, head_dim) = q.dims3()?;
    let k_len = k.dim(0)?;
    let k = repeat_kv(k, num_heads)?;
    let v = repeat_kv(v, num_heads)?;
    // (tokens, heads, d) -> (heads, tokens, d)
    let q = q.transpose(0, 1)?.contiguous()?;
    let k = k.transpose(0, 1)?.contiguous()?;
    let v = v.transpose(0, 1)?.contiguous()?;
    // (heads, q_len, d) x (heads, d, k_len) -> (heads, q_len, k_len)
    let scale = 1.0 / (head_dim as f64).sqrt();
    let scores = (q.matmul(&k.t()?)? * scale)?;
    let scores = if q_len > 1 || k_len > num_cached + q_len {
        scores.broadcast_add(
            &causal_mask(q_len, k_len, num_cached, q.device())?.to_dtype(scores.dtype())?,
        )?
    } else {
        scores
    };
    let probs = softmax_last_dim(&scores)?;
    // (heads, q_len, k_len) x (heads, k_len, d) -> (heads, q_len, d) -> (q_len, heads, d)
    probs.matmul(&v)?.transpose(0, 1)?.contiguous()
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
