//! The paged attention kernels (`engine.attention = "cuda"`) on the GPU against the generic
//! path and the f64 reference, in f32, bf16 and f16.

use candle_core::Device;

use super::Check;
use crate::TrainError;

const NAME: &str = "paged attention kernels";

/// Skipped on the CPU (the CPU twin is checked by the tests).
pub(super) fn paged_attention(device: &Device) -> Result<Check, TrainError> {
    if !device.is_cuda() {
        return Ok(Check::skip(
            NAME,
            "the CUDA kernels run on a GPU; their CPU twin is checked by the tests",
        ));
    }
    on_gpu(device)
}

#[cfg(feature = "cuda")]
fn on_gpu(device: &Device) -> Result<Check, TrainError> {
    let reports = dppo_engine::cuda_attn::device_check::run(device)?;
    let detail = reports
        .iter()
        .map(|r| {
            format!(
                "{:?}: {} cases, max diff {:.1e} vs f64, {:.1e} vs generic (<= {:.0e}), {} \
                 pools differ",
                r.dtype, r.cases, r.vs_reference, r.vs_generic, r.tolerance, r.pools_differing
            )
        })
        .chain(reports.iter().filter_map(|r| r.first_failure.clone()))
        .collect::<Vec<_>>()
        .join("; ");
    Ok(Check::expect(
        reports.iter().all(|r| r.passed()),
        NAME,
        detail,
        super::compare::BUG_FIX,
    ))
}

#[cfg(not(feature = "cuda"))]
fn on_gpu(device: &Device) -> Result<Check, TrainError> {
    Ok(Check::skip(
        NAME,
        format!("no CUDA kernels in this build for {:?}", device.location()),
    ))
}
