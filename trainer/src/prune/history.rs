//! Prompt-level pruning (before rollout): a per-prompt history of how much signal the
//! prompt carried and how hard it was, candidates among the batch's seen prompts, the
//! fixed-count design, and the over-draw that keeps the rollout batch full.

use std::collections::BTreeMap;

use rand::Rng;
use serde::{Deserialize, Serialize};

use super::design::{candidates, prune_scope, CandidateRule, Inclusion};
use super::LevelConfig;
use crate::group::Group;

/// How a prompt's history scores it for prompt-level pruning (`dppo.prompt_predictor`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PromptPredictor {
    /// The EMA of the group's mean |A| at its visits; candidates by `dppo.candidates`.
    #[default]
    SignalEma,
    /// The chance that the group's rewards are not all equal now, from the prompt's
    /// difficulty and the policy's current pass rate (a one-parameter item-response model);
    /// candidates are the prompts less than half as likely to carry signal as the batch's
    /// seen prompts on average. Unlike the EMA, it knows that a prompt all wrong under an
    /// earlier, weaker policy may not be now, and while every prompt is equally unlikely
    /// to carry signal (a policy that is nearly always wrong) none is a candidate.
    Difficulty,
}

/// The fraction of the seen prompts' mean predicted signal below which
/// [`PromptPredictor::Difficulty`] makes a prompt a candidate.
const SIGNAL_FRACTION_OF_MEAN: f64 = 0.5;

/// What we remember of one prompt.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct PromptStats {
    /// EMA of the group's mean |A| (0 when all right or all wrong).
    pub score: f64,
    pub last_step: u64,
    pub visits: u64,
    /// Consecutive visits whose rewards were all equal.
    pub zero_var_streak: u64,
    /// Right answers over all visits (rewards summed, each read as a pass rate).
    #[serde(default)]
    pub right: f64,
    /// Samples over all visits (0: recorded before difficulties were).
    #[serde(default)]
    pub samples: u64,
    /// The policy's ability at each visit, summed over the visit's samples.
    #[serde(default)]
    pub ability_sum: f64,
    /// Samples of the group at the last visit.
    #[serde(default)]
    pub group_size: u64,
}

impl PromptStats {
    /// How much harder than the batch's average prompt this one is: the policy's mean
    /// ability over the visits minus the logit of the pooled pass rate, smoothed by half a
    /// success (Jeffreys) so that all right or all wrong stay finite and say more the more
    /// samples back them (see [`PromptHistory::ability`]). NaN before any sample is
    /// recorded (`samples == 0`), which [`PromptHistory::predicted_signal`] checks.
    pub fn difficulty(&self) -> f64 {
        let n = self.samples as f64;
        self.ability_sum / n - logit((self.right + 0.5) / (n + 1.0))
    }
}

/// Per-prompt history; serialisable for checkpoints.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PromptHistory {
    /// EMA decay: `score = decay * score + (1 - decay) * new`.
    pub decay: f64,
    pub entries: BTreeMap<u64, PromptStats>,
    /// Candidates / batch size at the last selection (`f` of the over-draw).
    pub last_candidate_fraction: f64,
    /// EMA (same decay) over steps of the batch's pass rate, each step's estimated over the
    /// drawn prompts with the rolled-out ones' `w_q` (None before the first rollout).
    #[serde(default)]
    pub pass_rate: Option<f64>,
}

/// The success rate of a group: its mean reward, read as a pass rate in [0, 1] (verifiable
/// rewards: 1 right, 0 wrong).
fn group_pass_rate(g: &Group) -> f64 {
    g.mean_reward().clamp(0.0, 1.0)
}

fn logit(p: f64) -> f64 {
    (p / (1.0 - p)).ln()
}

/// The chance that `n` samples, each right with probability `p`, are neither all right nor
/// all wrong.
fn signal_probability(p: f64, n: u64) -> f64 {
    let n = n as i32;
    1.0 - p.powi(n) - (1.0 - p).powi(n)
}

impl PromptHistory {
    /// An empty history with EMA `decay` (`history_decay`, default 0.5).
    pub fn new(decay: f64) -> Self {
        Self {
            decay,
            entries: BTreeMap::new(),
            last_candidate_fraction: 0.0,
            pass_rate: None,
        }
    }

    /// The policy's ability: the logit of its pass rate over the batch (kept off 0 and 1).
    pub fn ability(&self) -> Option<f64> {
        self.pass_rate.map(|p| logit(p.clamp(0.01, 0.99)))
    }

    /// Records the groups rolled out at `step`.
    pub fn update(&mut self, groups: &[Group], step: u64) {
        let decay = self.decay;
        let total_w: f64 = groups.iter().map(|g| g.w_q).sum();
        if total_w > 0.0 {
            // Horvitz-Thompson: the rolled-out prompts, each standing for 1/pi drawn ones.
            let batch = groups
                .iter()
                .map(|g| g.w_q * group_pass_rate(g))
                .sum::<f64>()
                / total_w;
            self.pass_rate = Some(
                self.pass_rate
                    .map_or(batch, |p| decay * p + (1.0 - decay) * batch),
            );
        }
        let ability = self.ability().unwrap_or(0.0);
        for g in groups {
            let signal = g.mean_abs_advantage();
            let zero_var = g.advantages.iter().all(|&a| a == 0.0);
            let n = g.samples.len() as u64;
            let right = group_pass_rate(g) * n as f64;
            let s = self.entries.entry(g.prompt_id).or_insert(PromptStats {
                score: signal,
                last_step: step,
                visits: 0,
                zero_var_streak: 0,
                right: 0.0,
                samples: 0,
                ability_sum: 0.0,
                group_size: n,
            });
            if s.visits > 0 {
                s.score = decay * s.score + (1.0 - decay) * signal;
            }
            s.visits += 1;
            s.last_step = step;
            s.zero_var_streak = if zero_var { s.zero_var_streak + 1 } else { 0 };
            s.right += right;
            s.samples += n;
            s.ability_sum += ability * n as f64;
            s.group_size = n;
        }
    }

    /// The chance that `stats`'s prompt carries signal if rolled out now: its pass rate is
    /// predicted as `sigmoid(ability - difficulty)`, the policy's progress since the visits
    /// moving every prompt alike on the logit scale. 1 (never a candidate) without a record.
    pub fn predicted_signal(&self, stats: &PromptStats) -> f64 {
        match self.ability() {
            Some(ability) if stats.samples > 0 => {
                let p = 1.0 / (1.0 + (stats.difficulty() - ability).exp());
                signal_probability(p, stats.group_size)
            }
            _ => 1.0,
        }
    }

    /// How many prompts to draw for a rollout batch of `batch_size`:
    /// `ceil(batch_size / (1 - r_q * f))`.
    pub fn overdraw(&self, batch_size: usize, rate: f64) -> usize {
        let f = self.last_candidate_fraction;
        (batch_size as f64 / (1.0 - rate * f)).ceil() as usize
    }

    /// Decides which of `prompt_ids` are rolled out, with their weight `w_q`, scoring the
    /// seen prompts by `predictor`. Prompts never seen are never candidates; candidates
    /// depend on the history only, never on this step's draws.
    pub fn select<R: Rng>(
        &mut self,
        prompt_ids: &[u64],
        level: &LevelConfig,
        predictor: PromptPredictor,
        rng: &mut R,
    ) -> Vec<Inclusion> {
        let seen: Vec<usize> = (0..prompt_ids.len())
            .filter(|&i| self.entries.contains_key(&prompt_ids[i]))
            .collect();
        let stats = seen.iter().map(|&i| &self.entries[&prompt_ids[i]]);
        let (scores, rule): (Vec<f64>, _) = match predictor {
            PromptPredictor::SignalEma => (stats.map(|s| s.score).collect(), level.candidates),
            PromptPredictor::Difficulty => (
                stats.map(|s| self.predicted_signal(s)).collect(),
                CandidateRule::BelowMeanFraction {
                    fraction: SIGNAL_FRACTION_OF_MEAN,
                },
            ),
        };
        self.last_candidate_fraction = if prompt_ids.is_empty() {
            0.0
        } else {
            candidates(&scores, rule).len() as f64 / prompt_ids.len() as f64
        };
        let mut out = vec![Some(1.0); prompt_ids.len()];
        let inclusion = prune_scope(&scores, level.rate, rule, level.mode, rng);
        for (&i, w) in seen.iter().zip(inclusion) {
            out[i] = w;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prune::{CandidateRule, PruneMode};
    use rand::{rngs::StdRng, SeedableRng};

    fn group(prompt_id: u64, advantages: &[f64]) -> Group {
        Group {
            advantages: advantages.to_vec(),
            ..crate::group::test_group(prompt_id, &vec![0.0; advantages.len()])
        }
    }

    #[test]
    fn history_tracks_ema_visits_and_zero_variance_streaks() {
        let mut h = PromptHistory::new(0.5);
        h.update(&[group(7, &[1.0, -1.0])], 3);
        h.update(&[group(7, &[0.0, 0.0])], 5);
        h.update(&[group(7, &[0.0, 0.0])], 6);
        let s = h.entries[&7];
        assert_eq!((s.visits, s.last_step, s.zero_var_streak), (3, 6, 2));
        assert!((s.score - 0.25).abs() < 1e-12);
        // Serialisable for checkpoints.
        let json = serde_json::to_string(&h).unwrap();
        assert_eq!(serde_json::from_str::<PromptHistory>(&json).unwrap(), h);
    }

    #[test]
    fn unseen_prompts_are_never_pruned_and_overdraw_keeps_the_batch_full() {
        let mut h = PromptHistory::new(0.5);
        h.update(
            &[
                group(1, &[0.1, -0.1]),
                group(2, &[2.0, -2.0]),
                group(3, &[0.0, 0.0]),
            ],
            0,
        );
        let level = LevelConfig {
            rate: 0.5,
            candidates: CandidateRule::BelowMean,
            mode: PruneMode::FixedCount,
        };
        let mut rng = StdRng::seed_from_u64(3);
        // Seen scores 0.1, 2.0, 0.0: candidates 1 and 3; one of them is dropped.
        let w = h.select(
            &[1, 2, 3, 10, 11, 12],
            &level,
            PromptPredictor::SignalEma,
            &mut rng,
        );
        assert_eq!(w[1..2], [Some(1.0)]);
        assert_eq!(
            w[3..],
            [Some(1.0); 3],
            "unseen prompts are never candidates"
        );
        assert_eq!(w[0].is_none() as u8 + w[2].is_none() as u8, 1);
        assert!(w.iter().flatten().all(|&x| x == 1.0 || x == 2.0));
        assert!((h.last_candidate_fraction - 2.0 / 6.0).abs() < 1e-12);
        // Over-draw: 1 / (1 - 0.5 * 1/3) = 1.2 times the batch.
        assert_eq!(h.overdraw(10, 0.5), 12);
    }

    /// A scored group of `n` samples of which `right` have reward 1, the rest 0.
    fn scored(prompt_id: u64, right: usize, n: usize) -> Group {
        let rewards: Vec<f64> = (0..n).map(|i| f64::from(u8::from(i < right))).collect();
        let mut g = vec![crate::group::test_group(prompt_id, &rewards)];
        crate::advantages::compute_advantages(&mut g, crate::advantages::ScaleRewards::Group);
        g.remove(0)
    }

    #[test]
    fn signal_probability_of_a_group() {
        assert_eq!(signal_probability(0.0, 8), 0.0);
        assert_eq!(signal_probability(1.0, 8), 0.0);
        assert!((signal_probability(0.5, 8) - (1.0 - 2.0 / 256.0)).abs() < 1e-15);
        assert!((signal_probability(0.1, 2) - 0.18).abs() < 1e-15);
    }

    #[test]
    fn difficulty_predicts_that_an_improving_policy_solves_prompts_once_all_wrong() {
        let mut h = PromptHistory::new(0.5);
        // A weak policy: prompt 1 all wrong, prompts 2 and 4 all right, prompt 3 half
        // right, six more all wrong; pass rate 0.25.
        let mut first = vec![
            scored(1, 0, 8),
            scored(2, 8, 8),
            scored(3, 4, 8),
            scored(4, 8, 8),
        ];
        first.extend((10..16).map(|id| scored(id, 0, 8)));
        h.update(&first, 0);
        assert!((h.pass_rate.unwrap() - 0.25).abs() < 1e-12);
        let signal = |h: &PromptHistory, id: u64| h.predicted_signal(&h.entries[&id]);
        // Under the same policy, all right or all wrong again is likely: the signal chance
        // is 1 - 0.944^8 - 0.056^8 = 0.37 at the Jeffreys-smoothed pass rate 0.5/9, but not
        // below half the mean (0.52): nothing is a candidate.
        for id in [1, 2, 4] {
            assert!((signal(&h, id) - 0.3670).abs() < 1e-4, "{}", signal(&h, id));
        }
        assert!(signal(&h, 3) > 0.99);
        let level = LevelConfig {
            rate: 0.99,
            candidates: CandidateRule::BelowMean,
            mode: PruneMode::FixedCount,
        };
        let ids = [1, 2, 3, 4];
        let mut rng = StdRng::seed_from_u64(5);
        let w = h.select(&ids, &level, PromptPredictor::Difficulty, &mut rng);
        assert_eq!(w, vec![Some(1.0); 4]);
        // The policy improves to 7 of 8 right on other prompts.
        for step in 1..5 {
            let batch: Vec<Group> = (100..110).map(|id| scored(id, 7, 8)).collect();
            h.update(&batch, step);
        }
        assert!((h.pass_rate.unwrap() - (0.25 / 16.0 + 0.875 * 15.0 / 16.0)).abs() < 1e-12);
        // Prompt 1 is now expected about half right and prompt 3 mostly right: they are
        // rolled out. Prompts 2 and 4 stay solved: candidates (0.03 < 0.36 / 2).
        assert!(signal(&h, 1) > 0.95, "{}", signal(&h, 1));
        assert!(signal(&h, 2) < 0.05, "{}", signal(&h, 2));
        assert!((signal(&h, 3) - 0.397).abs() < 1e-3, "{}", signal(&h, 3));
        let w = h.select(&ids, &level, PromptPredictor::Difficulty, &mut rng);
        assert_eq!((w[0], w[2]), (Some(1.0), Some(1.0)), "{w:?}");
        let mut solved = [w[1], w[3]];
        solved.sort_by(|a, b| a.partial_cmp(b).unwrap());
        assert_eq!(solved, [None, Some(2.0)]);
        assert!((h.last_candidate_fraction - 0.5).abs() < 1e-12);
        // The EMA of |A| cannot tell 1 from 2 and 4, and keeps 3: 1, 2 and 4 are candidates.
        let w = h.select(&ids, &level, PromptPredictor::SignalEma, &mut rng);
        assert_eq!(w[2], Some(1.0));
        assert_eq!(w.iter().filter(|w| w.is_none()).count(), 2, "{w:?}");
    }

    #[test]
    fn every_visit_all_wrong_makes_a_prompt_harder() {
        let mut h = PromptHistory::new(0.5);
        let visit = |h: &mut PromptHistory, step: u64, others_right: usize| {
            let mut batch = vec![scored(1, 0, 8)];
            batch.extend((10..19).map(|id| scored(id, others_right, 8)));
            h.update(&batch, step);
        };
        visit(&mut h, 0, 4);
        let once = h.predicted_signal(&h.entries[&1]);
        assert!((once - 0.3670).abs() < 1e-4, "{once}");
        // Three more visits all wrong while the policy improves to 6 of 8 elsewhere: the
        // pooled 0 of 32 says much more than 0 of 8 did.
        let mut last = h.entries[&1].difficulty();
        for step in 1..4 {
            visit(&mut h, step, 6);
            let d = h.entries[&1].difficulty();
            assert!(d > last, "visit {step}: {d} <= {last}");
            last = d;
        }
        let stats = h.entries[&1];
        assert_eq!((stats.samples, stats.right, stats.visits), (32, 0.0, 4));
        let four = h.predicted_signal(&stats);
        assert!((0.1..0.2).contains(&four), "{four}");
        let ids: Vec<u64> = std::iter::once(1).chain(10..19).collect();
        let level = LevelConfig {
            rate: 0.5,
            candidates: CandidateRule::BelowMean,
            mode: PruneMode::FixedCount,
        };
        let mut rng = StdRng::seed_from_u64(2);
        h.select(&ids, &level, PromptPredictor::Difficulty, &mut rng);
        assert!((h.last_candidate_fraction - 0.1).abs() < 1e-12);
    }

    #[test]
    fn a_policy_nearly_always_wrong_makes_no_difficulty_candidates() {
        // One right answer in 80, then none: every prompt is unlikely to carry signal, the
        // all-wrong ones alike (0.31), and dropping some would only thin the rare signal.
        let mut h = PromptHistory::new(0.5);
        let mut first = vec![scored(0, 1, 8)];
        first.extend((1..10).map(|id| scored(id, 0, 8)));
        h.update(&first, 0);
        h.update(
            &(100..110).map(|id| scored(id, 0, 8)).collect::<Vec<_>>(),
            1,
        );
        let all_wrong = h.predicted_signal(&h.entries[&1]);
        assert!((0.25..0.4).contains(&all_wrong), "{all_wrong}");
        let level = LevelConfig {
            rate: 0.99,
            candidates: CandidateRule::BelowMean,
            mode: PruneMode::FixedCount,
        };
        let ids: Vec<u64> = (0..10).collect();
        let mut rng = StdRng::seed_from_u64(1);
        let w = h.select(&ids, &level, PromptPredictor::Difficulty, &mut rng);
        assert_eq!(w, vec![Some(1.0); 10]);
        assert_eq!(h.last_candidate_fraction, 0.0);
    }

    #[test]
    fn difficulty_pruning_is_unbiased_and_the_pass_rate_weighs_by_w_q() {
        let mut h = PromptHistory::new(0.5);
        let ids: Vec<u64> = (0..12).collect();
        let groups: Vec<Group> = ids
            .iter()
            .map(|&id| scored(id, (id % 9) as usize, 8))
            .collect();
        h.update(&groups, 0);
        let level = LevelConfig {
            rate: 0.7,
            candidates: CandidateRule::BelowMean,
            mode: PruneMode::FixedCount,
        };
        // Any per-prompt quantity: its Horvitz-Thompson total over the kept prompts.
        let x: Vec<f64> = ids
            .iter()
            .map(|&id| 1.0 + (id as f64 * 0.37).sin())
            .collect();
        let total: f64 = x.iter().sum();
        let mut rng = StdRng::seed_from_u64(11);
        let draws = 20_000;
        let (mut sum, mut pruned) = (0.0, 0);
        for _ in 0..draws {
            let w = h.select(&ids, &level, PromptPredictor::Difficulty, &mut rng);
            pruned += w.iter().filter(|w| w.is_none()).count();
            sum += w
                .iter()
                .zip(&x)
                .filter_map(|(w, x)| w.map(|w| w * x))
                .sum::<f64>();
        }
        // Candidates: ids 0 and 9 (all wrong) and 8 (all right): floor(0.7 * 3) = 2 dropped.
        assert_eq!(pruned, 2 * draws);
        let mean = sum / draws as f64;
        assert!((mean - total).abs() < 0.01 * total, "{mean} vs {total}");
        // A kept candidate standing for three drawn prompts moves the batch pass rate by
        // its weight: prompt 0 (all wrong, w_q 3) and prompt 1 (all right, w_q 1).
        let mut h = PromptHistory::new(0.5);
        let mut g = vec![scored(0, 0, 8), scored(1, 8, 8)];
        g[0].w_q = 3.0;
        h.update(&g, 0);
        assert!((h.pass_rate.unwrap() - 0.25).abs() < 1e-12);
    }
}
