//! Row-wise ops: RMSNorm, and the scaled causal softmax of attention scores.

use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor, D};

use super::{applies, run_kernel, Kernel, Real};

/// RMSNorm over the last dimension, `x / sqrt(mean(x^2) + eps) * weight`; fused with its
/// own backward on f32/f64 CPU tensors, [`crate::ops::rms_norm`] otherwise.
pub fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    if applies(&[x, weight]) {
        x.contiguous()?
            .apply_op2(&weight.contiguous()?, RmsNorm { eps })
    } else if super::inference::applies(&[x, weight]) {
        super::inference::rms_norm(x, weight, eps)
    } else {
        crate::ops::rms_norm(x, weight, eps)
    }
}

/// The forward op (and, with a weight of ones, the normalised input).
#[derive(Clone, Copy)]
pub(crate) struct RmsNorm {
    pub eps: f64,
}

impl RmsNorm {
    /// `1 / sqrt(mean(x^2) + eps)` of one row.
    pub(crate) fn inv_rms<R: Real>(&self, x: &[R]) -> R {
        let sum = x.iter().fold(R::ZERO, |acc, &v| acc + v * v);
        R::ONE / (sum / R::of(x.len() as f64) + R::of(self.eps)).sqrt()
    }
}

/// The fused forward: each row times its inverse RMS, times the weight.
pub(crate) struct NormRows {
    pub op: RmsNorm,
    pub width: usize,
}

impl Kernel for NormRows {
    fn width(&self) -> usize {
        self.width
    }
    fn run<R: Real>(&self, _unit: usize, inputs: &[&[R]], out: &mut [R]) {
        let (x, w) = (inputs[0], inputs[1]);
        let r = self.op.inv_rms(x);
        for ((o, &x), &w) in out.iter_mut().zip(x).zip(w) {
            *o = x * r * w;
        }
    }
}

/// The gradient with respect to `x`, from x, weight, grad:
/// `r (g w) - x r^3 sum(g w x) / n`.
pub(crate) struct NormGradX {
    pub op: RmsNorm,
    pub width: usize,
}

impl Kernel for NormGradX {
    fn width(&self) -> usize {
        self.width
    }
    fn run<R: Real>(&self, _unit: usize, inputs: &[&[R]], out: &mut [R]) {
        let (x, w, g) = (inputs[0], inputs[1], inputs[2]);
        let r = self.op.inv_rms(x);
        let dot = (0..x.len()).fold(R::ZERO, |acc, i| acc + g[i] * w[i] * x[i]);
        let k = r * r * r * dot / R::of(x.len() as f64);
        for (i, o) in out.iter_mut().enumerate() {
            *o = r * g[i] * w[i] - x[i] * k;
        }
    }
}

impl CustomOp2 for RmsNorm {
    fn name(&self) -> &'static str {
        "dppo-rms-norm"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let width = xl.shape().dims().last().copied().unwrap_or(1);
        if wl.shape().dims() != [width] {
            candle_core::bail!("rms_norm: x {:?} but weight {:?}", xl.shape(), wl.shape());
        }
        let kernel = NormRows { op: *self, width };
        Ok((
            run_kernel(&kernel, &[(xs, xl), (ws, wl)])?,
            xl.shape().clone(),
        ))
    }

    fn bwd(
        &self,
        x: &Tensor,
        weight: &Tensor,
        _out: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (x, weight, grad) = (x.detach(), weight.detach(), grad.contiguous()?);
        let width = weight.dim(0)?;
        let grad_x = x.apply_op3_no_bwd(&weight, &grad, &NormGradX { op: *self, width })?;
        // d / d weight: the normalised input times the gradient, summed over rows.
        let normed = x.apply_op2_no_bwd(&weight.ones_like()?, self)?;
        let grad_w = (grad * normed)?.reshape(((), width))?.sum(0)?;
        Ok((Some(grad_x), Some(grad_w)))
    }
}

impl CustomOp3 for NormGradX {
    fn name(&self) -> &'static str {
        "dppo-rms-norm-backward"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        if l1.shape() != l3.shape() {
            candle_core::bail!("rms_norm backward: x and grad differ in shape");
        }
        Ok((
            run_kernel(self, &[(s1, l1), (s2, l2), (s3, l3)])?,
            l1.shape().clone(),
        ))
    }
}

/// Softmax over the last dimension of `scores * scale` (batch, heads, q_len, k_len) where
/// query `i` sees keys `0..=num_cached + i` only (the others get probability 0). Fused with
/// its own backward on f32/f64 CPU tensors (it keeps the scores and the probabilities
/// only); otherwise the composite ops with an additive `-inf` mask.
pub fn causal_softmax(scores: &Tensor, scale: f64, num_cached: usize) -> Result<Tensor> {
    let (q_len, k_len) = (scores.dim(D::Minus2)?, scores.dim(D::Minus1)?);
    if applies(&[scores]) {
        return scores.contiguous()?.apply_op1(CausalSoftmax {
            scale,
            q_len,
            k_len,
            num_cached,
        });
    }
    if q_len > 1 || k_len > num_cached + q_len {
        let mask = crate::attention::causal_mask(q_len, k_len, num_cached, scores.device())?;
        crate::attention::masked_softmax(scores, scale, &mask)
    } else {
        crate::ops::softmax_last_dim(&(scores * scale)?)
    }
}

/// The fused causal softmax (forward kernel too: one row per query).
#[derive(Clone, Copy)]
pub(crate) struct CausalSoftmax {
    pub scale: f64,
    pub q_len: usize,
    pub k_len: usize,
    pub num_cached: usize,
}

impl CausalSoftmax {
    /// Keys the query of row `unit` sees.
    fn visible(&self, unit: usize) -> usize {
        (self.num_cached + unit % self.q_len + 1).min(self.k_len)
    }
}

impl Kernel for CausalSoftmax {
    fn width(&self) -> usize {
        self.k_len
    }
    fn run<R: Real>(&self, unit: usize, inputs: &[&[R]], out: &mut [R]) {
        let n = self.visible(unit);
        let (x, scale) = (&inputs[0][..n], R::of(self.scale));
        let max = x.iter().fold(R::NEG_INFINITY, |m, &v| {
            let v = v * scale;
            if v > m {
                v
            } else {
                m
            }
        });
        let mut sum = R::ZERO;
        for (o, &v) in out.iter_mut().zip(x) {
            *o = (v * scale - max).exp();
            sum = sum + *o;
        }
        for o in &mut out[..n] {
            *o = *o / sum;
        }
        for o in &mut out[n..] {
            *o = R::ZERO;
        }
    }
}

/// The gradient with respect to the scores, from the probabilities and their gradient:
/// `scale p (g - sum(p g))`.
pub(crate) struct SoftmaxGrad(pub CausalSoftmax);

impl Kernel for SoftmaxGrad {
    fn width(&self) -> usize {
        self.0.k_len
    }
    fn run<R: Real>(&self, _unit: usize, inputs: &[&[R]], out: &mut [R]) {
        let (p, g) = (inputs[0], inputs[1]);
        let dot = p.iter().zip(g).fold(R::ZERO, |acc, (&p, &g)| acc + p * g);
        let scale = R::of(self.0.scale);
        for ((o, &p), &g) in out.iter_mut().zip(p).zip(g) {
            *o = scale * p * (g - dot);
        }
    }
}

impl CustomOp1 for CausalSoftmax {
    fn name(&self) -> &'static str {
        "dppo-causal-softmax"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        Ok((run_kernel(self, &[(s, l)])?, l.shape().clone()))
    }

    fn bwd(&self, _scores: &Tensor, probs: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let probs = probs.detach();
        Ok(Some(probs.apply_op2_no_bwd(
            &grad.contiguous()?,
            &SoftmaxGrad(*self),
        )?))
    }
}

impl CustomOp2 for SoftmaxGrad {
    fn name(&self) -> &'static str {
        "dppo-causal-softmax-backward"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        if l1.shape() != l2.shape() {
            candle_core::bail!("causal softmax backward: probabilities and grad differ in shape");
        }
        Ok((run_kernel(self, &[(s1, l1), (s2, l2)])?, l1.shape().clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fused::check::fused_matches_composite;

    #[test]
    fn rms_norm_matches_composite_and_finite_differences() {
        fused_matches_composite(
            &[&[2, 3, 8], &[8]],
            |x| rms_norm(&x[0], &x[1], 1e-6),
            |x| crate::ops::rms_norm(&x[0], &x[1], 1e-6),
        );
    }

    #[test]
    fn causal_softmax_matches_composite_and_finite_differences() {
        // Prefill (square, masked), chunked prefill after cached keys, and one decode row.
        for (q_len, k_len, cached) in [(5, 5, 0), (3, 7, 4), (1, 6, 5)] {
            let composite = move |x: &[Tensor]| {
                let mask = crate::attention::causal_mask(q_len, k_len, cached, x[0].device())?;
                let s = (&x[0] * 0.3)?.broadcast_add(&mask.to_dtype(x[0].dtype())?)?;
                crate::ops::softmax_last_dim(&s)
            };
            fused_matches_composite(
                &[&[2, 3, q_len, k_len]],
                |x| causal_softmax(&x[0], 0.3, cached),
                composite,
            );
        }
    }
}
