//! `a + b` elementwise (the residual stream's sums) on rayon's pool: candle's CPU add
//! hands large tensors to a thread pool of its own, which on a busy machine competes with
//! rayon's for the cores and leaves the caller spinning at a barrier.

use candle_core::{CpuStorage, CustomOp2, Layout, Result, Shape, Tensor};

use super::{applies, run_kernel, Kernel, Real};

/// `a + b` for tensors of one shape: on rayon's pool for f32/f64 CPU tensors, candle's
/// add otherwise. The sums are the same either way.
pub fn add(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    if applies(&[a, b]) {
        a.contiguous()?.apply_op2(&b.contiguous()?, Add)
    } else {
        a + b
    }
}

/// The op (forward kernel and backward).
struct Add;

impl Kernel for Add {
    fn width(&self) -> usize {
        1
    }
    fn run<R: Real>(&self, _unit: usize, inputs: &[&[R]], out: &mut [R]) {
        for ((o, &x), &y) in out.iter_mut().zip(inputs[0]).zip(inputs[1]) {
            *o = x + y;
        }
    }
}

impl CustomOp2 for Add {
    fn name(&self) -> &'static str {
        "dppo-add"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        if l1.shape() != l2.shape() {
            candle_core::bail!("add: {:?} and {:?}", l1.shape(), l2.shape());
        }
        Ok((run_kernel(self, &[(s1, l1), (s2, l2)])?, l1.shape().clone()))
    }

    fn bwd(
        &self,
        _a: &Tensor,
        _b: &Tensor,
        _out: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let grad = grad.detach();
        Ok((Some(grad.clone()), Some(grad)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fused::check::fused_matches_composite;

    #[test]
    fn add_matches_candle_add_and_finite_differences() {
        fused_matches_composite(
            &[&[3, 7], &[3, 7]],
            |x| add(&x[0], &x[1]),
            |x| &x[0] + &x[1],
        );
    }

    #[test]
    fn add_is_exactly_candle_add_across_parallel_blocks() {
        let dev = candle_core::Device::Cpu;
        let n = 3 << 14;
        let a: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin() * 1e3).collect();
        let b: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos() * 1e-3).collect();
        let a = Tensor::from_vec(a, (3, 1 << 14), &dev).unwrap();
        let b = Tensor::from_vec(b, (3, 1 << 14), &dev).unwrap();
        let ours = add(&a, &b)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        let theirs = (&a + &b)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        assert!(ours
            .iter()
            .zip(&theirs)
            .all(|(x, y)| x.to_bits() == y.to_bits()));
    }
}
