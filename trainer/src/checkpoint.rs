//! Checkpoints: the policy as an HF directory, the optimizer moments, and the trainer's
//! state (step, policy version, data position, prompt history, GRESO state, and a rollout
//! made ahead of its step when one step off-policy), written to a
//! temporary directory and renamed into place; the last `keep` are kept.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use dppo_model::weights::{save_safetensors_atomic, write_atomic};
use dppo_model::Policy;
use serde::{Deserialize, Serialize};

use crate::prune::{Greso, PromptHistory};
use crate::step::{Pending, StepRollout, Trainer};
use crate::TrainError;

/// Everything but tensors.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TrainerState {
    pub step: u64,
    pub policy_version: u64,
    pub drawn: u64,
    pub optimizer_step: u64,
    pub history: PromptHistory,
    pub greso: Greso,
    /// Held-out accuracy before RL, so a resumed run reports the same summary.
    pub eval_before: Option<f64>,
    /// The next step's rollout, generated ahead of it (`rollout.one_step_off_policy`).
    #[serde(default)]
    pub pending: Option<StepRollout>,
}

const STATE: &str = "state.json";
const OPTIMIZER: &str = "optimizer.safetensors";
const REFERENCE: &str = "reference.safetensors";
/// The policy's HF directory inside a checkpoint.
pub const MODEL_DIR: &str = "model";
/// The effective config inside a checkpoint.
pub const CONFIG: &str = "config.toml";

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> TrainError + '_ {
    move |e| TrainError::Config(format!("{}: {e}", path.display()))
}

impl Trainer {
    /// Writes `root/step-NNNNNN` atomically and deletes all but the newest `keep`. Waits
    /// for a rollout in flight first, so that it is saved with the step it belongs to.
    pub fn save_checkpoint(
        &mut self,
        root: &Path,
        keep: usize,
        eval_before: Option<f64>,
    ) -> Result<PathBuf, TrainError> {
        self.settle()?;
        std::fs::create_dir_all(root).map_err(io(root))?;
        let dir = root.join(format!("step-{:06}", self.step));
        let tmp = root.join(format!(".step-{:06}.tmp", self.step));
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(&tmp).map_err(io(&tmp))?;
        let policy = Policy::new(
            self.learner.model.config().clone(),
            self.learner.weights()?,
            self.tokenizer().clone(),
        )?;
        policy.save_hf(&tmp.join(MODEL_DIR))?;
        let mut moments = BTreeMap::new();
        for (name, (m, v)) in &self.learner.optimizer.moments {
            moments.insert(format!("m/{name}"), m.clone());
            moments.insert(format!("v/{name}"), v.clone());
        }
        save_safetensors_atomic(&moments, &tmp.join(OPTIMIZER))?;
        if let Some(reference) = &self.learner.reference {
            save_safetensors_atomic(reference.weights.tensors(), &tmp.join(REFERENCE))?;
        }
        let state = TrainerState {
            step: self.step,
            policy_version: self.policy_version,
            drawn: self.order.drawn,
            optimizer_step: self.learner.optimizer.step,
            history: self.history.clone(),
            greso: self.greso.clone(),
            eval_before,
            pending: match &self.pending {
                Some(Pending::Done(rollout)) => Some(rollout.clone()),
                Some(Pending::InFlight(_)) => unreachable!("settled above"),
                None => None,
            },
        };
        let json = serde_json::to_string(&state).map_err(|e| TrainError::Config(e.to_string()))?;
        write_atomic(&tmp.join(STATE), json.as_bytes())?;
        write_atomic(&tmp.join(CONFIG), self.cfg.to_toml().as_bytes())?;
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::rename(&tmp, &dir).map_err(io(&dir))?;
        prune_old(root, keep)?;
        Ok(dir)
    }

    /// Restores the optimizer and the loop state from checkpoint `dir` (the weights came
    /// with the policy the trainer was built from: `dir/model`).
    pub fn restore(&mut self, dir: &Path) -> Result<TrainerState, TrainError> {
        let path = dir.join(STATE);
        let text = std::fs::read_to_string(&path).map_err(io(&path))?;
        let state: TrainerState = serde_json::from_str(&text)
            .map_err(|e| TrainError::Config(format!("{}: {e}", path.display())))?;
        let path = dir.join(OPTIMIZER);
        let tensors = candle_core::safetensors::load(&path, &Device::Cpu)
            .map_err(|e| TrainError::Config(format!("{}: {e}", path.display())))?;
        let mut moments: BTreeMap<String, (Tensor, Tensor)> = BTreeMap::new();
        for name in self.learner.vars.keys() {
            if let (Some(m), Some(v)) = (
                tensors.get(&format!("m/{name}")),
                tensors.get(&format!("v/{name}")),
            ) {
                moments.insert(name.clone(), (m.clone(), v.clone()));
            }
        }
        self.learner.optimizer.moments = moments;
        let path = dir.join(REFERENCE);
        if self.learner.reference.is_some() && path.exists() {
            let tensors = candle_core::safetensors::load(&path, &Device::Cpu)
                .map_err(|e| TrainError::Config(format!("{}: {e}", path.display())))?;
            let weights = dppo_model::Weights::from_tensors(
                self.learner.model.config(),
                tensors.into_iter().collect(),
                path.display().to_string(),
            )?;
            self.learner.set_reference(&weights)?;
        }
        self.learner.optimizer.step = state.optimizer_step;
        self.step = state.step;
        self.order.drawn = state.drawn;
        self.history = state.history.clone();
        self.greso = state.greso.clone();
        if let Some(rollout) = &state.pending {
            if rollout.step != state.step {
                return Err(TrainError::Config(format!(
                    "{}: the saved rollout is for step {}, the checkpoint is at step {}",
                    dir.join(STATE).display(),
                    rollout.step,
                    state.step
                )));
            }
        }
        self.pending = state.pending.clone().map(Pending::Done);
        self.resume_version(state.policy_version)?;
        Ok(state)
    }
}

/// Keeps the newest `keep` `step-*` directories under `root`.
fn prune_old(root: &Path, keep: usize) -> Result<(), TrainError> {
    let mut steps: Vec<PathBuf> = std::fs::read_dir(root)
        .map_err(io(root))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("step-"))
        })
        .collect();
    steps.sort();
    let excess = steps.len().saturating_sub(keep.max(1));
    for old in &steps[..excess] {
        std::fs::remove_dir_all(old).map_err(io(old))?;
    }
    Ok(())
}
