//! Checkpoints on disk: the policy as an HF directory, the optimizer moments, the KL
//! reference, the trainer's state as JSON (each part of the trainer writes its own share of
//! it) and the effective config, written to a temporary directory and renamed into place;
//! the last `keep` are kept.
//!
//! A manifest of every file's size and CRC-32 is written last: a checkpoint without one
//! is incomplete, and one whose files disagree with it is corrupt. [`verify`] names the
//! bad file; [`latest`] picks the newest checkpoint that verifies.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};
use dppo_model::weights::{save_safetensors_atomic, write_atomic};
use dppo_model::{Policy, Weights};
use serde::{Deserialize, Serialize};

use crate::TrainError;

/// The trainer's state as JSON.
pub const STATE: &str = "state.json";
/// Every other file's size and CRC-32; written last.
pub const MANIFEST: &str = "manifest.json";
/// The optimizer's moments (`m/<param>`, `v/<param>`).
pub const OPTIMIZER: &str = "optimizer.safetensors";
/// The KL reference's weights, when the KL term is on.
pub const REFERENCE: &str = "reference.safetensors";
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

/// Everything one checkpoint holds.
pub struct Contents<'a> {
    /// RL steps done: the directory is `step-NNNNNN`.
    pub step: u64,
    pub policy: &'a Policy,
    /// The optimizer's tensors by their names in [`OPTIMIZER`].
    pub optimizer: BTreeMap<String, Tensor>,
    pub reference: Option<&'a Weights>,
    /// The trainer's state, serialised.
    pub state: String,
    /// The effective config as TOML.
    pub config: String,
}

/// The directory of the checkpoint of `step` under `root`.
pub fn step_dir(root: &Path, step: u64) -> PathBuf {
    root.join(format!("step-{step:06}"))
}

/// Writes `contents` as `root/step-NNNNNN` atomically (unless that checkpoint is saved
/// already: a resumed run stopped before its next step) and deletes all but the newest
/// `keep` (> 0).
pub fn write(root: &Path, keep: usize, contents: &Contents<'_>) -> Result<PathBuf, TrainError> {
    let dir = step_dir(root, contents.step);
    std::fs::create_dir_all(root).map_err(io(root))?;
    if verify(&dir).is_ok() {
        return Ok(dir);
    }
    let tmp = root.join(format!(".step-{:06}.tmp", contents.step));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).map_err(io(&tmp))?;
    contents.policy.save_hf(&tmp.join(MODEL_DIR))?;
    save_safetensors_atomic(&contents.optimizer, &tmp.join(OPTIMIZER))?;
    if let Some(reference) = contents.reference {
        save_safetensors_atomic(reference.tensors(), &tmp.join(REFERENCE))?;
    }
    write_atomic(&tmp.join(STATE), contents.state.as_bytes())?;
    write_atomic(&tmp.join(CONFIG), contents.config.as_bytes())?;
    write_manifest(&tmp)?;
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::rename(&tmp, &dir).map_err(io(&dir))?;
    std::fs::File::open(root)
        .and_then(|d| d.sync_all())
        .map_err(io(root))?;
    prune_old(root, keep)?;
    Ok(dir)
}

/// The error of a checkpoint `dir` whose `file` cannot be used.
pub fn corrupt(dir: &Path, file: &str, reason: String) -> TrainError {
    TrainError::Checkpoint {
        dir: dir.display().to_string(),
        reason: format!("{file} is unreadable ({reason}): resume from another checkpoint"),
    }
}

/// The trainer's state saved in checkpoint `dir`, as JSON text.
pub fn read_state(dir: &Path) -> Result<String, TrainError> {
    let path = dir.join(STATE);
    std::fs::read_to_string(&path).map_err(io(&path))
}

/// The tensors of `file` ([`OPTIMIZER`] or [`REFERENCE`]) in checkpoint `dir`, loaded onto
/// `device`; `None` when the checkpoint has no such file.
pub fn read_tensors(
    dir: &Path,
    file: &str,
    device: &Device,
) -> Result<Option<HashMap<String, Tensor>>, TrainError> {
    let path = dir.join(file);
    if !path.exists() {
        return Ok(None);
    }
    candle_core::safetensors::load(&path, device)
        .map(Some)
        .map_err(|e| corrupt(dir, file, e.to_string()))
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
    if !dir.is_dir() {
        return Err(bad("no such checkpoint directory".into()));
    }
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
