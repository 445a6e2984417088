//! Custom ops with hand-written backward passes for the CPU: SiLU-gated product, RMSNorm,
//! rotary embeddings, the scaled causal softmax of attention and the residual sums.
//!
//! The composite ops of [`crate::ops`] each keep their intermediates alive until the
//! backward pass and run one pass per primitive, each a round trip through candle's thread
//! pool; these keep only their inputs and output and compute each direction in one parallel
//! pass on rayon's pool, the one the projections run on. They apply to f32/f64 CPU tensors,
//! in training and in the engine alike (so the learner and the engine compute the same
//! numbers); other devices and dtypes keep the composite ops. Each row is computed alone,
//! so a row's result does not depend on the batch.

mod add;
pub mod inference;
mod rope;
mod rows;
mod silu_mul;

use std::ops::{Add, Div, Mul, Neg, Sub};

use candle_core::{bail, CpuStorage, DType, Layout, Result, Tensor};

use crate::uninit;

pub use add::add;
pub use rope::rope;
pub(crate) use rope::Rotate;
pub use rows::{causal_softmax, rms_norm};
pub(crate) use rows::{CausalSoftmax, NormGradX, NormRows, RmsNorm, SoftmaxGrad};
pub use silu_mul::silu_mul;
pub(crate) use silu_mul::{Backward as SiluMulGrad, Forward as SiluMulRows};

/// Whether the fused ops apply to `operands`: f32/f64 CPU tensors of one dtype.
pub(crate) fn applies(operands: &[&Tensor]) -> bool {
    let dtype = operands[0].dtype();
    operands
        .iter()
        .all(|t| t.device().is_cpu() && t.dtype() == dtype)
        && matches!(dtype, DType::F32 | DType::F64)
}

/// The float types the ops compute in.
pub(crate) trait Real:
    Copy
    + Default
    + Send
    + Sync
    + PartialOrd
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
    + Neg<Output = Self>
{
    const ZERO: Self;
    const ONE: Self;
    const NEG_INFINITY: Self;
    fn of(x: f64) -> Self;
    fn exp(self) -> Self;
    fn sqrt(self) -> Self;
}

macro_rules! real {
    ($t:ty) => {
        impl Real for $t {
            const ZERO: Self = 0.0;
            const ONE: Self = 1.0;
            const NEG_INFINITY: Self = <$t>::NEG_INFINITY;
            fn of(x: f64) -> Self {
                x as $t
            }
            fn exp(self) -> Self {
                <$t>::exp(self)
            }
            fn sqrt(self) -> Self {
                <$t>::sqrt(self)
            }
        }
    };
}
real!(f32);
real!(f64);

/// The data of a contiguous operand.
fn slice<'a, T>(data: &'a [T], layout: &Layout) -> Result<&'a [T]> {
    match layout.contiguous_offsets() {
        Some((start, end)) => Ok(&data[start..end]),
        None => bail!("fused op: operand is not contiguous"),
    }
}

/// A function of float operands computed per element or per row, in parallel.
pub(crate) trait Kernel: Sync {
    /// Elements per independent unit (a row; 1 for elementwise functions).
    fn width(&self) -> usize;
    /// Fills `out`, one row (or a block of elements for elementwise kernels) starting at
    /// unit `unit`, from `inputs`: operands the size of the output come as the matching
    /// slice, others (a norm's weight, rope's tables) whole.
    fn run<R: Real>(&self, unit: usize, inputs: &[&[R]], out: &mut [R]);
}

/// Runs `kernel` over contiguous f32 or f64 CPU operands, of which the first has the
/// output's size.
fn run_kernel<K: Kernel>(kernel: &K, inputs: &[(&CpuStorage, &Layout)]) -> Result<CpuStorage> {
    let mut f32s = Vec::new();
    let mut f64s = Vec::new();
    for (storage, layout) in inputs {
        match storage {
            CpuStorage::F32(d) => f32s.push(slice(d, layout)?),
            CpuStorage::F64(d) => f64s.push(slice(d, layout)?),
            _ => bail!("fused op: operands must be f32 or f64"),
        }
    }
    match (f32s.len(), f64s.len()) {
        (_, 0) => Ok(CpuStorage::F32(apply(kernel, &f32s))),
        (0, _) => Ok(CpuStorage::F64(apply(kernel, &f64s))),
        _ => bail!("fused op: operands mix f32 and f64"),
    }
}

/// `kernel` over `inputs`, of which the first has the output's size: the operands of that
/// size come to each unit as the matching slice, the others whole (see [`Kernel::run`]).
pub(crate) fn apply<R: Real, K: Kernel>(kernel: &K, inputs: &[&[R]]) -> Vec<R> {
    let len = inputs[0].len();
    let width = kernel.width().max(1);
    // Elementwise kernels take blocks of many elements at once.
    let block = if width == 1 { 1 << 14 } else { width };
    uninit::filled_rows(len, block, |b, chunk| {
        let start = b * block;
        let parts: Vec<&[R]> = inputs
            .iter()
            .map(|x| {
                if x.len() == len {
                    &x[start..start + chunk.len()]
                } else {
                    x
                }
            })
            .collect();
        kernel.run(start / width, &parts, chunk);
    })
}

#[cfg(test)]
pub(crate) mod check;
