//! candle-nn's fused kernels (RMSNorm, rotary embedding, SiLU, softmax) for inference: one
//! launch each on a GPU where the composites of [`crate::ops`] take five to nine. They have
//! no backward pass, so they run only on a thread that asked for them (the engine's worker,
//! with `engine.fused_kernels`) and only on tensors that track no gradient: a learner's
//! forward over its variables never reaches them.

use std::cell::Cell;

use candle_core::{Device, Result, Tensor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Whether the engine uses the fused kernels (`engine.fused_kernels`): `auto` (the default)
/// on a GPU, where `dppo doctor` checks them and they were measured faster than the
/// composites, and not on the CPU; or as set (`true`, `false`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FusedKernels {
    #[default]
    Auto,
    On,
    Off,
}

impl FusedKernels {
    /// Whether they are used on `device` (`Auto` resolved).
    pub fn on(self, device: &Device) -> bool {
        match self {
            Self::Auto => device.is_cuda(),
            Self::On => true,
            Self::Off => false,
        }
    }
}

impl From<bool> for FusedKernels {
    fn from(on: bool) -> Self {
        if on {
            Self::On
        } else {
            Self::Off
        }
    }
}

/// `"auto"`, `true` or `false`, as the config file writes it.
impl Serialize for FusedKernels {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        match self {
            Self::Auto => s.serialize_str("auto"),
            Self::On => s.serialize_bool(true),
            Self::Off => s.serialize_bool(false),
        }
    }
}

impl<'de> Deserialize<'de> for FusedKernels {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Written {
            Bool(bool),
            Text(String),
        }
        match Written::deserialize(d)? {
            Written::Bool(on) => Ok(on.into()),
            Written::Text(t) if t == "auto" => Ok(Self::Auto),
            Written::Text(t) => Err(serde::de::Error::custom(format!(
                "fused_kernels: got {t:?}, allowed: auto | true | false"
            ))),
        }
    }
}

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
