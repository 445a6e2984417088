//! The device sampler against its host reference: the same draws from the same logits by
//! `kernels/sample.cu` on the GPU and by `dppo_engine::gumbel::draw` on the host.

use candle_core::{DType, Device, Tensor};
use dppo_engine::device_sample::{
    self, checked_draws, Agreement, Noise, LOGPROB_TOL, MIN_AGREEMENT,
};
use dppo_engine::gumbel::Drawn;

use super::compare::BUG_FIX;
use super::{Check, Status};
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
        .map(|dtype| Ok(draws_from(device, &logits(dtype, 3.0)?, Noise::Every)?.0))
        .collect()
}

/// `engine.lazy_noise`'s checks (an error fails its check alone): from the same logits,
/// spread (std 3) and close (std 0.3, an untrained model's), the same draws as with every
/// score's exact noise, bit for bit, and so the host reference's.
pub(super) fn lazy_noise(device: &Device) -> Vec<Check> {
    if device.is_cpu() {
        return Vec::new();
    }
    let mut checks = Vec::new();
    for dtype in [DType::F32, DType::BF16] {
        for std in [3.0, 0.3] {
            let name = format!("device sampling, lazy noise, {dtype:?} logits, std {std}");
            let check = match lazy_against_exact(device, dtype, std) {
                Ok((passed, detail)) => Check::expect(passed, name, detail, BUG_FIX),
                Err(e) => Check::fail(name, e.to_string(), BUG_FIX),
            };
            checks.push(check);
        }
    }
    checks
}

/// Whether lazy noise drew the exact noise's draws and the host reference's from the same
/// logits in `dtype` at `std`, and what was found.
fn lazy_against_exact(
    device: &Device,
    dtype: DType,
    std: f32,
) -> Result<(bool, String), TrainError> {
    let host = logits(dtype, std)?;
    let (_, every) = draws_from(device, &host, Noise::Every)?;
    let (lazy, got) = draws_from(device, &host, Noise::Lazy)?;
    let same = got == every;
    let detail = format!(
        "{}; {} the exact noise's draws",
        lazy.detail,
        if same {
            "identical to"
        } else {
            "NOT identical to"
        }
    );
    Ok((lazy.status == Status::Ok && same, detail))
}

/// Logits as the checks draw them, on the host in `dtype`: normal(0, `std`).
fn logits(dtype: DType, std: f32) -> Result<Tensor, TrainError> {
    Ok(Tensor::randn(0f32, std, (ROWS, VOCAB), &Device::Cpu)?.to_dtype(dtype)?)
}

/// The check of draws with `noise` from `host` (copied to `device`; the host reference reads
/// their f32 values), and the draws.
fn draws_from(
    device: &Device,
    host: &Tensor,
    noise: Noise,
) -> Result<(Check, Vec<Drawn>), TrainError> {
    let dtype = host.dtype();
    let logits = host.to_device(device)?;
    let rows = host.to_dtype(DType::F32)?.to_vec2::<f32>()?;
    let draws = checked_draws(ROWS);
    let got = device_sample::sample(&logits, &draws, noise)?;
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
    let check = Check::expect(
        agreement.passed(),
        format!("device sampling, {dtype:?} logits"),
        detail,
        BUG_FIX,
    );
    Ok((check, got))
}
