//! [`Policy::load`]: what a model spec names (a built-in preset, a random-weight model of a
//! real shape, a GGUF file, an HF or checkpoint directory, a Hugging Face id) and where the
//! policy is read from.

use std::path::Path;

use candle_core::Device;

use crate::policy::Policy;
use crate::shapes::{RandomSpec, PREFIX as RANDOM};
use crate::{hub, presets, ModelError, Result};

impl Policy {
    /// Loads `spec`: `builtin:<name>`, `random:<shape>[@seed=N]` (see [`crate::shapes`]), a
    /// `.gguf` file, an HF directory, a dppo checkpoint directory (its `model/`), or a
    /// Hugging Face id (`Org/Name`) from the local hub cache.
    pub fn load(spec: &str, device: &Device) -> Result<Self> {
        Self::load_revision(spec, None, device)
    }

    /// [`Policy::load`], with the hub `revision` (branch, tag or commit) to take when `spec`
    /// is a Hugging Face id; `None` takes `main`. A revision for anything else is an error.
    pub fn load_revision(spec: &str, revision: Option<&str>, device: &Device) -> Result<Self> {
        let path = Path::new(spec);
        if !path.exists() && hub::is_repo_id(spec) {
            let cache = hub::cache_dir(|key| std::env::var_os(key)).ok_or_else(|| {
                ModelError::weights(
                    spec,
                    "no Hugging Face cache: HF_HUB_CACHE, HF_HOME and HOME are unset",
                )
            })?;
            return Self::from_hf_dir(&hub::snapshot_dir(&cache, spec, revision)?, device);
        }
        if let Some(r) = revision {
            return Err(ModelError::weights(
                spec,
                format!("a revision ({r}) applies only to a Hugging Face id such as Org/Name"),
            ));
        }
        if let Some(name) = spec.strip_prefix("builtin:") {
            return presets::load_preset(name, device);
        }
        if let Some(shape) = spec.strip_prefix(RANDOM) {
            return shape.parse::<RandomSpec>()?.load(device);
        }
        let checkpoint_model = path.join("model");
        if path.is_dir()
            && !path.join("config.json").exists()
            && checkpoint_model.join("config.json").exists()
        {
            Self::from_hf_dir(&checkpoint_model, device)
        } else if path.is_dir() {
            Self::from_hf_dir(path, device)
        } else if path
            .extension()
            .is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
        {
            Self::from_gguf(path, device)
        } else if path.exists() {
            Err(ModelError::weights(
                spec,
                "expected an HF model directory or a .gguf file",
            ))
        } else {
            Err(ModelError::weights(
                spec,
                "no such file or directory (expected builtin:tiny, random:SHAPE, an HF directory, a .gguf file or a Hugging Face id Org/Name)",
            ))
        }
    }
}
