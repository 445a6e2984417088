//! The device sampler against its host reference: the same draws from the same logits by
//! `kernels/sample.cu` on the GPU and by `dppo_engine::gumbel::draw` on the host.

use candle_core::{DType, Device, Tensor};
use dppo_engine::device_sample::{
    self, checked_draws, Agreement, Noise, SampleKernel, LOGPROB_TOL, MIN_AGREEMENT,
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
        .map(|dtype| {
            Ok(draws_from(device, &logits(dtype, 3.0, VOCAB)?, SampleKernel::default())?.0)
        })
        .collect()
}

/// One comparison of the kernel's switches: what is compared, the kernel and the one it is
/// held to (named), the logprob tolerance, and the logits' dtype, spread and vocabulary.
struct Comparison {
    what: &'static str,
    kernel: SampleKernel,
    against: (&'static str, SampleKernel),
    tolerance: f32,
    dtype: DType,
    std: f32,
    vocab: usize,
}

/// The kernel's switches against its defaults' draws, an error failing its check alone:
/// `engine.lazy_noise` (on by default), the same draws as every score's exact noise gives, bit
/// for bit; then `engine.split_draws` (an experiment's checks until a GPU passes them), the
/// one-block kernel's tokens and top-logprob ids, logprobs within [`LOGPROB_TOL`] (the split's
/// log-sum-exps merge in another order). Each from the same logits, spread (std 3) and close
/// (std 0.3, an untrained model's), and so the host reference's draws too; the split also
/// over a vocabulary one short of Qwen's (rows off its vector loads' alignment, a last group
/// of three) and with the exact noise.
pub(super) fn kernel_switches(device: &Device) -> Vec<Check> {
    if device.is_cpu() {
        return Vec::new();
    }
    let exact = SampleKernel::default();
    let lazy = SampleKernel {
        noise: Noise::Lazy,
        ..exact
    };
    let split = SampleKernel {
        split: true,
        ..lazy
    };
    let split_exact = SampleKernel {
        split: true,
        ..exact
    };
    let one_block = "one block a draw";
    let mut comparisons = Vec::new();
    for (what, kernel, against, tolerance) in [
        ("lazy noise", lazy, ("the exact noise", exact), 0.0),
        ("split draws", split, (one_block, lazy), LOGPROB_TOL),
    ] {
        for dtype in [DType::F32, DType::BF16] {
            for std in [3.0, 0.3] {
                comparisons.push(Comparison {
                    what,
                    kernel,
                    against,
                    tolerance,
                    dtype,
                    std,
                    vocab: VOCAB,
                });
            }
        }
    }
    let odd = Comparison {
        what: "split draws",
        kernel: split,
        against: (one_block, lazy),
        tolerance: LOGPROB_TOL,
        dtype: DType::BF16,
        std: 0.3,
        vocab: VOCAB - 1,
    };
    let exact_noise = Comparison {
        what: "split draws, exact noise",
        kernel: split_exact,
        against: (one_block, exact),
        std: 3.0,
        vocab: VOCAB,
        ..odd
    };
    comparisons.extend([odd, exact_noise]);
    comparisons
        .into_iter()
        .map(|c| {
            let mut name = format!(
                "device sampling, {}, {:?} logits, std {}",
                c.what, c.dtype, c.std
            );
            if c.vocab != VOCAB {
                name += &format!(", vocabulary {}", c.vocab);
            }
            let check = match against_kernel(device, &c) {
                Ok((passed, detail)) => Check::expect(passed, name, detail, BUG_FIX),
                Err(e) => Check::fail(name, e.to_string(), BUG_FIX),
            };
            if c.kernel.split {
                check.of_experiment()
            } else {
                check
            }
        })
        .collect()
}

/// Whether `c.kernel` drew what `c.against` draws (the same tokens and top-logprob ids, every
/// logprob within `c.tolerance`) and the host reference's, from the same logits, and what was
/// found.
fn against_kernel(device: &Device, c: &Comparison) -> Result<(bool, String), TrainError> {
    let host = logits(c.dtype, c.std, c.vocab)?;
    let (label, against) = c.against;
    let (_, want) = draws_from(device, &host, against)?;
    let (check, got) = draws_from(device, &host, c.kernel)?;
    let (same, worst) = compare_draws(&got, &want);
    let detail = format!(
        "{}; against {label}: {}, logprob diff max {worst:.1e} (<= {:.0e})",
        check.detail,
        if same {
            "the same tokens"
        } else {
            "OTHER tokens"
        },
        c.tolerance
    );
    Ok((
        check.status == Status::Ok && same && worst <= c.tolerance,
        detail,
    ))
}

/// Whether `got` and `want` hold the same tokens and top-logprob ids, and the largest
/// difference of their logprobs (infinite where one is NaN and the other not).
fn compare_draws(got: &[Drawn], want: &[Drawn]) -> (bool, f32) {
    let mut same = got.len() == want.len();
    let mut worst = 0f32;
    let diff = |a: f32, b: f32| match (a.is_nan(), b.is_nan()) {
        (true, true) => 0.0,
        (false, false) => (a - b).abs(),
        _ => f32::INFINITY,
    };
    for (g, w) in got.iter().zip(want) {
        same &= g.token == w.token && g.top_logprobs.len() == w.top_logprobs.len();
        worst = worst
            .max(diff(g.logprob, w.logprob))
            .max(diff(g.model_logprob, w.model_logprob));
        for (a, b) in g.top_logprobs.iter().zip(&w.top_logprobs) {
            same &= a.0 == b.0;
            worst = worst.max(diff(a.1, b.1));
        }
    }
    (same, worst)
}

/// Logits as the checks draw them, on the host in `dtype`: normal(0, `std`), `vocab` a row.
fn logits(dtype: DType, std: f32, vocab: usize) -> Result<Tensor, TrainError> {
    Ok(Tensor::randn(0f32, std, (ROWS, vocab), &Device::Cpu)?.to_dtype(dtype)?)
}

/// The check of draws by `kernel` from `host` (copied to `device`; the host reference reads
/// their f32 values), and the draws.
fn draws_from(
    device: &Device,
    host: &Tensor,
    kernel: SampleKernel,
) -> Result<(Check, Vec<Drawn>), TrainError> {
    let dtype = host.dtype();
    let logits = host.to_device(device)?;
    let rows = host.to_dtype(DType::F32)?.to_vec2::<f32>()?;
    let draws = checked_draws(ROWS);
    let got = device_sample::sample(&logits, &draws, kernel)?;
    let agreement = Agreement::of(&rows, &draws, &got);
    let Agreement {
        agreed,
        worst,
        first_disagreement,
        ..
    } = agreement;
    let vocab = rows.first().map_or(0, Vec::len);
    let mut detail = format!(
        "{agreed}/{} draws ({ROWS} rows x {vocab} logits; temperature, top-k, top-p, min-p) \
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
