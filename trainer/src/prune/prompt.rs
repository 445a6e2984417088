//! Prompt-level pruning (before rollout): a per-prompt history of how much signal the
//! prompt carried, candidates among the batch's seen prompts, the fixed-count design, and
//! the over-draw that keeps the rollout batch full.

use std::collections::BTreeMap;

use rand::Rng;
use serde::{Deserialize, Serialize};

use super::design::{candidates, prune_scope, Inclusion};
use super::LevelConfig;
use crate::rollout::Group;

/// What we remember of one prompt.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct PromptStats {
    /// EMA of the group's mean |A| (0 when all right or all wrong).
    pub score: f64,
    pub last_step: u64,
    pub visits: u64,
    /// Consecutive visits whose rewards were all equal.
    pub zero_var_streak: u64,
}

/// Per-prompt history; serialisable for checkpoints.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PromptHistory {
    /// EMA decay: `score = decay * score + (1 - decay) * new`.
    pub decay: f64,
    pub entries: BTreeMap<u64, PromptStats>,
    /// Candidates / batch size at the last selection (`f` of the over-draw).
    pub last_candidate_fraction: f64,
}

impl PromptHistory {
    /// An empty history with EMA `decay` (`history_decay`, default 0.5).
    pub fn new(decay: f64) -> Self {
        Self {
            decay,
            entries: BTreeMap::new(),
            last_candidate_fraction: 0.0,
        }
    }

    /// Records the groups rolled out at `step`.
    pub fn update(&mut self, groups: &[Group], step: u64) {
        for g in groups {
            let signal = g.mean_abs_advantage();
            let zero_var = g.advantages.iter().all(|&a| a == 0.0);
            let decay = self.decay;
            self.entries
                .entry(g.prompt_id)
                .and_modify(|s| {
                    s.score = decay * s.score + (1.0 - decay) * signal;
                    s.visits += 1;
                    s.last_step = step;
                    s.zero_var_streak = if zero_var { s.zero_var_streak + 1 } else { 0 };
                })
                .or_insert(PromptStats {
                    score: signal,
                    last_step: step,
                    visits: 1,
                    zero_var_streak: u64::from(zero_var),
                });
        }
    }

    /// How many prompts to draw for a rollout batch of `batch_size`:
    /// `ceil(batch_size / (1 - r_q * f))`.
    pub fn overdraw(&self, batch_size: usize, rate: f64) -> usize {
        let f = self.last_candidate_fraction;
        (batch_size as f64 / (1.0 - rate * f)).ceil() as usize
    }

    /// Decides which of `prompt_ids` are rolled out, with their weight `w_q`. Prompts never
    /// seen are never candidates.
    pub fn select<R: Rng>(
        &mut self,
        prompt_ids: &[u64],
        level: &LevelConfig,
        rng: &mut R,
    ) -> Vec<Inclusion> {
        let seen: Vec<usize> = (0..prompt_ids.len())
            .filter(|&i| self.entries.contains_key(&prompt_ids[i]))
            .collect();
        let scores: Vec<f64> = seen
            .iter()
            .map(|&i| self.entries[&prompt_ids[i]].score)
            .collect();
        self.last_candidate_fraction = if prompt_ids.is_empty() {
            0.0
        } else {
            candidates(&scores, level.candidates).len() as f64 / prompt_ids.len() as f64
        };
        let mut out = vec![Some(1.0); prompt_ids.len()];
        let inclusion = prune_scope(&scores, level.rate, level.candidates, level.mode, rng);
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
            ..crate::rollout::test_group(prompt_id, &vec![0.0; advantages.len()])
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
        let w = h.select(&[1, 2, 3, 10, 11, 12], &level, &mut rng);
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
}
