//! The device sampler against its host reference: the same draws from the same logits by
//! `kernels/sample.cu` on the GPU and by `dppo_engine::gumbel::draw` on the host.

use candle_core::{DType, Device, Tensor};
use dppo_engine::device_sample::{self, checked_draws, Agreement, LOGPROB_TOL, MIN_AGREEMENT};

use super::compare::BUG_FIX;
use super::Check;
use crate::TrainError;

/// Rows and vocabulary of the check (Qwen's vocabulary size, so the block's strided loop
/// and the vocabulary's tail are exercised).
const ROWS: usize = 16;
const VOCAB: usize = 151_936;

/// Draws 8 samples per row on `device` against the host (see
/// [`device_sample::checked_draws`]), from f32 logits and from bf16 ones (the kernel reads
/// the model's bf16 logits as they are).
pub(super) fn device_sampling(device: &Device) -> Result<Vec<Check>, TrainError> {
    if device.is_cpu() {
        return Ok(vec![Check::skip(
            "device sampling",
            "the CPU samples on the host; this checks the GPU kernel",
        )]);
    }
    [DType::F32, DType::BF16]
        .into_iter()
        .map(|dtype| draws_from(device, dtype))
        .collect()
}

/// The check on logits in `dtype` (the host reference reads their f32 values).
fn draws_from(device: &Device, dtype: DType) -> Result<Check, TrainError> {
    let host = Tensor::randn(0f32, 3.0, (ROWS, VOCAB), &Device::Cpu)?.to_dtype(dtype)?;
    let logits = host.to_device(device)?;
    let rows = host.to_dtype(DType::F32)?.to_vec2::<f32>()?;
    let draws = checked_draws(ROWS);
    let got = device_sample::sample(&logits, &draws)?;
    let agreement = Agreement::of(&rows, &draws, &got);
    let Agreement {
        agreed,
        worst,
        first_disagreement,
        ..
    } = agreement;
    let mut detail = format!(
        "{agreed}/{} draws ({ROWS} rows x {VOCAB} logits; temperature, top-k, top-p, min-p) \
         pick the host reference's token and top logprobs (>= {MIN_AGREEMENT}); logprob diff \
         max {worst:.1e} (<= {LOGPROB_TOL:.0e})",
        draws.len()
    );
    if let Some(i) = first_disagreement {
        detail += &format!(
            "; first disagreement: draw {i}, {:?}, got {:?}",
            draws[i], got[i]
        );
    }
    Ok(Check::expect(
        agreement.passed(),
        format!("device sampling, {dtype:?} logits"),
        detail,
        BUG_FIX,
    ))
}
