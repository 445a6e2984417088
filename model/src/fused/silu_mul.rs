//! `silu(gate) * up`, the gated MLP's product: keeps `gate` and `up` only, where the
//! composite keeps five tensors of their size.

use candle_core::{CpuStorage, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};

use super::{applies, run_kernel, Kernel, Real};
use crate::ops::silu;

/// `silu(gate) * up` elementwise (same shapes); fused with its own backward on f32/f64 CPU
/// tensors, the composite ops otherwise.
pub fn silu_mul(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    if applies(&[gate, up]) {
        gate.contiguous()?.apply_op2(&up.contiguous()?, SiluMul)
    } else if super::inference::applies(&[gate, up]) {
        super::inference::silu_mul(gate, up)
    } else {
        silu(gate)? * up
    }
}

fn sigmoid<R: Real>(x: R) -> R {
    R::ONE / ((-x).exp() + R::ONE)
}

/// The forward op.
struct SiluMul;

/// `x * sigmoid(x) * u`, in the composite's order of operations.
pub(crate) struct Forward;

impl Kernel for Forward {
    fn width(&self) -> usize {
        1
    }
    fn run<R: Real>(&self, _unit: usize, inputs: &[&[R]], out: &mut [R]) {
        let (gate, up) = (inputs[0], inputs[1]);
        for ((o, &x), &u) in out.iter_mut().zip(gate).zip(up) {
            *o = x * sigmoid(x) * u;
        }
    }
}

/// The gradient with respect to `gate` (`wrt_gate`) or to `up`, from gate, up, grad.
pub(crate) struct Backward {
    pub wrt_gate: bool,
}

impl Kernel for Backward {
    fn width(&self) -> usize {
        1
    }
    fn run<R: Real>(&self, _unit: usize, inputs: &[&[R]], out: &mut [R]) {
        let (gate, up, grad) = (inputs[0], inputs[1], inputs[2]);
        for (i, o) in out.iter_mut().enumerate() {
            let (x, s) = (gate[i], sigmoid(gate[i]));
            *o = if self.wrt_gate {
                // d silu / dx = s (1 + x (1 - s))
                grad[i] * up[i] * (s * (R::ONE + x * (R::ONE - s)))
            } else {
                grad[i] * x * s
            };
        }
    }
}

impl CustomOp2 for SiluMul {
    fn name(&self) -> &'static str {
        "dppo-silu-mul"
    }

    fn cpu_fwd(
        &self,
        gs: &CpuStorage,
        gl: &Layout,
        us: &CpuStorage,
        ul: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        if gl.shape() != ul.shape() {
            candle_core::bail!("silu_mul: gate {:?} but up {:?}", gl.shape(), ul.shape());
        }
        Ok((
            run_kernel(&Forward, &[(gs, gl), (us, ul)])?,
            gl.shape().clone(),
        ))
    }

    fn bwd(
        &self,
        gate: &Tensor,
        up: &Tensor,
        _out: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        // Detached: gradients must not record ops (they would keep the graph alive).
        let (gate, up, grad) = (gate.detach(), up.detach(), grad.contiguous()?);
        let wrt = |wrt_gate| gate.apply_op3_no_bwd(&up, &grad, &Backward { wrt_gate });
        Ok((Some(wrt(true)?), Some(wrt(false)?)))
    }
}

impl CustomOp3 for Backward {
    fn name(&self) -> &'static str {
        "dppo-silu-mul-backward"
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
        if l1.shape() != l2.shape() || l1.shape() != l3.shape() {
            candle_core::bail!("silu_mul backward: operands differ in shape");
        }
        Ok((
            run_kernel(self, &[(s1, l1), (s2, l2), (s3, l3)])?,
            l1.shape().clone(),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fused::check::fused_matches_composite;

    #[test]
    fn silu_mul_matches_composite_and_finite_differences() {
        fused_matches_composite(
            &[&[5, 7], &[5, 7]],
            |x| silu_mul(&x[0], &x[1]),
            |x| silu(&x[0])? * &x[1],
        );
    }
}
