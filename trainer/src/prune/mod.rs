//! Pruning algorithms: which prompts are rolled out and which completions are learned from,
//! with the weights that keep the gradient an unbiased estimate of full GRPO
//! (docs/algorithm.md §2). One [`PruningAlgorithm`] trait, one file per algorithm: GRPO (no
//! pruning), DPPO, and the biased baselines CPPO and GRESO; the designs, completion pruning
//! and prompt histories they are built from beside them.

mod completion;
mod cppo;
mod design;
mod dppo;
mod greso;
mod grpo;
mod history;

use rand::rngs::StdRng;
use serde::{Deserialize, Serialize};

use crate::data::ProblemOrder;
use crate::group::Group;
use crate::loss::Normalisers;

pub use completion::{cppo_completions, prune_completions, CompletionScope};
pub use cppo::Cppo;
pub use design::{candidates, max_weight, prune_scope, CandidateRule, Inclusion, PruneMode};
pub use dppo::Dppo;
pub use greso::{Greso, GresoState};
pub use grpo::Grpo;
pub use history::{PromptHistory, PromptPredictor, PromptStats};

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

/// What every algorithm needs of the run's batch: its size, the completions' group size
/// and length bound (normalisers), the KL coefficient (which items have zero loss) and
/// where completions compete.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BatchShape {
    /// `rollout.prompts_per_step`.
    pub prompts_per_step: usize,
    /// `rollout.n`.
    pub group_size: usize,
    /// `rollout.max_response_len`.
    pub max_len: usize,
    /// `actor.beta`.
    pub beta: f64,
    /// `dppo.scope`.
    pub scope: CompletionScope,
}

/// The prompts drawn for a step and what prompt pruning made of them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Drawn {
    /// Training problems drawn, in order.
    pub problems: Vec<usize>,
    /// `w_q` of each drawn prompt; `None` when it is not rolled out.
    pub w_q: Vec<Option<f64>>,
}

/// The training problems in the run's order, as an algorithm draws them.
pub struct PromptPool<'a> {
    pub order: &'a mut ProblemOrder,
    /// The prompt id of each training problem.
    pub prompt_ids: &'a [u64],
}

impl PromptPool<'_> {
    /// Training problems in all.
    pub fn len(&self) -> usize {
        self.prompt_ids.len()
    }

    /// Whether there are no training problems.
    pub fn is_empty(&self) -> bool {
        self.prompt_ids.is_empty()
    }

    /// The next `count` problems of the order, with their prompt ids.
    pub fn next(&mut self, count: usize) -> (Vec<usize>, Vec<u64>) {
        let problems = self.order.next(count);
        let ids = problems.iter().map(|&i| self.prompt_ids[i]).collect();
        (problems, ids)
    }
}

/// An algorithm's share of a checkpoint: the prompt history (DPPO) or GRESO's state.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AlgorithmState {
    pub history: Option<PromptHistory>,
    pub greso: Option<GresoState>,
}

/// What a training algorithm decides in a step: which prompts are rolled out (with `w_q`),
/// which completions are learned from (with `w_q * w_o`), and the loss normalisers.
pub trait PruningAlgorithm: Send {
    /// Draws a step's prompts from `pool` and decides which are rolled out.
    fn draw(&mut self, pool: &mut PromptPool<'_>, rng: &mut StdRng) -> Drawn;

    /// Learns from a step's scored groups, advantages computed (`step` is 0-based).
    fn update(&mut self, _groups: &[Group], _step: u64) {}

    /// The completion-level pruning rate (0: none).
    fn completion_rate(&self) -> f64 {
        0.0
    }

    /// The completions the learner trains on, pruned at `rate`, with their weights.
    fn select_completions(&self, groups: &[Group], rate: f64, rng: &mut StdRng) -> Vec<Kept>;

    /// The loss normalisers of a step whose `groups` were rolled out of `num_drawn` prompts
    /// and whose `kept` completions are trained on.
    fn normalisers(&self, groups: &[Group], kept: &[Kept], num_drawn: usize) -> Normalisers;

    /// This algorithm's share of a checkpoint.
    fn state(&self) -> AlgorithmState {
        AlgorithmState::default()
    }

    /// Continues from a checkpoint's share (the fresh state where it has none).
    fn restore(&mut self, _state: AlgorithmState) {}
}

/// `draw` of the algorithms without prompt pruning: the next `prompts_per_step` problems,
/// every one rolled out with `w_q = 1`.
fn draw_all(pool: &mut PromptPool<'_>, prompts_per_step: usize) -> Drawn {
    let (problems, _) = pool.next(prompts_per_step);
    let w_q = vec![Some(1.0); problems.len()];
    Drawn { problems, w_q }
}

/// Normalisers of the full, unpruned batch: `N_seq` counts every completion of
/// `num_prompts` prompts, `N_tok` is the sum of `w_q * T_j` over the rolled-out groups.
pub fn full_batch_normalisers(
    groups: &[Group],
    num_prompts: usize,
    shape: &BatchShape,
) -> Normalisers {
    Normalisers {
        num_seqs: (num_prompts * shape.group_size) as f64,
        num_tokens: groups
            .iter()
            .map(|g| g.w_q * g.num_completion_tokens() as f64)
            .sum(),
        max_len: shape.max_len as f64,
    }
}
