//! kernels/paged_attention.cu on a GPU: its module, the functions looked up in it, and what
//! every launch of its kernels needs (the launch configuration, its inputs' device slices).

use candle_core::cuda_backend::cudarc::driver::{CudaFunction, CudaView, LaunchConfig};
use candle_core::cuda_backend::{CudaDType, CudaStorage};
use candle_core::{bail, CudaDevice, DType, Layout, Result};

use super::{AttentionKernel, Geometry, SOURCE};

/// kernels/paged_attention.cu as the GPU loads it.
static MODULE: crate::nvrtc::Module =
    crate::nvrtc::Module::new("dppo_paged_attention", "kernels/paged_attention.cu", SOURCE);

/// The same source with the attention's other variants, compiled only when one is asked for.
static VARIANTS: crate::nvrtc::Module = crate::nvrtc::Module::with_options(
    "dppo_paged_attention_variants",
    "kernels/paged_attention.cu",
    SOURCE,
    &["-DATTENTION_VARIANTS"],
);

/// `CustomOp3::cpu_fwd` of an op of these kernels, which runs on a GPU only: an error naming
/// the op.
macro_rules! gpu_only_cpu_fwd {
    ($op:literal) => {
        fn cpu_fwd(
            &self,
            _: &candle_core::CpuStorage,
            _: &candle_core::Layout,
            _: &candle_core::CpuStorage,
            _: &candle_core::Layout,
            _: &candle_core::CpuStorage,
            _: &candle_core::Layout,
        ) -> candle_core::Result<(candle_core::CpuStorage, candle_core::Shape)> {
            candle_core::bail!(concat!($op, " runs on a GPU only"))
        }
    };
}
pub(super) use gpu_only_cpu_fwd;

/// `g` as cudarc takes it.
pub(super) fn config(g: Geometry) -> LaunchConfig {
    LaunchConfig {
        grid_dim: g.grid,
        block_dim: g.block,
        shared_mem_bytes: g.shared_bytes,
    }
}

/// `storage`'s contiguous elements of type `T` (`what` names the input in errors).
pub(super) fn elements<'a, T: CudaDType>(
    storage: &'a CudaStorage,
    layout: &Layout,
    what: &str,
) -> Result<CudaView<'a, T>> {
    let Some((start, end)) = layout.contiguous_offsets() else {
        bail!("{what} is not contiguous");
    };
    Ok(storage.as_cuda_slice::<T>()?.slice(start..end))
}

/// The kernels' suffix for `dtype`.
fn suffix(dtype: DType) -> Result<&'static str> {
    Ok(match dtype {
        DType::F32 => "f32",
        DType::BF16 => "bf16",
        DType::F16 => "f16",
        other => bail!("cuda attention: no kernels for {other:?}"),
    })
}

/// The attention kernel `variant` for `dtype` at `head_dim`, from the module that holds it.
pub(super) fn attention_function(
    device: &CudaDevice,
    (dtype, head_dim): (DType, usize),
    variant: AttentionKernel,
) -> Result<CudaFunction> {
    let name = variant.kernel_name(suffix(dtype)?, head_dim);
    match variant.is_default() {
        true => MODULE.function(device, &name),
        false => VARIANTS.function(device, &name),
    }
}

/// Loads `name` (for `dtype`, where it has a version per dtype) from the module, compiling
/// it (once per process) on first use.
pub(super) fn function(
    device: &CudaDevice,
    name: &str,
    dtype: Option<DType>,
) -> Result<CudaFunction> {
    let name = match dtype {
        Some(dtype) => format!("{name}_{}", suffix(dtype)?),
        None => name.to_string(),
    };
    MODULE.function(device, &name)
}
