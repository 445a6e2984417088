//! A group: the samples of one prompt, as the learner sees the rollout batch.

use serde::{Deserialize, Serialize};

/// One completion of a prompt, with what the engine and the verifier said of it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    pub prompt_ids: Vec<u32>,
    pub completion_ids: Vec<u32>,
    pub reward: f64,
    /// Log-probability of each completion token under the rollout policy.
    pub rollout_logprobs: Vec<f32>,
    pub policy_version: u64,
}

/// The `G` samples of one prompt and their advantages.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Group {
    pub prompt_id: u64,
    pub samples: Vec<Sample>,
    /// One per sample; computed on the full group before any pruning, never recomputed.
    pub advantages: Vec<f64>,
    /// Prompt-level inclusion weight `w_q` (1 when the prompt was not a pruning candidate).
    pub w_q: f64,
}

impl Group {
    /// A group with zero advantages and `w_q = 1`.
    pub fn new(prompt_id: u64, samples: Vec<Sample>) -> Self {
        let n = samples.len();
        Self {
            prompt_id,
            samples,
            advantages: vec![0.0; n],
            w_q: 1.0,
        }
    }

    /// Completion tokens of all samples (`T_j`).
    pub fn num_completion_tokens(&self) -> usize {
        self.samples.iter().map(|s| s.completion_ids.len()).sum()
    }

    /// Mean reward over the group's samples (0 for an empty group).
    pub fn mean_reward(&self) -> f64 {
        self.samples.iter().map(|s| s.reward).sum::<f64>() / self.samples.len().max(1) as f64
    }

    /// Mean of |A| over the group: the prompt's signal (0 when all rewards are equal).
    pub fn mean_abs_advantage(&self) -> f64 {
        if self.advantages.is_empty() {
            return 0.0;
        }
        self.advantages.iter().map(|a| a.abs()).sum::<f64>() / self.advantages.len() as f64
    }
}

/// A group with one single-token sample per reward, for unit tests.
#[cfg(test)]
pub(crate) fn test_group(prompt_id: u64, rewards: &[f64]) -> Group {
    let samples = rewards
        .iter()
        .map(|&reward| Sample {
            prompt_ids: vec![1],
            completion_ids: vec![2],
            reward,
            rollout_logprobs: vec![0.0],
            policy_version: 0,
        })
        .collect();
    Group::new(prompt_id, samples)
}
