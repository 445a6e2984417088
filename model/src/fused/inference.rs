//! candle-nn's fused kernels (RMSNorm, rotary embedding, SiLU, softmax) for inference: one
//! launch each on a GPU where the composites of [`crate::ops`] take five to nine. They have
//! no backward pass, so they run only on a thread that asked for them (the engine's worker,
//! with `engine.fused_kernels`) and only on tensors that track no gradient: a learner's
//! forward over its variables never reaches them.

use std::cell::Cell;

use candle_core::{Result, Tensor};

thread_local! {
    static ON: Cell<bool> = const { Cell::new(false) };
}

/// Whether this thread's inference forward passes may use candle-nn's fused kernels.
pub fn use_on_this_thread(on: bool) {
    ON.with(|c| c.set(on));
}

/// Whether `operands` go through the fused kernels here.
pub(super) fn applies(operands: &[&Tensor]) -> bool {
    ON.with(Cell::get) && operands.iter().all(|t| !t.track_op())
}

/// RMSNorm of the last dimension; f32 inside for half-precision inputs.
pub(super) fn rms_norm(x: &Tensor, weight: &Tensor, eps: f64) -> Result<Tensor> {
    candle_nn::ops::rms_norm(&x.contiguous()?, weight, eps as f32)
}

/// `silu(gate) * up`.
pub(super) fn silu_mul(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    candle_nn::ops::silu(gate)? * up
}

/// "Rotate half" rotary embedding of `x` (tokens, heads, head_dim) by `cos`, `sin`
/// (tokens, head_dim / 2): candle-nn's `rope_thd` with one batch row.
pub(super) fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    candle_nn::rotary_emb::rope_thd(
        &x.contiguous()?.unsqueeze(0)?,
        &cos.contiguous()?,
        &sin.contiguous()?,
    )?
    .squeeze(0)
}

/// Softmax over the last dimension.
pub fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    if applies(&[x]) {
        candle_nn::ops::softmax_last_dim(&x.contiguous()?)
    } else {
        crate::ops::softmax_last_dim(x)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device, Var};

    /// Relative to the value's magnitude (at least 1): bf16's rounding scales with it, and
    /// the inputs are random, so a large value may round a whole ulp away.
    fn close(a: &Tensor, b: &Tensor, tol: f32) {
        let f = |t: &Tensor| t.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
        let (a, b) = (
            f(a).to_vec1::<f32>().unwrap(),
            f(b).to_vec1::<f32>().unwrap(),
        );
        let d = a
            .iter()
            .zip(&b)
            .map(|(x, y)| (x - y).abs() / y.abs().max(1.0))
            .fold(
                0f32,
                |m, d| if d.is_nan() { f32::INFINITY } else { m.max(d) },
            );
        assert!(d <= tol, "max relative difference {d} > {tol}");
    }

    /// Each kernel computes what its composite does (the same layouts and formulas), in f32
    /// and in bf16 (within bf16's rounding).
    #[test]
    fn the_kernels_compute_the_composites() {
        let dev = Device::Cpu;
        let x = Tensor::randn(0f32, 1.0, (5, 3, 8), &dev).unwrap();
        let w = Tensor::randn(1f32, 0.2, 8, &dev).unwrap();
        let cos = Tensor::randn(0f32, 1.0, (5, 4), &dev).unwrap();
        let sin = Tensor::randn(0f32, 1.0, (5, 4), &dev).unwrap();
        let up = Tensor::randn(0f32, 1.0, (5, 3, 8), &dev).unwrap();
        for (dtype, tol) in [(DType::F32, 1e-5), (DType::BF16, 3e-2)] {
            let c = |t: &Tensor| t.to_dtype(dtype).unwrap();
            close(
                &rms_norm(&c(&x), &c(&w), 1e-6).unwrap(),
                &crate::ops::rms_norm(&c(&x), &c(&w), 1e-6).unwrap(),
                tol,
            );
            close(
                &silu_mul(&c(&x), &c(&up)).unwrap(),
                &(crate::ops::silu(&c(&x)).unwrap() * c(&up)).unwrap(),
                tol,
            );
            close(
                &rope(&c(&x), &c(&cos), &c(&sin)).unwrap(),
                &crate::ops::rope(&c(&x), &c(&cos), &c(&sin)).unwrap(),
                tol,
            );
            close(
                &candle_nn::ops::softmax_last_dim(&c(&x)).unwrap(),
                &crate::ops::softmax_last_dim(&c(&x)).unwrap(),
                tol,
            );
        }
    }

    /// Only a thread that asked, and only for tensors without gradient tracking.
    #[test]
    fn tracked_tensors_and_other_threads_keep_the_composites() {
        let x = Tensor::ones(4, DType::F32, &Device::Cpu).unwrap();
        let var = Var::from_tensor(&x).unwrap();
        assert!(!applies(&[&x]));
        use_on_this_thread(true);
        assert!(applies(&[&x]));
        assert!(!applies(&[&x, var.as_tensor()]));
        std::thread::spawn(move || assert!(!applies(&[&x])))
            .join()
            .unwrap();
        use_on_this_thread(false);
    }
}
