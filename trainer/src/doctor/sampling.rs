//! The device sampler against its host reference: the same draws from the same logits by
//! `kernels/sample.cu` on the GPU and by `dppo_engine::gumbel::draw` on the host.

use candle_core::{DType, Device, Tensor};
use dppo_engine::device_sample::{self, DeviceDraw};
use dppo_engine::gumbel::{self, DrawKey, DrawParams};

use super::compare::BUG_FIX;
use super::Check;
use crate::TrainError;

/// Rows and vocabulary of the check (Qwen's vocabulary size, so the block's strided loop
/// and the vocabulary's tail are exercised).
const ROWS: usize = 16;
const VOCAB: usize = 151_936;
/// Share of draws that must pick the host's token: only a near-tie of two noisy scores,
/// where the GPU's and the host's `log` round differently, may part them.
const MIN_AGREEMENT: f64 = 0.99;
/// Largest logprob difference where the tokens agree (the reductions' orders differ).
const LOGPROB_TOL: f32 = 1e-4;

/// Draws 8 samples per row on `device` against the host: temperatures 1, 0.7 and greedy,
/// each plain, with top-k 50, with top-p 0.9 and with both and min-p 0.05, and 5 top
/// logprobs on some.
pub(super) fn device_sampling(device: &Device) -> Result<Check, TrainError> {
    if device.is_cpu() {
        return Ok(Check::skip(
            "device sampling",
            "the CPU samples on the host; this checks the GPU kernel",
        ));
    }
    let host = Tensor::randn(0f32, 3.0, (ROWS, VOCAB), &Device::Cpu)?;
    let logits = host.to_device(device)?.to_dtype(DType::F32)?;
    let rows = host.to_vec2::<f32>()?;
    let inv_temperatures = [1.0f32, 1.0 / 0.7, 0.0];
    let truncations = [
        (0, 1.0f32, 0.0f32),
        (50, 1.0, 0.0),
        (0, 0.9, 0.0),
        (50, 0.9, 0.05),
    ];
    let mut draws = Vec::new();
    for row in 0..ROWS {
        for sample in 0..8u32 {
            let (top_k, top_p, min_p) = truncations[(row / 3 + sample as usize) % 4];
            draws.push(DeviceDraw {
                row: row as u32,
                key: DrawKey {
                    key: 0x5eed_0000 + row as u64,
                    position: 17 + sample,
                    sample_index: sample,
                },
                params: DrawParams {
                    inv_temperature: inv_temperatures[(row + sample as usize) % 3],
                    top_k,
                    top_p,
                    min_p,
                    top_logprobs: if sample % 3 == 0 { 5 } else { 0 },
                },
            });
        }
    }
    let got = device_sample::sample(&logits, &draws)?;
    let (mut agreed, mut worst) = (0usize, 0f32);
    for (d, got) in draws.iter().zip(&got) {
        let want = gumbel::draw(&rows[d.row as usize], &d.params, &d.key);
        let same_tops = want.top_logprobs.len() == got.top_logprobs.len()
            && want
                .top_logprobs
                .iter()
                .zip(&got.top_logprobs)
                .all(|(a, b)| a.0 == b.0);
        if want.token == got.token && same_tops {
            agreed += 1;
            worst = worst
                .max((want.logprob - got.logprob).abs())
                .max((want.model_logprob - got.model_logprob).abs());
            for (a, b) in want.top_logprobs.iter().zip(&got.top_logprobs) {
                worst = worst.max((a.1 - b.1).abs());
            }
        }
    }
    let share = agreed as f64 / draws.len() as f64;
    Ok(Check::expect(
        share >= MIN_AGREEMENT && worst <= LOGPROB_TOL,
        "device sampling",
        format!(
            "{agreed}/{} draws ({ROWS} rows x {VOCAB} logits; temperature, top-k, top-p, min-p) \
             pick the host reference's token and top logprobs (>= {MIN_AGREEMENT}); logprob \
             diff max {worst:.1e} (<= {LOGPROB_TOL:.0e})",
            draws.len()
        ),
        BUG_FIX,
    ))
}
