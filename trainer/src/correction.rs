//! Rollout correction (verl's `algorithm.rollout_correction`): per-token weights on the
//! policy-gradient loss from the ratio `exp(learner - rollout)` of the sampled tokens'
//! logprobs, the learner's taken before the update. Truncated importance sampling (TIS)
//! multiplies by the ratio capped at a threshold, per token or per sequence; rejection
//! sampling (RS, as MIS and IcePop) masks tokens or sequences whose ratio leaves a band.
//! Off by default: on the CPU in f32 the two logprobs differ by rounding only.

use serde::{Deserialize, Serialize};

/// Importance weights: none, per token, or per sequence (the product of its tokens' ratios).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum IsLevel {
    #[default]
    None,
    Token,
    Sequence,
}

/// Rejection (masking): none, per token, per sequence (the product of its ratios), or
/// geometric (per sequence, the geometric mean of its ratios).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RsLevel {
    #[default]
    None,
    Token,
    Sequence,
    Geometric,
}

/// `[rollout_correction]`, with verl's names.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RolloutCorrection {
    pub rollout_is: IsLevel,
    /// The importance weight's cap (TIS).
    pub rollout_is_threshold: f64,
    pub rollout_rs: RsLevel,
    /// Ratios above this are masked.
    pub rollout_rs_threshold: f64,
    /// Ratios below this are masked.
    pub rollout_rs_threshold_lower: f64,
}

impl Default for RolloutCorrection {
    fn default() -> Self {
        Self {
            rollout_is: IsLevel::None,
            rollout_is_threshold: 2.0,
            rollout_rs: RsLevel::None,
            rollout_rs_threshold: 2.0,
            rollout_rs_threshold_lower: 0.5,
        }
    }
}

/// What the weights did, summed over tokens.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct CorrectionSums {
    /// Sum of the importance weights (1 per token without IS).
    pub weight_sum: f64,
    /// Tokens whose importance weight hit the cap.
    pub truncated: usize,
    /// Tokens masked by rejection.
    pub masked: usize,
}

impl RolloutCorrection {
    /// Whether any correction is on.
    pub fn is_on(&self) -> bool {
        self.rollout_is != IsLevel::None || self.rollout_rs != RsLevel::None
    }

    /// The weight of each token given `d` = learner minus rollout logprob, tokens of
    /// consecutive sequences of `lengths` tokens, and what they did.
    pub fn weights(&self, d: &[f64], lengths: &[usize]) -> (Vec<f64>, CorrectionSums) {
        let mut weights = Vec::with_capacity(d.len());
        let mut sums = CorrectionSums::default();
        let (lo, hi) = (
            self.rollout_rs_threshold_lower.ln(),
            self.rollout_rs_threshold.ln(),
        );
        let cap = self.rollout_is_threshold.ln();
        let mut start = 0;
        for &len in lengths {
            let seq = &d[start..start + len];
            start += len;
            let total: f64 = seq.iter().sum();
            let mean = total / len.max(1) as f64;
            for &x in seq {
                let log_w = match self.rollout_is {
                    IsLevel::None => 0.0,
                    IsLevel::Token => x,
                    IsLevel::Sequence => total,
                };
                let truncated = self.rollout_is != IsLevel::None && log_w > cap;
                let w = log_w.min(cap).exp();
                let log_r = match self.rollout_rs {
                    RsLevel::None => 0.0,
                    RsLevel::Token => x,
                    RsLevel::Sequence => total,
                    RsLevel::Geometric => mean,
                };
                let masked = self.rollout_rs != RsLevel::None && !(lo..=hi).contains(&log_r);
                sums.weight_sum += if self.rollout_is == IsLevel::None {
                    1.0
                } else {
                    w
                };
                sums.truncated += usize::from(truncated);
                sums.masked += usize::from(masked);
                weights.push(if masked {
                    0.0
                } else if self.rollout_is == IsLevel::None {
                    1.0
                } else {
                    w
                });
            }
        }
        (weights, sums)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two sequences of log-ratios: [0.1, 0.9] and [-0.8, 0.05, 0.0].
    const D: [f64; 5] = [0.1, 0.9, -0.8, 0.05, 0.0];
    const LENGTHS: [usize; 2] = [2, 3];

    fn with(is: IsLevel, rs: RsLevel) -> RolloutCorrection {
        RolloutCorrection {
            rollout_is: is,
            rollout_rs: rs,
            ..RolloutCorrection::default()
        }
    }

    fn close(a: &[f64], b: &[f64]) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-12)
    }

    #[test]
    fn off_weighs_every_token_one() {
        let (w, s) = RolloutCorrection::default().weights(&D, &LENGTHS);
        assert_eq!(w, vec![1.0; 5]);
        assert_eq!((s.weight_sum, s.truncated, s.masked), (5.0, 0, 0));
    }

    #[test]
    fn token_tis_caps_each_ratio() {
        let (w, s) = with(IsLevel::Token, RsLevel::None).weights(&D, &LENGTHS);
        // exp(0.9) = 2.46 is capped at 2.
        let want = [0.1f64.exp(), 2.0, (-0.8f64).exp(), 0.05f64.exp(), 1.0];
        assert!(close(&w, &want), "{w:?}");
        assert_eq!(s.truncated, 1);
        assert!((s.weight_sum - want.iter().sum::<f64>()).abs() < 1e-12);
    }

    #[test]
    fn sequence_tis_shares_the_capped_product() {
        let (w, s) = with(IsLevel::Sequence, RsLevel::None).weights(&D, &LENGTHS);
        // Sequence 1: exp(1.0) = 2.72 -> 2; sequence 2: exp(-0.75).
        let b = (-0.75f64).exp();
        assert!(close(&w, &[2.0, 2.0, b, b, b]), "{w:?}");
        assert_eq!(s.truncated, 2);
    }

    #[test]
    fn rejection_masks_outside_the_band_per_token_sequence_or_geometric_mean() {
        // Band [0.5, 2]: log in [-0.693, 0.693].
        let (w, s) = with(IsLevel::None, RsLevel::Token).weights(&D, &LENGTHS);
        assert_eq!(w, vec![1.0, 0.0, 0.0, 1.0, 1.0]);
        assert_eq!(s.masked, 2);
        let (w, _) = with(IsLevel::None, RsLevel::Sequence).weights(&D, &LENGTHS);
        assert_eq!(w, vec![0.0, 0.0, 0.0, 0.0, 0.0]);
        // Geometric means: 0.5 and -0.25, both inside.
        let (w, s) = with(IsLevel::None, RsLevel::Geometric).weights(&D, &LENGTHS);
        assert_eq!(w, vec![1.0; 5]);
        assert_eq!(s.masked, 0);
        // Both: a masked token weighs 0, the others their capped ratio.
        let (w, _) = with(IsLevel::Token, RsLevel::Token).weights(&D, &LENGTHS);
        assert!(
            close(&w, &[0.1f64.exp(), 0.0, 0.0, 0.05f64.exp(), 1.0]),
            "{w:?}"
        );
    }
}
