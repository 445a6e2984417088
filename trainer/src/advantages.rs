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
/// `scale` (population std, as TRL and verl use).
pub fn compute_advantages(groups: &mut [Group], scale: ScaleRewards) {
    let batch_std = std_of(
        groups
            .iter()
            .flat_map(|g| g.samples.iter().map(|s| s.reward)),
    );
    for g in groups.iter_mut() {
        let rewards: Vec<f64> = g.samples.iter().map(|s| s.reward).collect();
        let mean = rewards.iter().sum::<f64>() / rewards.len().max(1) as f64;
        let denom = match scale {
            ScaleRewards::Group => std_of(rewards.iter().copied()) + STD_EPS,
            ScaleRewards::Batch => batch_std + STD_EPS,
            ScaleRewards::None => 1.0,
        };
        g.advantages = rewards.iter().map(|r| (r - mean) / denom).collect();
    }
}

fn std_of(xs: impl Iterator<Item = f64> + Clone) -> f64 {
    let n = xs.clone().count();
    if n == 0 {
        return 0.0;
    }
    let mean = xs.clone().sum::<f64>() / n as f64;
    (xs.map(|x| (x - mean).powi(2)).sum::<f64>() / n as f64).sqrt()
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
}
