//! One step's metrics line (`metrics.jsonl`): what the step measured, named as
//! docs/design.md's conventions name it.

use std::collections::BTreeMap;

use serde_json::{json, Map, Value};

use crate::group::Group;
use crate::learner::StepMetrics;
use crate::reward::RewardTally;

/// What one RL step produced, for its metrics line.
pub(super) struct StepReport<'a> {
    /// Steps done, this one included.
    pub step: u64,
    pub policy_version: u64,
    /// Policy versions between the rollout's and the one trained.
    pub staleness: u64,
    /// The rolled-out groups, scored.
    pub groups: &'a [Group],
    /// Prompts drawn for the step (before prompt pruning).
    pub num_drawn: usize,
    /// Completions the learner trained on (after completion pruning).
    pub num_trained: usize,
    /// G.
    pub samples_per_prompt: usize,
    /// `rollout.max_response_len`: a completion this long was cut.
    pub max_response_len: usize,
    /// Whether `[rollout_correction]` is on (its metrics are logged then).
    pub correction_on: bool,
    /// What the reward counted: verdicts, extraction rules, errors, `extra_logs`.
    pub tally: RewardTally,
    pub gen_tokens: usize,
    /// Engine seconds spent generating the rollout (0: not recorded).
    pub gen_busy_s: f64,
    pub learner: &'a StepMetrics,
    pub num_nonfinite_steps: u64,
    /// `prune/grad_rel_mse`, at the steps that measure it.
    pub grad_rel_mse: Option<f64>,
    /// `timing_s/*` by full metric name.
    pub timings: BTreeMap<String, f64>,
}

impl StepReport<'_> {
    /// The metrics line.
    pub fn into_line(self) -> Map<String, Value> {
        let rewards: Vec<f64> = self
            .groups
            .iter()
            .flat_map(|g| g.samples.iter().map(|s| s.reward))
            .collect();
        let completions = (self.groups.len() * self.samples_per_prompt).max(1);
        let mut line = Map::new();
        let mut put = |k: &str, v: Value| {
            line.insert(k.to_string(), v);
        };
        put("step", json!(self.step));
        put("policy_version", json!(self.policy_version));
        put("rollout/staleness", json!(self.staleness));
        put(
            "reward/mean",
            json!(rewards.iter().sum::<f64>() / rewards.len().max(1) as f64),
        );
        // Accuracy over the completions the verifier judged (an external reward has no
        // verdicts: its own `extra_logs` say what it measured).
        let judged = rewards.len().saturating_sub(self.tally.num_external);
        if judged > 0 || self.tally.num_external == 0 {
            put(
                "acc/mean",
                json!(self.tally.num_correct as f64 / judged.max(1) as f64),
            );
        }
        if self.tally.num_external > 0 {
            put("reward/errors", json!(self.tally.errors));
        }
        for (name, (sum, count)) in &self.tally.logs {
            put(
                &format!("reward/{name}/mean"),
                json!(sum / (*count).max(1) as f64),
            );
        }
        // Groups whose rewards were all equal carry no signal: what prompt pruning aims at.
        let all_equal = self
            .groups
            .iter()
            .filter(|g| g.samples.windows(2).all(|w| w[0].reward == w[1].reward))
            .count();
        put(
            "rollout/all_equal",
            json!(all_equal as f64 / self.groups.len().max(1) as f64),
        );
        for (rule, count) in &self.tally.extracted_by {
            put(&format!("reward/extracted_by/{rule}"), json!(count));
        }
        put(
            "prune/prompts_kept",
            json!(self.groups.len() as f64 / self.num_drawn.max(1) as f64),
        );
        put(
            "prune/completions_kept",
            json!(self.num_trained as f64 / completions as f64),
        );
        put("pack/density", json!(self.learner.pack_density));
        put("pack/buffers", json!(self.learner.num_buffers));
        if self.gen_busy_s > 0.0 {
            put(
                "perf/gen_tokens_per_s",
                json!(self.gen_tokens as f64 / self.gen_busy_s),
            );
        }
        put(
            "perf/train_tokens_per_s",
            json!(self.learner.train_tokens_per_s),
        );
        put("actor/pg_loss", json!(self.learner.pg_loss));
        put("actor/grad_norm", json!(self.learner.grad_norm));
        put("actor/clipfrac", json!(self.learner.clipfrac));
        put("actor/entropy", json!(self.learner.entropy));
        put("actor/lr", json!(self.learner.lr));
        if self.learner.mismatch.tokens > 0 {
            for (name, value) in self.learner.mismatch.metrics() {
                put(name, json!(value));
            }
            if self.correction_on {
                for (name, value) in self.learner.mismatch.correction_metrics() {
                    put(name, json!(value));
                }
            }
        }
        let lengths: Vec<usize> = self
            .groups
            .iter()
            .flat_map(|g| g.samples.iter().map(|s| s.completion_ids.len()))
            .collect();
        let n = lengths.len().max(1) as f64;
        put(
            "response_length/mean",
            json!(lengths.iter().sum::<usize>() as f64 / n),
        );
        put(
            "response_length/max",
            json!(lengths.iter().copied().max().unwrap_or(0)),
        );
        // verl's name: the share of completions cut at the length limit.
        let cut = lengths
            .iter()
            .filter(|&&l| l >= self.max_response_len)
            .count();
        put("response_length/clip_ratio", json!(cut as f64 / n));
        put("train/nonfinite_steps", json!(self.num_nonfinite_steps));
        if let Some(v) = self.grad_rel_mse {
            put("prune/grad_rel_mse", json!(v));
        }
        for (k, v) in self.timings {
            line.insert(k, json!(v));
        }
        line
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::group::test_group;

    fn report<'a>(
        groups: &'a [Group],
        tally: RewardTally,
        learner: &'a StepMetrics,
    ) -> StepReport<'a> {
        StepReport {
            step: 1,
            policy_version: 1,
            staleness: 0,
            groups,
            num_drawn: 5,
            num_trained: 5,
            samples_per_prompt: 3,
            max_response_len: 8,
            correction_on: false,
            tally,
            gen_tokens: 12,
            gen_busy_s: 0.0,
            learner,
            num_nonfinite_steps: 0,
            grad_rel_mse: None,
            timings: BTreeMap::new(),
        }
    }

    #[test]
    fn all_equal_counts_the_groups_whose_rewards_all_match() {
        let groups = [
            test_group(0, &[1.0, 1.0, 1.0]),
            test_group(1, &[0.0, 0.0, 0.0]),
            test_group(2, &[0.0, 1.0, 0.0]),
            test_group(3, &[0.5, 0.5, 0.25]),
        ];
        let tally = RewardTally {
            num_correct: 4,
            ..RewardTally::default()
        };
        let line = report(&groups, tally, &StepMetrics::default()).into_line();
        assert_eq!(line["rollout/all_equal"], json!(0.5));
        assert_eq!(line["prune/prompts_kept"], json!(0.8));
        assert_eq!(line["acc/mean"], json!(4.0 / 12.0));
        assert!(!line.contains_key("reward/errors"));
    }

    /// An external reward's completions have no verdict: no accuracy, but its errors and
    /// the means of its `extra_logs`.
    #[test]
    fn an_external_reward_logs_its_errors_and_extra_logs() {
        let groups = [test_group(0, &[1.0, 0.0, 0.0]), test_group(1, &[0.0; 3])];
        let tally = RewardTally {
            num_external: 6,
            errors: 3,
            logs: [("format".to_string(), (2.0, 4))].into(),
            ..RewardTally::default()
        };
        let line = report(&groups, tally, &StepMetrics::default()).into_line();
        assert!(!line.contains_key("acc/mean"), "{line:?}");
        assert_eq!(line["reward/errors"], json!(3));
        assert_eq!(line["reward/format/mean"], json!(0.5));
    }
}
