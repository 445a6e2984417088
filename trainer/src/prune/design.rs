//! The sampling design shared by both pruning levels: within a scope, decide which items
//! are candidates (before any random draw), drop some, and weight the survivors by
//! 1 / (inclusion probability) so that the estimate stays unbiased (Horvitz-Thompson).

use rand::seq::index::sample as sample_indices;
use rand::Rng;
use serde::{Deserialize, Serialize};

/// Which items of a scope may be dropped (`candidates`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "rule")]
pub enum CandidateRule {
    /// Items whose score is below the scope's mean score.
    BelowMean,
    /// The lowest `fraction` of the scope by score (ties by position).
    LowestFraction { fraction: f64 },
    /// Items whose score is below `fraction` of the scope's mean score.
    BelowMeanFraction { fraction: f64 },
}

/// How candidates are dropped (`mode`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PruneMode {
    /// Drop exactly `floor(r * |C|)` candidates uniformly without replacement; kept
    /// candidates weigh `|C| / (|C| - k)`. Exactly unbiased, fixed count (the default).
    #[default]
    FixedCount,
    /// Keep each candidate independently with `pi = clamp(s / mean_s, 1 - r, 1)`, weight
    /// `1 / pi`. Exactly unbiased, random count.
    Poisson,
    /// Drop the `floor(r * |C|)` lowest-score candidates, weight 1. Biased: ablation only.
    Deterministic,
}

/// The outcome for one item: dropped, or kept with its weight.
pub type Inclusion = Option<f64>;

/// Prunes one scope of `scores` at `rate` in [0, 1). Returns one [`Inclusion`] per item.
pub fn prune_scope<R: Rng>(
    scores: &[f64],
    rate: f64,
    rule: CandidateRule,
    mode: PruneMode,
    rng: &mut R,
) -> Vec<Inclusion> {
    let mut out = vec![Some(1.0); scores.len()];
    let candidates = candidates(scores, rule);
    let k = (rate * candidates.len() as f64).floor() as usize;
    if candidates.is_empty() || (k == 0 && mode != PruneMode::Poisson) || rate <= 0.0 {
        return out;
    }
    match mode {
        PruneMode::FixedCount => {
            let keep_weight = candidates.len() as f64 / (candidates.len() - k) as f64;
            for &c in &candidates {
                out[c] = Some(keep_weight);
            }
            for i in sample_indices(rng, candidates.len(), k) {
                out[candidates[i]] = None;
            }
        }
        PruneMode::Poisson => {
            let mean = scores.iter().sum::<f64>() / scores.len() as f64;
            for &c in &candidates {
                let pi = if mean > 0.0 { scores[c] / mean } else { 1.0 };
                let pi = pi.clamp(1.0 - rate, 1.0);
                out[c] = (rng.random::<f64>() < pi).then_some(1.0 / pi);
            }
        }
        PruneMode::Deterministic => {
            let mut by_score = candidates.clone();
            by_score.sort_by(|&a, &b| scores[a].total_cmp(&scores[b]).then(a.cmp(&b)));
            for &c in &by_score[..k] {
                out[c] = None;
            }
        }
    }
    out
}

/// Candidate indices of a scope, decided by the scores alone (no randomness).
pub fn candidates(scores: &[f64], rule: CandidateRule) -> Vec<usize> {
    if scores.is_empty() {
        return Vec::new();
    }
    match rule {
        CandidateRule::BelowMean => below_mean_fraction(scores, 1.0),
        CandidateRule::LowestFraction { fraction } => {
            let mut order: Vec<usize> = (0..scores.len()).collect();
            order.sort_by(|&a, &b| scores[a].total_cmp(&scores[b]).then(a.cmp(&b)));
            order.truncate((fraction * scores.len() as f64).floor() as usize);
            order.sort_unstable();
            order
        }
        CandidateRule::BelowMeanFraction { fraction } => below_mean_fraction(scores, fraction),
    }
}

/// Indices of the scores below `fraction` of their mean (`scores` not empty).
fn below_mean_fraction(scores: &[f64], fraction: f64) -> Vec<usize> {
    let mean = scores.iter().sum::<f64>() / scores.len() as f64;
    (0..scores.len())
        .filter(|&i| scores[i] < fraction * mean)
        .collect()
}

/// The largest weight a kept item can get at `rate` (all modes): `1 / (1 - rate)`.
pub fn max_weight(rate: f64) -> f64 {
    1.0 / (1.0 - rate)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{rngs::StdRng, SeedableRng};

    const SCORES: [f64; 8] = [0.1, 0.9, 0.2, 1.5, 0.3, 0.05, 2.0, 0.4];

    #[test]
    fn candidates_by_rule() {
        // mean = 0.68125
        assert_eq!(
            candidates(&SCORES, CandidateRule::BelowMean),
            vec![0, 2, 4, 5, 7]
        );
        let lowest = CandidateRule::LowestFraction { fraction: 0.25 };
        assert_eq!(candidates(&SCORES, lowest), vec![0, 5]);
        // Below half the mean: 0.340625.
        let below_half = CandidateRule::BelowMeanFraction { fraction: 0.5 };
        assert_eq!(candidates(&SCORES, below_half), vec![0, 2, 4, 5]);
    }

    #[test]
    fn fixed_count_drops_exactly_k_and_reweights_the_rest() {
        let mut rng = StdRng::seed_from_u64(1);
        for _ in 0..100 {
            let out = prune_scope(
                &SCORES,
                0.5,
                CandidateRule::BelowMean,
                PruneMode::FixedCount,
                &mut rng,
            );
            // 5 candidates, k = 2: three survive with weight 5/3; non-candidates weigh 1.
            assert_eq!(out.iter().filter(|w| w.is_none()).count(), 2);
            for (i, w) in out.iter().enumerate() {
                match [0, 2, 4, 5, 7].contains(&i) {
                    true => assert!(w.is_none() || *w == Some(5.0 / 3.0)),
                    false => assert_eq!(*w, Some(1.0)),
                }
            }
        }
    }

    /// The built-in default's `r_o = 0.9` on groups of 8 with 0/1 rewards: every group with
    /// mixed outcomes keeps all of its minority outcome and exactly one of its majority
    /// (the below-mean |A|), which weighs the majority's count; `0.85` keeps two of seven.
    #[test]
    fn rates_from_seven_eighths_keep_one_majority_sample_per_group_of_eight() {
        let mut rng = StdRng::seed_from_u64(5);
        let group_scores = |right: usize| -> Vec<f64> {
            let p = right as f64 / 8.0;
            let std = (p * (1.0 - p)).sqrt();
            (0..8)
                .map(|i| if i < right { (1.0 - p) / std } else { p / std })
                .collect()
        };
        for rate in [0.875, 0.9] {
            for right in 1..8 {
                let scores = group_scores(right);
                let majority = right.max(8 - right);
                let out = prune_scope(
                    &scores,
                    rate,
                    CandidateRule::BelowMean,
                    PruneMode::FixedCount,
                    &mut rng,
                );
                let kept: Vec<f64> = out.iter().flatten().copied().collect();
                if right == 4 {
                    // Equal |A| everywhere: no candidates, nothing dropped.
                    assert_eq!(kept, vec![1.0; 8]);
                    continue;
                }
                assert_eq!(kept.len(), 8 - majority + 1, "{right} of 8 right at {rate}");
                let heavy: Vec<f64> = kept.iter().copied().filter(|&w| w > 1.0).collect();
                assert_eq!(heavy, vec![majority as f64], "{right} of 8 right at {rate}");
            }
        }
        let out = prune_scope(
            &group_scores(7),
            0.85,
            CandidateRule::BelowMean,
            PruneMode::FixedCount,
            &mut rng,
        );
        assert_eq!(out.iter().flatten().count(), 3);
    }

    #[test]
    fn weights_stay_within_their_bound() {
        let mut rng = StdRng::seed_from_u64(2);
        for mode in [
            PruneMode::FixedCount,
            PruneMode::Poisson,
            PruneMode::Deterministic,
        ] {
            for rate in [0.0, 0.3, 0.7, 0.9] {
                for _ in 0..50 {
                    let out = prune_scope(&SCORES, rate, CandidateRule::BelowMean, mode, &mut rng);
                    assert!(out
                        .iter()
                        .flatten()
                        .all(|&w| (1.0..=max_weight(rate) + 1e-12).contains(&w)));
                }
            }
        }
    }

    #[test]
    fn rate_zero_keeps_everything_with_weight_exactly_one() {
        let mut rng = StdRng::seed_from_u64(3);
        for mode in [
            PruneMode::FixedCount,
            PruneMode::Poisson,
            PruneMode::Deterministic,
        ] {
            let out = prune_scope(&SCORES, 0.0, CandidateRule::BelowMean, mode, &mut rng);
            assert_eq!(out, vec![Some(1.0); SCORES.len()]);
        }
    }

    #[test]
    fn deterministic_drops_the_lowest_candidates() {
        let mut rng = StdRng::seed_from_u64(4);
        let out = prune_scope(
            &SCORES,
            0.5,
            CandidateRule::BelowMean,
            PruneMode::Deterministic,
            &mut rng,
        );
        let dropped: Vec<usize> = (0..8).filter(|&i| out[i].is_none()).collect();
        assert_eq!(dropped, vec![0, 5]);
        assert!(out.iter().flatten().all(|&w| w == 1.0));
    }
}
