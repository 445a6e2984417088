//! Pruning: which prompts are rolled out and which completions are learned from, with the
//! weights that keep the gradient an unbiased estimate of full GRPO (docs/algorithm.md §2), plus
//! the biased baselines CPPO and GRESO for comparison.

mod completion;
mod design;
mod greso;
mod prompt;

use serde::{Deserialize, Serialize};

pub use completion::{cppo_completions, prune_completions, CompletionScope};
pub use design::{candidates, max_weight, prune_scope, CandidateRule, Inclusion, PruneMode};
pub use greso::Greso;
pub use prompt::{PromptHistory, PromptPredictor, PromptStats};

/// The algorithm a run trains with (`algorithm`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Algorithm {
    /// No pruning (`r_q = r_o = 0`).
    Grpo,
    /// Unbiased two-level pruning with Horvitz-Thompson weights.
    Dppo,
    /// Drop the lowest-|A| completions of the batch, no re-weighting (biased).
    Cppo,
    /// Skip prompts that were all right or all wrong recently, no re-weighting (biased).
    Greso,
}

/// One pruning level's settings.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LevelConfig {
    /// Pruning rate in [0, 1).
    pub rate: f64,
    pub candidates: CandidateRule,
    pub mode: PruneMode,
}

impl LevelConfig {
    /// No pruning at this level.
    pub fn off() -> Self {
        Self {
            rate: 0.0,
            candidates: CandidateRule::BelowMean,
            mode: PruneMode::FixedCount,
        }
    }
}

/// A completion that survived pruning: where it is and its combined weight `w_q * w_o`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Kept {
    pub group_idx: usize,
    pub sample_idx: usize,
    pub weight: f64,
}

/// The completions `algorithm` learns from (after rollout). GRPO and GRESO keep every
/// completion that carries signal; DPPO prunes at `level`; CPPO cuts the batch at
/// `level.rate`.
pub fn select_completions<R: rand::Rng>(
    groups: &[crate::group::Group],
    algorithm: Algorithm,
    level: &LevelConfig,
    scope: CompletionScope,
    beta: f64,
    rng: &mut R,
) -> Vec<Kept> {
    match algorithm {
        Algorithm::Grpo | Algorithm::Greso => {
            prune_completions(groups, &LevelConfig::off(), scope, beta, rng)
        }
        Algorithm::Dppo => prune_completions(groups, level, scope, beta, rng),
        Algorithm::Cppo => cppo_completions(groups, level.rate, beta),
    }
}
