//! The trainer's share of a checkpoint: what `state.json` holds, how a step is saved
//! (gathered from every rank, written by rank 0) and how a run resumes from one.

use std::path::{Path, PathBuf};

use dppo_model::Policy;
use serde::{Deserialize, Serialize};

use super::prompts::PromptsState;
use super::{StepRollout, Trainer};
use crate::checkpoint::{self, Contents, OPTIMIZER, REFERENCE, STATE};
use crate::prune::{AlgorithmState, GresoState, PromptHistory};
use crate::TrainError;

/// The trainer's state in a checkpoint (`state.json`): the step, and each part's share
/// as flat fields (serde's `flatten` cannot read the integer keys of the prompt history).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TrainerState {
    pub step: u64,
    /// Held-out accuracy before RL, so a resumed run reports the same summary.
    pub eval_before: Option<f64>,
    /// Ranks of the run that wrote it (1 before data parallelism). A run resumed with as
    /// many continues bit for bit; with another number it continues from the same state,
    /// its gradients summed in another order.
    #[serde(default = "one")]
    pub world_size: usize,
    /// The prompts' share: training problems drawn so far.
    pub drawn: u64,
    /// The prompts' share: DPPO's prompt history.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub history: Option<PromptHistory>,
    /// The prompts' share: GRESO's state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub greso: Option<GresoState>,
    /// The rollouts' share: the newest published policy version.
    pub policy_version: u64,
    /// The rollouts' share: the next step's rollout, generated ahead of it.
    #[serde(default)]
    pub pending: Option<StepRollout>,
    /// The learner's share: optimizer updates done (its tensors are files of their own).
    pub optimizer_step: u64,
    /// Steps skipped so far for a non-finite loss or gradient (`train/nonfinite_steps`).
    #[serde(default)]
    pub num_nonfinite_steps: u64,
    /// Whether its records are keyed by stable prompt ids; `false` (older checkpoints) keys a
    /// file's prompts by line number, mapped to stable ids when they resume.
    #[serde(default)]
    pub stable_prompt_ids: bool,
}

fn one() -> usize {
    1
}

impl Trainer {
    /// Writes the checkpoint of this step under `root` atomically and deletes all but the
    /// newest `keep`. Waits for a rollout in flight first, so that it is saved with the
    /// step it belongs to.
    ///
    /// With several ranks every rank calls it: they check that their weights agree, rank 0
    /// gathers the rollout waiting for the next step (each rank holds its share) and writes
    /// the checkpoint, and all return once it is written.
    pub fn save_checkpoint(
        &mut self,
        root: &Path,
        keep: usize,
        eval_before: Option<f64>,
    ) -> Result<PathBuf, TrainError> {
        self.rollouts.settle()?;
        let (rank, world) = self.rank();
        if world == 1 {
            return self.write_checkpoint(root, keep, eval_before, self.rollouts.done().cloned());
        }
        self.check_replicas()?;
        let whole = self.ranks.gather_rollout(self.rollouts.done())?;
        let written = match rank {
            0 => self.write_checkpoint(root, keep, eval_before, whole),
            _ => Ok(checkpoint::step_dir(root, self.step)),
        };
        // Rank 0's outcome, so that no rank goes on past a checkpoint that failed.
        let failed = self.any_rank(written.is_err())?;
        let dir = written?;
        if failed {
            return Err(TrainError::Checkpoint {
                dir: dir.display().to_string(),
                reason: "rank 0 could not write it (its output says why)".into(),
            });
        }
        Ok(dir)
    }

    /// Writes this step's checkpoint under `root` with `pending`, the whole step's rollout
    /// waiting for the next step.
    fn write_checkpoint(
        &self,
        root: &Path,
        keep: usize,
        eval_before: Option<f64>,
        pending: Option<StepRollout>,
    ) -> Result<PathBuf, TrainError> {
        let policy = Policy::new(
            self.learner.model.config().clone(),
            self.learner.weights()?,
            self.tokenizer.clone(),
        )?;
        let PromptsState { drawn, algorithm } = self.prompts.state();
        let state = TrainerState {
            step: self.step,
            eval_before,
            world_size: self.rank().1,
            drawn,
            history: algorithm.history,
            greso: algorithm.greso,
            policy_version: self.policy_version(),
            pending,
            optimizer_step: self.learner.optimizer.step,
            num_nonfinite_steps: self.nonfinite.num_steps(),
            stable_prompt_ids: true,
        };
        let contents = Contents {
            step: self.step,
            policy: &policy,
            optimizer: self.learner.optimizer_tensors(),
            reference: self.learner.reference_weights(),
            state: serde_json::to_string(&state).map_err(|e| TrainError::State {
                what: "the trainer state",
                reason: e.to_string(),
            })?,
            config: self.cfg.to_toml(),
        };
        checkpoint::write(root, keep, &contents)
    }

    /// Restores the optimizer and the loop state from checkpoint `dir` (the weights came
    /// with the policy the trainer was built from: `dir/model`).
    pub fn restore(&mut self, dir: &Path) -> Result<TrainerState, TrainError> {
        let mut state: TrainerState = serde_json::from_str(&checkpoint::read_state(dir)?)
            .map_err(|e| checkpoint::corrupt(dir, STATE, e.to_string()))?;
        if !state.stable_prompt_ids {
            self.prompts.upgrade_ids(&mut state);
        }
        // Onto the learner's device, whichever device wrote the checkpoint.
        let device = self.learner.model.device().clone();
        let optimizer = checkpoint::read_tensors(dir, OPTIMIZER, &device)?
            .ok_or_else(|| checkpoint::corrupt(dir, OPTIMIZER, "missing".into()))?;
        self.learner
            .restore_optimizer(&optimizer, state.optimizer_step);
        if self.learner.reference.is_some() {
            if let Some(tensors) = checkpoint::read_tensors(dir, REFERENCE, &device)? {
                let weights = dppo_model::Weights::from_tensors(
                    self.learner.model.config(),
                    tensors.into_iter().collect(),
                    dir.join(REFERENCE).display().to_string(),
                )?;
                self.learner.set_reference(&weights)?;
            }
        }
        self.step = state.step;
        self.prompts.restore(PromptsState {
            drawn: state.drawn,
            algorithm: AlgorithmState {
                history: state.history.clone(),
                greso: state.greso.clone(),
            },
        });
        self.nonfinite.restore(state.num_nonfinite_steps);
        let pending = state.pending.clone();
        if let Some(rollout) = &pending {
            if rollout.step != state.step {
                return Err(checkpoint::corrupt(
                    dir,
                    STATE,
                    format!(
                        "its saved rollout is for step {}, the checkpoint is at step {}",
                        rollout.step, state.step
                    ),
                ));
            }
        }
        let world = self.rank().1;
        if state.world_size != world {
            tracing::warn!(
                "{} was written by {} rank(s), this run has {world}: it continues from the \
                 same state, but not bit for bit as the original run would have",
                dir.display(),
                state.world_size
            );
        }
        let pending = pending.map(|rollout| self.ranks.share_of(rollout));
        self.rollouts
            .restore(&self.learner, state.policy_version, pending)?;
        Ok(state)
    }
}
