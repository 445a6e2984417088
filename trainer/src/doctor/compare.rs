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
            max_diff = max_diff.max((a - b).abs());
            sum_diff += (a - b).abs();
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
