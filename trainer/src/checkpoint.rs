//! Checkpoints: the policy as an HF directory, the optimizer moments, and the trainer's
//! state (step, policy version, data position, prompt history, GRESO state, and a rollout
//! made ahead of its step when one step off-policy), written to a
//! temporary directory and renamed into place; the last `keep` are kept.
//!
//! A manifest of every file's size and CRC-32 is written last: a checkpoint without one
//! is incomplete, and one whose files disagree with it is corrupt. [`verify`] names the
//! bad file; [`latest`] picks the newest checkpoint that verifies.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use candle_core::Tensor;
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
    /// Steps skipped so far for a non-finite loss or gradient (`train/nonfinite_steps`).
    #[serde(default)]
    pub num_nonfinite_steps: u64,
    /// Ranks of the run that wrote it (1 before data parallelism). A run resumed with as
    /// many continues bit for bit; with another number it continues from the same state,
    /// its gradients summed in another order.
    #[serde(default = "one")]
    pub world_size: usize,
}

fn one() -> usize {
    1
}

const STATE: &str = "state.json";
/// Every other file's size and CRC-32; written last.
pub const MANIFEST: &str = "manifest.json";
const OPTIMIZER: &str = "optimizer.safetensors";
const REFERENCE: &str = "reference.safetensors";
/// The policy's HF directory inside a checkpoint.
pub const MODEL_DIR: &str = "model";
/// The effective config inside a checkpoint.
pub const CONFIG: &str = "config.toml";

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> TrainError + '_ {
    move |source| TrainError::Io {
        path: path.display().to_string(),
        source,
    }
}

impl Trainer {
    /// Writes `root/step-NNNNNN` atomically and deletes all but the newest `keep`. Waits
    /// for a rollout in flight first, so that it is saved with the step it belongs to.
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
        self.settle()?;
        let dir = root.join(format!("step-{:06}", self.step));
        let (rank, world) = self.rank();
        if world > 1 {
            self.check_replicas()?;
            let pending = match &self.pending {
                Some(Pending::Done(rollout)) => Some(rollout),
                Some(Pending::InFlight(_)) => unreachable!("settled"),
                None => None,
            };
            let whole = self.gather_rollout(pending)?;
            let written = match rank {
                0 => self.write_checkpoint(root, &dir, keep, eval_before, whole.as_ref()),
                _ => Ok(()),
            };
            // Rank 0's outcome, so that no rank goes on past a checkpoint that failed.
            let failed = self.any_rank(written.is_err())?;
            written?;
            if failed {
                return Err(TrainError::Checkpoint {
                    dir: dir.display().to_string(),
                    reason: "rank 0 could not write it (its output says why)".into(),
                });
            }
            return Ok(dir);
        }
        let pending = match &self.pending {
            Some(Pending::Done(rollout)) => Some(rollout.clone()),
            Some(Pending::InFlight(_)) => unreachable!("settled above"),
            None => None,
        };
        self.write_checkpoint(root, &dir, keep, eval_before, pending.as_ref())?;
        Ok(dir)
    }

    /// Writes checkpoint `dir` under `root` with `pending`, the whole step's rollout waiting
    /// for the next step.
    fn write_checkpoint(
        &self,
        root: &Path,
        dir: &Path,
        keep: usize,
        eval_before: Option<f64>,
        pending: Option<&StepRollout>,
    ) -> Result<(), TrainError> {
        std::fs::create_dir_all(root).map_err(io(root))?;
        if verify(dir).is_ok() {
            // This step is saved already (e.g. a resumed run stopped before its next step).
            return Ok(());
        }
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
            pending: pending.cloned(),
            num_nonfinite_steps: self.num_nonfinite_steps,
            world_size: self.rank().1,
        };
        let json = serde_json::to_string(&state).map_err(|e| TrainError::State {
            what: "the trainer state",
            reason: e.to_string(),
        })?;
        write_atomic(&tmp.join(STATE), json.as_bytes())?;
        write_atomic(&tmp.join(CONFIG), self.cfg.to_toml().as_bytes())?;
        write_manifest(&tmp)?;
        let _ = std::fs::remove_dir_all(dir);
        std::fs::rename(&tmp, dir).map_err(io(dir))?;
        std::fs::File::open(root)
            .and_then(|d| d.sync_all())
            .map_err(io(root))?;
        prune_old(root, keep)
    }

    /// Restores the optimizer and the loop state from checkpoint `dir` (the weights came
    /// with the policy the trainer was built from: `dir/model`).
    pub fn restore(&mut self, dir: &Path) -> Result<TrainerState, TrainError> {
        let path = dir.join(STATE);
        let text = std::fs::read_to_string(&path).map_err(io(&path))?;
        let corrupt = |file: &str, e: String| TrainError::Checkpoint {
            dir: dir.display().to_string(),
            reason: format!("{file} is unreadable ({e}): resume from another checkpoint"),
        };
        let state: TrainerState =
            serde_json::from_str(&text).map_err(|e| corrupt(STATE, e.to_string()))?;
        // Onto the learner's device, whichever device wrote the checkpoint.
        let device = self.learner.model.device().clone();
        let path = dir.join(OPTIMIZER);
        let tensors = candle_core::safetensors::load(&path, &device)
            .map_err(|e| corrupt(OPTIMIZER, e.to_string()))?;
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
            let tensors = candle_core::safetensors::load(&path, &device)
                .map_err(|e| corrupt(REFERENCE, e.to_string()))?;
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
        self.num_nonfinite_steps = state.num_nonfinite_steps;
        if let Some(rollout) = &state.pending {
            if rollout.step != state.step {
                return Err(corrupt(
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
        self.pending = state
            .pending
            .clone()
            .map(|rollout| Pending::Done(self.share_of(rollout)));
        self.resume_version(state.policy_version)?;
        Ok(state)
    }
}

/// What [`MANIFEST`] records of one file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct FileSum {
    bytes: u64,
    crc32: u32,
}

/// Size and CRC-32 of the file at `path`.
fn file_sum(path: &Path) -> Result<FileSum, TrainError> {
    let bytes = std::fs::read(path).map_err(io(path))?;
    Ok(FileSum {
        bytes: bytes.len() as u64,
        crc32: crc32fast::hash(&bytes),
    })
}

/// The files under `dir`, as `/`-separated paths relative to it, sorted.
fn files_under(dir: &Path) -> Result<Vec<String>, TrainError> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(&d).map_err(io(&d))? {
            let path = entry.map_err(io(&d))?.path();
            if path.is_dir() {
                stack.push(path);
            } else if let Ok(rel) = path.strip_prefix(dir) {
                let parts: Vec<_> = rel.iter().map(|p| p.to_string_lossy()).collect();
                out.push(parts.join("/"));
            }
        }
    }
    out.sort();
    Ok(out)
}

/// Writes `dir`'s manifest: the size and CRC-32 of every file in it.
fn write_manifest(dir: &Path) -> Result<(), TrainError> {
    let mut files = BTreeMap::new();
    for rel in files_under(dir)? {
        files.insert(rel.clone(), file_sum(&dir.join(&rel))?);
    }
    let json =
        serde_json::to_string_pretty(&serde_json::json!({ "files": files })).map_err(|e| {
            TrainError::State {
                what: "the checkpoint manifest",
                reason: e.to_string(),
            }
        })?;
    Ok(write_atomic(&dir.join(MANIFEST), json.as_bytes())?)
}

/// Checks checkpoint `dir` against its manifest: every listed file present with its size
/// and CRC-32. The error names the bad file (or the missing manifest: an incomplete save).
pub fn verify(dir: &Path) -> Result<(), TrainError> {
    let bad = |reason: String| TrainError::Checkpoint {
        dir: dir.display().to_string(),
        reason,
    };
    let path = dir.join(MANIFEST);
    let text = std::fs::read_to_string(&path).map_err(|e| {
        bad(format!(
            "no readable {MANIFEST} ({e}): the save did not finish, or predates manifests"
        ))
    })?;
    let manifest: BTreeMap<String, BTreeMap<String, FileSum>> =
        serde_json::from_str(&text).map_err(|e| bad(format!("{MANIFEST} is corrupt: {e}")))?;
    let files = manifest
        .get("files")
        .filter(|f| !f.is_empty())
        .ok_or_else(|| bad(format!("{MANIFEST} lists no files")))?;
    for (rel, want) in files {
        let got = file_sum(&dir.join(rel)).map_err(|e| bad(format!("{rel}: {e}")))?;
        if got != *want {
            return Err(bad(format!(
                "{rel} is corrupt: {} bytes with CRC-32 {:08x}, the manifest says {} bytes \
                 with {:08x}",
                got.bytes, got.crc32, want.bytes, want.crc32
            )));
        }
    }
    Ok(())
}

/// The `step-*` directories under `root`, oldest first.
fn step_dirs(root: &Path) -> Vec<PathBuf> {
    let mut steps: Vec<PathBuf> = std::fs::read_dir(root)
        .into_iter()
        .flatten()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("step-"))
        })
        .collect();
    steps.sort();
    steps
}

/// The newest checkpoint under `root` that [`verify`] accepts, skipping incomplete and
/// corrupt ones with a warning; `None` when there is none (or no `root`).
pub fn latest(root: &Path) -> Option<PathBuf> {
    step_dirs(root)
        .into_iter()
        .rev()
        .find(|dir| match verify(dir) {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!("skipping checkpoint: {e}");
                false
            }
        })
}

/// Keeps the newest `keep` `step-*` directories under `root`, and removes the temporary
/// directories of saves that never finished.
fn prune_old(root: &Path, keep: usize) -> Result<(), TrainError> {
    let steps = step_dirs(root);
    let excess = steps.len().saturating_sub(keep);
    for old in &steps[..excess] {
        std::fs::remove_dir_all(old).map_err(io(old))?;
    }
    for entry in std::fs::read_dir(root).map_err(io(root))?.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with(".step-") && name.ends_with(".tmp") {
            std::fs::remove_dir_all(entry.path()).map_err(io(&entry.path()))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A checkpoint-like directory with two files and, if `complete`, its manifest.
    fn fake_checkpoint(dir: &Path, complete: bool) {
        std::fs::create_dir_all(dir.join("model")).unwrap();
        std::fs::write(dir.join(STATE), b"{\"step\": 1}").unwrap();
        std::fs::write(dir.join("model/model.safetensors"), vec![7u8; 4096]).unwrap();
        if complete {
            write_manifest(dir).unwrap();
        }
    }

    #[test]
    fn verify_names_the_bad_file_and_latest_skips_bad_checkpoints() {
        let root = std::env::temp_dir().join(format!("dppo-manifest-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let step = |n: u64| root.join(format!("step-{n:06}"));
        assert_eq!(
            latest(&root),
            None,
            "no directory: start from the beginning"
        );
        fake_checkpoint(&step(1), true);
        fake_checkpoint(&step(2), true);
        fake_checkpoint(&step(3), false);
        verify(&step(1)).unwrap();
        let err = verify(&step(3)).unwrap_err().to_string();
        assert!(
            err.contains("step-000003") && err.contains(MANIFEST),
            "{err}"
        );
        assert_eq!(
            latest(&root),
            Some(step(2)),
            "the incomplete one is skipped"
        );
        // A flipped bit, then a truncation, in step 2's weights.
        let weights = step(2).join("model/model.safetensors");
        let mut bytes = std::fs::read(&weights).unwrap();
        bytes[100] ^= 4;
        std::fs::write(&weights, &bytes).unwrap();
        let err = verify(&step(2)).unwrap_err().to_string();
        assert!(err.contains("model/model.safetensors is corrupt"), "{err}");
        std::fs::write(&weights, &bytes[..1000]).unwrap();
        let err = verify(&step(2)).unwrap_err().to_string();
        assert!(err.contains("1000 bytes"), "{err}");
        assert_eq!(latest(&root), Some(step(1)));
        std::fs::remove_file(step(1).join(STATE)).unwrap();
        let err = verify(&step(1)).unwrap_err().to_string();
        assert!(err.contains(STATE), "{err}");
        assert_eq!(latest(&root), None);
        std::fs::remove_dir_all(&root).unwrap();
    }
}
