//! `add_rms_norm` and `silu_mul` run on the CPU, as `layer_ops`' ops launch them on a GPU
//! (the same argument lists and geometry), and tested against the model's own ops.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, DType, Layout, Result};

use super::{launch, Stored};
use crate::cuda_attn::layer_ops::AddNorm;
use crate::cuda_attn::params::{AddRmsNorm, SiluMul};
use crate::cuda_attn::{norm_geometry, silu_geometry};
use crate::kernel_emu::Args;

/// The values `layout` spans in `storage`, as `T`; they must be contiguous.
fn values<'a, T: Stored>(storage: &'a CpuStorage, layout: &Layout) -> Result<&'a [T]> {
    let Some((start, end)) = layout.contiguous_offsets() else {
        bail!("emulated kernels: a non-contiguous input");
    };
    Ok(&T::cpu_storage_as_slice(storage)?[start..end])
}

/// `add_rms_norm` of x, the residual and the weight: (2, rows, width), poisoned first.
pub(in crate::cuda_attn) fn add_rms_norm(
    op: &AddNorm,
    x: (&CpuStorage, &Layout),
    r: (&CpuStorage, &Layout),
    w: (&CpuStorage, &Layout),
) -> Result<CpuStorage> {
    match x.0.dtype() {
        DType::F32 => norm::<f32>(op, x, r, w),
        DType::BF16 => norm::<half::bf16>(op, x, r, w),
        DType::F16 => norm::<half::f16>(op, x, r, w),
        other => bail!("add_rms_norm: no kernel for {other:?}"),
    }
}

fn norm<T: Stored>(
    op: &AddNorm,
    (x, xl): (&CpuStorage, &Layout),
    (r, rl): (&CpuStorage, &Layout),
    (w, wl): (&CpuStorage, &Layout),
) -> Result<CpuStorage> {
    let (xs, rs, ws) = (
        values::<T>(x, xl)?,
        values::<T>(r, rl)?,
        values::<T>(w, wl)?,
    );
    let width = ws.len();
    let rows = xs.len() / width;
    let mut out = vec![T::of(f32::NAN); 2 * rows * width];
    let (width_arg, has_residual) = (width as u32, u32::from(op.has_residual));
    let list = AddRmsNorm {
        x: xs.as_ptr(),
        r: rs.as_ptr(),
        weight: ws.as_ptr(),
        out: out.as_mut_ptr(),
        width: &width_arg,
        has_residual: &has_residual,
        eps: &op.eps,
    };
    let args = Args::filled(|l| list.push_to(l));
    launch(
        &format!("add_rms_norm_{}", T::SUFFIX),
        norm_geometry(rows),
        &args,
    )?;
    Ok(T::to_cpu_storage_owned(out))
}

/// `silu_mul` of a (rows, 2 * width) projection: (rows, width), poisoned first.
pub(in crate::cuda_attn) fn silu_mul(
    s: (&CpuStorage, &Layout),
    width: usize,
) -> Result<CpuStorage> {
    match s.0.dtype() {
        DType::F32 => gated::<f32>(s, width),
        DType::BF16 => gated::<half::bf16>(s, width),
        DType::F16 => gated::<half::f16>(s, width),
        other => bail!("silu_mul: no kernel for {other:?}"),
    }
}

fn gated<T: Stored>((s, l): (&CpuStorage, &Layout), width: usize) -> Result<CpuStorage> {
    let gate_up = values::<T>(s, l)?;
    let total = gate_up.len() / 2;
    let mut out = vec![T::of(f32::NAN); total];
    let (width_arg, total_arg) = (width as u32, total as u32);
    let list = SiluMul {
        gate_up: gate_up.as_ptr(),
        out: out.as_mut_ptr(),
        width: &width_arg,
        total: &total_arg,
    };
    let args = Args::filled(|l| list.push_to(l));
    launch(
        &format!("silu_mul_{}", T::SUFFIX),
        silu_geometry(total),
        &args,
    )?;
    Ok(T::to_cpu_storage_owned(out))
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor};
    use dppo_model::LayerKernels;

    use crate::cuda_attn::layer_ops::LayerOps;

    /// Largest difference between `a` and `b` relative to `b`'s magnitude (at least 1).
    fn worst(a: &Tensor, b: &Tensor) -> f32 {
        let f = |t: &Tensor| {
            let t = t.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
            t.to_vec1::<f32>().unwrap()
        };
        f(a).iter()
            .zip(f(b))
            .map(|(x, y)| (x - y).abs() / y.abs().max(1.0))
            .fold(
                0f32,
                |m, d| if d.is_nan() { f32::INFINITY } else { m.max(d) },
            )
    }

    /// The kernels compute what the model's ops compute: the residual sum and its RMSNorm
    /// (with and without a residual), and silu(gate) * up from the projection's halves; in
    /// f32 within rounding, in bf16 and f16 within their own. Widths that leave threads idle
    /// and rows that span several of the silu kernel's blocks.
    #[test]
    fn the_layer_kernels_compute_the_models_ops() {
        let dev = Device::Cpu;
        for (rows, width) in [(5, 96), (3, 896), (130, 40)] {
            let x = Tensor::randn(0f32, 1.0, (rows, width), &dev).unwrap();
            let r = Tensor::randn(0f32, 1.0, (rows, width), &dev).unwrap();
            let w = Tensor::randn(1f32, 0.2, width, &dev).unwrap();
            let gate_up = Tensor::randn(0f32, 2.0, (rows, 2 * width), &dev).unwrap();
            for (dtype, tol) in [(DType::F32, 1e-6), (DType::BF16, 2e-2), (DType::F16, 2e-3)] {
                let c = |t: &Tensor| t.to_dtype(dtype).unwrap();
                for residual in [None, Some(c(&r))] {
                    let (sum, normed) = LayerOps::default()
                        .add_rms_norm(&c(&x), residual.as_ref(), &c(&w), 1e-6)
                        .unwrap();
                    let want_sum = match &residual {
                        Some(r) => (c(&x) + r).unwrap(),
                        None => c(&x),
                    };
                    // The sum is rounded as candle's add rounds it: equal.
                    assert_eq!(worst(&sum, &want_sum), 0.0, "{dtype:?} sum");
                    let want = dppo_model::ops::rms_norm(&want_sum, &c(&w), 1e-6).unwrap();
                    let d = worst(&normed, &want);
                    assert!(d <= tol, "{dtype:?} {rows}x{width} norm: {d}");
                }
                let got = LayerOps::default().silu_mul_halves(&c(&gate_up)).unwrap();
                let (gate, up) = (
                    c(&gate_up).narrow(1, 0, width).unwrap(),
                    c(&gate_up).narrow(1, width, width).unwrap(),
                );
                let want = (dppo_model::ops::silu(&gate).unwrap() * up).unwrap();
                let d = worst(&got, &want);
                assert!(d <= tol, "{dtype:?} {rows}x{width} silu_mul: {d}");
            }
        }
    }
}
