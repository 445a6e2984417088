//! Models named as on the Hugging Face Hub (`Org/Name`), found in the local hub cache that
//! `huggingface-cli download` fills, without any network access.
//!
//! Cache layout: `<cache>/models--Org--Name/refs/<branch or tag>` holds a commit hash, and
//! `<cache>/models--Org--Name/snapshots/<hash>/` holds the files (links into `blobs/`).

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use crate::{ModelError, Result};

/// The hub cache directory, as `huggingface_hub` picks it: `$HF_HUB_CACHE`, else
/// `$HF_HOME/hub`, else `$HOME/.cache/huggingface/hub`. `env` reads a variable, so that
/// tests can pass their own environment; `None` when none of the three is set.
pub fn cache_dir(env: impl Fn(&str) -> Option<OsString>) -> Option<PathBuf> {
    let set = |key: &str| env(key).filter(|v| !v.is_empty()).map(PathBuf::from);
    set("HF_HUB_CACHE")
        .or_else(|| set("HF_HOME").map(|home| home.join("hub")))
        .or_else(|| set("HOME").map(|home| home.join(".cache/huggingface/hub")))
}

/// Whether `spec` has the shape of a hub repository id: `Org/Name`, two non-empty parts of
/// letters, digits, `-`, `_` and `.`, neither starting with `.` (so `./x` and `../x` stay
/// paths).
pub fn is_repo_id(spec: &str) -> bool {
    let part_ok = |p: &str| {
        !p.is_empty()
            && !p.starts_with('.')
            && p.chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    };
    matches!(spec.split_once('/'), Some((org, name)) if part_ok(org) && part_ok(name))
}

/// The snapshot directory of `repo_id` at `revision` in `cache`: a branch or tag (read from
/// `refs/`) or a commit hash; `main` when `revision` is `None`. A missing repository,
/// revision or snapshot is an error that gives the download command.
pub fn snapshot_dir(cache: &Path, repo_id: &str, revision: Option<&str>) -> Result<PathBuf> {
    let repo_dir = cache.join(format!("models--{}", repo_id.replace('/', "--")));
    let revision_name = revision.unwrap_or("main");
    let missing = |reason: String| ModelError::NotInHubCache {
        repo_id: repo_id.to_string(),
        cache: cache.display().to_string(),
        reason,
        download: match revision {
            Some(r) => format!("huggingface-cli download {repo_id} --revision {r}"),
            None => format!("huggingface-cli download {repo_id}"),
        },
    };
    if !repo_dir.is_dir() {
        return Err(missing(format!("no {}", repo_dir.display())));
    }
    let ref_path = repo_dir.join("refs").join(revision_name);
    let commit = match std::fs::read_to_string(&ref_path) {
        Ok(text) => text.trim().to_string(),
        Err(_) if revision.is_some() => revision_name.to_string(),
        Err(e) => return Err(missing(format!("{}: {e}", ref_path.display()))),
    };
    let snapshot = repo_dir.join("snapshots").join(&commit);
    if !snapshot.join("config.json").is_file() {
        return Err(missing(format!(
            "revision {revision_name} (commit {commit}) has no {}",
            snapshot.join("config.json").display()
        )));
    }
    Ok(snapshot)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An environment of `pairs` only.
    fn env<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<OsString> + 'a {
        move |key: &str| {
            pairs
                .iter()
                .find(|(k, _)| *k == key)
                .map(|(_, v)| OsString::from(v))
        }
    }

    #[test]
    fn the_cache_dir_follows_huggingface_hub_precedence() {
        let all = [("HF_HUB_CACHE", "/c"), ("HF_HOME", "/h"), ("HOME", "/u")];
        assert_eq!(cache_dir(env(&all)), Some(PathBuf::from("/c")));
        let no_hub_cache = [("HF_HUB_CACHE", ""), ("HF_HOME", "/h"), ("HOME", "/u")];
        assert_eq!(cache_dir(env(&no_hub_cache)), Some(PathBuf::from("/h/hub")));
        assert_eq!(
            cache_dir(env(&[("HOME", "/u")])),
            Some(PathBuf::from("/u/.cache/huggingface/hub"))
        );
        assert_eq!(cache_dir(env(&[])), None);
    }

    #[test]
    fn repo_ids_are_told_from_paths() {
        for id in [
            "Qwen/Qwen2.5-0.5B-Instruct",
            "HuggingFaceTB/SmolLM2-135M",
            "a/b",
        ] {
            assert!(is_repo_id(id), "{id}");
        }
        for path in [
            "model.gguf",
            "./x",
            "../x/y",
            "runs/a/b",
            "/abs",
            "a/",
            "/b",
            "a b/c",
        ] {
            assert!(!is_repo_id(path), "{path}");
        }
    }
}
