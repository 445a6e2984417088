//! Group-relative advantages (GRPO family), computed on the full groups before pruning.

use serde::{Deserialize, Serialize};

use crate::group::Group;

/// How rewards are scaled after subtracting the group mean (`scale_rewards`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ScaleRewards {
    /// Divide by the group's standard deviation (GRPO).
    Group,
    /// Divide by the batch's standard deviation.
    Batch,
    /// No division (Dr. GRPO).
    None,
}

/// Added to standard deviations so that a zero-variance group gets A = 0, not NaN.
const STD_EPS: f64 = 1e-6;

/// Sets every group's advantages: `A = (r - mean_group) / (std + 1e-6)` with the std of
/// `scale` (population std, as TRL and verl use). A group whose rewards are all equal gets
/// exactly 0 (its mean, rounded, would leave a residue that no check for zero catches).
/// The batch std weighs each group by its prompt-inclusion weight `w_q`: under prompt
/// pruning it is the Horvitz-Thompson estimate of the full batch's, and with every
/// `w_q = 1` it is the plain std.
pub fn compute_advantages(groups: &mut [Group], scale: ScaleRewards) {
    let batch_std = weighted_std(
        groups
            .iter()
            .flat_map(|g| g.samples.iter().map(|s| (s.reward, g.w_q))),
    );
    for g in groups.iter_mut() {
        let rewards: Vec<f64> = g.samples.iter().map(|s| s.reward).collect();
        if rewards.windows(2).all(|w| w[0] == w[1]) {
            g.advantages = vec![0.0; rewards.len()];
            continue;
        }
        let mean = rewards.iter().sum::<f64>() / rewards.len().max(1) as f64;
        let denom = match scale {
            ScaleRewards::Group => weighted_std(rewards.iter().map(|&r| (r, 1.0))) + STD_EPS,
            ScaleRewards::Batch => batch_std + STD_EPS,
            ScaleRewards::None => 1.0,
        };
        g.advantages = rewards.iter().map(|r| (r - mean) / denom).collect();
    }
}

/// The population std of values weighted as given: `sqrt(sum w (x - m)^2 / sum w)` with
/// `m = sum w x / sum w`.
fn weighted_std(xs: impl Iterator<Item = (f64, f64)> + Clone) -> f64 {
    let total: f64 = xs.clone().map(|(_, w)| w).sum();
    if total == 0.0 {
        return 0.0;
    }
    let mean = xs.clone().map(|(x, w)| w * x).sum::<f64>() / total;
    (xs.map(|(x, w)| w * (x - mean).powi(2)).sum::<f64>() / total).sqrt()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn group(rewards: &[f64]) -> Group {
        crate::group::test_group(0, rewards)
    }

    #[test]
    fn group_batch_and_none_scalings() {
        let mut gs = vec![group(&[1.0, 0.0, 0.0, 1.0]), group(&[1.0, 1.0, 1.0, 1.0])];
        compute_advantages(&mut gs, ScaleRewards::Group);
        // mean 0.5, population std 0.5
        let want = 0.5 / (0.5 + 1e-6);
        assert_eq!(gs[0].advantages, vec![want, -want, -want, want]);
        assert_eq!(
            gs[1].advantages,
            vec![0.0; 4],
            "equal rewards carry no signal"
        );
        compute_advantages(&mut gs, ScaleRewards::None);
        assert_eq!(gs[0].advantages, vec![0.5, -0.5, -0.5, 0.5]);
        compute_advantages(&mut gs, ScaleRewards::Batch);
        // batch of 8 rewards, 6 ones: mean 0.75, std sqrt(0.1875)
        let s = 0.1875f64.sqrt() + 1e-6;
        assert!((gs[0].advantages[0] - 0.5 / s).abs() < 1e-12);
    }

    /// Equal non-binary rewards: the rounded mean of [0.1, 0.1, 0.1] is not 0.1, which left
    /// advantages of about 1e-11 that the zero-loss checks did not see.
    #[test]
    fn equal_rewards_give_exactly_zero_advantages_under_every_scaling() {
        for scale in [ScaleRewards::Group, ScaleRewards::Batch, ScaleRewards::None] {
            let mut gs = vec![group(&[0.1, 0.1, 0.1]), group(&[0.3, 0.7, 0.7])];
            compute_advantages(&mut gs, scale);
            assert_eq!(gs[0].advantages, vec![0.0; 3], "{scale:?}");
            assert!(gs[1].advantages.iter().all(|&a| a != 0.0), "{scale:?}");
        }
    }

    /// Under prompt pruning the batch std weighs each rolled-out group by `w_q`: a group
    /// kept with weight 3 counts as three copies of itself.
    #[test]
    fn the_batch_std_weighs_groups_by_their_inclusion_weight() {
        let mut weighted = vec![group(&[1.0, 0.0]), group(&[1.0, 1.0])];
        weighted[1].w_q = 3.0;
        compute_advantages(&mut weighted, ScaleRewards::Batch);
        let mut copies = vec![
            group(&[1.0, 0.0]),
            group(&[1.0, 1.0]),
            group(&[1.0, 1.0]),
            group(&[1.0, 1.0]),
        ];
        compute_advantages(&mut copies, ScaleRewards::Batch);
        assert!((weighted[0].advantages[0] - copies[0].advantages[0]).abs() < 1e-12);
        // Unweighted, the std of [1, 0, 1, 1] would have been used instead.
        let mut unweighted = vec![group(&[1.0, 0.0]), group(&[1.0, 1.0])];
        compute_advantages(&mut unweighted, ScaleRewards::Batch);
        assert!((weighted[0].advantages[0] - unweighted[0].advantages[0]).abs() > 1e-3);
    }
}
