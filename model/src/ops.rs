//! Differentiable composite ops.
//!
//! candle's fused `softmax_last_dim`, `rms_norm`, `RmsNorm::forward` and `rotary_emb::rope*`
//! have no backward pass and silently drop gradients (candle #2168, #3568, #3569). These
//! compositions of primitive ops are what training runs wherever the fused ops of
//! [`crate::fused`] (which carry their own backward) do not apply.

use candle_core::{DType, Result, Tensor, D};

/// `x` in f32 when it is in a half-precision dtype (bf16, f16), else `x` itself (f32 and
/// f64 stay as they are): where reductions and softmaxes compute.
pub fn at_least_f32(x: &Tensor) -> Result<Tensor> {
    match x.dtype() {
        DType::BF16 | DType::F16 => x.to_dtype(DType::F32),
        _ => Ok(x.clone()),
    }
}

/// RMSNorm over the last dimension: `x / sqrt(mean(x^2) + eps) * weight`. Computed in at
/// least f32 (as HF does: a bf16 mean of squares loses the small values), then cast back
/// before the weight.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    let wide = at_least_f32(x)?;
    let inv_rms = (wide.sqr()?.mean_keepdim(D::Minus1)? + eps)?
        .sqrt()?
        .recip()?;
    wide.broadcast_mul(&inv_rms)?
        .to_dtype(x.dtype())?
        .broadcast_mul(weight)
}

/// Softmax over the last dimension. The max is detached: the result does not depend on it.
pub fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    let shifted = x.broadcast_sub(&x.max_keepdim(D::Minus1)?.detach())?;
    let e = shifted.exp()?;
    e.broadcast_div(&e.sum_keepdim(D::Minus1)?)
}

/// Log-softmax over the last dimension (log-sum-exp with a detached max shift).
pub fn log_softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    let shifted = x.broadcast_sub(&x.max_keepdim(D::Minus1)?.detach())?;
    let lse = shifted.exp()?.sum_keepdim(D::Minus1)?.log()?;
    shifted.broadcast_sub(&lse)
}

/// SiLU as `x * sigmoid(x)`, `sigmoid = 1 / (1 + exp(-x))`.
pub fn silu(x: &Tensor) -> Result<Tensor> {
    let sigmoid = (x.neg()?.exp()? + 1.0)?.recip()?;
    x.mul(&sigmoid)
}

/// Rotary embedding in the HF "rotate half" layout: the rotation of `x` (tokens, heads,
/// head_dim) by `cos`, `sin` (tokens, head_dim / 2).
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let half = x.dim(D::Minus1)? / 2;
    let (cos, sin) = (cos.unsqueeze(1)?, sin.unsqueeze(1)?);
    let x1 = x.narrow(D::Minus1, 0, half)?;
    let x2 = x.narrow(D::Minus1, half, half)?;
    let r1 = (x1.broadcast_mul(&cos)? - x2.broadcast_mul(&sin)?)?;
    let r2 = (x2.broadcast_mul(&cos)? + x1.broadcast_mul(&sin)?)?;
    Tensor::cat(&[r1, r2], D::Minus1)
}

/// Log-probability of each `targets[i]` under `logits[i]`: (tokens, vocab) -> (tokens,).
pub fn token_logprobs(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let logp = log_softmax_last_dim(logits)?;
    logp.gather(&targets.unsqueeze(1)?, 1)?.squeeze(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    #[test]
    fn softmax_matches_fused_and_sums_to_one() {
        let x = Tensor::new(&[[1f32, 2.0, 3.0], [-5.0, 0.0, 5.0]], &Device::Cpu).unwrap();
        let ours = softmax_last_dim(&x).unwrap();
        let fused = candle_nn::ops::softmax_last_dim(&x).unwrap();
        let diff = (ours - fused).unwrap().abs().unwrap().max_all().unwrap();
        assert!(diff.to_scalar::<f32>().unwrap() < 1e-6);
    }

    #[test]
    fn composite_ops_carry_gradients() {
        let x = Var::new(&[[0.5f32, -1.0, 2.0]], &Device::Cpu).unwrap();
        let w = Var::new(&[1.5f32, 0.5, 1.0], &Device::Cpu).unwrap();
        let y = rms_norm(x.as_tensor(), w.as_tensor(), 1e-6).unwrap();
        let y = softmax_last_dim(&silu(&y).unwrap()).unwrap();
        let loss = (y * Tensor::new(&[[1f32, 2.0, 3.0]], &Device::Cpu).unwrap())
            .unwrap()
            .sum_all()
            .unwrap();
        let grads = loss.backward().unwrap();
        for v in [&x, &w] {
            let g = grads.get(v).expect("gradient missing");
            let norm = g
                .sqr()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            assert!(norm > 0.0);
        }
    }
}
