//! What the device checks share: generating with an engine of a given configuration, the
//! greedy comparison against the CPU, and the fix a computing difference calls for.

use candle_core::{DType, Device};
use dppo_engine::{Completion, Engine, EngineConfig, GenerateRequest};
use dppo_model::Policy;

use super::Check;
use crate::TrainError;

/// Largest |logprob| difference from the CPU's f32 allowed for f32 on a GPU.
const LOGPROB_TOL_F32: f32 = 1e-3;
/// Largest mean |logprob| difference from the CPU's f32 allowed for bf16, whose single
/// tokens can be off by a rounding step of a large logit.
const LOGPROB_TOL_BF16: f32 = 5e-2;
/// The fix of a check that finds the device computing differently from the CPU.
pub(super) const BUG_FIX: &str =
    "the device computes differently from the CPU: report it with the \
    output of `dppo doctor --json`";

/// The completions of `reqs` by an engine of `cfg` on `device`, and the engine.
pub(super) fn generate_with(
    policy: &Policy,
    device: &Device,
    cfg: EngineConfig,
    reqs: &[GenerateRequest],
) -> Result<(Vec<Completion>, Engine), TrainError> {
    let engine = Engine::new(policy, cfg, device.clone())?;
    let out = engine.generate(reqs.to_vec())?;
    Ok((out.into_iter().flatten().collect(), engine))
}

/// [`dppo_engine::diff::abs_diff`] in f32: a NaN is the largest difference.
pub(super) fn diff(a: f32, b: f32) -> f32 {
    dppo_engine::diff::abs_diff(a as f64, b as f64) as f32
}

/// Greedy tokens and logprobs of `got` against the CPU's f32 `want`: in f32 the same
/// tokens and the largest logprob difference within tolerance (none on the CPU), in bf16
/// the mean difference where the tokens still agree.
pub(super) fn compare_greedy(
    want: &[Completion],
    got: &[Completion],
    dtype: DType,
    exact: bool,
) -> Check {
    let f32 = dtype == DType::F32;
    let (mut agreed, mut total, mut max_diff, mut sum_diff) = (0, 0, 0f32, 0f32);
    for (w, g) in want.iter().zip(got) {
        let prefix = w
            .token_ids
            .iter()
            .zip(&g.token_ids)
            .take_while(|(a, b)| a == b)
            .count();
        agreed += prefix;
        total += w.token_ids.len();
        for (a, b) in w.logprobs.iter().zip(&g.logprobs).take(prefix) {
            max_diff = max_diff.max(diff(*a, *b));
            sum_diff += diff(*a, *b);
        }
    }
    let mean_diff = sum_diff / agreed.max(1) as f32;
    // bf16 may pick another token where two logits are within its rounding, and a random
    // model's continuations then part; a broken device agrees on next to none.
    let (passed, rule) = match (f32, exact) {
        (true, true) => (agreed == total && max_diff == 0.0, "equal".to_string()),
        (true, false) => (
            agreed == total && max_diff <= LOGPROB_TOL_F32,
            format!("max <= {LOGPROB_TOL_F32:.0e}"),
        ),
        (false, _) => (
            4 * agreed >= total && mean_diff <= LOGPROB_TOL_BF16,
            format!("mean <= {LOGPROB_TOL_BF16:.0e} over the tokens agreeing, at least 1/4"),
        ),
    };
    let detail = format!(
        "{agreed}/{total} greedy tokens as the CPU's f32; |logprob diff| max {max_diff:.1e}, \
         mean {mean_diff:.1e} ({rule})"
    );
    Check::expect(
        passed,
        format!("greedy {}", dtype.as_str()),
        detail,
        BUG_FIX,
    )
}

#[cfg(test)]
mod tests {
    use dppo_engine::FinishReason;

    use super::*;
    use crate::doctor::Status;

    fn completion(logprobs: &[f32]) -> Completion {
        Completion {
            sample_index: 0,
            token_ids: vec![7; logprobs.len()],
            logprobs: logprobs.to_vec(),
            model_logprobs: None,
            top_logprobs: Vec::new(),
            finish_reason: FinishReason::Length,
            policy_version: 0,
            last_policy_version: 0,
        }
    }

    #[test]
    fn a_nan_logprob_on_the_device_fails_the_comparison() {
        let want = [completion(&[-1.0, -2.0, f32::NEG_INFINITY])];
        let close = [completion(&[-1.0, -2.0001, f32::NEG_INFINITY])];
        let nan = [completion(&[-1.0, f32::NAN, f32::NEG_INFINITY])];
        for dtype in [DType::F32, DType::BF16] {
            let ok = compare_greedy(&want, &close, dtype, false);
            assert_eq!(ok.status, Status::Ok, "{dtype:?}: {}", ok.detail);
            let bad = compare_greedy(&want, &nan, dtype, false);
            assert_eq!(bad.status, Status::Fail, "{dtype:?}: {}", bad.detail);
        }
        assert_eq!(diff(f32::INFINITY, f32::INFINITY), 0.0);
        assert_eq!(diff(1.0, f32::NAN), f32::INFINITY);
    }
}
