//! How far the learner's logprobs of the sampled tokens are from the rollout's: the numbers
//! verl, TRL and OpenRLHF users watch for the engine-trainer mismatch that collapses runs.
//! On a synchronous step at the first update both are the same policy, so what remains is
//! numerical; one step off-policy it also holds the last update's change.

use candle_core::{DType, Result, Tensor};

use crate::correction::CorrectionSums;

/// A ratio `exp(learner - rollout)` outside `[1/OUTSIDE, OUTSIDE]` counts as far off.
pub const OUTSIDE: f64 = 2.0;

/// Sums over sampled tokens, added up over buffers and ranks.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Mismatch {
    pub tokens: usize,
    /// `sum |learner - rollout|` of the logprobs.
    pub abs_sum: f64,
    /// `max |learner - rollout|`.
    pub abs_max: f64,
    /// `sum (r - 1 - log r)`, `r = exp(learner - rollout)`: k3's estimate of
    /// KL(rollout || learner) from the rollout's own samples, times the token count.
    pub k3_sum: f64,
    /// Tokens whose ratio is outside `[1/OUTSIDE, OUTSIDE]`.
    pub outside: usize,
    /// What the rollout correction did (zeros when it is off).
    pub correction: CorrectionSums,
}

impl Mismatch {
    /// The sums over `learner` and `rollout` (M,) logprobs; no gradient flows.
    pub fn of(learner: &Tensor, rollout: &Tensor) -> Result<Self> {
        Ok(Self::from_diffs(&diffs(learner, rollout)?))
    }

    /// The sums over `d`, the per-token differences learner minus rollout.
    pub fn from_diffs(d: &[f64]) -> Self {
        let mut m = Self {
            tokens: d.len(),
            ..Self::default()
        };
        for &x in d {
            m.abs_sum += x.abs();
            m.abs_max = m.abs_max.max(x.abs());
            m.k3_sum += x.exp() - 1.0 - x;
            m.outside += usize::from(x.abs() > OUTSIDE.ln());
        }
        m
    }

    /// Both sums together.
    pub fn add(&mut self, other: &Self) {
        self.tokens += other.tokens;
        self.abs_sum += other.abs_sum;
        self.abs_max = self.abs_max.max(other.abs_max);
        self.k3_sum += other.k3_sum;
        self.outside += other.outside;
        self.correction.weight_sum += other.correction.weight_sum;
        self.correction.truncated += other.correction.truncated;
        self.correction.masked += other.correction.masked;
    }

    /// `rollout_corr/{is_weight_mean,is_truncated_frac,rs_masked_frac}`, for the metrics line
    /// of a run with the correction on.
    pub fn correction_metrics(&self) -> [(&'static str, f64); 3] {
        let n = self.tokens.max(1) as f64;
        [
            (
                "rollout_corr/is_weight_mean",
                self.correction.weight_sum / n,
            ),
            (
                "rollout_corr/is_truncated_frac",
                self.correction.truncated as f64 / n,
            ),
            (
                "rollout_corr/rs_masked_frac",
                self.correction.masked as f64 / n,
            ),
        ]
    }

    /// `(mismatch/logprob_abs_diff_mean, mismatch/logprob_abs_diff_max, mismatch/k3_kl,
    /// mismatch/ratio_outside_frac)` by name, for the metrics line.
    pub fn metrics(&self) -> [(&'static str, f64); 4] {
        let n = self.tokens.max(1) as f64;
        [
            ("mismatch/logprob_abs_diff_mean", self.abs_sum / n),
            ("mismatch/logprob_abs_diff_max", self.abs_max),
            ("mismatch/k3_kl", self.k3_sum / n),
            ("mismatch/ratio_outside_frac", self.outside as f64 / n),
        ]
    }
}

/// `learner - rollout` per token, in f64, without gradient.
pub fn diffs(learner: &Tensor, rollout: &Tensor) -> Result<Vec<f64>> {
    (learner.detach() - rollout)?
        .to_dtype(DType::F64)?
        .to_vec1::<f64>()
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn sums_match_a_hand_computation_and_add_up() {
        let learner = Tensor::new(&[-1.0f32, -2.0, -0.2, -3.0], &Device::Cpu).unwrap();
        let rollout = Tensor::new(&[-1.0f32, -1.0, -1.0, -3.5], &Device::Cpu).unwrap();
        let m = Mismatch::of(&learner, &rollout).unwrap();
        let d = [0.0f64, -1.0, 0.8, 0.5];
        assert_eq!(m.tokens, 4);
        assert!((m.abs_sum - 2.3).abs() < 1e-6);
        assert!((m.abs_max - 1.0).abs() < 1e-6);
        let k3: f64 = d.iter().map(|x| x.exp() - 1.0 - x).sum();
        assert!((m.k3_sum - k3).abs() < 1e-6);
        // ln 2 = 0.693: -1.0 and 0.8 are outside, 0.5 inside.
        assert_eq!(m.outside, 2);
        let mut twice = m;
        twice.add(&m);
        assert_eq!(twice.tokens, 8);
        assert_eq!(twice.outside, 4);
        assert!((twice.abs_max - 1.0).abs() < 1e-6);
        let named = twice.metrics();
        assert_eq!(named[3], ("mismatch/ratio_outside_frac", 0.5));
        assert!((named[2].1 - k3 / 4.0).abs() < 1e-6);
    }

    #[test]
    fn equal_logprobs_have_no_mismatch() {
        let lp = Tensor::new(&[-0.5f32, -2.0], &Device::Cpu).unwrap();
        let m = Mismatch::of(&lp, &lp).unwrap();
        assert_eq!(m.metrics().map(|(_, v)| v), [0.0; 4]);
    }
}
