//! `add_rms_norm` and `silu_mul` run on the CPU, as `layer_ops`' ops launch them on a GPU
//! (the same argument lists and geometry); `layer_ops`' tests hold them to the model's ops.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, DType, Layout, Result};

use super::{launch, Stored};
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

/// `add_rms_norm` of x, the residual (x itself without one) and the weight: (2, rows, width),
/// poisoned first.
pub(in crate::cuda_attn) fn add_rms_norm(
    op: (bool, f32),
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
    (has_residual, eps): (bool, f32),
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
    let (width_arg, has_residual) = (width as u32, u32::from(has_residual));
    let list = AddRmsNorm {
        x: xs.as_ptr(),
        r: rs.as_ptr(),
        weight: ws.as_ptr(),
        out: out.as_mut_ptr(),
        width: &width_arg,
        has_residual: &has_residual,
        eps: &eps,
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
    let rows = total / width;
    let mut out = vec![T::of(f32::NAN); total];
    let (width_arg, rows_arg) = (width as u32, rows as u32);
    let list = SiluMul {
        gate_up: gate_up.as_ptr(),
        out: out.as_mut_ptr(),
        width: &width_arg,
        rows: &rows_arg,
    };
    let args = Args::filled(|l| list.push_to(l));
    launch(
        &format!("silu_mul_{}", T::SUFFIX),
        silu_geometry(rows, width, std::mem::size_of::<T>()),
        &args,
    )?;
    Ok(T::to_cpu_storage_owned(out))
}
