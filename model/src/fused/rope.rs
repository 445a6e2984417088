//! Rotary embeddings ("rotate half" layout): the backward is the inverse rotation, so the op
//! keeps no intermediate at all.

use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Tensor};

use super::{applies, run_kernel, Kernel, Real};

/// Rotates `x` (tokens, heads, head_dim) by per-token angles given as `cos`, `sin` (tokens,
/// head_dim / 2) of `x`'s dtype; fused with its own backward on f32/f64 CPU tensors,
/// [`crate::ops::rope`] otherwise.
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    if applies(&[x, cos, sin]) {
        let heads = x.dim(1)?;
        let op = Rotate {
            heads,
            head_dim: x.dim(2)?,
            inverse: false,
        };
        x.contiguous()?
            .apply_op3(&cos.contiguous()?, &sin.contiguous()?, op)
    } else if super::inference::applies(&[x, cos, sin]) {
        super::inference::rope(x, cos, sin)
    } else {
        crate::ops::rope(x, cos, sin)
    }
}

/// The rotation (or its inverse, the rotation by minus the angle).
#[derive(Clone, Copy)]
pub(crate) struct Rotate {
    pub heads: usize,
    pub head_dim: usize,
    pub inverse: bool,
}

impl Kernel for Rotate {
    fn width(&self) -> usize {
        self.head_dim
    }
    fn run<R: Real>(&self, unit: usize, inputs: &[&[R]], out: &mut [R]) {
        let half = self.head_dim / 2;
        let token = unit / self.heads;
        let (x, cos, sin) = (inputs[0], inputs[1], inputs[2]);
        let (cos, sin) = (&cos[token * half..][..half], &sin[token * half..][..half]);
        let (x1, x2) = x.split_at(half);
        let (o1, o2) = out.split_at_mut(half);
        for j in 0..half {
            let s = if self.inverse { -sin[j] } else { sin[j] };
            o1[j] = x1[j] * cos[j] - x2[j] * s;
            o2[j] = x2[j] * cos[j] + x1[j] * s;
        }
    }
}

impl CustomOp3 for Rotate {
    fn name(&self) -> &'static str {
        "dppo-rope"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        cs: &CpuStorage,
        cl: &Layout,
        ss: &CpuStorage,
        sl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (tokens, heads, head_dim) = xl.shape().dims3()?;
        let table = [tokens, head_dim / 2];
        if heads != self.heads || head_dim % 2 != 0 || cl.dims() != table || sl.dims() != table {
            candle_core::bail!(
                "rope: x {:?} needs cos and sin of shape {table:?}, got {:?} and {:?}",
                xl.shape(),
                cl.shape(),
                sl.shape()
            );
        }
        Ok((
            run_kernel(self, &[(xs, xl), (cs, cl), (ss, sl)])?,
            xl.shape().clone(),
        ))
    }

    fn bwd(
        &self,
        _x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        _out: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let inverse = Rotate {
            inverse: !self.inverse,
            ..*self
        };
        let grad_x = grad
            .contiguous()?
            .apply_op3_no_bwd(&cos.detach(), &sin.detach(), &inverse)?;
        Ok((Some(grad_x), None, None))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fused::check::fused_matches_composite;
    use candle_core::Device;

    #[test]
    fn rope_matches_composite_and_finite_differences() {
        let (tokens, half) = (4, 3);
        let angles: Vec<f64> = (0..tokens * half).map(|i| 0.37 * i as f64 - 1.1).collect();
        let table = |f: fn(f64) -> f64, x: &Tensor| {
            let v: Vec<f64> = angles.iter().map(|&a| f(a)).collect();
            Tensor::from_vec(v, (tokens, half), &Device::Cpu)?.to_dtype(x.dtype())
        };
        fused_matches_composite(
            &[&[tokens, 2, 2 * half]],
            |x| rope(&x[0], &table(f64::cos, &x[0])?, &table(f64::sin, &x[0])?),
            |x| crate::ops::rope(&x[0], &table(f64::cos, &x[0])?, &table(f64::sin, &x[0])?),
        );
    }
}
